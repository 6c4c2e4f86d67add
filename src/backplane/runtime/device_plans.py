"""The plan of a LoadedNetwork for inputs and outputs in device memory (``LoadedNetwork.plan``,
split from ``loaded_network.py``): the host plan's layers with each device input imported by the
copy layers that would have moved it into that memory (one host copy for every other reader), and
each device output taken where it is made or moved there, or written into a buffer the caller gives.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from backplane.backends.api.backend import Workload
from backplane.backends.api.memory import HOST_FACTORY, to_device, to_host
from backplane.ir.graph import Layer
from backplane.runtime import user_buffers
from backplane.runtime.memory_plan import GLUE
from backplane.runtime.steps import Plan, plan_steps

if TYPE_CHECKING:
    from backplane.runtime.loaded_network import LoadedNetwork


def placed_plan(loaded: LoadedNetwork, inputs_on: tuple[str, ...],
                outputs_on: tuple[str | None, ...]) -> Plan:
    """``loaded``'s plan for inputs in the memory of ``inputs_on`` and outputs wanted in
    ``outputs_on`` (``LoadedNetwork.plan`` says what each means); its slots numbered in ``loaded``."""
    graph = loaded.network.graph
    layers = list(loaded.layers)
    workloads = [step.workload for step in loaded.steps]
    front: list[tuple[Layer, Workload]] = []
    for name, device in zip(loaded.network.input_names, inputs_on):
        if device == "cpu":
            continue
        host_copy = ""
        for index, layer in enumerate(layers):
            if name not in layer.inputs:
                continue
            target = layer.attrs.get("target")
            if layer.op_type in GLUE and getattr(target, "device", None) == device:
                layers[index] = Layer(f"MemImport[{name}](user {device}->{layer.outputs[0]})",
                                      "MemImport", [name], list(layer.outputs),
                                      {"source": device, "target": target}, backend="builtin")
                workloads[index] = _importer(target)
                continue
            if not host_copy:
                host_copy = f"{name}@host"
                copy = Layer(f"MemCopy[{name}](user {device}->host)", "MemCopy", [name],
                             [host_copy], {"source": device, "target": HOST_FACTORY},
                             backend="builtin")
                front.append((copy, lambda x: (to_host(x),)))
            layers[index] = _renamed(layer, name, host_copy)
            for constant in layer.inputs:  # its constants stay bound where they were
                bound = loaded._constant_slots.get((id(layer), constant))
                if bound is not None:
                    loaded._constant_slots[id(layers[index]), constant] = bound
    outputs = list(graph.outputs)
    back: list[tuple[Layer, Workload]] = []
    producer = {o: i for i, layer in enumerate(layers) for o in layer.outputs}
    for position, (name, device) in enumerate(zip(graph.outputs, outputs_on)):
        if device is None or device == "cpu" or device == user_buffers.INTO:
            continue
        index = producer.get(name)
        layer = layers[index] if index is not None else None
        if layer is not None and layer.op_type in GLUE \
                and getattr(layer.attrs.get("source"), "device", None) == device:
            name = layer.inputs[0]  # the value before it was brought to the host
            made_by = producer.get(name)
            if not str(getattr(layer.attrs["source"], "id", "")).startswith("torch-"):
                # another library's tensor handle: handed over as a torch tensor, no copy
                copy = Layer(f"MemImport[{name}]({device}->user {device})", "MemImport",
                             [name], [f"{name}@user {device}"],
                             {"source": layer.attrs["source"], "target": device},
                             backend="builtin")
                back.append((copy, functools.partial(_moved, to_device, device)))
                outputs[position] = copy.outputs[0]
                continue
            if made_by is None or not getattr(workloads[made_by], "exclusive", False):
                outputs[position] = name
                continue
            copy = Layer(f"MemCopy[{name}]({device}->user {device})", "MemCopy", [name],
                         [f"{name}@user {device}"], {"source": device, "target": device},
                         backend="builtin")
            back.append((copy, lambda x: (x.clone(),)))
        else:
            copy = Layer(f"MemCopy[{name}](host->user {device})", "MemCopy", [name],
                         [f"{name}@user {device}"], {"source": HOST_FACTORY, "target": device},
                         backend="builtin")
            back.append((copy, functools.partial(_moved, to_device, device)))
        outputs[position] = copy.outputs[0]
    into = [i for i, device in enumerate(outputs_on) if device == user_buffers.INTO]
    buffers, copies = user_buffers.bind(layers, workloads, outputs, into,
                                        loaded.network.output_names, graph,
                                        loaded.network.backends, loaded._constant_slots)
    back += copies
    read = {n for layer in layers for n in layer.inputs} | {n for c, _ in back for n in c.inputs}
    kept = [(layer, w) for layer, w in zip(layers, workloads)
            if layer.op_type not in GLUE or any(o in read or o in outputs for o in layer.outputs)]
    placed = [*front, *kept, *back]
    for layer, workload in placed:
        for value in (*layer.inputs, *layer.outputs):
            loaded._slot(value)
        loaded._layer_of.setdefault(id(workload), layer)
    output_slots = tuple(loaded._slot(name) for name in outputs)
    steps = plan_steps([layer for layer, _ in placed], [w for _, w in placed], loaded._slots,
                       set(output_slots), loaded._constant_slots)
    return Plan(tuple(steps), tuple(layer for layer, _ in placed), output_slots,
                (*loaded.input_slots, *(loaded._slot(name) for name in buffers)))


def _importer(target: Any) -> Workload:
    import_ = target.import_

    def mem_import(x: Any) -> tuple[Any]:
        return (import_(x),)

    return mem_import


def _moved(to_device: Any, device: str, x: Any) -> tuple[Any]:
    return (to_device(x, device),)


def _renamed(layer: Layer, old: str, new: str) -> Layer:
    return dataclasses.replace(layer, inputs=[new if n == old else n for n in layer.inputs])
