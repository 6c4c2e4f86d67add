"""``optimize_subgraph`` for OpenVINO: each maximal partition OpenVINO takes as one compiled layer.

1. The whole view as one ONNX model in memory, read by OpenVINO's ONNX frontend and asked of the CPU
   plugin (``query_model``). Taken whole: one ``CompiledModel`` layer replaces the view.
2. Otherwise each layer is asked alone, its constants with it (``query.layer_refusal``). The layers
   refused fail, each with OpenVINO's reason (they go to the next backend, the reason a refusal in
   the placement report); the rest is cut into pieces that keep the graph acyclic, and each piece is
   asked again as in step 1.

Before either, ``checks.refusal`` leaves to the next backend the layers OpenVINO would crash on or
answer silently wrong (contradictory recurrent weights, sizes and indices out of range or computed
where nothing can check them), and the rest is asked in pieces. The checks of sizes and indices that
are the partition's inputs go with the compiled layer (``attrs["checks"]``); the workload makes them
before each run.

The ``openvino.Model`` read here is kept in the layer; it is compiled, with the network's options, when
the network loads (``workload.compile_model``), as Arm NN's precompiled layers are made into workloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.openvino import checks, onnx_model, query
from backplane.ir.graph import Graph, Layer, SubgraphView

DOMAIN = "backplane.openvino"
"""The domain of the layers OpenVINO substitutes."""
OP = "CompiledModel"


def optimize(view: SubgraphView) -> OptimizationViews:
    """The view as compiled layers where OpenVINO takes it, the layers it refuses failed with why."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    compiled = {layer.name for layer in view.layers if layer.domain == DOMAIN}
    if compiled:  # a later round of the optimizer: what was compiled stays, the rest is asked
        return _around(view, graph, compiled)
    produced = {out: layer for layer in view.layers for out in layer.outputs if out}
    checked = {layer.name: why for layer in view.layers
               if (why := checks.refusal(layer, graph, produced)) is not None}
    if checked:  # left to the next backend before OpenVINO sees them; the rest asked in pieces
        views = _failed(OptimizationViews(), [lay for lay in view.layers if lay.name in checked],
                        graph, "")
        views.reasons.update(checked)
        for piece in acyclic_pieces(view.layers, set(checked)):
            _merge(views, optimize(SubgraphView.of(graph, piece)))
        return views
    model, reason = convert(view, graph)
    if model is not None:
        return OptimizationViews(substitutions=[Substitution(view, [compiled_layer(view, *model)])])
    refusals = {layer.name: why for layer in view.layers
                if (why := query.layer_refusal(layer, graph)) is not None}
    if not refusals:  # every layer taken alone, not all together: the whole view fails
        return _failed(OptimizationViews(), view.layers, graph, reason or "")
    views = _failed(OptimizationViews(), [lay for lay in view.layers if lay.name in refusals],
                    graph, "")
    views.reasons.update(refusals)
    for piece in acyclic_pieces(view.layers, set(refusals)):
        sub = SubgraphView.of(graph, piece)
        model, reason = convert(sub, graph)
        if model is None:
            _failed(views, piece, graph, reason or "")
        else:
            views.substitutions.append(Substitution(sub, [compiled_layer(sub, *model)]))
    return views


def convert(view: SubgraphView, graph: Graph) -> tuple[tuple[Any, checks.Plan] | None, str | None]:
    """((the view as an ``openvino.Model``, its checks), None), or (None, why OpenVINO does not
    take it whole). The model outputs what the checks read after the run (``checks.Plan``)."""
    plan = checks.plan(view.layers, view.inputs, graph)
    outputs = [*view.outputs, *plan.added]
    try:
        model = query.read(onnx_model.model(view.layers, view.inputs, outputs, graph,
                                            shapes=plan.shapes))
    except Exception as exc:  # noqa: BLE001 - OpenVINO raises RuntimeError and others
        return None, f"OpenVINO's ONNX frontend cannot convert its partition: " \
                     f"{query.frontend_message(exc)}"
    contradiction = query.shape_contradiction(model, view.outputs, graph)
    if contradiction:
        return None, contradiction
    try:
        refused = query.refused_ops(model)
    except Exception as exc:  # noqa: BLE001 - query_model validates shapes too
        return None, f"OpenVINO's {query.DEVICE} plugin cannot query its partition: " \
                     f"{query.frontend_message(exc)}"
    if refused:
        return None, (f"OpenVINO's {query.DEVICE} plugin does not take {', '.join(refused[:4])} "
                      f"of its partition")
    return (model, plan), None


