"""GpuAcc's host predicates: the layers computing an If's predicate from the model's inputs and
constants, given back to the next backend in the list so that the If reads its predicate on the host
(``with_host_predicates``, called by ``GpuAcc.optimize_subgraph``; out of ``cuda.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.api.optimization import OptimizationViews
from backplane.ir.graph import Graph, Layer, SubgraphView

PREDICATE_ELEMENTS = 64
"""The most elements a tensor of a host predicate (``host_predicates``) may have."""
HOST_BACKENDS = ("CpuAcc", "CpuRef")
"""The backends that take a predicate back: one of them must be in the list (and available)."""
HOST_PREDICATE = ("an If's predicate, from the model's inputs and constants: computed on the host, "
                  "where the If reads it, not waited for and copied from the GPU")


def with_host_predicates(view: SubgraphView, optimize: Callable[[SubgraphView], OptimizationViews],
                         ) -> OptimizationViews:
    """``optimize`` (GpuAcc's) of the view but its host predicates (``host_predicates``), which it
    gives back as failed, for the next backend in the list: an If reads its predicate on the host,
    so one made on the GPU costs a wait for the GPU and a copy in the middle of the run (the
    corpus VAD's sampling-rate test: ``sr`` uploaded, compared on the GPU and copied back)."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    host = host_predicates(view)
    if not host:
        return optimize(view)
    taken = {id(layer) for layer in host}
    rest = [layer for layer in view.layers if id(layer) not in taken]
    views = optimize(SubgraphView.of(graph, rest)) if rest else OptimizationViews()
    views.failed.append(SubgraphView.of(graph, host))
    views.reasons.update({layer.name: HOST_PREDICATE for layer in host})
    return views


def host_predicates(view: SubgraphView) -> list[Layer]:
    """The view's layers that compute nothing but If predicates (an If's first input) from the
    graph's inputs and constants, every tensor of them static and of at most
    ``PREDICATE_ELEMENTS`` elements: a Gather, an Equal and a Cast of an input's value."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    readers: dict[str, list[tuple[Layer, int]]] = {}
    for layer in graph.layers:
        for position, name in enumerate(layer.inputs):
            if name:
                readers.setdefault(name, []).append((layer, position))
    found = {id(layer): layer for layer in view.layers if _tiny(layer, graph)}
    made = {name: layer for layer in view.layers for name in layer.outputs if name}
    while True:
        kept = {key: layer for key, layer in found.items() if _feeds_predicates(
            layer, graph, readers, found) and all(
            name in graph.inputs or name in graph.constants or id(made.get(name)) in found
            for name in layer.inputs if name)}
        if len(kept) == len(found):
            break
        found = kept
    ifs = [reader for layer in found.values() for name in layer.outputs
           for reader, _ in readers.get(name, ()) if reader.op_type == "If"]
    if not ifs or not all(map(_host_listed, ifs)):
        return []
    return [layer for layer in view.layers if id(layer) in found]


def _host_listed(layer: Layer) -> bool:
    """Whether the list ``layer``'s bodies were placed with (the model's: an If's bodies are
    optimized before its graph's partitions) holds an available CpuAcc or CpuRef, which takes
    the predicate back; with GpuAcc alone it stays on the GPU."""
    report = getattr(layer.attrs.get("then_branch"), "report", None)
    gone = getattr(report, "unavailable", {})
    return any(b in HOST_BACKENDS and b not in gone for b in getattr(report, "preferences", ()))


def _feeds_predicates(layer: Layer, graph: Any, readers: dict[str, list[tuple[Layer, int]]],
                      found: dict[int, Layer]) -> bool:
    """Whether each output of ``layer`` is read, and only as an If's predicate or by ``found``."""
    for name in layer.outputs:
        uses = readers.get(name, ()) if name else ()
        if name and (name in graph.outputs or not uses or not all(
                (reader.op_type == "If" and not reader.domain and position == 0)
                or id(reader) in found for reader, position in uses)):
            return False
    return True


def _tiny(layer: Layer, graph: Any) -> bool:
    """A layer of the default domain, no body, every tensor static and small."""
    if layer.domain or any(isinstance(v, Graph) for v in layer.attrs.values()):
        return False
    for name in (*layer.inputs, *layer.outputs):
        info = graph.info(name) if name else None
        if info is not None and (not info.is_static or info.shape is None
                                 or int(np.prod(info.shape)) > PREDICATE_ELEMENTS):
            return False
    return True
