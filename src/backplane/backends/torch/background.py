"""CpuAcc's loads without waiting: measured and compiled in a background thread, swapped in.

What makes a CpuAcc load slow is what makes its runs fast: each convolution's and linear's route
timed on a sample (``fusion.patterns.fastest``), and each subgraph traced and compiled by oneDNN
Graph or TorchScript, then timed against its layers (``onednn_graph``, ``traced``). The demo model's
session took 0.3-0.5 s so on a quiet 2-core machine and 5-9 s while other jobs kept it busy, where
ONNX Runtime's takes 0.02-0.03 s; a compile whose route the cache remembers still compiled at load
(issue 27, item 5).

So a load with ``CpuAcc.background`` True (off by default: see ``DEFAULT``) makes each such workload as a busy machine
would, at once: the first route, the layers one by one (``threads.deferring``). Each of those
stand-ins is marked ``deferred``; ``deferred`` wraps it in a ``Swapped`` and queues the real make
for one background thread per process, which measures and compiles as a quiet load would and
swaps the result in between two runs. A run reads the workload once per call, so a run is whole:
all stand-in or all compiled. Where a run of that network shared the CPUs with the measuring, the
routes measured are used but not written to the route cache (``route_cache.held``): a route measured
under noise is not kept for good.

``wait`` blocks until the queue is done (the CLI and the bench call it before they time runs).
A process that exits stops the thread between two jobs (``atexit``), never inside torch.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from backplane.backends.api.backend import Workload

log = logging.getLogger("backplane.torch")

DEFAULT = False
"""``CpuAcc.background``'s default. Off: what the background thread measures is not what the
loading thread will run. OpenMP gives each thread its own team, and the background's runs beside
the loading thread's spinning one: on the corpus's layout_hswish_ts11 it measured oneDNN's
convolution route faster (0.047 against torch's 0.059 ms) where the loading thread runs torch's
in 0.011 against 0.031, and the model then ran at 4.64 ms against 2.38 measured at load (yolo_v8_ts17
4.18 against 1.72; 2 threads, this 2-core AMD EPYC at load 1.4). Until the timing is done in the
loading thread, a load that does not wait is an option (True), for a busy machine's first
seconds."""


class Swapped:
    """A workload whose work the background replaces; its other attributes are the work's."""

    __slots__ = ("work", "calls", "__weakref__", "__dict__")  # attributes set on it stay its own

    def __init__(self, work: Workload) -> None:
        self.work, self.calls = work, 0

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        self.calls += 1
        return self.work(*inputs)

    def __getattr__(self, name: str) -> Any:
        if name in Swapped.__slots__:  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.work, name)

    def __repr__(self) -> str:
        return f"Swapped({self.work!r})"


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
    ``make()`` made as a quiet load would."""
    import torch

    from backplane.backends.torch import threads

    with threads.deferred_scope():
        quick = make()
    if not getattr(quick, "deferred", False):
        return quick
    swapped = Swapped(quick)
    _worker().put(weakref.ref(swapped), make, name, torch.get_num_threads())
    return swapped


def pending() -> int:
    """How many queued jobs are not done yet (0: the background is idle)."""
    worker = _WORKER
    return 0 if worker is None else worker.pending


def wait(timeout: float | None = None) -> bool:
    """Block until every queued measuring and compiling is done (True), or ``timeout`` seconds
    pass (False)."""
    worker = _WORKER
    return True if worker is None else worker.idle(timeout)


class _Worker:
    """One thread that makes the queued workloads one after the other."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.pending = 0
        self.done = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="backplane-background",
                                       daemon=True)
        self.thread.start()
        atexit.register(self.stop)

    def put(self, target: weakref.ref[Swapped], make: Callable[[], Workload], name: str,
            count: int) -> None:
        with self.done:
            self.pending += 1
        self.jobs.put((target, make, name, count))

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
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                if not self.stopping:
                    _swap(*job)
            except Exception as exc:  # noqa: BLE001  # the stand-in keeps running: say why
                log.warning("CpuAcc: measuring and compiling %s in the background failed (%s: "
                            "%s); its layers run as loaded", job[2], type(exc).__name__, exc)
            finally:
                with self.done:
                    self.pending -= 1
                    self.done.notify_all()


def _swap(target: weakref.ref[Swapped], make: Callable[[], Workload], name: str,
          count: int) -> None:
    """The job: ``make()`` as a quiet load, swapped into the target if it is still loaded; the
    routes measured written to the cache only where the target ran no call meanwhile."""
    import torch

    from backplane.backends.torch import route_cache, threads

    swapped = target()
    if swapped is None:  # its network was unloaded
        return
    if threads.crowded():  # a quiet load's make would make the same stand-in
        log.info("CpuAcc: %s not measured nor compiled in the background: a busy machine", name)
        return
    calls, start = swapped.calls, time.perf_counter()
    del swapped  # not held while compiling: an unloaded network goes
    torch.set_num_threads(count)  # the loading thread's count: the cache keys routes by it
    with route_cache.held() as routes:
        work = make()
    swapped = target()
    if swapped is None:
        return
    swapped.work = work
    quiet = swapped.calls == calls
    if quiet:
        for key, route in routes.items():
            route_cache.store(key, route)
    log.info("CpuAcc: %s measured and compiled in the background in %.2f s (%s)", name,
             time.perf_counter() - start, "routes kept" if quiet else
             "its runs meanwhile: routes not kept")


_WORKER: _Worker | None = None
_STARTING = threading.Lock()


def _worker() -> _Worker:
    global _WORKER
    with _STARTING:
        if _WORKER is None:
            _WORKER = _Worker()
        return _WORKER
