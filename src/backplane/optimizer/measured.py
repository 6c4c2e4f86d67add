"""Measured placement (issue 12, item 3): each partition on the backend measured fastest for it.

With ``OptimizerOptions(placement="measured")``, after the layers are placed by preference,
``place`` takes each partition (layers of one backend, as ``partition`` splits them) and every
backend that supports all of its layers, and times each one:

- the partition alone, as a network of its own, prepared as it would really run: the backend's
  ``optimize_subgraph`` substitutions, workloads from its workload factory, constants in its memory,
  inputs already in its memory (no copy at the boundary: those are the edges, timed apart). Every
  candidate is loaded and called WARMUP times first, then timed in rounds of one turn each (A, B,
  C, then B, C, A, ...), so that drift of the machine (a neighbour's burst, the clock's speed)
  reaches all of them alike rather than the one being timed when it happens. A turn waits
  SETTLE_S after the last call of another candidate, makes one untimed call, then times a few runs
  (TURN_S, TURN_RUNS): each timed run follows a run of its own, as a model's runs follow each
  other, and not another backend's, whose threads may still spin (NumPy's BLAS threads after
  CpuRef made the next backend's runs up to 2x slower). Rounds go on until each candidate has
  RUNS, or ROUNDS were made, BUDGET_S spent and each has MIN_RUNS, however slow the partition; a
  candidate whose fastest run is over CLEARLY times another's median stops at once. Every
  candidate's network is held until its partition is timed (its constants too);
- every tensor that crosses to a neighbouring partition (or from / to the user): the copy or import
  that ``edge_strategy`` picks for the two backends' tensor-handle factories, run by builtin's
  MemCopy / MemImport workload on a tensor of that size (a FallbackImport as one copy into fallback
  memory, the most it costs: whether the producer writes in place is known only at load).

A greedy pass in execution order, repeated until nothing changes, then gives each partition the
backend of least time (the median of its runs) plus edge time to its neighbours' current backends
plus a margin. The margin is 0 for the partition's reference, the backend preference gave it (the
first candidate timed); for any other it is the noise measured: its upper quartile over its
median plus the reference's median over its lower quartile, at least MARGIN (2%) of the
reference's median. So another backend takes a partition only when its median, edges included,
is below the reference's by more than the two middle halves of runs reach towards each other:
their middle halves do not overlap, and it saves at least 2%. Why quartiles: a run's noise is one-
sided (preemption, a cold cache only add time) and comes in outliers, which move the quartiles of 5
to 15 runs less than a range or a standard deviation. Why a floor: the partition is timed alone
at load, which is not the model's run (timed back to back, before these turns, a resnet50 load
measured OpenVINO at 64.05 and CpuAcc at 64.08 ms, where whole runs took 72 and 82 ms; in turns,
67.4 and 80.3, the sessions 71.8 and 77.9); below a 2% gain, preference is kept.
Each move lowers the sum of times, edges and margins, so the placement's measured total is below
preference order's by at least the margins of the partitions it moved, never above it. A
partition moves whole or not at all: layers a backend refuses stay where preference put them.
The report's measurements say per backend its median, edge ms, whether chosen and, in the note,
its runs (count, middle half, why they stopped early) and what it saved on the reference against
the margin it needed.

Values: graph inputs are seeded (floats normal, integers 0 or 1, booleans random; free dimensions
at 1); a partition's other inputs are the outputs of its producer's run, so shapes and indices
downstream are real. Partitions with a pinned layer are kept (and only timed where preference put
them); builtin's (control flow) are neither timed nor moved.

Measurements live as long as the process (``_TIMES``, ``edge_cost._EDGES``), keyed by the partition's
signature (op types, attributes, shapes, element types, a hash of its constants), the backend's id
and version, and the options. On disk, the compile cache keeps the placement itself: its key holds
the optimizer options, and the artifact the report with its measurements.
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane import progress
from backplane.backends.api.backend import Backend, OptionError, support_of
from backplane.backends.api.memory import HOST_FACTORY, to_device, to_host
from backplane.backends.registry import BackendRegistry
from backplane.ir.graph import Graph, SubgraphView
from backplane.optimizer import edge_cost, samples
from backplane.optimizer.edges import BUILTIN, USER
from backplane.optimizer.partition import partition
from backplane.optimizer.report import MeasurementRecord, PlacementReport
from backplane.optimizer.samples import seeded, seeded_inputs
from backplane.runtime import host_threads

log = logging.getLogger("backplane.optimizer")

PLACEMENTS = {
    "preference": "each layer on the first backend of the list that supports it (the default)",
    "measured": "each partition on the capable backend timed fastest at load, edges included",
}
WARMUP = 3
"""Untimed calls per (partition, backend) before any is timed, the first one (which gives the
outputs) included: CpuAcc compiles a OneDnnGraph at load (three calls there), and again over the
first two calls of a thread count it was not compiled at; OpenVINO's first inference is its
slowest."""
MIN_RUNS = 5
"""Timed runs per candidate at least, whatever they take, unless it is dropped as clearly slower
(``CLEARLY``); a partition's lone candidate gets one turn (nothing is decided on it)."""
RUNS = 15
"""Timed runs per candidate at most (a lone candidate: one turn)."""
ROUNDS = 3
"""Rounds (one turn per candidate) at least, unless each candidate has RUNS before."""
TURN_RUNS, TURN_S = 5, 0.1
"""Timed runs of one turn at most, and seconds of them past which it ends (one run at least)."""
BUDGET_S = 1.0
"""Seconds of timed runs per partition, all its candidates together: past it, rounds stop once
each candidate has MIN_RUNS and ROUNDS were made."""
SETTLE_S = 0.2
"""Seconds between another candidate's last call and a turn's first: NumPy's BLAS threads
(CpuRef's MatMul, Gemm, Conv) spin for about 0.1 to 0.2 s after a call, and on a 2-core machine
made a torch conv of 24.5 ms take 66 right after, 42 after 0.1 s, 23.5 after 0.2 s; a resnet50
load timed OpenVINO at 113-121 ms right after CpuRef and 66 ms after CpuAcc, whose OpenMP threads
and OpenVINO's own spin for much less. The turn sleeps for it (no CPU taken)."""
CLEARLY = 2.0
"""A candidate whose fastest run is this many times another's median is dropped: no noise turns
it into the faster one, and a slow backend (CpuRef on a BERT) is not run MIN_RUNS times."""
MARGIN = 0.02
"""The least a backend other than the reference must save (a fraction of the reference's median
ms) to take a partition from it, however steady both were: the timing of a partition alone, at
load, is not the run itself."""
PASSES = 4
"""Greedy passes over the partitions at most (each one that changes nothing ends it)."""
_clock: Callable[[], float] = time.perf_counter
_sleep: Callable[[float], None] = time.sleep
"""The clock and sleep of partition timing (the tests give fake ones); edges use perf_counter."""

