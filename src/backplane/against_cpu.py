"""A small model's placement timed against the placement without its first backend, the faster
kept: GpuAcc against the CPU (issue 28, item 2), CpuAcc's control flow against CpuRef (issue 27,
item 3).

Each ``Rule`` names a backend whose fixed cost per call can outweigh a small model's work:

- ``GPU``: a GPU run costs a fixed price whatever its work (the upload, a graph's launch, the
  download and the wait, 0.13-0.2 ms on the H100 machine, where two cores of its Xeon run a small
  CNN on CpuAcc in 0.1-0.4 ms), and control flow and data-sized layers cost more on the GPU than on
  the CPU. Where a session puts layers on GpuAcc and also lists CpuAcc or OpenVINO.
- ``CONTROL_FLOW``: a builtin If, Loop or Scan runs its bodies as nested networks, a call of each
  body layer's kernel per run (per iteration for a Loop's), on tensors of a few elements, where a
  torch call costs several times a NumPy one (cond_nested_dyn18: 0.050 ms a run on CpuAcc, 0.021
  on CpuRef; loop_scripted_ts16 0.48 against 0.30). Where a session puts layers on CpuAcc, its
  network holds such control flow and CpuRef is listed. The placement without CpuAcc is CpuRef's
  whole: with the bodies alone on CpuRef the CpuAcc partitions around them kept most of the cost
  (0.048 and 0.33 ms).

``choose`` times the model both ways and keeps the faster:

1. The network as placed is loaded, run WARMUP times on seeded inputs (floats normal, integers 0
   or 1, a free batch at 1: measured placement's), and timed. Where the fastest run after the
   first takes the rule's ``limit_ms`` or more, the model has work enough: it is kept, and
   nothing else is built.
2. Otherwise the network placed without the rule's backend is optimized and loaded too, and both
   are timed in turns (placed, other, then other, placed, ...), TURN runs a turn, each turn after
   a run of its own, until each has RUNS or the rule's ``budget_s`` is spent.
3. The other network is kept where its median is below the placed one's by the rule's
   ``margin`` (GPU: at all, CONTROL_FLOW: by 10% or more), and the slower one is unloaded. The kept network's report holds both medians (its
   ``measurements``); GPU's choice is also a warning (the user listed a GPU and does not get it),
   CONTROL_FLOW's an INFO line (CpuRef is in the user's list: as a measured route, not news).

A model with a free dimension other than the first of an input (an image's height and width, a
sequence's length: seeded at 1 they make inputs the model refuses, or whose time says nothing of
the real ones), or with an integer or boolean input and an If, Loop or Scan (seeded at 0 or 1 it
may take another branch or trip count than the caller's), is timed the same way at its first
``InferenceSession.run``, on the caller's inputs, which that run then pays for (building the other
network and the turns).

``GpuAcc.against_cpu="off"`` and ``CpuAcc.against_cpuref="off"`` keep the placement untimed. Not
timed either: models of more than MAX_WEIGHT_BYTES of weights, networks with a layer pinned to the
rule's backend, and runs that fail. Each rule that applies times the placement the one before it
kept (``settle``: GPU, then CONTROL_FLOW). An artifact
(``backplane.compile``, and the compile cache's entries) is timed when it is compiled
(``at_compile``) and keeps the faster placement; a session loading it from the compile cache times
a model ``at_load`` does not take at its first run, as a session does (the model file is there to
place it again); an artifact loaded by itself times nothing. The weights of a session that may
time both ways stay in memory (its graph is not released to the model file,
``InferenceSession._give_up_weights``): the other network is made from it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from backplane.backends.api.backend import OptionError
from backplane.backends.builtin.control_flow import CONTROL_FLOW_OPS
from backplane.backends.torch import background
from backplane.optimizer.samples import seeded_inputs
from backplane.optimizer.optimize import OptimizedNetwork
from backplane.optimizer.report import MeasurementRecord
from backplane.runtime.runtime import Runtime, within
from backplane.session_options import RunOptions, stop_scope

log = logging.getLogger("backplane")

CHOICES = ("auto", "off")
DEFAULT = "auto"
"""Where a rule's option is not given (the test suite's conftest sets "off": its tests test the
backends where they place them; tests/runtime/test_against_cpu.py gives the options itself)."""
WARMUP = 3
TURN, RUNS = 5, 25
FIRST_RUN_S = 5.0
"""The most a timing's first run of a placement may take (``_first``): it builds what first runs
build (a compile at the first run: 0.1-1.1 s on this 2-core machine, busy or not)."""
MAX_WEIGHT_BYTES = 64 << 20
"""Models with more weights are not timed both ways: the other network would cost seconds of load
and its weights' memory for a model whose size gives the backend work enough (BERT-base: 440 MB)."""


