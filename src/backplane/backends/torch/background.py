"""CpuAcc's loads without waiting: built in a background thread, swapped in, timed by the runs.

What makes a CpuAcc load slow is what makes its runs fast: each convolution's and linear's route
timed on a sample (``fusion.patterns.fastest``), and each subgraph traced and compiled by oneDNN
Graph or TorchScript, then timed against its layers (``onednn_graph``, ``traced``). The demo model's
session took 0.3-0.5 s so on a quiet 2-core machine and 5-9 s while other jobs kept it busy, where
ONNX Runtime's takes 0.02-0.03 s (issue 27, item 5).

So a CpuAcc load with ``CpuAcc.background`` True (off by default: see ``DEFAULT``) makes each such
workload as a busy machine would, at once: the first route, the layers one by one
(``threads.deferring``). Each of those stand-ins is marked ``deferred``; ``deferred`` wraps it in a
``Swapped`` and queues the real make for one background thread per process. That thread builds every
candidate (packs weights, traces, compiles, checks a compile against the layers: none of it depends
on the thread) and swaps the result in between two runs; a run reads the workload once per call, so
a run is whole. It times nothing: a route timed there is not the one that runs (OpenMP gives each
thread its own team; see ``trials``), so where a layer has candidates the swapped-in workload is a
``trials.Trial`` that the network's own calls time, in the thread that runs them, and that writes
its choice to the route cache only where it timed it alone on a quiet machine. On a busy machine
(``threads.crowded``) the thread builds each layer's first route, a subgraph compiled where it
compiles (oneDNN Graph's CNN partitions, traced transformers: what pays without timing;
``traced.UNTIMED_LAYERS``), untimed and kept nowhere.

``wait`` blocks until the queue is done; ``settle`` also runs a network until its routes are
chosen (the CLI and the benches call it before they time runs); ``settled`` says whether every
network's are. A process that exits stops the thread between two jobs (``atexit``), never inside
torch.
"""

from __future__ import annotations

import atexit
import logging
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from backplane.backends.api.backend import Workload
from backplane.backends.torch.wrapped import Wrapper

log = logging.getLogger("backplane.torch")

DEFAULT = False
"""``CpuAcc.background``'s default. Off: a load measures and compiles in the loading thread before
it returns (what an artifact's compile does, and what the tests' conftest sets: a test checks what a
load chose). On (True), a load does not wait, but what its runs choose is not yet as fast: the
corpus's full tier on a quiet machine (this 2-core AMD EPYC, load 1.3, 2 threads, `bench/wild.py
--tier full --rounds 1`, ms a run, on / off): gpt_causal_ts15 7.7 / 4.47, encoder4_plain_dyn18 4.75
/ 2.97, bytes_int32_dyn20 2.07 / 1.95; the small tier's lstm_bi2_ts14 0.505 / 0.338. One cause
found and mended (``trials.WATCH``): routes timed at 2 threads, then run at the one thread the
partition chose. Still slower on (the GPU machine's Intel Xeon, 2 CPUs by taskset, quiet, 2
processes each, ms a run on / off): resnet_basic_dyn21 8.2-9.2 / 4.5-5.0, gpt_causal_ts15 4.7-5.5
/ 3.4-4.7, encoder4_plain_dyn18 3.6-3.8 / 2.8-3.4; even: lstm_bi2_ts14 2.6-3.0 / 2.6-3.7,
unet_resize_dyn20 8.9 / 7.9-9.1, char_tagger_ts14 2.1 / 2.1 (a fresh process per figure)."""


class Swapped(Wrapper):
    """A workload whose work the background replaces; its other attributes are the work's."""

    __slots__ = ("work", "__weakref__", "__dict__")  # attributes set on it stay its own

    def __init__(self, work: Workload) -> None:
        self.work = work

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        return self.work(*inputs)


def wanted(backend: Any) -> bool:
    """Whether ``backend``'s loads leave their measuring to the background: its option, and never
    while routes are being kept for an artifact (``route_cache.KEPT``: its blob holds what a load
    measured)."""
    from backplane.backends.torch import route_cache

    option = backend.options.get("CpuAcc.background", DEFAULT)
    if not isinstance(option, bool):
        raise_option(option)
    return option and route_cache.KEPT.get() is None