_TIMES: dict[tuple[str, str, str, str], _Runs | str] = {}
"""(signature, backend id, version, options) -> its timed runs, or why it could not be timed."""
_OUTPUTS: dict[str, list[np.ndarray]] = {}
"""signature -> the outputs of its first run (host arrays): inputs of the partitions after it."""


def check_placement(value: str) -> None:
    """OptionError for a placement that is not one of ``PLACEMENTS``, listing them."""
    if value not in PLACEMENTS:
        choices = "; ".join(f"{name}: {what}" for name, what in PLACEMENTS.items())
        raise OptionError(f"placement {value!r} is not one of the choices: {choices}")


@dataclass(frozen=True)
class _Runs:
    """One candidate's timed runs of one partition (ms, in the order they ran), timed in rounds
    with the partition's other candidates; ``dropped``: why it stopped before MIN_RUNS, or ""."""

    ms: tuple[float, ...]
    dropped: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    def quartiles(self) -> tuple[float, float]:
        """The middle half of the runs, (lower quartile, upper quartile); one run: itself twice."""
        if len(self.ms) < 2:
            return self.ms[0], self.ms[0]
        low, _, high = statistics.quantiles(self.ms, n=4, method="inclusive")
        return low, high


@dataclass
class _Part:
    """One partition, the backends it could run on and what each one measured."""

    view: SubgraphView
    backend: str  # the current choice: preference's first, then the greedy pass's
    candidates: list[str]  # preference's backend first
    runs: dict[str, _Runs] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # backend -> why not timed; "" for the part

    @property
    def ms(self) -> dict[str, float]:
        """Each timed backend's median ms."""
        return {b: runs.median for b, runs in self.runs.items()}

    @property
    def reference(self) -> str | None:
        """The backend the others must beat by more than the noise: the first timed candidate
        (preference's, unless it could not run the partition alone)."""
        return next((b for b in self.candidates if b in self.runs), None)

    def margin(self, backend_id: str) -> float:
        """The ms ``backend_id`` must save on the reference to take the partition from it: the
        two sets of runs' spreads (its upper quartile over its median, the reference's median
        over its lower quartile), at least MARGIN of the reference's median; 0 for the
        reference."""
        reference = self.reference
        if reference is None or backend_id == reference:
            return 0.0
        ours, theirs = self.runs[backend_id], self.runs[reference]
        spread = ours.quartiles()[1] - ours.median + theirs.median - theirs.quartiles()[0]
        return max(MARGIN * theirs.median, spread)

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
    values = seeded_inputs(graph)
    one_blas = host_threads.mixed(available.values())  # as a run that mixes them would be
    key = (repr(sorted((k, repr(v)) for k, v in backend_options.items()))
           + (" one BLAS thread" if one_blas else ""),
           {b: backend.version for b, backend in available.items()})
    with progress.task("measured placement: timing each partition on each backend",
                       total=sum(len(part.candidates) for part in parts)) as step:
        for part in parts:
            _measure(part, graph, values, registry, backend_options, key, step, one_blas)
    producer = {out: index for index, part in enumerate(parts) for out in part.view.outputs}
    edges = [(name, producer.get(name, -1), index) for index, part in enumerate(parts)
             for name in part.view.inputs]
    edges += [(name, producer[name], -1) for name in graph.outputs if name in producer]
    factories = {b: backend.tensor_handle_factories()[0] for b, backend in available.items()}
    factories[USER] = HOST_FACTORY  # and builtin's tensors, read as the user's

    def edge_ms(name: str, source: str, target: str) -> float:
        return edge_cost.edge_ms(values.get(name), factories[source], factories[target], target == USER)

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
        if all(support_of(
                available[other], layer, [graph.info(n) for n in layer.inputs if n],
                [graph.info(n) for n in layer.outputs if n]).ok for layer in view.layers):
            candidates.append(other)
    return _Part(view, backend_id, candidates)


