"""A small CpuAcc partition runs on one thread, where that measures at least as fast.

Why: torch's intra-op work runs on OpenMP threads that meet at a barrier at the end of every
parallel region, and each layer of a compiled partition is one or more regions. On a small model
(the corpus's CNNs at 32x32, its GRUs and 1-D convolutions: a few million multiply-adds a run)
that fork and join is most of what a second thread adds: one 16->16 3x3 convolution on a 16x16 map
took 38 us at 2 threads and 32 at 1 on this 2-core AMD EPYC; resnet_basic_ts16's compiled
partition 0.142 ms at 2 threads and 0.129 at 1. And where another process holds a core, the thread
that shares it is preempted in every region (that convolution: 79 us at 1 thread against 620 at 2
beside two busy neighbours). ONNX Runtime's pool likewise runs small operators on the calling
thread.

On a many-core machine the same holds between one thread and all: on a 16-CPU Xeon at torch's
16 threads the full tier's lstm_bi2_ts14 ran in 18.3 ms and char_tagger_ts14 in 9.8, where ONNX
Runtime on 2 cores takes 2.6 and 2.0 (issue 27).

So when a Specialized layer builds a signature (``specialize``), ``fewer_threads`` times the build
on the signature's values at one thread; under ``SMALL_SECONDS`` it times it at each of
``counts`` (the calling thread's count halved down to 2, and 1; on 16 CPUs 16, 8, 4, 2, 1),
in a block of calls each (cut short where a count is far slower than one thread), and keeps
the fewest threads within ``MARGIN`` of the fastest where a second comparison agrees, else the
caller's count (on a busy machine, ``threads.crowded``, one thread without comparing). One
comparison alone, disturbed, kept the full tier's lstm_bi2_ts14 at one
thread for its process ({2: 3.0, 1: 2.96} ms; undisturbed {2: 2.0-2.25, 1: 2.5-2.8}: 3.84 ms a
run in the bench against 2.16 in the next process). A static partition that CpuAcc's background
builds (a compiled subgraph, ``background.deferred``) gets the same choice (``static``), made at
a call once its routes are chosen (``Undecided``). A count given by
``CpuAcc.threads`` is then the most threads a partition may use, as ONNX Runtime's
``intra_op_num_threads`` is. ``torch.set_num_threads`` sets the calling thread's count for about
0.2 us, so each call of a ``OneThread`` sets it and puts the caller's back (a oneDNN Graph keeps a
module compiled per count, ``onednn_graph.CompiledPerThreads``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from backplane.backends.torch import background, trials
from backplane.backends.torch.wrapped import Wrapper

SMALL_SECONDS = 10e-3
"""A partition that runs slower than this on one thread keeps the caller's threads, untimed (the
comparison costs about 30 calls, once per build)."""
MARGIN = 1.1
"""The fewest threads are kept unless more run the partition this many times faster: fewer
threads are what a busy machine wants, and they leave the other CPUs to the caller."""
REPEAT = 5
GIVE_UP = 4.0
"""A count whose best call is this many times one thread's stops being timed (``_timed``)."""


