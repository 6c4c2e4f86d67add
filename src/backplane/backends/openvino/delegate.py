"""OpenVINO's artifact blob: each compiled partition exported by OpenVINO, imported at load.

``preprocess`` compiles each of the partition's compiled-model layers for the CPU with the options
given and keeps OpenVINO's own export of it (``CompiledModel.export_model``); ``init`` imports them
(``Core.import_model``), so loading an artifact converts and compiles nothing. The exported model
depends on OpenVINO's version and the CPU's instruction sets: both are the backend's machine facts,
compared when the artifact loads.

The partition stored beside the blob keeps each layer's boundary and the model nodes it runs, not
OpenVINO's in-memory model (it has no portable form here): such a partition cannot be preprocessed
again from the artifact, only compiled again from the ONNX file.

The blob: an 8-byte little-endian length, a JSON header ``{"models": [size, ...], "nan_models":
[size, ...]}`` (one per layer, in the partition's order), then the exported models one after the
other, then the exported NaN-keeping models (``nan_forms``; size 0 where the layer has none), imported
at the first run given a NaN or an infinity. A layer's run-time checks (``checks.Check``) are kept
in its attributes.
"""

from __future__ import annotations

import functools
import io
import json
from collections.abc import Callable
from typing import Any

from backplane.backends.api.backend import InitContext, PreprocessResult
from backplane.ir.graph import Graph, Layer


def machine_facts() -> dict[str, str]:
    """What an exported compiled model depends on: OpenVINO's version and the instruction sets."""
    import openvino

    from backplane.artifact.facts import cpu

    return {"openvino": openvino.get_version(), "isa": cpu()["isa"]}


def preprocess(backend: Any, graph: Graph) -> PreprocessResult:
    """Compile and export each layer; the layers kept in ``graph`` lose their in-memory model."""
    from backplane.backends.openvino import partition, workload

    exported: list[bytes] = []
    keeping: list[bytes] = []
    handles: dict[str, list[str]] = {}
    for index, layer in enumerate(graph.layers):
        if layer.domain != partition.DOMAIN or layer.op_type != partition.OP \
                or "model" not in layer.attrs:
            raise ValueError(f"OpenVINO cannot preprocess {layer.describe()}: only the partitions "
                             f"it compiled from an ONNX model, in this process (an artifact's "
                             f"stored partition keeps no model: compile again from the ONNX file)")
        exported.append(_export(workload.compile_model(layer.attrs["model"], backend.options)))
        nan_model = layer.attrs.get("nan_model")  # the NaN-keeping model, when one differs
        keeping.append(b"" if nan_model is None else
                       _export(workload.compile_model(nan_model(), backend.options)))
        nodes = [str(name) for name in layer.attrs.get("layers", [layer.name])]
        handles[layer.name] = nodes
        attrs = {"layers": nodes, "checks": list(layer.attrs.get("checks", []))}
        graph.layers[index] = Layer(layer.name, layer.op_type, list(layer.inputs),
                                    list(layer.outputs), attrs, layer.domain,
                                    layer.opset, layer.backend)
    text = json.dumps({"models": [len(data) for data in exported],
                       "nan_models": [len(data) for data in keeping]}).encode()
    return PreprocessResult(len(text).to_bytes(8, "little") + text + b"".join(exported)
                            + b"".join(keeping), handles)


def _export(compiled: Any) -> bytes:
    stream = io.BytesIO()
    compiled.export_model(stream)  # (without a stream, 2026.4 returns a BytesIO, not bytes)
    return stream.getvalue()


def _import(piece: memoryview, config: dict[str, str]) -> Any:
    from backplane.backends.openvino.query import DEVICE, core

    return core().import_model(io.BytesIO(bytes(piece)), DEVICE, config)


def init(backend: Any, processed: bytes | memoryview, context: InitContext,
         ) -> Callable[..., tuple[Any, ...]]:
    """The partition's layers, each imported from its exported model, as one call (the handle)."""
    from backplane.backends.openvino import workload
    from backplane.backends.openvino.query import DEVICE, core

    data = memoryview(processed)
    length = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8:8 + length]))
    sizes, nan_sizes = header["models"], header.get("nan_models", [0] * len(header["models"]))
    graph = context.graph
    if len(sizes) != len(graph.layers):
        raise ValueError(f"OpenVINO's blob holds {len(sizes)} models for a partition of "
                         f"{len(graph.layers)} layers")
    config = workload.compile_config(backend.options)
    offset, nan_offset = 8 + length, 8 + length + sum(sizes)
    steps = []
    for layer, size, nan_size in zip(graph.layers, sizes, nan_sizes):
        compiled = core().import_model(io.BytesIO(bytes(data[offset:offset + size])), DEVICE,
                                       config)
        offset += size
        nan_compiled = None
        if nan_size:  # imported at the first run that needs it, as a compiled one is compiled
            piece = data[nan_offset:nan_offset + nan_size]
            nan_compiled = functools.partial(_import, piece, config)
            nan_offset += nan_size
        outputs = [graph.info(name) for name in layer.outputs]
        steps.append((workload.CompiledPartition(compiled, outputs, nan_compiled,
                                                 layer.attrs.get("checks", ())),
                      layer.inputs, layer.outputs))
    if len(steps) == 1 and list(graph.inputs) == list(steps[0][1]) \
            and list(graph.outputs) == list(steps[0][2]):
        return steps[0][0]  # the common case: the partition is one compiled model
    names_in, names_out = list(graph.inputs), list(graph.outputs)
    constants = dict(graph.constants)

    def run(*values: Any) -> tuple[Any, ...]:
        env = dict(constants)
        env.update(zip(names_in, values))
        for call, reads, writes in steps:
            env.update(zip(writes, call(*[env[n] for n in reads])))
        return tuple(env[n] for n in names_out)

    return run
