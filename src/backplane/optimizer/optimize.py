"""Optimize: a Graph and backend preferences in, an OptimizedNetwork with its placement report out.

1. generic passes (constant folding, identity / dropout removal, dead layers)
2. assign: per layer, its pin first, then the preferences; support with reasons
3. split per backend into acyclic subgraphs
4. backend.optimize_subgraph(view): substitutions applied, failed layers reassigned, untouched kept
5-6. tensor-handle strategy per edge; MemCopy layers where a copy is needed
7. a delegation tag per partition (ExecuTorch's partitioner), in the report
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backplane import debug
from backplane.backends.api.backend import Backend, BackendOptions, check_options, support_of
from backplane.backends.api.memory import MemorySource
from backplane.backends.builtin.backend import OWNED_OPS
from backplane.backends.builtin.control_flow import CONTROL_FLOW_OPS
from backplane.backends.registry import BackendRegistry, UnknownBackendError
from backplane.backends.registry import registry as default_registry
from backplane.ir.graph import Graph, Layer
from backplane.optimizer import decided, measured, ort_patterns, passes
from backplane.optimizer.edges import BUILTIN, insert_compatibility_layers
from backplane.optimizer.partition import delegation_tags, partition
from backplane.optimizer.report import LayerPlacement, PlacementReport, SubgraphRecord

if TYPE_CHECKING:
    from backplane.optimizer.release import FileWeights

log = logging.getLogger("backplane.optimizer")


class OptimizationError(RuntimeError):
    """No backend can run a layer, or none of the preferred backends is available."""


@dataclass(frozen=True)
class OptimizerOptions:
    fold_constants: bool = True
    remove_identities: bool = True
    remove_dead_layers: bool = True
    strict: bool = False
    """Fail instead of falling back: a requested backend unavailable, or any layer refused by one."""
    placement: str = "preference"
    """"preference" (the list's order) or "measured": each partition on the backend timed fastest
    for it at load, the copies at its edges included (``optimizer/measured.py``)."""

    def __post_init__(self) -> None:
        measured.check_placement(self.placement)


@dataclass
class OptimizedNetwork:
    """The plan the runtime loads: the graph with every layer placed, and how it got there."""

    graph: Graph
    backends: dict[str, Backend]  # every backend a layer runs on, builtin included
    report: PlacementReport
    input_names: list[str]
    output_names: list[str]  # the model's names; graph.outputs may name copies of them
    options: OptimizerOptions = field(default_factory=OptimizerOptions)
    backend_options: dict[str, object] = field(default_factory=dict)
    """The options this network's backends were given (``Backend.options``)."""
    exclusions: dict[str, dict[str, str]] = field(default_factory=dict)
    """Layer name -> {backend id: reason}: the backends kept from each layer (``optimize``'s
    ``exclude``)."""
    remake: Callable[[dict[str, dict[str, str]]], OptimizedNetwork] | None = None
    """Optimizes the same graph again with other exclusions: what the runtime does when a backend
    cannot create a workload for a layer it took (Arm NN's failed subgraph, found at load)."""
    weights: FileWeights | None = None
    """Where the weights its model file holds can be read again: set by the network's maker (a
    session) to give them up: loading the network leaves each weight to the workloads that read
    it (``optimizer/release.py``)."""
    released: bool = False
    """A load released its weights: loading it again loads its ``remake``."""

    def layers_behind(self, layer: Layer) -> list[str]:
        """The model's layers that ``layer`` runs: itself, or those a substitution put into it."""
        if layer.name in self.report.layers:
            return [layer.name]
        return [p.name for p in self.report.layers.values() if p.substituted_by == layer.name]


def optimize(graph: Graph, backends: Sequence[str], *, pins: Mapping[str, str] | None = None,
             options: OptimizerOptions | None = None, registry: BackendRegistry | None = None,
             backend_options: Mapping[str, object] | None = None,
             exclude: Mapping[str, Mapping[str, str]] | None = None) -> OptimizedNetwork:
    """Place every layer of ``graph`` on the first of ``backends`` that supports it.

    ``pins`` maps a layer name or an op type to a backend id tried before the preferences (a layer
    name wins over its op type). ``backend_options`` ("CpuAcc.compile": "layers", ...) go to this
    network's backends, created for it alone, before any of them is asked anything. ``exclude``
    maps a layer name to the backends that must not take it, each with the reason (the report
    shows it as a refusal). The user's graph is not modified.

    Each fallback is one warning in the report (``report.warnings``) and a DEBUG message; the log
    gets one WARNING per (op type, backend, reason) with its count (``report.fallback_summary``).
    """
    network = _optimize(graph, backends, pins=pins, options=options, registry=registry,
                        backend_options=backend_options, exclude=exclude)
    for line in network.report.fallback_summary():
        log.warning(line)
    refused = first_choice_refusals(network.report, registry or default_registry)
    if refused:
        _warn(network.report, refused)
    return network


def first_choice_refusals(report: PlacementReport, registry: BackendRegistry,
                          named: int = 8) -> str | None:
    """One line naming the layers the first backend of the list refused, and why, where that
    backend keeps its tensors off the host (GpuAcc): each such layer runs elsewhere, behind copies,
    and a model it refuses whole would otherwise run on the next backend with only a count per op
    type in the log. None where it refused nothing, is unavailable or computes in host memory."""
    first = report.preferences[0] if report.preferences else None
    refused = [(p, next(r for b, r in p.refusals if b == first)) for p in report.layers.values()
               if any(b == first for b, _ in p.refusals)]
    if first is None or not refused or first in report.unavailable:
        return None
    memory = registry.create(first).tensor_handle_factories()[0].memory
    if memory & (MemorySource.MALLOC | MemorySource.PINNED):
        return None
    by_reason: dict[str, list[str]] = {}
    for placement, reason in refused:
        by_reason.setdefault(reason, []).append(f"{placement.name} ({placement.op_type})")
    places = Counter(p.backend for p, _ in refused)
    reasons = "; ".join(f"{reason}: {', '.join(names[:named])}"
                        + (f" and {len(names) - named} more" if len(names) > named else "")
                        for reason, names in by_reason.items())
    return (f"{first}, first in the list, refused {len(refused)} of {len(report.layers)} layers, "
            f"placed on {', '.join(f'{b} ({n})' for b, n in places.items())} instead: {reasons}")


def _optimize(graph: Graph, backends: Sequence[str], *, pins: Mapping[str, str] | None = None,
              options: OptimizerOptions | None = None, registry: BackendRegistry | None = None,
              backend_options: Mapping[str, object] | None = None,
              exclude: Mapping[str, Mapping[str, str]] | None = None,
              decide: int = decided.MAX_DECIDED) -> OptimizedNetwork:
    """``optimize`` without the summary in the log (bodies and remakes: their parent logs).
    ``decide``: how many Ifs deep the model's inputs may decide (``decided.py``; 0 in bodies)."""
    options = options or OptimizerOptions()
    registry = registry or default_registry
    pins = dict(pins or {})
    backend_options = dict(backend_options or {})
    exclusions = {name: dict(reasons) for name, reasons in (exclude or {}).items()}

    source = graph  # the user's, untouched: ``graph`` becomes our copy below

    def remake(more: dict[str, dict[str, str]]) -> OptimizedNetwork:
        return _optimize(source, backends, pins=pins, options=options, registry=registry,
                        backend_options=backend_options, exclude=more, decide=decide)

    graph = graph.private_copy()
    expose_captures(graph)
    output_names = list(graph.outputs)
    _run_passes(graph, options)
    if options.fold_constants and decided.inline_constant_ifs(graph):
        _run_passes(graph, options)
    decision = _decision(graph, registry, output_names) if decide > 0 else None
    if decision is not None:
        def version(body: Graph, path: str) -> OptimizedNetwork:
            mine = {key[len(path):]: reasons for key, reasons in exclusions.items()
                    if key.startswith(path)}
            return _optimize(body, backends, pins=pins, options=options, registry=registry,
                             backend_options=backend_options, exclude=mine, decide=decide - 1)

        return _decided(graph, decision, version, options, registry, backend_options,
                        exclusions, remake, output_names)
    report = PlacementReport(list(backends))
    available = _available_backends(backends, pins, registry, report, backend_options)
    if BUILTIN not in available:
        available[BUILTIN] = registry.create(BUILTIN)
        available[BUILTIN].options = BackendOptions(backend_options)
    _assign(graph, available, pins, report, excluded=exclusions)
    for layer in graph.layers:
        if layer.backend == BUILTIN and layer.op_type in CONTROL_FLOW_OPS:
            _optimize_bodies(layer, graph, backends, pins, options, registry, report, backend_options,
                             exclusions)
            if layer.op_type == "If":
                report.layers[layer.name].note = decided.why_nested(decide, graph)
    if options.placement == "measured":
        measured.place(graph, available, pins, report, exclusions, registry, backend_options)
    _optimize_subgraphs(graph, available, pins, report, exclusions)
    if options.strict:
        _check_strict(report)
    used = {layer.backend for layer in graph.layers if layer.backend}
    factories = {bid: tuple(available[bid].tensor_handle_factories()) for bid in used}
    capabilities = {bid: available[bid].capabilities() for bid in used}
    report.copies += insert_compatibility_layers(  # after the bodies' own
        graph, factories, {b for b, c in capabilities.items() if c.get("AsyncExecution")},
        {b for b, c in capabilities.items() if c.get("ProtectedContentAllocation")})
    _tag(graph, report, backend_options)
    chosen = {bid: available[bid] for bid in used}
    if any(layer.backend == BUILTIN for layer in graph.layers):  # copies, imports, syncs
        chosen[BUILTIN] = available[BUILTIN]
    if debug.level() >= 1:
        report.render(debug.console())
    return OptimizedNetwork(graph, chosen, report, list(graph.inputs), output_names, options,
                            backend_options, exclusions, remake)


def _decision(graph: Graph, registry: BackendRegistry,
              output_names: Sequence[str]) -> decided.Decision | None:
    """The If of ``graph`` its small inputs decide (``decided.find``), where its predicate's
    layers have CpuRef kernels (builtin computes it with them)."""
    if list(graph.outputs) != list(output_names) or not any(
            layer.op_type == "If" for layer in graph.layers):
        return None
    reference = registry.create("CpuRef")
    return decided.find(graph, lambda layer: reference.kernel_for(layer) is not None)


def _decided(graph: Graph, decision: decided.Decision,
             version: Callable[[Graph, str], OptimizedNetwork], options: OptimizerOptions,
             registry: BackendRegistry, backend_options: Mapping[str, object],
             exclusions: dict[str, dict[str, str]],
             remake: Callable[[dict[str, dict[str, str]]], OptimizedNetwork],
             output_names: list[str]) -> OptimizedNetwork:
    """``graph`` as builtin's one DecidedIf layer over its versions (``decided.py``)."""
    outer, report, _ = decided.decided_network(graph, decision, version)
    builtin = registry.create(BUILTIN)
    builtin.options = BackendOptions(backend_options)
    outer.layers[0].backend = BUILTIN
    if debug.level() >= 1:
        report.render(debug.console())
    return OptimizedNetwork(outer, {BUILTIN: builtin}, report, list(outer.inputs), output_names,
                            options, dict(backend_options), exclusions, remake)


def _run_passes(graph: Graph, options: OptimizerOptions) -> None:
    if options.remove_identities:
        passes.remove_identities(graph)
    if options.fold_constants:
        passes.fold_constants(graph)
        ort_patterns.plain_forms(graph)  # static shapes and constants known now
    if options.remove_dead_layers:
        passes.remove_dead_layers(graph)


def _available_backends(preferences: Sequence[str], pins: Mapping[str, str],
                        registry: BackendRegistry, report: PlacementReport,
                        backend_options: Mapping[str, object]) -> dict[str, Backend]:
    if not preferences:
        raise OptimizationError(f"no backend preferences given. Known backends are: "
                                f"{', '.join(registry.ids())}")
    available: dict[str, Backend] = {}
    for backend_id in [*preferences, *pins.values()]:
        if backend_id in available or backend_id in report.unavailable:
            continue
        try:
            backend = registry.create(backend_id)
        except UnknownBackendError as exc:
            raise OptimizationError(str(exc)) from exc
        check_options(backend, backend_options)
        backend.options = BackendOptions(backend_options)
        status = backend.availability()
        if status.ok:
            available[backend_id] = backend
        else:
            report.unavailable[backend_id] = status.reason
            _warn(report, f"backend {backend_id} is not available: {status.reason}")
    if not any(b in available for b in preferences):
        raise OptimizationError(
            f"none of the preferred backends {list(preferences)} are available "
            f"({'; '.join(f'{b}: {r}' for b, r in report.unavailable.items())}). "
            f"Registered backends are: {', '.join(registry.ids())}")
    return available


def _candidates(layer: Layer, preferences: Sequence[str], available: Mapping[str, Backend],
                pins: Mapping[str, str], excluded: set[str]) -> list[str]:
    pin = pins.get(layer.name) or pins.get(layer.op_type)
    order = ([pin] if pin else []) + [b for b in preferences if b != pin]
    return [b for b in order if b in available and b not in excluded]


def _assign(graph: Graph, available: Mapping[str, Backend], pins: Mapping[str, str],
            report: PlacementReport, layers: Sequence[Layer] | None = None,
            excluded: Mapping[str, Mapping[str, str]] | None = None) -> None:
    """Place ``layers`` (all by default); ``excluded``: layer name -> {backend id: reason} not to
    try, each a refusal in the report."""
    for layer in layers if layers is not None else graph.layers:
        placement = report.layers.get(layer.name) or LayerPlacement(layer.name, layer.op_type, "")
        ins = [graph.info(n) for n in layer.inputs if n]
        outs = [graph.info(n) for n in layer.outputs if n]
        if layer.op_type in OWNED_OPS and not layer.domain:  # builtin's own, always
            support = support_of(available[BUILTIN], layer, ins, outs)
            if not support.ok:
                raise OptimizationError(f"no backend can run {layer.describe()}: builtin: "
                                        f"{support.reason}")
            layer.backend = placement.backend = BUILTIN
            report.layers[layer.name] = placement
            continue
        placement.pinned = pins.get(layer.name) or pins.get(layer.op_type)
        skip = (excluded or {}).get(layer.name, {})
        for backend_id, reason in skip.items():
            if (backend_id, reason) not in placement.refusals:
                placement.refusals.append((backend_id, reason))
        for backend_id in _candidates(layer, report.preferences, available, pins, set(skip)):
            support = support_of(available[backend_id], layer, ins, outs)
            if support.ok:
                layer.backend = placement.backend = backend_id
                for refused, reason in placement.refusals:
                    _warn(report, level=logging.DEBUG, message=f"Layer of type {layer.op_type} is not supported on requested "
                                  f"backend {refused} (reason: {reason}), falling back to the next "
                                  f"backend")
                break
            placement.refusals.append((backend_id, support.reason or "no reason given"))
        else:
            reasons = "; ".join(f"{b}: {r}" for b, r in placement.refusals) or "no backend tried"
            raise OptimizationError(f"no backend can run {layer.describe()}: {reasons}")
        report.layers[layer.name] = placement


def _optimize_subgraphs(graph: Graph, available: Mapping[str, Backend], pins: Mapping[str, str],
                        report: PlacementReport, exclusions: Mapping[str, Mapping[str, str]]) -> None:
    """Let every backend rewrite its subgraphs; reassign failed layers until none fail."""
    excluded = {name: dict(reasons) for name, reasons in exclusions.items()}
    done: set[int] = set()  # layers already seen by their backend's optimize_subgraph
    for _ in range(len(available) + 1):
        failed: list[Layer] = []
        for backend_id, view in partition(graph):
            if all(id(layer) in done for layer in view.layers):
                continue
            views = available[backend_id].optimize_subgraph(view)
            views.validate(view, backend_id)
            for sub in views.substitutions:
                _substitute(graph, sub.substitutable.layers, sub.replacement, backend_id, report)
                done.update(id(layer) for layer in sub.replacement)
                report.subgraphs.append(SubgraphRecord(backend_id, [lay.name for lay in sub.replacement],
                                                       "substituted"))
            for part in views.untouched:
                done.update(id(layer) for layer in part.layers)
                report.subgraphs.append(SubgraphRecord(backend_id, [lay.name for lay in part.layers],
                                                       "untouched"))
            for part in views.failed:
                report.subgraphs.append(SubgraphRecord(backend_id, [lay.name for lay in part.layers],
                                                       "failed"))
                for layer in part.layers:
                    excluded.setdefault(layer.name, {})[backend_id] = views.reasons.get(
                        layer.name, "optimize_subgraph reported it failed")
                    failed.append(layer)
        if not failed:
            return
        _assign(graph, available, pins, report, failed, excluded)
    raise OptimizationError("optimize_subgraph kept failing layers on every backend")


def _substitute(graph: Graph, old: Sequence[Layer], new: Sequence[Layer], backend_id: str,
                report: PlacementReport) -> None:
    gone = set(map(id, old))
    position = min(i for i, layer in enumerate(graph.layers) if id(layer) in gone)
    for layer in new:
        layer.backend = backend_id
    kept = [layer for layer in graph.layers if id(layer) not in gone]
    graph.layers = kept[:position] + list(new) + kept[position:]
    graph.toposort()
    if len(new) != 1:
        return
    gone_names = {layer.name for layer in old} - {new[0].name}
    for placement in report.layers.values():  # also those an earlier substitution put into ``old``
        if placement.name in gone_names or placement.substituted_by in gone_names:
            placement.substituted_by = new[0].name


def expose_captures(graph: Graph) -> None:
    """Append to each control-flow layer's inputs the outer tensors its bodies read (their captures).

    The bodies are copied first, so the user's graph is untouched; each body's inputs grow by the
    same names, which the builtin workload passes after the formal inputs.
    """
    for layer in graph.layers:
        if layer.op_type not in CONTROL_FLOW_OPS or layer.domain or "captured" in layer.attrs:
            continue
        bodies = {name: layer.attrs[name].private_copy() for name in CONTROL_FLOW_OPS[layer.op_type]}
        captured: list[str] = []
        for body in bodies.values():
            expose_captures(body)
            captured += [n for n in _free_names(body) if n not in captured]
        for body in bodies.values():
            body.inputs = body.inputs + captured
        layer.attrs = {**layer.attrs, **bodies, "captured": len(captured)}
        layer.inputs = layer.inputs + captured


def _free_names(graph: Graph) -> list[str]:
    defined = set(graph.inputs) | set(graph.constants)
    defined |= {out for layer in graph.layers for out in layer.outputs}
    free: list[str] = []
    for name in [n for layer in graph.layers for n in layer.inputs] + graph.outputs:
        if name and name not in defined and name not in free:
            free.append(name)
    return free


def _optimize_bodies(layer: Layer, graph: Graph, backends: Sequence[str], pins: Mapping[str, str],
                     options: OptimizerOptions, registry: BackendRegistry,
                     report: PlacementReport, backend_options: Mapping[str, object],
                     exclusions: Mapping[str, Mapping[str, str]] | None = None) -> None:
    """Place the layers of a control-flow layer's bodies like any others; their report joins ours.
    ``exclusions`` of a body's layers are named by their path ("loop/body/conv", as the report
    names them)."""
    attrs = dict(layer.attrs)
    for name in CONTROL_FLOW_OPS[layer.op_type]:
        body: Graph = attrs[name]
        for outer in body.inputs:
            if outer not in body.tensors:
                body.tensors[outer] = graph.info(outer)
        path = f"{layer.name}/{name}/"
        mine = {key[len(path):]: reasons for key, reasons in (exclusions or {}).items()
                if key.startswith(path)}
        net = _optimize(body, backends, pins=pins, options=options, registry=registry,
                       backend_options=backend_options, exclude=mine, decide=0)
        attrs[name] = net
        for inner, placement in net.report.layers.items():
            placement.name = f"{path}{inner}"
            placement.tag = placement.tag and f"{path}{placement.tag}"
            report.layers[placement.name] = placement
        report.delegations.update((f"{path}{t}", d) for t, d in net.report.delegations.items())
        report.copies += net.report.copies
        report.warnings += net.report.warnings
    layer.attrs = attrs


def _tag(graph: Graph, report: PlacementReport, backend_options: Mapping[str, object]) -> None:
    """Each partition's delegation tag on the report's layers it runs (a substituted layer's
    tag is its substitution's); a body's layers have theirs already, under the body's path."""
    tags, specs = delegation_tags(graph, backend_options)
    report.delegations.update(specs)
    for placement in report.layers.values():
        runs = placement.substituted_by or placement.name
        if runs in tags:
            placement.tag = tags[runs]


def _check_strict(report: PlacementReport) -> None:
    problems = [f"backend {b} is unavailable: {r}" for b, r in report.unavailable.items()]
    problems += [f"layer '{p.name}' ({p.op_type}) fell back to {p.backend}: "
                 + "; ".join(f"{b}: {r}" for b, r in p.refusals)
                 for p in report.layers.values() if p.refusals]
    if problems:
        raise OptimizationError("strict placement failed:\n  " + "\n  ".join(problems))


def _warn(report: PlacementReport, message: str, level: int = logging.WARNING) -> None:
    report.warnings.append(message)
    log.log(level, message)
