"""CpuAcc's artifact blob: what its load does at a cost, done once at compile time, kept as data.

Loading a CpuAcc partition measures routes (oneDNN, MKL or torch's own per fused layer, compiled
or layer by layer per OneDnnGraph) and packs the weights of its oneDNN routes. ``preprocess`` does
that load once and keeps in the blob every route chosen, by its route-cache key, the names of the
OneDnnGraph layers it compiled, and each weight a kept oneDNN route packed, as its bytes and its
oneDNN memory descriptor (``prepacked``). ``init`` creates the workloads with the routes known
(nothing is measured, no weight packed), each compiled OneDnnGraph's layers among them, from the
layer the artifact's network stores as data, its weights mapped from the file. At its first run
such a OneDnnGraph is traced with the kept routes (its layers run once on a sample), frozen,
compiled by oneDNN Graph at that run's thread count and checked against its layers, as a load
makes it (``onednn_graph.at_first_run``): the compile's load does not compile it either (its
"compiled" is what that load planned), so the model is compiled once, at its first run.

The blob is data: no TorchScript archive, no pickle, no name from the file looked up in a module
(a type is read through ``prepacked.DTYPES``). Every offset, size and descriptor is checked against
the payload it points into before native code reads it, and every name against the partition's
layers; a blob that fails is an ``ArtifactError`` naming what and where.

The blob: an 8-byte little-endian length, a JSON header ``{"layout": 3, "routes": {key: route},
"compiled": [layer name, ...], "packed": {layer name: {"descriptor": [offset, size], "data":
[offset, size], "sizes": [...], "dtype": "float32"}}}`` padded so that the payload starts at a
multiple of 64 bytes, then the payload: the packed weights' descriptors and bytes, each at a
multiple of 64 bytes. Layouts 1 and 2 (no "layout"; CpuAcc 0.1 and 0.2) kept each compiled
OneDnnGraph as a TorchScript archive, code that loading it would run: such a blob is refused
(compile the model again).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from backplane.artifact.container import ALIGNMENT, ArtifactError
from backplane.backends.api.backend import InitContext, PreprocessResult, Workload
from backplane.backends.torch import prepacked, route_cache
from backplane.backends.torch.fusion import onednn_graph
from backplane.ir.graph import Graph, Layer

FACT_NAMES = ("torch", "isa")
LAYOUT = 3
"""The blob's layout: 3 holds no code (1 and 2 held TorchScript archives, refused)."""
KEYS = ("layout", "routes", "compiled", "packed")
PACKED_KEYS = ("descriptor", "data", "sizes", "dtype")


def machine_facts() -> dict[str, str]:
    """What CpuAcc's blobs depend on: torch's version (its TorchScript and oneDNN) and the
    instruction sets the routes were measured and the weights packed for."""
    import torch

    from backplane.artifact.facts import cpu

    return {"torch": torch.__version__, "isa": cpu()["isa"]}


def preprocess(backend: Any, graph: Graph) -> PreprocessResult:
    """Load the partition once, keeping the routes chosen, the compiled OneDnnGraphs' names and
    the packed weights."""
    kept: dict[str, str] = {}
    made: dict[str, Any] = {}
    token, packing = route_cache.KEPT.set(kept), prepacked.MADE.set(made)
    try:
        workloads = _workloads(backend, graph, set())
        compiled = [layer.name for layer, workload in zip(graph.layers, workloads)
                    if layer.op_type == "OneDnnGraph"
                    and getattr(workload, "route", None) == "onednn_graph"]
        header: dict[str, Any] = {"layout": LAYOUT, "routes": kept, "compiled": compiled,
                                  "packed": {}}
        payload = bytearray()
        if prepacked.available():
            for name, tensor in sorted(prepacked.alive(made).items()):
                descriptor, data, sizes, dtype = prepacked.to_bytes(tensor)
                header["packed"][name] = {"descriptor": _append(payload, descriptor),
                                          "data": _append(payload, data), "sizes": sizes,
                                          "dtype": dtype}
        del workloads
    finally:
        route_cache.KEPT.reset(token)
        prepacked.MADE.reset(packing)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % ALIGNMENT)  # the payload starts aligned, as the blob does
    blob = len(text).to_bytes(8, "little") + text + bytes(payload)
    return PreprocessResult(blob, {layer.name: _model_nodes(layer) for layer in graph.layers})


