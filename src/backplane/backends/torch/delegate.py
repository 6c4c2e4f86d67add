"""CpuAcc's artifact blob: what its load does at a cost, done once at compile time.

Loading a CpuAcc partition measures routes (oneDNN, MKL or torch's own per fused layer, compiled
or layer by layer per OneDnnGraph) and traces and freezes the compiled partitions. ``preprocess``
does that load once and keeps the outcome in the blob: every route chosen, by its route-cache key,
and each compiled OneDnnGraph as the frozen TorchScript module (``torch.jit.save``, a format torch
keeps). ``init`` then creates the partition's workloads with those routes known (nothing is
measured) and the compiled partitions loaded instead of traced (``torch.jit.load``; oneDNN Graph
still compiles them at their first calls, as the profiling executor does, here during ``init``).
The weights are not in the blob: they are the artifact's constants, mapped, in the portable
subgraph ``init`` gets.

The blob: an 8-byte little-endian length, a JSON header ``{"routes": {key: route}, "modules":
{layer name: [offset, size]}}``, then the saved modules.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from backplane.backends.api.backend import InitContext, PreprocessResult, Workload
from backplane.backends.torch import route_cache
from backplane.ir.graph import Graph, Layer

FACT_NAMES = ("torch", "isa")


def machine_facts() -> dict[str, str]:
    """What CpuAcc's blobs depend on: torch's version (its TorchScript and oneDNN) and the
    instruction sets the routes were measured and the partitions compiled with."""
    import torch

    from backplane.artifact.facts import cpu

    return {"torch": torch.__version__, "isa": cpu()["isa"]}


def preprocess(backend: Any, graph: Graph) -> PreprocessResult:
    """Load the partition once, keeping the routes chosen and the compiled modules."""
    import torch

    kept: dict[str, str] = {}
    token = route_cache.KEPT.set(kept)
    try:
        workloads = _workloads(backend, graph, {})
    finally:
        route_cache.KEPT.reset(token)
    modules: dict[str, bytes] = {}
    for layer, workload in zip(graph.layers, workloads):
        module = getattr(workload, "module", None)
        if layer.op_type == "OneDnnGraph" and module is not None:
            buffer = io.BytesIO()
            torch.jit.save(module, buffer)
            modules[layer.name] = buffer.getvalue()
    header: dict[str, Any] = {"routes": kept, "modules": {}}
    offset = 0
    for name, data in modules.items():
        header["modules"][name] = [offset, len(data)]
        offset += len(data)
    text = json.dumps(header).encode()
    blob = len(text).to_bytes(8, "little") + text + b"".join(modules.values())
    return PreprocessResult(blob, {layer.name: _model_nodes(layer) for layer in graph.layers})


def init(backend: Any, processed: bytes | memoryview, context: InitContext) -> Callable[..., Any]:
    """The partition's workloads with the kept routes and modules, as one call (the handle)."""
    import torch

    processed = memoryview(processed)
    length = int.from_bytes(processed[:8], "little")
    header = json.loads(bytes(processed[8:8 + length]))
    payload = processed[8 + length:]
    modules = {}
    for name, (offset, size) in header["modules"].items():
        modules[name] = torch.jit.load(io.BytesIO(payload[offset:offset + size]))
    token = route_cache.KEPT.set(dict(header["routes"]))
    try:
        workloads = _workloads(backend, context.graph, modules)
    finally:
        route_cache.KEPT.reset(token)
    return _sequence(context.graph, workloads)


def _workloads(backend: Any, graph: Graph, modules: dict[str, Any]) -> list[Workload]:
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


def _kept_module(layer: Layer, module: Any, graph: Graph) -> Workload:
    """A compiled OneDnnGraph from its saved module: the inputs conformed to the layout it was
    traced for, oneDNN fusion on for its calls (as ``onednn_graph._compiled`` runs it)."""
    import torch

    from backplane.backends.torch.fusion import onednn_graph
    from backplane.backends.torch.threads import PerThreadCount

    sample = onednn_graph._sample([graph.info(n) for n in layer.inputs],
                                  layer.attrs.get("channels_last"))
    conform = onednn_graph._layout_guard(sample)
    modules = PerThreadCount(module, sample, 2)  # one compiled per thread count: threads.py

    def run(*values: Any) -> tuple[Any, ...]:
        values = conform(values)
        was = torch.jit.onednn_fusion_enabled()
        torch.jit.enable_onednn_fusion(True)
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                outputs = modules.current()(*values)
        finally:
            torch.jit.enable_onednn_fusion(was)
        return outputs if isinstance(outputs, tuple) else (outputs,)

    for _ in range(2):  # the first call profiles, the second hands the partitions to oneDNN Graph
        run(*sample)
    run.route = "onednn_graph"  # type: ignore[attr-defined]
    run.relayouts = conform.relayouts  # type: ignore[attr-defined]
    return run


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