def counts(most: int) -> list[int]:
    """The thread counts ``fewer_threads`` compares: ``most``, halved down to 2, and 1 (16: 16, 8,
    4, 2, 1; 2: 2, 1)."""
    found = [most]
    while found[-1] // 2 >= 2:
        found.append(found[-1] // 2)
    return found + [1] if most > 1 else found


def fewer_threads(run: Any, values: Sequence[Any]) -> Any:
    """``run`` (a partition built for the shapes of ``values``), or ``AtThreads(run, count)`` for
    the fewest of ``counts`` (the calling thread's count halved) that runs it within ``MARGIN`` of
    the fastest, where one thread runs it in under ``SMALL_SECONDS`` (timed on ``values``, a
    block of calls per count, twice where the first would take fewer threads than the caller's:
    where the two disagree, ``run``; on a busy machine, ``crowded``, one thread without
    comparing)."""
    import torch

    from backplane.backends.torch import threads

    most = threads.quiet_count()  # a governor holding fewer threads now: its ceiling compared
    if most == 1:
        return run
    with at_threads(1):
        for _ in range(2):  # a oneDNN Graph compiles its partitions for this count at its first calls
            run(*values)
        alone = min(_seconds(run, values) for _ in range(2))
    if alone > SMALL_SECONDS:
        return run
    if threads.crowded():
        return OneThread(run)
    count = _fewest(_timed(run, values, counts(most), alone))
    if count != most and _fewest(_timed(run, values, counts(most), alone)) != count:
        return run  # the two comparisons disagree: a burst of load, not the partition
    if count == most:
        return run
    return OneThread(run) if count == 1 else AtThreads(run, count)


def _fewest(times: dict[int, float]) -> int:
    """The fewest threads within ``MARGIN`` of the fastest of ``times`` (count -> seconds)."""
    fastest = min(times.values())
    return min(n for n, t in times.items() if t <= fastest * MARGIN)


def _timed(run: Any, values: Sequence[Any], candidates: list[int],
           alone: float) -> dict[int, float]:
    """Each count's best of ``REPEAT`` calls, in a block per count after one untimed call (a
    oneDNN Graph compiles for a count at its first call; the count's sleeping OpenMP workers wake),
    the block cut short where its best is over ``GIVE_UP`` times one thread's time ``alone``.

    Why: the counts alternated every call, and on a busy machine each call at two threads took
    135-145 CPU ms where the partition runs in 0.26 ms (mobilenet_dw_ts13 at load average 6-7 on
    this 2-core AMD EPYC: every parallel region waited for its second thread to get a CPU, its
    first spinning at the barrier meanwhile), ten and more of them: 1.4-3.7 s of its first call.
    Such a count cannot be the fastest by ``MARGIN``; its block stops at its first timed call."""
    best = {}
    for count in candidates:
        with at_threads(count):
            run(*values)
            best[count] = math.inf
            for _ in range(REPEAT):
                best[count] = min(best[count], _seconds(run, values))
                if best[count] > GIVE_UP * alone:
                    break
    return best


def deciding(run: Any, values: Sequence[Any]) -> Any:
    """``fewer_threads``' choice for ``run``, made now; or, where CpuAcc's background is still
    making workloads or its runs still time their routes (``background.settled``: ``run`` is then
    made of stand-ins or candidates, whose time says nothing of what will run: mobilenet_fp16_ts17
    kept two threads by its layers' 1.4 ms, then ran traced at 2.4 ms a run against 0.7 at one
    thread), an ``Undecided`` that chooses at its first call after that."""
    if background.settled():
        return fewer_threads(run, values)
    return Undecided(run)


def unwrapped(run: Any) -> Any:
    """``run`` without the thread choice's wrappers (``AtThreads``, ``Undecided``): the build
    itself, for what does not run on torch's threads (a native plan's NumPy run, which
    ``runtime/host_route.py`` reads only from the workload that offers it)."""
    while isinstance(run, (AtThreads, Undecided)):
        run = run.work
    return run


_building = threading.local()  # .on: making the workloads of a build that ``deciding`` wraps


@contextlib.contextmanager
def whole() -> Iterator[None]:
    """The workloads made in the block are parts of a build whose threads are chosen whole
    (``deciding``, a Specialized signature's): ``static`` leaves theirs as they are."""
    was, _building.on = getattr(_building, "on", False), True
    try:
        yield
    finally:
        _building.on = was


def static(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make`` (of a static partition's workload, which CpuAcc's background builds), its workload
    an ``Undecided`` (its threads chosen as a Specialized build's are, once its routes are) unless
    it is made as part of a build chosen ``whole``."""
    if getattr(_building, "on", False):
        return make
    return lambda: Undecided(make())


class Undecided(Wrapper):
    """A build called at the caller's threads until a call of it finds CpuAcc's background idle
    and calls no route still choosing (``trials.choosing``), or every network's routes are chosen
    (``background.settled``), then as ``fewer_threads`` chooses on the next call's values; its
    other attributes are the build's."""

    __slots__ = ("work", "decided", "ready")

    def __init__(self, work: Any) -> None:
        self.work, self.decided, self.ready = work, None, False

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        decided = self.decided
        if decided is None:
            if not (self.ready or background.settled()):
                idle, before = background.pending(low=False) == 0, trials.choosing()
                outputs = self.work(*inputs)
                self.ready = idle and trials.choosing() == before
                return outputs
            decided = self.decided = fewer_threads(self.work, inputs)
        return decided(*inputs)



def _seconds(run: Any, values: Sequence[Any]) -> float:
    start = time.perf_counter()
    run(*values)
    return time.perf_counter() - start


@contextlib.contextmanager
def at_threads(count: int) -> Iterator[None]:
    """The calling thread at ``count`` torch threads, its own count back after."""
    import torch

    before = torch.get_num_threads()
    if before != count:
        torch.set_num_threads(count)
    held = _hold(before) if count < before else None
    try:
        yield
    finally:
        if before != count:
            torch.set_num_threads(before)
        if held is not None:
            _HELD.count = held


_HELD = threading.local()
""".count: the calling thread's torch threads before ``AtThreads`` or ``at_threads`` held it to
fewer (``caller_threads``)."""


def _hold(before: int) -> int:
    """Records ``before`` as the caller's count; the count recorded until now (to put back)."""
    held = getattr(_HELD, "count", 0)
    _HELD.count = max(before, held)
    return held


def caller_threads() -> int:
    """The threads the calling thread may use: its torch count, or the count it had before a
    partition was held to fewer (a kernel may run work beside it on a thread of its own,
    ``kernels/recurrent_parallel.py``: a second OpenMP thread spinning there would take its CPU)."""
    import torch

    return max(torch.get_num_threads(), getattr(_HELD, "count", 0))


class AtThreads(Wrapper):
    """A workload called at ``count`` torch threads, or the caller's count where that is fewer
    (the caller's count back after each call); its other attributes (``route``, ``why``,
    ``profiled``, ...) are the workload's."""

    __slots__ = ("work", "count", "_get", "_set")

    def __init__(self, work: Any, count: int) -> None:
        import torch

        self.work, self.count = work, count
        self._get, self._set = torch.get_num_threads, torch.set_num_threads

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        before = self._get()
        if before <= self.count:
            return self.work(*inputs)
        self._set(self.count)
        held = _hold(before)
        try:
            return self.work(*inputs)
        finally:
            self._set(before)
            _HELD.count = held

    def __getattr__(self, name: str) -> Any:
        found = super().__getattr__(name)
        if name == "profiled":
            return functools.partial(_at, self.count, found)
        return found

    def __repr__(self) -> str:
        return f"AtThreads({self.work!r}, {self.count})"


class OneThread(AtThreads):
    """``AtThreads`` at one thread."""

    __slots__ = ()

    def __init__(self, work: Any) -> None:
        super().__init__(work, 1)

    def __repr__(self) -> str:
        return f"OneThread({self.work!r})"


def _at(count: int, call: Any, *inputs: Any) -> Any:
    with at_threads(count):
        return call(*inputs)