def _measure(part: _Part, graph: Graph, values: dict[str, np.ndarray],
             registry: BackendRegistry, backend_options: Mapping[str, object],
             key: tuple[str, Mapping[str, str]], step: progress.Step, one_blas: bool = False) -> None:
    """Time ``part`` on each of its candidates; its outputs join ``values``. ``key``: the options
    (as text) and each backend's version; ``step``: one for each candidate (progress);
    ``one_blas``: a candidate of BLAS threads runs on one (``runtime/host_threads.py``)."""
    missing = [n for n in part.view.inputs if n not in values and not graph.info(n).is_static]
    if missing:
        step(advance=len(part.candidates))
        part.candidates = [part.backend]
        part.notes[""] = f"not timed: the shape of {', '.join(missing)} is known only at run time"
        return
    for name in part.view.inputs:  # the output of a partition not timed: seeded, of its shape
        if name not in values:
            info = graph.info(name)
            values[name] = seeded(np.random.default_rng(0), info.shape, info.dtype)  # type: ignore
    alone = _alone(graph, part.view)
    inputs = [values[n] for n in alone.inputs]
    signature = samples.signature(alone, inputs)
    options, versions = key
    entries = {b: (signature, b, versions[b], options) for b in part.candidates}
    todo = [b for b in part.candidates if entries[b] not in _TIMES]
    runners: dict[str, Callable[[], Any]] = {}
    for backend_id in todo:  # all loaded and run once before any is timed
        step(f"measured placement: a partition of {len(part.view.layers)} layers on {backend_id}",
             advance=0)
        made = _prepare(alone, backend_id, inputs, signature, registry, backend_options, one_blas)
        if isinstance(made, str):
            _TIMES[entries[backend_id]] = made
        else:
            runners[backend_id] = made
    if runners:
        step(f"measured placement: timing {', '.join(runners)} in turn", advance=0)
        _TIMES.update({entries[b]: runs for b, runs in _interleaved(runners).items()})
    step(advance=len(part.candidates))
    for backend_id in part.candidates:
        found = _TIMES[entries[backend_id]]
        if isinstance(found, str):
            part.notes[backend_id] = found
        else:
            part.runs[backend_id] = found
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