def init(backend: Any, processed: bytes | memoryview, context: InitContext) -> Callable[..., Any]:
    """The partition's workloads with the kept routes and packed weights, the compiled
    OneDnnGraphs traced again, as one call (the handle)."""
    header, payload = _header(memoryview(processed))
    compiled = _compiled_names(header["compiled"], context.graph)
    packed = _packed(header["packed"], payload, context.graph) if prepacked.available() else {}
    token, packing = route_cache.KEPT.set(header["routes"]), prepacked.KEPT.set(packed)
    try:
        workloads = _workloads(backend, context.graph, compiled)
    finally:
        route_cache.KEPT.reset(token)
        prepacked.KEPT.reset(packing)
    return _sequence(context.graph, workloads)


# -- reading the blob: every field checked before it is used --------------------------------------
def _header(processed: memoryview) -> tuple[dict[str, Any], memoryview]:
    """The blob's header, checked as layout 3's, and its payload."""
    length = int.from_bytes(processed[:8], "little") if len(processed) >= 8 else -1
    if not 0 <= length <= len(processed) - 8:
        raise ArtifactError(f"CpuAcc's blob of {len(processed)} bytes names a header of {length}")
    try:
        header = json.loads(bytes(processed[8:8 + length]))
    except ValueError as exc:
        raise ArtifactError(f"CpuAcc's blob has no JSON header: {exc}") from exc
    if not isinstance(header, dict) or header.get("layout") != LAYOUT:
        layout = header.get("layout", "1 or 2") if isinstance(header, dict) else "unknown"
        raise ArtifactError(f"CpuAcc's blob is of layout {layout}, this CpuAcc reads layout "
                            f"{LAYOUT} (earlier ones kept TorchScript archives, which are not "
                            f"loaded): compile the model again")
    routes, compiled, packed = header.get("routes"), header.get("compiled"), header.get("packed")
    if (sorted(header) != sorted(KEYS) or not _strings(routes, values=True)
            or not (isinstance(compiled, list) and all(isinstance(n, str) for n in compiled))
            or not _strings(packed)):
        raise ArtifactError(f"CpuAcc's blob header has keys {sorted(header)} (expected "
                            f"{', '.join(KEYS)}: routes a mapping of names to names, compiled a "
                            f"list of layer names, packed a mapping by layer name)")
    return header, processed[8 + length:]


