"""Measured placement (issue 12, item 3): each partition on the backend measured fastest for it.

With ``OptimizerOptions(placement="measured")``, after the layers are placed by preference,
``place`` takes each partition (layers of one backend, as ``partition`` splits them) and every
backend that supports all of its layers, and times each one:

- the partition alone, as a network of its own, prepared as it would really run: the backend's
  ``optimize_subgraph`` substitutions, workloads from its workload factory, constants in its memory,
  inputs already in its memory (no copy at the boundary: those are the edges, timed apart);
- every tensor that crosses to a neighbouring partition (or from / to the user): the copy or import
  that ``edge_strategy`` picks for the two backends' tensor-handle factories, run by builtin's
  MemCopy / MemImport workload on a tensor of that size (a FallbackImport as one copy into fallback
  memory, the most it costs: whether the producer writes in place is known only at load).

A greedy pass in execution order, repeated until nothing changes, then gives each partition the
backend of least time plus edge time to its neighbours' current backends. Each step lowers the total
or leaves it, so the placement is never slower, as measured, than preference order; ties keep the
preferred backend. A partition moves whole or not at all: layers a backend refuses stay where
preference put them.

Values: graph inputs are seeded (floats normal, integers 0 or 1, booleans random; free dimensions
at 1); a partition's other inputs are the outputs of its producer's run, so shapes and indices
downstream are real. Partitions with a pinned layer are kept (and only timed where preference put
them); builtin's (control flow) are neither timed nor moved.

Measurements live as long as the process (``_TIMES``, ``_EDGES``), keyed by the partition's
signature (op types, attributes, shapes, element types, a hash of its constants), the backend's id
and version, and the options. On disk, the compile cache keeps the placement itself: its key holds
the optimizer options, and the artifact the report with its measurements.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane import progress
from backplane.backends.api.backend import Backend, OptionError
from backplane.backends.api.memory import (
    HOST_FACTORY,
    TensorHandleFactory,
    fallback_kind,
    to_device,
    to_host,
)
from backplane.backends.builtin.backend import make_mem_copy, make_mem_import
from backplane.backends.registry import BackendRegistry
from backplane.ir.graph import Graph, SubgraphView, TensorInfo
from backplane.optimizer.edges import BUILTIN, USER, EdgeStrategy, edge_strategy
from backplane.optimizer.partition import partition
from backplane.optimizer.report import MeasurementRecord, PlacementReport
from backplane.runtime.fallback import FallbackMemoryManager

log = logging.getLogger("backplane.optimizer")

PLACEMENTS = {
    "preference": "each layer on the first backend of the list that supports it (the default)",
    "measured": "each partition on the capable backend timed fastest at load, edges included",
}
WARMUP = 3
"""Untimed runs per (partition, backend) first: CpuAcc's TorchScript partitions are optimized at
their second or third call, OpenVINO's at the first."""
RUNS = 7
"""Timed runs per (partition, backend) after the warm-up, unless BUDGET_S is spent first."""
BUDGET_S = 0.3
"""Seconds of timed runs per (partition, backend): at least one run is timed whatever it takes."""
PASSES = 4
"""Greedy passes over the partitions at most (each one that changes nothing ends it)."""

_TIMES: dict[tuple[str, str, str, str], float | str] = {}
"""(signature, backend id, version, options) -> median ms, or why it could not be timed."""
_OUTPUTS: dict[str, list[np.ndarray]] = {}
"""signature -> the outputs of its first run (host arrays): inputs of the partitions after it."""
_EDGES: dict[tuple[str, str, tuple[int, ...], str, bool], float] = {}
"""(source factory id, target factory id, shape, element type, to the user) -> median ms of that
move."""


def check_placement(value: str) -> None:
    """OptionError for a placement that is not one of ``PLACEMENTS``, listing them."""
    if value not in PLACEMENTS:
        choices = "; ".join(f"{name}: {what}" for name, what in PLACEMENTS.items())
        raise OptionError(f"placement {value!r} is not one of the choices: {choices}")


@dataclass
class _Part:
    """One partition, the backends it could run on and what each one measured."""

    view: SubgraphView
    backend: str  # the current choice: preference's first, then the greedy pass's
    candidates: list[str]
    ms: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # backend -> why not timed; "" for the part

    @property
    def label(self) -> str:
        return f"{self.view.layers[0].name}..{self.view.layers[-1].name}"


