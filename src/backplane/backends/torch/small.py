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

So when a Specialized layer builds a signature (``specialize``), ``fewer_threads`` times the build
on the signature's values at one thread; under ``SMALL_SECONDS`` it times it at the calling
thread's count too, alternating, and keeps one thread unless the count is ``MARGIN`` times faster
(on a busy machine, ``threads.crowded``, one thread without comparing). A count given by
``CpuAcc.threads`` is then the most threads a partition may use, as ONNX Runtime's
``intra_op_num_threads`` is. ``torch.set_num_threads`` sets the calling thread's count for about
0.2 us, so each call of a ``OneThread`` sets it and puts the caller's back (a oneDNN Graph keeps a
module compiled per count, ``onednn_graph.CompiledPerThreads``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

from backplane.backends.torch import background, trials

SMALL_SECONDS = 1e-3
"""A partition that runs slower than this on one thread keeps the caller's threads, untimed."""
MARGIN = 1.1
"""One thread is kept unless the caller's count runs the partition this many times faster: one
thread is what a busy machine wants, and it leaves the other CPUs to the caller."""
REPEAT = 5


def fewer_threads(run: Any, values: Sequence[Any]) -> Any:
    """``run`` (a partition built for the shapes of ``values``), or ``OneThread(run)`` where one
    thread runs it in under ``SMALL_SECONDS`` and not ``MARGIN`` times slower than the calling
    thread's count (timed on ``values``, the calls alternating; on a busy machine, ``crowded``,
    one thread without the comparison)."""
    import torch

    from backplane.backends.torch import threads

    most = torch.get_num_threads()
    if most == 1:
        return run
    with one_thread():
        for _ in range(2):  # a oneDNN Graph compiles its partitions for this count at its first calls
            run(*values)
        alone = min(_seconds(run, values) for _ in range(2))
    if alone > SMALL_SECONDS:
        return run
    if threads.crowded():
        return OneThread(run)
    one = many = math.inf
    for _ in range(REPEAT):
        with one_thread():
            one = min(one, _seconds(run, values))
        many = min(many, _seconds(run, values))
    return OneThread(run) if one <= many * MARGIN else run


def deciding(run: Any, values: Sequence[Any]) -> Any:
    """``fewer_threads``' choice for ``run``, made now; or, where CpuAcc's background is still
    making workloads or its runs still time their routes (``background.settled``: ``run`` is then
    made of stand-ins or candidates, whose time says nothing of what will run: mobilenet_fp16_ts17
    kept two threads by its layers' 1.4 ms, then ran traced at 2.4 ms a run against 0.7 at one
    thread), an ``Undecided`` that chooses at its first call after that."""
    if background.settled():
        return fewer_threads(run, values)
    return Undecided(run)


class Undecided:
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
                idle, before = background.pending() == 0, trials.choosing()
                outputs = self.work(*inputs)
                self.ready = idle and trials.choosing() == before
                return outputs
            decided = self.decided = fewer_threads(self.work, inputs)
        return decided(*inputs)

    def __getattr__(self, name: str) -> Any:
        if name in Undecided.__slots__:  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.work, name)


def _seconds(run: Any, values: Sequence[Any]) -> float:
    start = time.perf_counter()
    run(*values)
    return time.perf_counter() - start


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The calling thread at one torch thread, its own count back after."""
    import torch

    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


class OneThread:
    """A workload called at one torch thread (the caller's count back after each call); its other
    attributes (``route``, ``why``, ``profiled``, ...) are the workload's."""

    __slots__ = ("work", "_get", "_set")

    def __init__(self, work: Any) -> None:
        import torch

        self.work, self._get, self._set = work, torch.get_num_threads, torch.set_num_threads

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        before = self._get()
        if before == 1:
            return self.work(*inputs)
        self._set(1)
        try:
            return self.work(*inputs)
        finally:
            self._set(before)

    def __getattr__(self, name: str) -> Any:
        if name in OneThread.__slots__:  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        found = getattr(self.work, name)
        if name == "profiled":
            return functools.partial(_at_one_thread, found)
        return found

    def __repr__(self) -> str:
        return f"OneThread({self.work!r})"


def _at_one_thread(call: Any, *inputs: Any) -> Any:
    with one_thread():
        return call(*inputs)