def _prepare(alone: Graph, backend_id: str, inputs: Sequence[np.ndarray], signature: str,
             registry: BackendRegistry, backend_options: Mapping[str, object],
             one_blas: bool = False) -> Callable[[], Any] | str:
    """``alone`` loaded on ``backend_id`` alone and run once (its outputs kept in ``_OUTPUTS``): a
    call that runs it again on the same inputs (on one BLAS thread where ``one_blas`` and the
    backend computes on BLAS threads), or why it could not run there."""
    from backplane.optimizer.optimize import OptimizerOptions, optimize  # it calls us
    from backplane.runtime.loaded_network import LoadedNetwork

    plain = OptimizerOptions(fold_constants=False, remove_identities=False,
                             remove_dead_layers=False, strict=True)
    try:
        network = optimize(alone, [backend_id], options=plain, registry=registry,
                           backend_options={**backend_options, "CpuAcc.background": False})
        loaded = LoadedNetwork(network, 0)  # compiled at load: timed as it will run
        device = network.backends[backend_id].tensor_handle_factories()[0].device
        on = device if device != "cpu" else None
        plan = loaded.plan([device] * len(inputs), [on] * len(alone.outputs))
        feed = [v if on is None else to_device(v, device) for v in inputs]
        outputs = loaded.execute_plan(plan, feed)
        _OUTPUTS.setdefault(signature, [np.array(to_host(o)) for o in outputs])
        run: Callable[[], Any] = lambda: loaded.execute_plan(plan, feed)  # noqa: E731
        libraries = host_threads.blas_libraries()
        if one_blas and libraries and network.backends[backend_id].capabilities().get(
                "HostThreads") == host_threads.BLAS:
            run = host_threads.OneBlasThread(run, libraries)
        return run
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run it is not a candidate
        log.info("measured placement: %s cannot run %s: %s", backend_id, alone.name, exc)
        return f"not a candidate: {type(exc).__name__}: {exc}"[:200]


def _interleaved(runners: Mapping[str, Callable[[], Any]]) -> dict[str, _Runs]:
    """Each runner's timed runs, taken in rounds of one turn each (A, B, C, then B, C, A, then C,
    A, B, ...: the order turns) after WARMUP - 1 untimed rounds, so drift of the machine reaches
    every candidate alike (``_turn`` says what a turn is). Rounds go on until each has RUNS, or
    ROUNDS were made, BUDGET_S of timed runs spent and each has MIN_RUNS; a candidate CLEARLY
    slower than another stops at once. A lone candidate gets one turn."""
    order = list(runners)
    for _ in range(WARMUP - 1):  # the first call was _prepare's
        for backend_id in order:
            runners[backend_id]()
    if len(order) == 1:  # nothing to decide: one turn, for the report
        return {order[0]: _Runs(tuple(_turn(runners[order[0]], TURN_RUNS)))}
    times: dict[str, list[float]] = {b: [] for b in order}
    dropped: dict[str, str] = {}
    rounds, last = 0, ("", _clock())  # who ran last, and when it ended
    while True:
        active = [b for b in order if b not in dropped]
        if all(len(times[b]) >= RUNS for b in active) or (
                rounds >= ROUNDS and sum(map(sum, times.values())) >= BUDGET_S * 1e3
                and all(len(times[b]) >= MIN_RUNS for b in active)):
            break
        for backend_id in active[rounds % len(active):] + active[:rounds % len(active)]:
            if last[0] != backend_id:
                _sleep(max(0.0, SETTLE_S - (_clock() - last[1])))
                runners[backend_id]()  # the lead-in
            times[backend_id] += _turn(runners[backend_id], RUNS - len(times[backend_id]))
            last = (backend_id, _clock())
        rounds += 1
        dropped.update(_clearly_slower({b: times[b] for b in active}))
    return {b: _Runs(tuple(times[b]), dropped.get(b, "")) for b in order}