def place(graph: Graph, available: Mapping[str, Backend], pins: Mapping[str, str],
          report: PlacementReport, exclusions: Mapping[str, Mapping[str, str]],
          registry: BackendRegistry, backend_options: Mapping[str, object]) -> None:
    """Move each partition of ``graph`` to the backend measured fastest for it, edges included;
    the measurements go to ``report.measurements``."""
    parts = [_part(graph, backend_id, view, available, pins, exclusions)
             for backend_id, view in partition(graph, skip=frozenset({BUILTIN}))]
    values = _seeded_inputs(graph)
    key = (repr(sorted((k, repr(v)) for k, v in backend_options.items())),
           {b: backend.version for b, backend in available.items()})
    with progress.task("measured placement: timing each partition on each backend",
                       total=sum(len(part.candidates) for part in parts)) as step:
        for part in parts:
            _measure(part, graph, values, registry, backend_options, key, step)
    producer = {out: index for index, part in enumerate(parts) for out in part.view.outputs}
    edges = [(name, producer.get(name, -1), index) for index, part in enumerate(parts)
             for name in part.view.inputs]
    edges += [(name, producer[name], -1) for name in graph.outputs if name in producer]
    factories = {b: backend.tensor_handle_factories()[0] for b, backend in available.items()}
    factories[USER] = HOST_FACTORY  # and builtin's tensors, read as the user's

    def edge_ms(name: str, source: str, target: str) -> float:
        return _edge_ms(values.get(name), factories[source], factories[target], target == USER)

    _choose(parts, edges, edge_ms)
    for part in parts:
        for layer in part.view.layers:
            layer.backend = report.layers[layer.name].backend = part.backend
    report.measurements = _records(parts, edges, edge_ms)


def _part(graph: Graph, backend_id: str, view: SubgraphView, available: Mapping[str, Backend],
          pins: Mapping[str, str], exclusions: Mapping[str, Mapping[str, str]]) -> _Part:
    if any(pins.get(layer.name) or pins.get(layer.op_type) for layer in view.layers):
        return _Part(view, backend_id, [backend_id], notes={"": "pinned"})
    candidates = [backend_id]
    for other in available:
        if other in (backend_id, BUILTIN) or any(other in exclusions.get(layer.name, {})
                                                 for layer in view.layers):
            continue
        if all(available[other].is_layer_supported(
                layer, [graph.info(n) for n in layer.inputs if n],
                [graph.info(n) for n in layer.outputs if n]).ok for layer in view.layers):
            candidates.append(other)
    return _Part(view, backend_id, candidates)


def _seeded_inputs(graph: Graph) -> dict[str, np.ndarray]:
    """Seeded values of the graph's inputs: floats normal, integers 0 or 1, booleans random; free
    dimensions at 1; inputs of unknown type or rank left out (what reads them is not timed)."""
    rng = np.random.default_rng(0)
    values: dict[str, np.ndarray] = {}
    for name in graph.inputs:
        info = graph.info(name)
        if info.shape is None or info.dtype is None:
            continue
        shape = tuple(d if isinstance(d, int) else 1 for d in info.shape)
        values[name] = _seeded(rng, shape, info.dtype)
    return values


