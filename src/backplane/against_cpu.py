"""GpuAcc never slower than the CPU by default (issue 28, item 2).

A GPU run of a small model costs a fixed price whatever its work: the upload, a graph's launch, the
download and the wait, 0.13-0.2 ms on the H100 machine, where two cores of its Xeon run a small CNN
on CpuAcc in 0.1-0.4 ms; and control flow and data-sized layers cost more on the GPU than on the
CPU (a Loop's body per iteration, NonMaxSuppression's reads of its scores). So where the backends
of a session put layers on GpuAcc and also list CpuAcc or OpenVINO, ``choose`` times the model both
ways at load and keeps the faster:

1. The network as placed (GpuAcc's) is loaded, run WARMUP times on seeded inputs (floats normal,
   integers 0 or 1, a free batch at 1: measured placement's), and timed. Where its median is
   LIMIT_MS or more, the model has work enough for the GPU: it is kept, and nothing else is built.
2. Otherwise the network placed without GpuAcc is optimized and loaded too, and both are timed in
   turns (GPU, CPU, then CPU, GPU, ...), TURN runs a turn, each turn after a run of its own, until
   each has RUNS or BUDGET_S is spent.
3. The CPU's network is kept where its median is below the GPU's by MARGIN or more, and the other
   one is unloaded; a warning then says so, with both medians and the layers GpuAcc would have run.

A model with a free dimension other than the first of an input (an image's height and width, a
sequence's length: seeded at 1 they make inputs the model refuses, or whose time says nothing of
the real ones) is timed the same way at its first ``InferenceSession.run``, on the caller's
inputs, which that run then pays for (building the CPU's network and the turns).

``GpuAcc.against_cpu="off"`` keeps GpuAcc's placement untimed. Not timed (GpuAcc's placement kept):
models of more than MAX_WEIGHT_BYTES of weights, networks with a layer pinned to GpuAcc, and runs
that fail. An artifact (``backplane.compile``, and the compile cache's entries) is timed so when it
is compiled (``at_compile``) and keeps the faster placement; its loads time nothing. It adds 0.1-0.8 s to the load (or the first run) of a small model (the corpus
on the H100 machine). The weights of a session that may time both ways stay in memory (its graph is
not released to the model file, ``InferenceSession._give_up_weights``): the CPU's network is made
from it.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from backplane.backends.api.backend import OptionError
from backplane.backends.torch import background
from backplane.optimizer.measured import _seeded_inputs
from backplane.optimizer.optimize import OptimizedNetwork
from backplane.runtime.runtime import Runtime

log = logging.getLogger("backplane")

OPTION = "GpuAcc.against_cpu"
CHOICES = ("auto", "off")
DEFAULT = "auto"
"""Where the option is not given (the test suite's conftest sets "off": its GPU tests test GpuAcc
where they place it; tests/runtime/test_against_cpu.py gives "auto")."""
CPU_BACKENDS = frozenset({"CpuAcc", "OpenVINO"})
WARMUP = 3
LIMIT_MS = 10.0
TURN, RUNS, BUDGET_S = 5, 25, 0.5
MARGIN = 0.10
MAX_WEIGHT_BYTES = 64 << 20
"""Models with more weights are not timed both ways: the CPU's network would cost seconds of load
and its weights' memory for a model whose size gives the GPU work enough (BERT-base: 440 MB)."""


