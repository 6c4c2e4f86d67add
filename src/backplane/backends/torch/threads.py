"""CpuAcc's threads on a busy machine: as many intra-op threads as the CPUs others leave free.

torch runs its intra-op work (its own kernels, oneDNN's, MKL's) on OpenMP threads that spin, then
sleep, at the end of each parallel region. Where a neighbour process holds a core, the thread that
shares that core is preempted for a scheduler slice while the others wait for it, in every region
of every layer: on a 2-core machine with one CPU-burning neighbour, the demo model's median run
went from 3 to 8 ms on CpuAcc and its worst to 175 ms (``bench/contention.py``).
``OMP_WAIT_POLICY=PASSIVE`` (threads sleep at once) tames that but cost the quiet machine 65%:
every region then wakes its threads through the kernel. And the wait policy is the process's,
fixed when OpenMP starts.

So the policy (``CpuAcc.threads="auto"``, the default) keeps OpenMP as it is and changes the number
of threads, which torch lets change between calls: at most every ``PERIOD`` seconds of runs it
reads how much of the CPUs the process may use (its affinity) were idle or its own since the last
reading (``/proc/stat`` and the process's CPU time), and runs with that many threads: torch's count
when the policy started, halved until the free CPUs (with ``SLACK``) cover it, at least one.
Subtracting only other processes' use keeps the decision stable: one thread fewer does not make
the neighbour look gone. Without ``/proc/stat`` (not Linux) it keeps torch's count.

A count a session gives (``SessionOptions(intra_op_num_threads=N)``, an ``AtMost(N)``) is a
ceiling the same way: N on a quiet machine (N even where it exceeds the CPUs), fewer while other
processes hold the CPUs, N again when they leave. Beside a 2-thread torch process a fixed 2 lost
30x (issue 27: yolo_v8 540 ms to 1.9 s against ONNX Runtime's 89-186; ONNX Runtime's pool gives a
region's chunks to whichever thread runs). ``CpuAcc.threads=N`` as a backend option stays a fixed,
exact count.

``torch.set_num_threads`` sets the calling thread's count (OpenMP's are per thread), so each thread
that runs a network gets the decision applied in it at its next call. A compiled ``OneDnnGraph``
does not follow the count: oneDNN Graph's partitions keep running on the threads they were compiled
with, so each count gets its own copy of the module, compiled at its first use
(``fusion.onednn_graph.CompiledPerThreads``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from backplane.backends.api.backend import OptionError, Workload
from backplane.backends.torch.wrapped import Wrapper

AUTO = "auto"
log = logging.getLogger("backplane.torch")
CROWDED_CHECK = True
"""Whether a load looks at the machine's other work: ``crowded`` reads the load average, and a
route measured beside other work is not kept (``route_cache.watched``). The test suite's conftest
turns it off: its tests test what a load measures, compiles and keeps, whatever else the machine
runs."""
_told_crowded = threading.Event()


def crowded() -> bool:
    """Whether more tasks were runnable than this process has CPUs over the last minute (the load
    average). A load then takes CpuAcc's defaults instead of measuring routes and compiling
    subgraphs to time them (``fusion.patterns.fastest``, ``onednn_graph``, ``traced``; a float32
    OneDnnGraph, taken by rule, is compiled at its first run all the same): on a busy
    machine those took 10-30 s a session and measured the neighbours (the demo model: 18.6 s at
    load average 3.7 on this 2-core AMD EPYC, 0.38 s without; issue 27, item 5), and nothing so
    chosen is kept in the route cache: a quiet load measures and compiles them."""
    if deferring():  # a load that leaves its measuring to the background (``background.py``)
        return True
    if making() is not None:  # the background's job, which read the load average when it began
        return False
    if not CROWDED_CHECK:
        return False
    try:
        load = os.getloadavg()[0]
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    except OSError:
        return False
    busy = load > (cpus or 1)
    if busy and not _told_crowded.is_set():
        _told_crowded.set()
        log.info("CpuAcc: the machine is busy (load average %.1f on %d CPUs): this process's loads "
                 "take the default routes unmeasured, compile only what a rule takes, and keep "
                 "no measurement (a load on a quiet machine measures and compiles them)", load, cpus)
    return busy


_deferral = threading.local()


def deferring() -> bool:
    """Whether this thread is making workloads whose measuring and compiling is left to the
    background (``background.deferred``): they take the routes a busy machine takes, and say so."""
    return getattr(_deferral, "on", False)


@contextlib.contextmanager
def deferred_scope() -> Iterator[None]:
    """``deferring`` true in this thread for the block."""
    was, _deferral.on = deferring(), True
    try:
        yield
    finally:
        _deferral.on = was


TRIALS = "trials"
"""``making``: each layer's candidates all built, timed later in the running thread (``trials``)."""
UNTIMED = "untimed"
"""``making``: on a busy machine, each layer's first candidate (the compiled one, for a subgraph
that compiles), untimed and not kept."""