@dataclass(frozen=True)
class Rule:
    """Where ``backend`` takes layers of a network ``holds`` picks and one of ``others`` is
    listed too, the placement without ``backend`` is timed against it (``option``: "off" turns it
    off; ``limit_ms``: a placed run this long is kept untimed; ``budget_s``: the turns' seconds;
    ``margin``: the other is kept where its median is below the placed one's by this fraction)."""

    backend: str
    others: frozenset[str]
    option: str
    limit_ms: float
    budget_s: float
    holds: Callable[[OptimizedNetwork], bool]
    without: str  # how the message names what the kept placement goes without
    warns: bool
    margin: float
    clock: Callable[[], float] = time.perf_counter
    """What a warm-up run's time is read on for ``limit_ms`` (``_warm``)."""
    first_run_s: float | None = None
    """The most each placement's first run may take (``_first``: the placed one's, then the
    other's, which may build a native library on a fresh machine); None: ``FIRST_RUN_S``."""


def _control_flow(network: OptimizedNetwork) -> bool:
    """Whether the network (or a body) holds an If, Loop, Scan or SequenceMap run as nested
    networks (a DecidedIf's versions are compiled whole: not these)."""
    return any(layer.op_type in CONTROL_FLOW_OPS for net in within(network)
               for layer in net.graph.layers)


GPU = Rule("GpuAcc", frozenset({"CpuAcc", "OpenVINO"}), "GpuAcc.against_cpu", limit_ms=10.0,
           budget_s=0.5, holds=lambda network: True, without="the GPU", warns=True, margin=0.0,
           first_run_s=30.0)
"""30 s for GpuAcc's first run: it captures each partition and NVRTC compiles its elementwise
trees (gpu_jit) on a process's first use; on a fresh H100 machine first calls took 4.5-6.8 s
(bench/corpus_gpu.py, session 16), and with FIRST_RUN_S's 5 s resnet_qdq_ort17's placement was
kept untimed ("its run failed (RunTerminated)"). Margin 0: a GPU placement timed slower than the CPU's is never kept (issue 28: no model slower
with GpuAcc first than on CpuAcc,CpuRef). With 10% the H100 machine kept GpuAcc's for two small
int8 models timed 9% slower than CpuAcc's (fakequant_qdq_ts13 0.101 against 0.092 ms,
resnet_qdq_ort17 0.287 against 0.261; bench/corpus_gpu.py --tier small)."""
CONTROL_FLOW = Rule("CpuAcc", frozenset({"CpuRef"}), "CpuAcc.against_cpuref", limit_ms=5.0,
                    budget_s=0.2, holds=_control_flow, without="CpuAcc", warns=False, margin=0.10,
                    clock=time.thread_time)
"""5 ms: past a few hundred small layer calls a run has work a torch kernel does better (2 ms on
the AVX-512 EPYC of the first sessions; on the AVX2 EPYC of the eleventh and twelfth, where torch's
calls cost more, loop_scripted_ts16 ran 2.4 ms on CpuAcc's placement, went untimed, and kept it
against CpuRef's 0.5 ms); 0.2 s of
turns: the corpus's two such models each get their 25 runs in under 30 ms; 10%: CpuRef in place
of CpuAcc is a measured route of the user's own list, not a promise to keep. The limit is read on
the calling thread's CPU time: on the busy 2-core machine (load 7) a process's first session of
loop_scripted_ts16 took 6.8 ms of wall time a warm-up run on CpuAcc (its two threads preempted),
went untimed and kept CpuAcc, where the next sessions timed it at 1.1-1.9 ms against CpuRef's
0.4-0.7 and moved: one placement or the other by process. A model of work enough keeps the
calling thread busy for most of it (with two threads, half of it or more)."""