def applies(ids: Sequence[str], network: OptimizedNetwork, options: Mapping[str, Any],
            pins: Mapping[str, str]) -> list[str] | None:
    """The backend list to try without GpuAcc, or None where the model is not timed both ways."""
    choice = options.get(OPTION, DEFAULT)
    if choice not in CHOICES:
        raise OptionError(f"{OPTION}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "off" or "GpuAcc" not in network.report.counts():
        return None
    rest = [i for i in ids if i != "GpuAcc"]
    if not CPU_BACKENDS & set(rest) or "GpuAcc" in pins.values():
        return None
    weights = sum(getattr(v, "nbytes", 0) for v in network.graph.constants.values())
    return rest if weights <= MAX_WEIGHT_BYTES else None


def at_compile(runtime: Runtime, graph: Any, network: OptimizedNetwork, ids: Sequence[str],
               options: Mapping[str, Any], pins: Mapping[str, str],
               make: Callable[[Sequence[str]], OptimizedNetwork]) -> OptimizedNetwork:
    """The network an artifact keeps (``artifact.build``, also the compile cache's): ``network``,
    or the one ``make`` places without GpuAcc where that runs the model faster, timed as a session
    times it at load (``choose``; seeded inputs, so only a model ``at_load`` takes). A session that
    loads an artifact takes the placement it holds and times nothing: with ``$BACKPLANE_COMPILE_CACHE``
    set, cond_nested_dyn18 and loop_scripted_ts16 stayed on GpuAcc, 2-4x CpuAcc's time a run."""
    without = applies(ids, network, options, pins)
    if without is None or not at_load(graph):
        return network
    kept, kept_id = choose(runtime, network, runtime.load(network), lambda: make(without))
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
    image under a 3x3 convolution) or whose time says nothing of the real ones."""
    for name in graph.inputs:
        info = graph.info(name)
        if info.shape is None or info.dtype is None:
            return False
        if any(not isinstance(d, int) for d in info.shape[1:]):
            return False
    return True


def choose(runtime: Runtime, gpu: OptimizedNetwork, gpu_id: int,
           make_cpu: Callable[[], OptimizedNetwork],
           feeds: Mapping[str, Any] | None = None) -> tuple[OptimizedNetwork, int]:
    """The network to keep, loaded, and its id: ``gpu`` (loaded as ``gpu_id``) or the one
    ``make_cpu`` places without GpuAcc, whichever runs the model faster on ``feeds`` (seeded
    inputs where None; see above)."""
    inputs = "seeded inputs" if feeds is None else "the first run's inputs"
    feeds = _seeded_inputs(gpu.graph) if feeds is None else feeds
    try:
        first = _warm(runtime, gpu_id, feeds)
    except Exception as exc:  # noqa: BLE001  # a seeded run may fail where real inputs would not
        log.debug("GpuAcc against the CPU: not timed (%s: %s)", type(exc).__name__, exc)
        return gpu, gpu_id
    if first >= LIMIT_MS:
        return gpu, gpu_id
    cpu = make_cpu()
    cpu_id = runtime.load(cpu)
    background.settle(lambda: runtime.run(cpu_id, feeds))  # CpuAcc's routes chosen: timed as final
    try:
        _warm(runtime, cpu_id, feeds)
        ms = _turns(runtime, {"gpu": gpu_id, "cpu": cpu_id}, feeds)
    except Exception as exc:  # noqa: BLE001
        log.debug("GpuAcc against the CPU: not timed (%s: %s)", type(exc).__name__, exc)
        runtime.unload(cpu_id)
        return gpu, gpu_id
    if ms["cpu"] > ms["gpu"] * (1 - MARGIN):
        runtime.unload(cpu_id)
        return gpu, gpu_id
    runtime.unload(gpu_id)
    placed = ", ".join(f"{b}: {n} layers" for b, n in cpu.report.counts().items())
    log.warning("GpuAcc: this model runs faster without the GPU, %.3f ms a run against %.3f ms "
                "with GpuAcc's %d layers (%s, medians); placed on %s. "
                "%s='off' keeps GpuAcc's placement", ms["cpu"], ms["gpu"],
                gpu.report.counts().get("GpuAcc", 0), inputs, placed, OPTION)
    cpu.report.warnings.append(
        f"GpuAcc's placement ran {ms['gpu']:.3f} ms a run, this one {ms['cpu']:.3f} ms: the model "
        f"was placed without GpuAcc ({OPTION}='off' keeps GpuAcc's)")
    return cpu, cpu_id


def _warm(runtime: Runtime, network_id: int, feeds: Mapping[str, Any]) -> float:
    """The time of the last of WARMUP runs, in ms (the first ones build what runs build)."""
    for _ in range(WARMUP):
        start = time.perf_counter()
        runtime.run(network_id, feeds)
    return (time.perf_counter() - start) * 1e3


def _turns(runtime: Runtime, ids: Mapping[str, int], feeds: Mapping[str, Any]) -> dict[str, float]:
    """Each network's median run in ms, timed in turns of TURN runs, the order turning."""
    times: dict[str, list[float]] = {name: [] for name in ids}
    order = list(ids)
    deadline = time.perf_counter() + BUDGET_S
    while min(len(t) for t in times.values()) < RUNS and time.perf_counter() < deadline:
        for name in order:
            runtime.run(ids[name], feeds)  # each timed run follows a run of its own
            for _ in range(TURN):
                start = time.perf_counter()
                runtime.run(ids[name], feeds)
                times[name].append((time.perf_counter() - start) * 1e3)
        order.reverse()
    return {name: statistics.median(t) for name, t in times.items()}