def making() -> str | None:
    """How this thread (CpuAcc's background thread, in a job) decides among a layer's routes:
    ``TRIALS``, ``UNTIMED``, or None (measured now, or a busy machine's defaults)."""
    return getattr(_deferral, "making", None)


@contextlib.contextmanager
def making_scope(mode: str) -> Iterator[None]:
    """``making`` is ``mode`` in this thread for the block."""
    was, _deferral.making = making(), mode
    try:
        yield
    finally:
        _deferral.making = was


def waited_for_cpus(tasks: str = "/proc/self/task") -> float | None:
    """Seconds this process's threads have spent runnable but off a CPU, waiting while another
    task held it: the run-queue delay of each thread's ``schedstat``, summed (a thread that ended
    takes its seconds with it); None where the kernel does not say (no schedstats, not Linux).
    What a measurement beside a neighbour loses, to the nanosecond, on any thread of the process
    (an OpenMP worker preempted at a barrier too): timing a convolution 6 times at 2 threads on
    this 2-core AMD EPYC, 0.0-0.01 of the wall time on the runs that took 2.5-2.8 ms, 1.4-4.7 on
    those beside other work (6-840 ms)."""
    total = 0
    try:
        names = os.listdir(tasks)
    except OSError:
        return None
    for name in names:
        try:
            with open(f"{tasks}/{name}/schedstat") as file:
                total += int(file.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9 if names else None


PERIOD = 0.25
"""Seconds between two readings of the CPUs' use (a reading costs about 0.1 ms)."""
SLACK = 0.25
"""A thread is used where 1 - SLACK of a CPU is free: 2 threads of 2 CPUs need 1.75 free."""


class AtMost(int):
    """``CpuAcc.threads`` as ``SessionOptions.intra_op_num_threads`` gives it: at most this many
    threads, fewer while other processes hold the CPUs (``governor(most)``). An int, so that it
    compares, prints and conflicts as the count it is."""

    __slots__ = ()


def thread_setting(value: Any) -> int | None:
    """``CpuAcc.threads`` as a fixed thread count, or None for the policy ("auto", None or 0, what
    ``SessionOptions.intra_op_num_threads=0`` gives; an ``AtMost``, whose count ``ceiling``
    says; ``AtMost(1)`` is 1, fixed); an OptionError for anything else."""
    if value is None or value == AUTO or (isinstance(value, int) and value == 0):
        return None
    if isinstance(value, AtMost):  # a ceiling of one thread is one thread: nothing to govern
        return None if value > 1 else thread_setting(int(value))
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str) and value.isdigit() and int(value) > 0:
        return int(value)
    raise OptionError(f"CpuAcc.threads {value!r} is neither {AUTO!r} (the default: fewer threads "
                      f"while other processes hold CPUs) nor a positive thread count")


def ceiling(value: Any) -> int | None:
    """The governor's most threads for ``CpuAcc.threads``: an ``AtMost``'s count; None for "auto"
    (torch's count) and for a fixed count (no governor)."""
    return int(value) if isinstance(value, AtMost) and value > 1 else None