def raise_option(value: Any) -> None:
    from backplane.backends.api.backend import OptionError

    raise OptionError(f"CpuAcc.background {value!r} is not one of True, False")


def deferred(make: Callable[[], Workload], name: str) -> Workload:
    """``make()`` made as a busy machine would; where that left something to measure or compile
    (the workload says ``deferred``), a ``Swapped`` of it, whose work the background replaces with
    ``make()`` built with every candidate (``_swap``)."""
    import torch

    from backplane.backends.torch import small, threads

    with threads.deferred_scope():
        quick = make()
    if not getattr(quick, "deferred", False):
        return quick
    swapped = Swapped(quick)
    # its threads chosen by its runs too, as a Specialized build's (``small.static``)
    _worker().put(_swap, (weakref.ref(swapped), small.static(make), name,
                          torch.get_num_threads()), name)
    return swapped


def later(job: Callable[..., None], *args: Any, name: str) -> None:
    """``job(*args)`` on the low-priority thread (``NICE``; one per process, started here): what
    may take a minute of the CPU's time, TorchInductor's compiles (``inductor_background``),
    counted by ``pending``, ``epoch`` and ``wait`` as the background's other jobs are."""
    _worker(low=True).put(job, args, name)


def pending(low: bool = True) -> int:
    """How many queued jobs are not done yet (0: the background is idle); ``low`` False: not
    counting the low-priority thread's (a compile that may take minutes, whose result is timed
    against what runs: a partition's thread count is not left waiting for it, ``small``)."""
    return sum(worker.pending for worker in _workers() if low or not worker.low)


def epoch() -> int | None:
    """A number that changes whenever a background thread starts or ends a job, or None while
    one runs (what a ``trials.Trial`` times beside it is not what the network runs alone)."""
    now = [worker.epoch for worker in _workers()]
    return None if any(e % 2 for e in now) else sum(now)


def settled() -> bool:
    """Whether the background is idle and every route it left to the runs is chosen
    (``trials.undecided``): what runs now is what will run."""
    from backplane.backends.torch import trials

    return pending() == 0 and trials.undecided() == 0


def wait(timeout: float | None = None) -> bool:
    """Block until every queued build is done and swapped in (True), or ``timeout`` seconds pass
    (False). The routes those builds left to the runs are chosen by the runs (``settled``). A
    default session's load deferred to the background (``backplane.deferred_load``) is waited for
    first: its network is taken over by its next run."""
    from backplane import deferred_load

    end = None if timeout is None else time.perf_counter() + timeout
    if not deferred_load.wait(timeout):
        return False
    for worker in _workers():  # a job of one may queue one on the other: both idle at the end
        if not worker.idle(None if end is None else max(0.0, end - time.perf_counter())):
            return False
    return pending() == 0 or wait(None if end is None else max(0.0, end - time.perf_counter()))


def settle(run: Callable[[], Any], timeout: float = 60.0) -> bool:
    """``wait``, then, unless ``settled``, ``run()`` (a run of one network: the routes left to
    its runs are timed by them) until a run calls no ``trials.Trial`` still choosing or watching
    the thread count after its choice (True: its routes are chosen, whatever other networks left
    to theirs), or ``timeout`` seconds have passed (False). What a caller that times runs calls first, so that it times what will run."""
    from backplane.backends.torch import trials

    end = time.perf_counter() + timeout
    while wait(max(0.0, end - time.perf_counter())):
        if settled():  # every network's chosen (or none left any): no run needed
            return True
        before = trials.choosing(), trials.watching()
        run()
        if (trials.choosing(), trials.watching()) == before and pending() == 0:
            return True
        if time.perf_counter() > end:
            return False
    return False


