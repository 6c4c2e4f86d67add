"""OpenVINO's artifact blob: each compiled partition exported by OpenVINO, imported at load.

``preprocess`` compiles each of the partition's compiled-model layers for the CPU with the options
given and keeps OpenVINO's own export of it (``CompiledModel.export_model``); ``init`` imports them
(``Core.import_model``), so loading an artifact converts and compiles nothing. The exported model
depends on OpenVINO's version and the CPU's instruction sets: both are the backend's machine facts,
compared when the artifact loads.

The partition stored beside the blob keeps each layer's boundary and the model nodes it runs, not
OpenVINO's in-memory model (it has no portable form here): such a partition cannot be preprocessed
again from the artifact, only compiled again from the ONNX file.

The blob: an 8-byte little-endian length, a JSON header ``{"models": [size, ...]}`` (one per layer,
in the partition's order), then the exported models one after the other.
"""

from __future__ import annotations

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
    handles: dict[str, list[str]] = {}
    for index, layer in enumerate(graph.layers):
        if layer.domain != partition.DOMAIN or layer.op_type != partition.OP \
                or "model" not in layer.attrs:
            raise ValueError(f"OpenVINO cannot preprocess {layer.describe()}: only the partitions "
                             f"it compiled from an ONNX model, in this process (an artifact's "
                             f"stored partition keeps no model: compile again from the ONNX file)")
        compiled = workload.compile_model(layer.attrs["model"], backend.options)
        stream = io.BytesIO()
        compiled.export_model(stream)  # (without a stream, 2026.4 returns a BytesIO, not bytes)
        exported.append(stream.getvalue())
        nodes = [str(name) for name in layer.attrs.get("layers", [layer.name])]
        handles[layer.name] = nodes
        graph.layers[index] = Layer(layer.name, layer.op_type, list(layer.inputs),
                                    list(layer.outputs), {"layers": nodes}, layer.domain,
                                    layer.opset, layer.backend)
    text = json.dumps({"models": [len(data) for data in exported]}).encode()
    return PreprocessResult(len(text).to_bytes(8, "little") + text + b"".join(exported), handles)


def init(backend: Any, processed: bytes | memoryview, context: InitContext,
         ) -> Callable[..., tuple[Any, ...]]:
    """The partition's layers, each imported from its exported model, as one call (the handle)."""
    from backplane.backends.openvino import workload
    from backplane.backends.openvino.query import DEVICE, core

    data = memoryview(processed)
    length = int.from_bytes(data[:8], "little")
    sizes = json.loads(bytes(data[8:8 + length]))["models"]
    graph = context.graph
    if len(sizes) != len(graph.layers):
        raise ValueError(f"OpenVINO's blob holds {len(sizes)} models for a partition of "
                         f"{len(graph.layers)} layers")
    config = workload.compile_config(backend.options)
    offset = 8 + length
    steps = []
    for layer, size in zip(graph.layers, sizes):
        stream = io.BytesIO(bytes(data[offset:offset + size]))
        offset += size
        compiled = core().import_model(stream, DEVICE, config)
        outputs = [graph.info(name) for name in layer.outputs]
        steps.append((workload.CompiledPartition(compiled, outputs), layer.inputs, layer.outputs))
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