@dataclass(frozen=True)
class Sample:
    """One reading: the clock, this process's CPU seconds (all its threads), and the idle and
    total ticks of the CPUs it may use."""

    wall: float
    own: float
    idle: int
    total: int


def read_sample(cpus: frozenset[int], stat: str = "/proc/stat") -> Sample | None:
    """Now's reading, or None where the kernel does not say (no ``/proc/stat``)."""
    try:
        with open(stat) as file:
            text = file.read()
    except OSError:
        return None
    idle = total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(field) for field in rest.split()[:8]]  # user .. steal; guest is in user
        idle += ticks[3] + ticks[4]  # idle, iowait
        total += sum(ticks)
    return Sample(time.perf_counter(), time.process_time(), idle, total)


def free_cpus(before: Sample, after: Sample, cpus: int) -> float:
    """The CPUs this process could have had between two readings: the idle ones and its own."""
    wall, ticks = after.wall - before.wall, after.total - before.total
    if wall <= 0 or ticks <= 0:
        return float(cpus)
    idle = cpus * (after.idle - before.idle) / ticks
    own = (after.own - before.own) / wall
    return min(float(cpus), idle + own)


def choose(free: float, most: int) -> int:
    """The threads for ``free`` CPUs: the largest of ``most``, half of it, a quarter, ... 1 that
    ``free`` holds (few counts: a compiled OneDnnGraph is kept per count, ``CompiledPerThreads``)."""
    count = most
    while count > 1 and count > free + SLACK:
        count //= 2
    return max(1, count)


_APPLIED = threading.local()
"""In each thread, the governor that last applied its count (``by``) and the count (``threads``):
two sessions of different ceilings called from one thread each set theirs again."""


def quiet_count() -> int:
    """The calling thread's torch threads on a quiet machine: the ceiling of the governor that set
    its count (it may hold fewer now), else torch's count.

    Why: ``small.fewer_threads`` compares the counts up to this. Compared up to the moment's
    count, a partition's threads chosen while the governor held one thread were no choice (one
    count), and it then ran at the governor's two once the machine was quiet again: a default
    session with ``CpuAcc.inductor`` auto chose so at its first calls after the compile, whose g++
    the governor had read as other processes' (gpt_causal_ts15 at 2 threads, 0.3 -> 0.5 ms a run
    in the seventeenth session's bench; issue 27)."""
    import torch

    count = torch.get_num_threads()
    by = getattr(_APPLIED, "by", None)
    if by is not None and getattr(_APPLIED, "threads", None) == count:  # the governor's count
        return max(count, by.most)
    return count


class ThreadGovernor:
    """Sets torch's threads to ``choose(free_cpus(...))`` every ``period`` seconds of calls:
    ``most`` while the CPUs it fits on (at most the affinity's) are free, fewer while others hold
    them."""

    def __init__(self, most: int, cpus: frozenset[int],
                 read: Callable[[frozenset[int]], Sample | None] = read_sample,
                 apply: Callable[[int], None] | None = None, period: float = PERIOD) -> None:
        self.most = self.threads = most
        self.cpus, self.read, self.period = cpus, read, period
        self.apply = apply or _set_torch_threads
        self.decisions: dict[int, int] = {}
        """How many readings chose each thread count (what the bench prints)."""
        self._last = read(cpus)
        self._due = time.perf_counter() + period
        self._lock = threading.Lock()

    def tick(self) -> None:
        """Before a call: read the CPUs' use if due, and give this thread the current count."""
        if time.perf_counter() >= self._due:
            self.update()
        if getattr(_APPLIED, "by", None) is not self or _APPLIED.threads != self.threads:
            self.apply(self.threads)
            _APPLIED.by, _APPLIED.threads = self, self.threads

    def update(self) -> None:
        with self._lock:
            self._due = time.perf_counter() + self.period
            sample = self.read(self.cpus)
            if sample is not None and self._last is not None:
                fits = max(1, min(self.most, len(self.cpus)))
                count = choose(free_cpus(self._last, sample, len(self.cpus)), fits)
                self.threads = self.most if count == fits else count  # quiet: the count given
                self.decisions[self.threads] = self.decisions.get(self.threads, 0) + 1
            self._last = sample

    def hold_most(self) -> None:
        """This thread at the full count (a load measures its routes, and keys their cache, at
        the count a quiet machine runs with); the next call's tick applies the decision again."""
        self.apply(self.most)
        _APPLIED.by, _APPLIED.threads = self, self.most