def _seeded(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    return np.zeros(shape, dtype)


def _measure(part: _Part, graph: Graph, values: dict[str, np.ndarray],
             registry: BackendRegistry, backend_options: Mapping[str, object],
             key: tuple[str, Mapping[str, str]], step: progress.Step) -> None:
    """Time ``part`` on each of its candidates; its outputs join ``values``. ``key``: the options
    (as text) and each backend's version; ``step``: one for each candidate (progress)."""
    missing = [n for n in part.view.inputs if n not in values and not graph.info(n).is_static]
    if missing:
        step(advance=len(part.candidates))
        part.candidates = [part.backend]
        part.notes[""] = f"not timed: the shape of {', '.join(missing)} is known only at run time"
        return
    for name in part.view.inputs:  # the output of a partition not timed: seeded, of its shape
        if name not in values:
            info = graph.info(name)
            values[name] = _seeded(np.random.default_rng(0), info.shape, info.dtype)  # type: ignore
    alone = _alone(graph, part.view)
    inputs = [values[n] for n in alone.inputs]
    signature = _signature(alone, inputs)
    options, versions = key
    for backend_id in part.candidates:
        entry = (signature, backend_id, versions[backend_id], options)
        step(f"measured placement: a partition of {len(part.view.layers)} layers on {backend_id}",
             advance=0)
        if entry not in _TIMES:
            _TIMES[entry] = _time_alone(alone, backend_id, inputs, signature, registry,
                                        backend_options)
        step()
        found = _TIMES[entry]
        if isinstance(found, str):
            part.notes[backend_id] = found
        else:
            part.ms[backend_id] = found
    if signature in _OUTPUTS:
        values.update(zip(alone.outputs, _OUTPUTS[signature]))


def _alone(graph: Graph, view: SubgraphView) -> Graph:
    """The partition as a graph of its own: its layers copied, its boundary as its inputs and
    outputs."""
    layers = [copy.copy(layer) for layer in view.layers]
    for layer in layers:
        layer.inputs, layer.outputs, layer.backend = list(layer.inputs), list(layer.outputs), None
    names = {n for layer in layers for n in (*layer.inputs, *layer.outputs) if n}
    return Graph(f"{graph.name}[{view.layers[0].name}..{view.layers[-1].name}]", layers,
                 list(view.inputs), list(view.outputs), {n: graph.info(n) for n in names},
                 {n: graph.constants[n] for n in names if n in graph.constants}, dict(graph.opsets))


def _time_alone(alone: Graph, backend_id: str, inputs: Sequence[np.ndarray], signature: str,
                registry: BackendRegistry, backend_options: Mapping[str, object]) -> float | str:
    """Median ms of ``alone`` on ``backend_id`` alone, or why it could not run there."""
    from backplane.optimizer.optimize import OptimizerOptions, optimize  # it calls us
    from backplane.runtime.loaded_network import LoadedNetwork

    plain = OptimizerOptions(fold_constants=False, remove_identities=False,
                             remove_dead_layers=False, strict=True)
    try:
        network = optimize(alone, [backend_id], options=plain, registry=registry,
                           backend_options=backend_options)
        loaded = LoadedNetwork(network, 0)
        device = network.backends[backend_id].tensor_handle_factories()[0].device
        on = device if device != "cpu" else None
        plan = loaded.plan([device] * len(inputs), [on] * len(alone.outputs))
        feed = [v if on is None else to_device(v, device) for v in inputs]
        outputs = loaded.execute_plan(plan, feed)
        _OUTPUTS.setdefault(signature, [np.array(to_host(o)) for o in outputs])
        return _median_ms(lambda: loaded.execute_plan(plan, feed), WARMUP - 1)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run it is not a candidate
        log.info("measured placement: %s cannot run %s: %s", backend_id, alone.name, exc)
        return f"not a candidate: {type(exc).__name__}: {exc}"[:200]


def _median_ms(run: Callable[[], Any], warmup: int) -> float:
    for _ in range(warmup):
        run()
    times: list[float] = []
    spent = 0.0
    while len(times) < RUNS and (not times or spent < BUDGET_S):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times) * 1e3


def _signature(alone: Graph, inputs: Sequence[np.ndarray]) -> str:
    """A hash of what a partition's time depends on: ops, attributes, wiring, shapes, element
    types, constants (their bytes) and the inputs' shapes; never its layers' or tensors' names."""
    local: dict[str, int] = {}

    def number(name: str) -> int:
        return local.setdefault(name, len(local)) if name else -1

    text = [repr([(tuple(v.shape), v.dtype.str) for v in inputs])]
    for name in alone.inputs:
        number(name)
    for layer in alone.layers:
        attrs = sorted((k, _attr(v)) for k, v in layer.attrs.items())
        text.append(repr((layer.domain, layer.op_type, layer.opset, attrs,
                          [number(n) for n in layer.inputs], [number(n) for n in layer.outputs])))
    for name, index in local.items():
        constant = alone.constants.get(name)
        digest = "" if constant is None else hashlib.sha256(
            np.ascontiguousarray(constant).tobytes()).hexdigest()
        text.append(f"{index}: {alone.info(name)} {digest}")
    text.append(repr([number(n) for n in alone.outputs]))
    return hashlib.sha256("\n".join(text).encode()).hexdigest()