class _Worker:
    """One thread that runs the queued jobs one after the other; ``low``: at the lowest priority
    (``NICE``), which the compilers it starts inherit."""

    def __init__(self, low: bool = False) -> None:
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.pending = 0
        self.epoch = 0  # odd while a job runs: a Trial's timing spans no job (``epoch``)
        self.done = threading.Condition()
        self.stopping = False
        self.low = low
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name="backplane-inductor" if low else "backplane-background")
        self.thread.start()
        atexit.register(self.stop)

    def put(self, job: Callable[..., None], args: tuple[Any, ...], name: str) -> None:
        with self.done:
            self.pending += 1
        self.jobs.put((job, args, name, time.perf_counter()))

    def idle(self, timeout: float | None) -> bool:
        with self.done:
            return self.done.wait_for(lambda: self.pending == 0, timeout)

    def stop(self) -> None:
        """At exit: no job after the one running, which is waited for (torch must not be inside
        a call while the interpreter finalizes)."""
        self.stopping = True
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        if self.low:
            _lowest_priority()
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.low:  # the load and its first runs first (the compile's Python takes the GIL)
                time.sleep(max(0.0, job[3] + START_DELAY - time.perf_counter()))
            self.epoch += 1
            switch = sys.getswitchinterval()
            try:
                if self.low:  # a run waiting for the GIL waits SWITCH, not 5 ms, per handover
                    sys.setswitchinterval(SWITCH)
                if not self.stopping:
                    job[0](*job[1])
            except Exception as exc:  # noqa: BLE001  # the stand-in keeps running: say why
                log.warning("CpuAcc: building %s in the background failed (%s: %s); "
                            "its layers run as loaded", job[2], type(exc).__name__, exc)
            finally:
                sys.setswitchinterval(switch)
                self.epoch += 1
                with self.done:
                    self.pending -= 1
                    self.done.notify_all()


NICE = 19
"""The low-priority thread's nice value (Linux: a thread's own; the compilers it starts inherit
it): its compiles take what CPU time the runs and the machine's other work leave."""


START_DELAY = 3.0
"""Seconds from a low-priority job's queueing to its start: begun at once, inductor's compile took
the GIL from the rest of the load and the first run (``bench/wild.py``'s first call of the small
tier's gpt_causal_ts15 in a default session: 7.96-8.62 s beside it, 1.04 s without)."""
SWITCH = 0.0002
"""Python's switch interval (seconds) while the low-priority thread runs a job: inductor's Python
holds the GIL for stretches, and a run that released it (in torch) waits a whole interval to take
it back, 5 ms by default: the small tier's gpt_causal_ts15 at 2 threads ran 4.76 ms a call beside
its compile (``bench/wild.py``, load 9.7) where it runs in 0.37."""


def _lowest_priority() -> None:
    """The calling thread (and what it starts) at ``NICE``; where the system has no per-thread
    priority, as it is."""
    import os

    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
    except (AttributeError, OSError):  # not Linux: the thread keeps its priority
        pass


def _swap(target: weakref.ref[Swapped], make: Callable[[], Workload], name: str,
          count: int) -> None:
    """The job: ``make()`` with every candidate built and none timed, swapped into the target if
    it is still loaded. Its layers' routes are then timed by the network's own calls
    (``trials``); on a busy machine each layer takes its first route, a subgraph compiled where
    it compiles, untimed and kept nowhere."""
    import torch

    from backplane.backends.torch import threads

    if target() is None:  # its network was unloaded
        return
    mode = threads.UNTIMED if threads.crowded() else threads.TRIALS
    start = time.perf_counter()
    torch.set_num_threads(count)  # the loading thread's count: the cache keys routes by it
    with threads.making_scope(mode):
        work = make()
    swapped = target()
    if swapped is None:
        return
    swapped.work = work
    log.info("CpuAcc: %s built in the background in %.2f s (%s)", name,
             time.perf_counter() - start, "a busy machine: first routes, untimed, not kept"
             if mode == threads.UNTIMED else "its routes timed by its runs")


_WORKER: _Worker | None = None
_LOW: _Worker | None = None
_STARTING = threading.Lock()


def _worker(low: bool = False) -> _Worker:
    global _WORKER, _LOW
    with _STARTING:
        if low:
            if _LOW is None:
                _LOW = _Worker(low=True)
            return _LOW
        if _WORKER is None:
            _WORKER = _Worker()
        return _WORKER


def _workers() -> list[_Worker]:
    return [worker for worker in (_WORKER, _LOW) if worker is not None]