def compiled_layer(view: SubgraphView, model: Any, plan: checks.Plan) -> Layer:
    """One layer in place of ``view``: the same boundary tensors, the model kept to compile at load.
    Where an op of the view drops NaN in OpenVINO (``nan_forms``), ``nan_model`` makes the model
    that keeps it, compiled at the first run given a NaN or an infinity (``workload``); a view whose
    constants hold one is that model from the start."""
    first, last = view.layers[0].name, view.layers[-1].name
    name = f"OpenVINO[{first}..{last}]({len(view.layers)} layers)"
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    attrs = {"model": model, "layers": [layer.name for layer in view.layers],
             "checks": [asdict(check) for check in plan.checks]}
    if onnx_model.drops_nan(view.layers, graph):
        layers, inputs = list(view.layers), list(view.inputs)
        outputs, shapes = [*view.outputs, *plan.added], list(plan.shapes)

        def nan_model() -> Any:
            return query.read(onnx_model.model(layers, inputs, outputs, graph, nan_keeping=True,
                                               shapes=shapes))

        if _non_finite_constants(layers, graph):
            attrs["model"] = nan_model()
        else:
            attrs["nan_model"] = nan_model
    return Layer(name, OP, list(view.inputs), list(view.outputs), attrs, DOMAIN, 1)


def _non_finite_constants(layers: Sequence[Layer], graph: Graph) -> bool:
    read = {n for layer in layers for n in layer.inputs if n in graph.constants}
    return any(not np.isfinite(array).all() for n in read
               if (array := np.asarray(graph.constants[n])).dtype.kind == "f")


def acyclic_pieces(layers: Sequence[Layer], refused: set[str]) -> list[list[Layer]]:
    """The layers not in ``refused``, in groups that can each run as one step: a layer's depth rises
    by one across every edge between a refused and a taken layer (``optimizer/partition.py``'s
    rule), and the taken layers of one depth form one group. ``layers`` is a convex view."""
    producers = {out: layer for layer in layers for out in layer.outputs if out}
    depth: dict[int, int] = {}
    groups: dict[int, list[Layer]] = {}
    for layer in layers:  # topological order
        level = 0
        for name in layer.inputs:
            dep = producers.get(name)
            if dep is not None:
                level = max(level, depth[id(dep)] + ((dep.name in refused) != (layer.name in refused)))
        depth[id(layer)] = level
        if layer.name not in refused:
            groups.setdefault(level, []).append(layer)
    return [groups[level] for level in sorted(groups)]


def _around(view: SubgraphView, graph: Graph, compiled: set[str]) -> OptimizationViews:
    views = OptimizationViews(untouched=[SubgraphView(
        [layer for layer in view.layers if layer.name in compiled], [], [], graph)])
    for piece in acyclic_pieces(view.layers, compiled):
        _merge(views, optimize(SubgraphView.of(graph, piece)))
    return views


def _merge(views: OptimizationViews, more: OptimizationViews) -> None:
    views.substitutions += more.substitutions
    views.failed += more.failed
    views.untouched += more.untouched
    views.reasons.update(more.reasons)


def _failed(views: OptimizationViews, layers: Sequence[Layer], graph: Graph,
            reason: str) -> OptimizationViews:
    if layers:
        views.failed.append(SubgraphView(list(layers), [], [], graph))
        if reason:
            views.reasons.update({layer.name: reason for layer in layers})
    return views