def _attr(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array{value.shape}{value.dtype.str}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    return repr(value)


def _edge_ms(value: np.ndarray | None, source: TensorHandleFactory,
             target: TensorHandleFactory, to_user: bool = False) -> float:
    """Median ms of moving ``value`` from ``source``'s memory to ``target``'s as the network would
    (nothing, an import, a fallback import or a copy); 0 where the value is unknown."""
    strategy = edge_strategy(source, target, to_user)
    if strategy is EdgeStrategy.DIRECT_COMPATIBILITY or value is None:
        return 0.0
    key = (source.id, target.id, tuple(value.shape), value.dtype.str, to_user)
    if key not in _EDGES:
        if strategy is EdgeStrategy.FALLBACK_IMPORT:
            glue = _fallback_import(value, source, target)
        else:
            make = make_mem_import if strategy is EdgeStrategy.EXPORT_TO_TARGET else make_mem_copy
            glue = make(source, target)
        held = value if source.id == HOST_FACTORY.id else source.copy_in(value)
        _EDGES[key] = _median_ms(lambda: glue(held), 1)
    return _EDGES[key]


def _fallback_import(value: np.ndarray, source: TensorHandleFactory,
                     target: TensorHandleFactory) -> Callable[[Any], Any]:
    """A FallbackImport of ``value``'s size as it runs when the producer cannot write in place: one
    copy into fallback memory. Which producers write in place is known only at load, so an edge is
    priced at the most it costs: a placement is never slower than measured."""
    kind = fallback_kind(source, target)
    assert kind is not None  # edge_strategy chose FALLBACK_IMPORT
    info = TensorInfo(tuple(value.shape), value.dtype)
    buffer, _ = FallbackMemoryManager().buffer("edge", kind, info, math.lcm(source.alignment,
                                                                             target.alignment))
    consumer = target.import_(buffer)

    def fallback_import(x: Any) -> tuple[Any]:
        source.write_to(x, buffer)
        return (consumer,)

    return fallback_import


Edge = tuple[str, int, int]  # (tensor, producing part or -1 for the user, reading part or -1)


def _incident(index: int, backend_id: str, parts: Sequence[_Part], edges: Sequence[Edge],
              edge_ms: Callable[[str, str, str], float]) -> float:
    """Edge ms of part ``index`` on ``backend_id``, its neighbours where they are now."""
    def where(other: int) -> str:
        return USER if other < 0 else (backend_id if other == index else parts[other].backend)

    return sum(edge_ms(name, where(src), where(dst)) for name, src, dst in edges
               if index in (src, dst))


def _choose(parts: Sequence[_Part], edges: Sequence[Edge],
            edge_ms: Callable[[str, str, str], float]) -> None:
    """Greedy passes: each part to its backend of least ms plus edge ms, until none moves."""
    for _ in range(PASSES):
        moved = False
        for index, part in enumerate(parts):
            if len(part.ms) < 2:
                continue
            cost = {b: ms + _incident(index, b, parts, edges, edge_ms) for b, ms in part.ms.items()}
            best = min(cost, key=lambda b: (cost[b], b != part.backend))  # a tie keeps it
            moved |= best != part.backend
            part.backend = best
        if not moved:
            return


def _records(parts: Sequence[_Part], edges: Sequence[Edge],
             edge_ms: Callable[[str, str, str], float]) -> list[MeasurementRecord]:
    """The table's rows: per part, each backend timed (ms, edge ms, chosen) or why not."""
    records = []
    for index, part in enumerate(parts):
        note = part.notes.get("", "")
        for backend_id in part.candidates:
            if backend_id in part.ms:
                edge = _incident(index, backend_id, parts, edges, edge_ms)
                records.append(MeasurementRecord(part.label, backend_id, part.ms[backend_id],
                                                 edge, backend_id == part.backend, note))
            elif backend_id in part.notes or not part.ms:
                records.append(MeasurementRecord(part.label, backend_id, None, None,
                                                 backend_id == part.backend,
                                                 part.notes.get(backend_id, note)))
    return records
