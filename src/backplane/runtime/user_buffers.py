"""Outputs written into buffers the caller gives (IOBinding's ``bind_output(name, buffer=...)``).

Seed 002: "The runtime core directly creates builtin's tensor objects to accept user-given input and
output buffers": the kernel that makes an output writes it into the caller's memory. A plan whose
outputs are bound to host buffers (``INTO`` in ``LoadedNetwork.plan``'s ``outputs_on``) reads each
buffer from a slot of its own, filled at each run after the inputs (``Plan.input_slots``): no buffer
is held by the network past its run. Per such output:

- where its producer's workload has ``write_into`` (CpuRef's and CpuAcc's common kernels, through
  NumPy's and torch's ``out=``; CpuAcc's compiled partitions copy their last result in) and the
  output is a tensor of static shape that no other output names, the producer is handed the
  buffer, imported into its backend's memory (``TensorHandleFactory.import_``: a torch view of it
  for CpuAcc), and the import or copy that took the output to the host is left out: no byte is
  copied;
- otherwise a ``MemCopy[y](host->user buffer)`` at the end of the run copies it into the buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Backend, Workload
from backplane.backends.api.memory import MemorySource, TensorHandleFactory, to_host
from backplane.ir.graph import Graph, Layer

INTO = "into"
"""``outputs_on``'s entry for an output written into a host buffer given at each run."""

_TO_HOST = ("MemCopy", "MemImport")


@dataclasses.dataclass(frozen=True)
class Writer:
    """Where a bound output is made: its producer's index, the output's position there, and the
    producer's tensor-handle factory (which imports the buffer and writes it where it must)."""

    index: int
    position: int
    factory: TensorHandleFactory


def bind(layers: list[Layer], workloads: list[Workload], outputs: list[str],
         positions: Sequence[int], labels: Sequence[str], graph: Graph,
         backends: Mapping[str, Backend], constant_slots: dict[tuple[int, str], str],
         ) -> tuple[list[str], list[tuple[Layer, Workload]]]:
    """The outputs at ``positions`` written into buffers (see the module's docstring): ``layers``,
    ``workloads`` and ``outputs`` (the plan's output names) changed in place; ``labels`` are the
    model's names of the outputs, for errors. Returns the buffers' names, in the order of
    ``positions`` (the run's values after its inputs), and the copy layers to run last."""
    made = {name: (i, k) for i, layer in enumerate(layers) for k, name in enumerate(layer.outputs)
            if name}
    buffers: list[str] = []
    copies: list[tuple[Layer, Workload]] = []
    bound: dict[int, dict[int, tuple[str, TensorHandleFactory]]] = {}
    for position in positions:
        name, label = outputs[position], labels[position]
        buffer = f"{label}@user buffer"
        buffers.append(buffer)
        writer = _writer(name, layers, workloads, made, outputs, graph, backends)
        if writer is None:
            copy = Layer(f"MemCopy[{label}](host->user buffer)", "MemCopy", [name, buffer],
                         [f"{buffer} filled"], {}, backend="builtin")
            copies.append((copy, _copy_into(label)))
            outputs[position] = copy.outputs[0]
        else:
            bound.setdefault(writer.index, {})[writer.position] = (buffer, writer.factory)
            outputs[position] = buffer
    for index, into in bound.items():
        layer = layers[index]
        names = [into[k][0] for k in sorted(into)]
        layers[index] = dataclasses.replace(layer, inputs=[*names, *layer.inputs])
        for constant in layer.inputs:  # its constants stay bound where they were
            slot = constant_slots.get((id(layer), constant))
            if slot is not None:
                constant_slots[id(layers[index]), constant] = slot
        workloads[index] = _writing(workloads[index], len(layer.outputs), into)
    return buffers, copies


def _writer(name: str, layers: Sequence[Layer], workloads: Sequence[Workload],
            made: Mapping[str, tuple[int, int]], outputs: Sequence[str], graph: Graph,
            backends: Mapping[str, Backend]) -> Writer | None:
    """The layer that computes the output ``name`` where it can write it into a host buffer
    (through the copy or import that brings it to the host, if any), else None."""
    if outputs.count(name) != 1 or name not in made:
        return None
    index, position = made[name]
    layer = layers[index]
    if layer.op_type in _TO_HOST:  # brought to the host: the layer before writes the buffer
        factory = layer.attrs.get("source")
        inner = layer.inputs[0]
        if inner not in made or inner in outputs or not isinstance(factory, TensorHandleFactory):
            return None
        name, (index, position) = inner, made[inner]
        if layers[index].op_type in _TO_HOST:
            return None
    else:
        backend = backends.get(layer.backend or "")
        if backend is None:
            return None
        factory = backend.tensor_handle_factories()[0]
    info = graph.info(name)
    if getattr(workloads[index], "write_into", None) is None or not info.is_static \
            or factory.device != "cpu" or not factory.import_flags & MemorySource.MALLOC:
        return None
    return Writer(index, position, factory)


def _writing(workload: Workload, count: int,
             into: Mapping[int, tuple[str, TensorHandleFactory]]) -> Workload:
    """``workload`` called as ``write_into`` with the buffers, its first values, imported into
    its memory; an output it wrote elsewhere after all is written into its buffer."""
    write_into = workload.write_into  # type: ignore[attr-defined]
    positions = sorted(into)
    factories = [into[k][1] for k in positions]
    given = len(positions)

    def writing(*values: Any) -> tuple[Any, ...]:
        memory: list[Any] = [None] * count
        for k, factory, buffer in zip(positions, factories, values):
            memory[k] = factory.import_(buffer)
        results = write_into(memory, *values[given:])
        for k, factory, buffer in zip(positions, factories, values):
            if results[k] is not memory[k]:  # a write_into that declined this one
                factory.write_to(results[k], buffer)
        return results  # type: ignore[no-any-return]

    return writing


def _copy_into(name: str) -> Workload:
    """A MemCopy of output ``name`` into its buffer (its producer cannot write it there)."""
    def copy_into(value: Any, buffer: np.ndarray) -> tuple[np.ndarray]:
        host = to_host(value)
        if host.shape != buffer.shape or host.dtype != buffer.dtype:
            raise ValueError(mismatch(name, host.shape, host.dtype, buffer.shape, buffer.dtype))
        np.copyto(buffer, host)
        return (buffer,)

    return copy_into


def mismatch(name: str, shape: Sequence[Any], dtype: Any, given_shape: Sequence[Any],
             given_dtype: Any) -> str:
    """The error for a buffer bound to output ``name`` that does not fit it."""
    return (f"the buffer bound to output '{name}' has shape {tuple(given_shape)} and dtype "
            f"{given_dtype}; the output has shape {tuple(shape)} and dtype {dtype}")