@dataclass(frozen=True)
class Timing:
    """A placement to time: ``rule``'s, against the one on the backends ``without``."""

    rule: Rule
    without: list[str]


def applies(ids: Sequence[str], network: OptimizedNetwork, options: Mapping[str, Any],
            pins: Mapping[str, str], done: Sequence[Rule] = ()) -> Timing | None:
    """The first rule (GPU, then CONTROL_FLOW; not one of ``done``) the session's placement is
    timed by, with the backend list to try; None where it is not timed both ways."""
    for rule in (GPU, CONTROL_FLOW):  # the module's, when called (tests replace them)
        if rule in done:
            continue
        without = _without(rule, ids, network, options, pins)
        if without is not None:
            return Timing(rule, without)
    return None


def _without(rule: Rule, ids: Sequence[str], network: OptimizedNetwork,
             options: Mapping[str, Any], pins: Mapping[str, str]) -> list[str] | None:
    choice = options.get(rule.option, DEFAULT)
    if choice not in CHOICES:
        raise OptionError(f"{rule.option}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "off" or rule.backend not in network.report.counts():
        return None
    rest = [i for i in ids if i != rule.backend]
    if not rule.others & set(rest) or rule.backend in pins.values():
        return None
    weights = sum(getattr(v, "nbytes", 0) for v in network.graph.constants.values())
    if weights > MAX_WEIGHT_BYTES or not rule.holds(network):
        return None
    return rest


def settle(runtime: Runtime, ids: Sequence[str], network: OptimizedNetwork, network_id: int,
           options: Mapping[str, Any], pins: Mapping[str, str],
           make: Callable[[Sequence[str]], OptimizedNetwork],
           feeds: Mapping[str, Any] | None = None) -> tuple[OptimizedNetwork, int]:
    """``network`` (loaded as ``network_id``) timed by each rule that applies, in turn, the faster
    placement kept at each (``choose``; ``make`` places the model on a backend list): a small
    control-flow model GpuAcc gave up to CpuAcc,CpuRef is then timed against CpuRef too (on the
    H100 machine cond_nested_dyn18 kept CpuAcc's 0.107 ms a run where CpuRef's takes 0.033)."""
    done: list[Rule] = []
    while (timing := applies(ids, network, options, pins, done)) is not None:
        done.append(timing.rule)
        kept, kept_id = choose(runtime, timing.rule, network, network_id,
                               lambda: make(timing.without), feeds)
        if kept_id != network_id:
            ids = timing.without
        network, network_id = kept, kept_id
    return network, network_id


def at_compile(runtime: Runtime, graph: Any, network: OptimizedNetwork, ids: Sequence[str],
               options: Mapping[str, Any], pins: Mapping[str, str],
               make: Callable[[Sequence[str]], OptimizedNetwork]) -> OptimizedNetwork:
    """The network an artifact keeps (``artifact.build``, also the compile cache's): ``network``,
    or the one ``make`` places on the rule's other backends where that runs the model faster,
    timed as a session times it at load (``choose``; seeded inputs, so only a model ``at_load``
    takes). With ``$BACKPLANE_COMPILE_CACHE`` set, sessions load through here: before, GpuAcc
    kept cond_nested_dyn18 and loop_scripted_ts16 at 2-4x CpuAcc's time a run."""
    if applies(ids, network, options, pins) is None or not at_load(graph):
        return network
    _, kept_id = settle(runtime, ids, network, runtime.load(network), options, pins, make)
    kept = runtime.network(kept_id).network  # as loaded (a load may give layers up)
    runtime.unload(kept_id)
    return kept


def at_load(graph: Any) -> bool:
    """Whether the model is timed both ways at load, on seeded inputs (``seedable``), or at its
    first run, on the caller's."""
    return _seedable(graph)


def _seedable(graph: Any) -> bool:
    """Whether seeded inputs stand for the model's: each input's type and shape known, free only
    in its first dimension (a batch, seeded at 1). Other free sizes (an image's height and width,
    a sequence's length) are not timed: seeded at 1 they make inputs the model refuses (a 1x1
    image under a 3x3 convolution) or whose time says nothing of the real ones. Nor are integer
    or boolean inputs of a model with control flow, seeded 0 or 1: they may pick another branch or
    trip count than the caller's. The corpus VAD's sampling rate picks its If's branch: seeded at 1
    it timed the 8 kHz branch, which its 16 kHz inputs never take (H200 machine, session 19:
    GpuAcc's 0.064 ms a run kept against CpuAcc's 0.072, where on its own inputs the two then ran
    0.053 and 0.034 side by side in one process; the CPU's route varies between processes too)."""
    steered = any(layer.op_type in CONTROL_FLOW_OPS for layer in graph.layers)
    for name in graph.inputs:
        info = graph.info(name)
        if info.shape is None or info.dtype is None:
            return False
        if any(not isinstance(d, int) for d in info.shape[1:]):
            return False
        if steered and np.dtype(info.dtype).kind in "biu":
            return False
    return True


def choose(runtime: Runtime, rule: Rule, placed: OptimizedNetwork, placed_id: int,
           make_other: Callable[[], OptimizedNetwork],
           feeds: Mapping[str, Any] | None = None) -> tuple[OptimizedNetwork, int]:
    """The network to keep, loaded, and its id: ``placed`` (loaded as ``placed_id``) or the one
    ``make_other`` places without ``rule.backend``, whichever runs the model faster on ``feeds``
    (seeded inputs where None; see above)."""
    inputs = "seeded inputs" if feeds is None else "the first run's inputs"
    feeds = seeded_inputs(placed.graph) if feeds is None else feeds
    try:
        first = _warm(runtime, placed_id, feeds, rule.clock, rule.first_run_s)
    except Exception as exc:  # noqa: BLE001  # a seeded run may fail where real inputs would not
        log.debug("%s: not timed (%s: %s)", rule.option, type(exc).__name__, exc)
        _untimed(runtime, rule, placed, placed_id, None, f"its run failed ({type(exc).__name__})")
        return placed, placed_id
    if first >= rule.limit_ms:
        _untimed(runtime, rule, placed, placed_id, first,
                 f"its fastest warm-up run took {first:.3f} ms, {rule.limit_ms:g} or more")
        return placed, placed_id
    other = make_other()
    other_id = runtime.load(other)
    try:
        _first(runtime, other_id, feeds, rule.first_run_s)
    except Exception as exc:  # noqa: BLE001  # a first run that builds a native library, say
        log.debug("%s: not timed (%s: %s)", rule.option, type(exc).__name__, exc)
        runtime.unload(other_id)
        _untimed(runtime, rule, placed, placed_id, first,
                 f"the placement without it failed its first run ({type(exc).__name__})")
        return placed, placed_id
    try:
        for network_id in (placed_id, other_id):  # CpuAcc's routes chosen: timed as final
            background.settle(partial(runtime.run, network_id, feeds))
        _warm(runtime, other_id, feeds)
        ms = _turns(runtime, {"placed": placed_id, "other": other_id}, feeds, rule.budget_s)
    except Exception as exc:  # noqa: BLE001
        log.debug("%s: not timed (%s: %s)", rule.option, type(exc).__name__, exc)
        runtime.unload(other_id)
        return placed, placed_id
    faster = ms["other"] < ms["placed"] * (1 - rule.margin)
    runtime.unload(placed_id if faster else other_id)
    kept, kept_id = (other, other_id) if faster else (placed, placed_id)
    _record(runtime.network(kept_id).network.report, rule, placed, other, ms, faster, inputs)
    if faster:
        _say(rule, placed, other, ms, inputs)
    return kept, kept_id


def _record(report: Any, rule: Rule, placed: OptimizedNetwork, other: OptimizedNetwork,
            ms: Mapping[str, float], faster: bool, inputs: str) -> None:
    """Both medians in the kept network's report (its measurements: ``backplane inspect``)."""
    note = f"{rule.option}: the whole model, median run on {inputs}"
    for name, network, chosen in (("placed", placed, not faster), ("other", other, faster)):
        report.measurements.append(MeasurementRecord(
            "(whole model)", ", ".join(network.report.preferences), ms[name], None, chosen, note))


def _untimed(runtime: Runtime, rule: Rule, placed: OptimizedNetwork, placed_id: int,
             ms: float | None, why: str) -> None:
    """Why the placement was kept untimed, in its report's measurements: a model that stays on
    the GPU says whether it was weighed against the CPU (the small tier's runs on the H100 showed
    a placement but not whether it had been timed)."""
    runtime.network(placed_id).network.report.measurements.append(MeasurementRecord(
        "(whole model)", ", ".join(placed.report.preferences), ms, None, True,
        f"{rule.option}: not timed: {why}"))


def _say(rule: Rule, placed: OptimizedNetwork, other: OptimizedNetwork,
         ms: Mapping[str, float], inputs: str) -> None:
    placed_on = ", ".join(f"{b}: {n} layers" for b, n in other.report.counts().items())
    layers = placed.report.counts().get(rule.backend, 0)
    line = (f"{rule.backend}: this model runs faster without {rule.without}, {ms['other']:.3f} ms "
            f"a run against {ms['placed']:.3f} ms with {rule.backend}'s {layers} layers ({inputs}, "
            f"medians); placed on {placed_on}. {rule.option}='off' keeps {rule.backend}'s "
            f"placement")
    log.log(logging.WARNING if rule.warns else logging.INFO, "%s", line)
    if rule.warns:
        other.report.warnings.append(
            f"{rule.backend}'s placement ran {ms['placed']:.3f} ms a run, this one "
            f"{ms['other']:.3f} ms: the model was placed without {rule.backend} ({rule.option}="
            f"'off' keeps {rule.backend}'s)")


def _warm(runtime: Runtime, network_id: int, feeds: Mapping[str, Any],
          clock: Callable[[], float] = time.perf_counter, first_s: float | None = None) -> float:
    """The fastest of WARMUP runs but the first (which builds what runs build, and may not end:
    ``_first``), in ms read on ``clock`` (the rule's): one run preempted on a busy machine (2 ms
    for a 0.05 ms model) does not pass for work enough."""
    _first(runtime, network_id, feeds, first_s)
    times = []
    for _ in range(WARMUP - 1):
        start = clock()
        runtime.run(network_id, feeds)
        times.append(clock() - start)
    return min(times) * 1e3


def _first(runtime: Runtime, network_id: int, feeds: Mapping[str, Any],
           limit_s: float | None = None) -> None:
    """A first run of the network, stopped (``RunTerminated``: the model is then not timed) after
    FIRST_RUN_S: on seeded inputs a model may run for ever (a Loop of 2**62 trips: the CPU rule
    made such a session's load hang until tests/runtime/test_hostile_graphs.py's 120 s child
    timeout). Only the first run asks before each layer: a run under a stop takes the steps' loop,
    not the one call or straight code of a plain run (``steps.one_call``), which the timed runs
    are."""
    with stop_scope(RunOptions(timeout_s=FIRST_RUN_S if limit_s is None else limit_s)):
        runtime.run(network_id, feeds)


def _turns(runtime: Runtime, ids: Mapping[str, int], feeds: Mapping[str, Any],
           budget_s: float) -> dict[str, float]:
    """Each network's median run in ms, timed in turns of TURN runs, the order turning, until
    each has RUNS or ``budget_s`` is spent."""
    times: dict[str, list[float]] = {name: [] for name in ids}
    order = list(ids)
    deadline = time.perf_counter() + budget_s
    while min(len(t) for t in times.values()) < RUNS and time.perf_counter() < deadline:
        for name in order:
            runtime.run(ids[name], feeds)  # each timed run follows a run of its own
            for _ in range(TURN):
                start = time.perf_counter()
                runtime.run(ids[name], feeds)
                times[name].append((time.perf_counter() - start) * 1e3)
        order.reverse()
    return {name: statistics.median(t) for name, t in times.items()}
