"""CpuAcc's artifact blob: what its load does at a cost, done once at compile time.

Loading a CpuAcc partition measures routes (oneDNN, MKL or torch's own per fused layer, compiled
or layer by layer per OneDnnGraph) and traces, freezes and compiles the compiled partitions.
``preprocess`` does that load once and keeps in the blob every route chosen, by its route-cache
key, and each compiled OneDnnGraph as its traced module without its weights
(``onednn_graph.weightless``: a TorchScript archive, each tensor the trace read a buffer saved
empty), with where each weight is: a view of one of the layer's own arrays, which the artifact
stores as its constants ("view": most weights), or its bytes in the blob, in its own strides
("raw": a layout a route made, as a 3x3 kernel's channels-last copy). ``init`` creates the
workloads with the routes known (nothing is measured), loads each archive (``torch.jit.load``),
sets its buffers to those tensors, mapped from the file, not copied, and freezes it: nothing
runs. oneDNN Graph compiles the frozen module's partitions at its first run, on that run's inputs
and at that run's thread count (``onednn_graph.CompiledPerThreads``): the first run costs what
the profiling executor needs (a profiled run, then the partitions compiled and run).

The blob: an 8-byte little-endian length, a JSON header ``{"routes": {key: route}, "modules":
{layer name: {"archive": [offset, size], "weights": {buffer: recipe}}}, "packed": {layer name:
{"descriptor": [offset, size], "data": [offset, size], "sizes": [...], "dtype": "float32"}}}``
padded so that the payload starts at a multiple of 64 bytes, then the payload: the archives, the
raw weights and the packed ones, each at a multiple of 64 bytes (a blob without "packed", of an
earlier backplane, loads and packs as before). A recipe is ``["view", array, element offset, sizes, strides]``
(``array``: ``constants/NAME`` or ``layers/I/ATTRIBUTE`` of the OneDnnGraph layer) or ``["raw",
dtype, [offset, size], sizes, strides]``.

A TorchScript archive is code, not pickled Python: TorchScript source (``code/``) that torch
compiles at ``torch.jit.load`` and runs at every call, and its objects (``data.pkl``,
``constants.pkl``: the module, its empty buffers, a scalar constant) in pickle's byte format, read
by torch's own C++ unpickler, which builds tensors and TorchScript objects and resolves classes in
the archive's own code only: no Python object is unpickled and no Python runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.artifact.container import ALIGNMENT
from backplane.backends.api.backend import InitContext, PreprocessResult, Workload
from backplane.backends.torch import prepacked, route_cache
from backplane.backends.torch.fusion import onednn_graph
from backplane.ir.graph import Graph, Layer

FACT_NAMES = ("torch", "isa")


def machine_facts() -> dict[str, str]:
    """What CpuAcc's blobs depend on: torch's version (its TorchScript and oneDNN) and the
    instruction sets the routes were measured and the partitions compiled with."""
    import torch

    from backplane.artifact.facts import cpu

    return {"torch": torch.__version__, "isa": cpu()["isa"]}


def preprocess(backend: Any, graph: Graph) -> PreprocessResult:
    """Load the partition once, keeping the routes chosen and the compiled modules' archives."""
    kept: dict[str, str] = {}
    made: dict[str, Any] = {}
    token, packing = route_cache.KEPT.set(kept), prepacked.MADE.set(made)
    try:
        workloads = _workloads(backend, graph, {})
        compiled = [layer for layer, workload in zip(graph.layers, workloads)
                    if layer.op_type == "OneDnnGraph"
                    and getattr(workload, "route", None) == "onednn_graph"]
        header: dict[str, Any] = {"routes": kept, "modules": {}, "packed": {}}
        payload = bytearray()
        for layer in compiled:
            archive, weights = onednn_graph.weightless(layer, backend, _sample(layer, graph))
            arrays = _arrays(layer)
            header["modules"][layer.name] = {
                "archive": _append(payload, archive),
                "weights": {name: _recipe(tensor, arrays, payload)
                            for name, tensor in weights.items()}}
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
    """The partition's workloads with the kept routes and modules, as one call (the handle)."""
    processed = memoryview(processed)
    length = int.from_bytes(processed[:8], "little")
    header = json.loads(bytes(processed[8:8 + length]))
    payload = processed[8 + length:]
    layers = {layer.name: layer for layer in context.graph.layers}
    modules = {}
    for name, kept in header["modules"].items():
        if not isinstance(kept, dict):  # [offset, size]: a frozen module with its weights
            raise ValueError(f"CpuAcc's blob for {name} is of the layout before weightless "
                             f"modules; compile the model again")
        start, size = kept["archive"]
        arrays = _arrays(layers[name])
        weights = {buffer: _tensor(recipe, arrays, payload)
                   for buffer, recipe in kept["weights"].items()}
        modules[name] = _maker(payload[start:start + size], weights)
    packed = {name: prepacked.from_bytes(_slice(payload, kept["descriptor"]),
                                         _slice(payload, kept["data"]), kept["sizes"], kept["dtype"])
              for name, kept in header.get("packed", {}).items()} if prepacked.available() else {}
    token, packing = route_cache.KEPT.set(dict(header["routes"])), prepacked.KEPT.set(packed)
    try:
        workloads = _workloads(backend, context.graph, modules)
    finally:
        route_cache.KEPT.reset(token)
        prepacked.KEPT.reset(packing)
    return _sequence(context.graph, workloads)