def _turn(run: Callable[[], Any], most: int) -> list[float]:
    """One turn's timed runs (ms): until TURN_S of them, one at least, TURN_RUNS and ``most`` at
    most. The turn's caller has let SETTLE_S pass since another candidate's last call and made
    one untimed call: each timed run follows a run of its own, as a model's runs follow each
    other, and none pays for what the one before left behind (see SETTLE_S)."""
    times: list[float] = []
    while not times or (len(times) < min(TURN_RUNS, most) and sum(times) < TURN_S * 1e3):
        start = _clock()
        run()
        times.append((_clock() - start) * 1e3)
    return times


def _clearly_slower(times: Mapping[str, list[float]]) -> dict[str, str]:
    """Those of ``times`` whose fastest run is over CLEARLY times another's median, and why."""
    medians = {b: statistics.median(ms) for b, ms in times.items()}
    slower = {}
    for backend_id, ms in times.items():
        other = min(medians, key=medians.__getitem__)
        if min(ms) > CLEARLY * medians[other]:
            slower[backend_id] = (f"stopped: its fastest run {min(ms):.3g} ms > {CLEARLY:g}x "
                                  f"{other}'s median {medians[other]:.3g} ms")
    return slower



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
    """Greedy passes, until none moves: each part to its backend of least ms plus edge ms plus
    margin (``_Part.margin``: 0 for the reference), a tie keeping where it is.

    Each move lowers that sum over all parts (a move changes only its part's ms, margin and
    edges), which is the measured total plus the margins of the parts off their reference: so
    the placement's measured total is below preference order's (margins all 0) by at least the
    margins of the parts it moved, and never above it."""
    for _ in range(PASSES):
        moved = False
        for index, part in enumerate(parts):
            if len(part.runs) < 2:
                continue
            cost = {b: ms + part.margin(b) + _incident(index, b, parts, edges, edge_ms)
                    for b, ms in part.ms.items()}
            best = min(cost, key=lambda b: (cost[b], b != part.backend))  # a tie keeps it
            moved |= best != part.backend
            part.backend = best
        if not moved:
            return


def _records(parts: Sequence[_Part], edges: Sequence[Edge],
             edge_ms: Callable[[str, str, str], float]) -> list[MeasurementRecord]:
    """The table's rows: per part, each backend timed (median ms, edge ms, chosen, its runs and
    the decision in its note) or why not."""
    records = []
    for index, part in enumerate(parts):
        note = part.notes.get("", "")
        edge = {b: _incident(index, b, parts, edges, edge_ms) for b in part.runs}
        for backend_id in part.candidates:
            if backend_id in part.runs:
                records.append(MeasurementRecord(part.label, backend_id, part.ms[backend_id],
                                                 edge[backend_id], backend_id == part.backend,
                                                 _note(part, backend_id, edge, note)))
            elif backend_id in part.notes or not part.runs:
                records.append(MeasurementRecord(part.label, backend_id, None, None,
                                                 backend_id == part.backend,
                                                 part.notes.get(backend_id, note)))
    return records


def _note(part: _Part, backend_id: str, edge: Mapping[str, float], note: str) -> str:
    """A timed row's note: its runs (how many, their middle half, why they stopped early), then
    "reference" (or "alone"), or the ms it saves on the reference (edges included) against the
    margin it needed."""
    runs, reference = part.runs[backend_id], part.reference
    low, high = runs.quartiles()
    said = [note] if note else []
    count = f"{len(runs.ms)} run{'s' * (len(runs.ms) > 1)}"
    said.append(f"{count}, middle half {low:.3g}-{high:.3g} ms")
    said += [runs.dropped] if runs.dropped else []
    if backend_id == reference or reference is None:
        said.append("reference" if len(part.runs) > 1 else "alone")
    else:
        saved = part.ms[reference] + edge[reference] - part.ms[backend_id] - edge[backend_id]
        margin = part.margin(backend_id)
        if saved <= 0:
            said.append(f"{-saved:.3g} ms slower than {reference}")
        else:
            said.append(f"saves {saved:.3g} ms on {reference}, needs over {margin:.3g} "
                        f"({'beyond' if saved > margin else 'within'} the noise)")
    return "; ".join(said)