def _strings(value: Any, values: bool = False) -> bool:
    """Whether ``value`` is a dict with string keys (and string values, where ``values``)."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and (not values or isinstance(v, str)) for k, v in value.items())


def _compiled_names(names: list[str], graph: Graph) -> set[str]:
    """The compiled OneDnnGraphs' names, each one of the partition's OneDnnGraph layers."""
    choices = {layer.name for layer in graph.layers if layer.op_type == "OneDnnGraph"}
    for name in names:
        if name not in choices:
            raise ArtifactError(f"CpuAcc's blob names {name!r} a compiled OneDnnGraph; the "
                                f"partition's are: {', '.join(sorted(choices)) or 'none'}")
    return set(names)


def _packed(entries: dict[str, Any], payload: memoryview, graph: Graph) -> dict[str, Any]:
    """The packed weights of ``entries`` by layer name, each checked against the layer that reads
    it (its weight's sizes and type) and made from the payload's bytes (``prepacked.from_bytes``:
    the descriptor checked against its data first)."""
    layers = _weighted_layers(graph.layers)
    packed = {}
    for name, entry in entries.items():
        layer = layers.get(name)
        if layer is None:
            raise ArtifactError(f"CpuAcc's blob keeps a packed weight for {name!r}, which is no "
                                f"fused layer of the partition with a weight")
        sizes = list(layer.attrs["weight"].shape)
        if layer.attrs.get("split"):  # a QLinearConv's halves, packed joined (``qlinear._scaled``)
            sizes[0] = layer.attrs["split"]
        dtype = layer.attrs.get("compute") or "float32"
        if not isinstance(entry, dict) or sorted(entry) != sorted(PACKED_KEYS) or \
                entry["sizes"] != sizes or entry["dtype"] != dtype:
            raise ArtifactError(f"CpuAcc's blob keeps a packed weight for {name!r} as {entry!r}; "
                                f"its layer's weight has sizes {sizes} and type {dtype}")
        packed[name] = prepacked.from_bytes(_slice(payload, entry["descriptor"], name),
                                            _slice(payload, entry["data"], name), sizes, dtype)
    return packed


def _weighted_layers(layers: list[Layer]) -> dict[str, Layer]:
    """The fused layers with a weight array (a Linear, a FusedConv) by name, those inside a
    OneDnnGraph, Reduced or Specialized layer included."""
    import numpy as np

    from backplane.backends.torch.backend import FUSED_DOMAIN

    found = {}
    for layer in layers:
        inner = layer.attrs.get("layers")
        if isinstance(inner, list):
            found.update(_weighted_layers([lay for lay in inner if isinstance(lay, Layer)]))
        if layer.domain == FUSED_DOMAIN and isinstance(layer.attrs.get("weight"), np.ndarray):
            found[layer.name] = layer
    return found


def _slice(payload: memoryview, where: Any, name: str) -> memoryview:
    """``payload[offset:offset + size]`` for ``where`` = [offset, size] inside the payload."""
    if not (isinstance(where, list) and len(where) == 2
            and all(type(v) is int and v >= 0 for v in where)
            and where[0] + where[1] <= len(payload)):
        raise ArtifactError(f"CpuAcc's blob keeps a packed weight for {name!r} at {where!r}, not "
                            f"an [offset, size] inside its payload of {len(payload)} bytes")
    return payload[where[0]:where[0] + where[1]]


def _workloads(backend: Any, graph: Graph, compiled: set[str]) -> list[Workload]:
    factory = backend.create_workload_factory()
    workloads = []
    for layer in graph.layers:
        if layer.name in compiled:
            workloads.append(_compiled_again(layer, backend, graph))
            continue
        infos_in = [graph.info(n) for n in layer.inputs]
        infos_out = [graph.info(n) for n in layer.outputs]
        workloads.append(factory.create_workload(layer, infos_in, infos_out))
    return workloads


def _compiled_again(layer: Layer, backend: Any, graph: Graph) -> Workload:
    """A compiled OneDnnGraph made again from its layer: traced, frozen, compiled by oneDNN Graph
    and checked against its layers at its first run, as a load makes it
    (``onednn_graph.at_first_run``; per thread count, ``onednn_graph.CompiledPerThreads``)."""
    inputs = [graph.info(n) for n in layer.inputs]
    return onednn_graph.at_first_run(layer, backend, inputs, "onednn_graph", None)


def _append(payload: bytearray, data: bytes) -> list[int]:
    """``data`` appended at the payload's next aligned offset; its [offset, size]."""
    payload.extend(b"\0" * (-len(payload) % ALIGNMENT))
    offset = len(payload)
    payload.extend(data)
    return [offset, len(data)]


def _sequence(graph: Graph, workloads: Sequence[Workload]) -> Callable[..., Any]:
    """The workloads one after the other over named values, each dropped after its last reader;
    ``profiled`` times each layer under its model node names."""
    from backplane.backends.torch.backend import _numpy_to_torch
    from backplane.backends.torch.fusion.onednn_graph import sequence_workload

    steps = [(w, layer.inputs, layer.outputs) for w, layer in zip(workloads, graph.layers)]
    read = {n for layer in graph.layers for n in layer.inputs}
    template = {n: _numpy_to_torch(v) for n, v in graph.constants.items() if n in read}
    return sequence_workload(graph.layers, steps, template, graph.inputs, graph.outputs)


def _model_nodes(layer: Layer) -> list[str]:
    """The model's nodes a layer runs: a fused layer's name joins them with '+'; a OneDnnGraph or
    Specialized layer holds its layers."""
    inner = layer.attrs.get("layers")
    if isinstance(inner, list) and inner and isinstance(inner[0], Layer):
        return [n for lay in inner for n in _model_nodes(lay)]
    return layer.name.split("+")