def _workloads(backend: Any, graph: Graph, modules: dict[str, Callable[[], Any]]) -> list[Workload]:
    factory = backend.create_workload_factory()
    workloads = []
    for layer in graph.layers:
        if layer.name in modules:
            workloads.append(_kept_module(layer, modules[layer.name], graph))
            continue
        infos_in = [graph.info(n) for n in layer.inputs]
        infos_out = [graph.info(n) for n in layer.outputs]
        workloads.append(factory.create_workload(layer, infos_in, infos_out))
    return workloads


def _kept_module(layer: Layer, make: Callable[[], Any], graph: Graph) -> Workload:
    """A compiled OneDnnGraph from its kept module, compiled by oneDNN Graph at its first run
    (per thread count, ``onednn_graph.CompiledPerThreads``), as ``onednn_graph._compiled`` runs it
    after its load."""
    modules = onednn_graph.CompiledPerThreads(make)
    run = onednn_graph.compiled_run(modules, _sample(layer, graph))
    run.route = "onednn_graph"  # type: ignore[attr-defined]
    return onednn_graph.edges(layer, run)


def _maker(archive: memoryview, weights: dict[str, Any]) -> Callable[[], Any]:
    """The kept module's maker: the module made here, at load (a broken blob fails the load, not
    the first run), handed out at the first call; a fresh one for each further thread count."""
    made = [onednn_graph.from_weightless(archive, weights)]
    return lambda: made.pop() if made else onednn_graph.from_weightless(archive, weights)


def _sample(layer: Layer, graph: Graph) -> list[Any]:
    return onednn_graph._sample([graph.info(n) for n in layer.inputs],
                                layer.attrs.get("channels_last"), layer.attrs.get("compute"))


# -- the kept modules' weights: views of the artifact's constants where they are ------------------
def _arrays(layer: Layer) -> dict[str, np.ndarray]:
    """The arrays a OneDnnGraph layer holds, by a name that finds them again in the layer the
    artifact gives back: its constants and its layers' array attributes (fused weights)."""
    arrays = {f"constants/{name}": np.asarray(value)
              for name, value in layer.attrs["constants"].items()}
    for i, inner in enumerate(layer.attrs["layers"]):
        arrays.update({f"layers/{i}/{key}": value for key, value in inner.attrs.items()
                       if isinstance(value, np.ndarray)})
    return arrays


def _recipe(tensor: Any, arrays: dict[str, np.ndarray], payload: bytearray) -> list[Any]:
    """How ``_tensor`` makes ``tensor`` again at load: a view of one of ``arrays`` ("view", the
    artifact's constants: the weights the routes read as they are), else its memory in the payload
    ("raw", in its own strides: a channels-last copy, a folded weight), mapped as the constants
    are, not copied. A tensor whose memory is not one dense block is stored contiguous."""
    import torch

    sizes, strides = list(tensor.shape), list(tensor.stride())
    item, start = tensor.element_size(), tensor.data_ptr()
    end = start + item * (1 + sum((n - 1) * s for n, s in zip(sizes, strides)))
    for key, array in arrays.items():
        base = array.__array_interface__["data"][0]
        if (str(array.dtype) == _dtype(tensor) and array.flags.c_contiguous
                and base <= start and end <= base + array.nbytes
                and (start - base) % item == 0 and min(strides, default=0) >= 0):
            return ["view", key, (start - base) // item, sizes, strides]
    if not _dense(sizes, strides):
        tensor = tensor.contiguous()
        strides = list(tensor.stride())
    memory = torch.as_strided(tensor, [tensor.numel()], [1])  # its elements as they lie in memory
    data = memory.view(torch.uint8).numpy().tobytes()
    return ["raw", _dtype(tensor), _append(payload, data), sizes, strides]


def _tensor(recipe: list[Any], arrays: dict[str, np.ndarray], payload: memoryview) -> Any:
    import torch

    kind, sizes, strides = recipe[0], recipe[-2], recipe[-1]
    if kind == "view":
        flat = torch.from_numpy(arrays[recipe[1]]).reshape(-1)
        return torch.as_strided(flat, sizes, strides, recipe[2])
    if kind == "raw":
        start, size = recipe[2]
        memory = torch.frombuffer(payload[start:start + size], dtype=torch.uint8)
        return torch.as_strided(memory.view(getattr(torch, recipe[1])), sizes, strides)
    raise ValueError(f"CpuAcc's blob: a weight kept as {kind!r}, not as 'view' or 'raw'")


def _dense(sizes: list[int], strides: list[int]) -> bool:
    """Whether a tensor's elements fill one block of memory (in any order of its dimensions)."""
    step = 1
    for size, stride in sorted(zip(sizes, strides), key=lambda pair: pair[1]):
        if size != 1 and stride != step:
            return False
        step *= size
    return True


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _slice(payload: memoryview, where: list[int]) -> memoryview:
    start, size = where
    return payload[start:start + size]


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