def fixed(count: int) -> None:
    """torch's threads at a fixed count (``CpuAcc.threads=N``, a session's one thread): this
    thread's count is then no governor's, so ``quiet_count`` reads no ceiling of another session
    (a governor that had last applied the same count left its mark: a one-thread session's builds
    were then compared up to that governor's two and wrapped for nothing, a Python frame a call)."""
    import torch

    torch.set_num_threads(count)
    _APPLIED.by = None


def _set_torch_threads(count: int) -> None:
    import torch

    torch.set_num_threads(count)


_GOVERNOR: ThreadGovernor | None = None
_CEILINGS: dict[int, ThreadGovernor] = {}
"""The governors of the counts sessions gave (``AtMost``), one per count."""
_MADE = threading.Lock()


def governor(most: int | None = None) -> ThreadGovernor:
    """The process's governor (torch's threads are the process's), made at the first "auto" load:
    at most torch's thread count then, and the CPUs of the process's affinity; with ``most`` (a
    session's count, ``AtMost``) that count's governor."""
    global _GOVERNOR
    with _MADE:
        if most is None and _GOVERNOR is not None:
            return _GOVERNOR
        if most is not None and most in _CEILINGS:
            return _CEILINGS[most]
        cpus = frozenset(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                         else range(os.cpu_count() or 1))
        if most is not None:
            _CEILINGS[most] = ThreadGovernor(most, cpus)
            return _CEILINGS[most]
        import torch

        _GOVERNOR = ThreadGovernor(max(1, min(torch.get_num_threads(), len(cpus))), cpus)
        return _GOVERNOR


class Governed(Wrapper):
    """A CpuAcc workload whose calls (and profiled calls) tick the governor first; its other
    attributes (``exclusive``, ``destroy``, ``relayouts``, ...) are the workload's."""

    __slots__ = ("work", "governor")

    def __init__(self, work: Workload, governor: ThreadGovernor) -> None:
        self.work, self.governor = work, governor

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        governor = self.governor  # tick's test in line: a frame less per call (the call's floor)
        if time.perf_counter() >= governor._due or getattr(_APPLIED, "by", None) is not governor \
                or _APPLIED.threads != governor.threads:
            governor.tick()
        return self.work(*inputs)

    def __getattr__(self, name: str) -> Any:
        found = super().__getattr__(name)
        if name == "profiled":
            return functools.partial(_ticked, self.governor, found)
        if name == "keyed":  # a Specialized layer's call by NumPy shapes: the direct run's
            return _keyed_ticking(self.governor, found)  # (without a tick there, none ran)
        return found


def _ticked(governor: ThreadGovernor, call: Callable[..., Any], *inputs: Any) -> Any:
    governor.tick()
    return call(*inputs)


def _keyed_ticking(governor: ThreadGovernor, keyed: Callable[..., Any]) -> Callable[..., Any]:
    """``keyed`` (``specialize``'s call by the inputs' NumPy shapes) ticking ``governor`` first, as
    ``Governed.__call__`` does: the direct run of a network that is one Specialized layer calls
    this, not the workload (the full tier's yolo_v8 at "auto" beside a 2-thread torch process ran
    at 2 threads, 1.1-1.7 s a run against 15 ms quiet, its governor never having read the
    machine; ticked, it ran at 1 thread, 145-250 ms, ONNX Runtime 217-325, load 4-7)."""
    def keyed_ticked(shapes: tuple[Any, ...], *values: Any) -> tuple[Any, ...]:
        if time.perf_counter() >= governor._due or getattr(_APPLIED, "by", None) is not governor \
                or _APPLIED.threads != governor.threads:
            governor.tick()
        return keyed(shapes, *values)

    return keyed_ticked
