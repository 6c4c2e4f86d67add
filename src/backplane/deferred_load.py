"""A default session that returns before torch is imported: CpuAcc built in the background.

Importing torch is most of a cold session's time (1.5-3.7 s on a 2-core AMD EPYC, against
0.3-0.5 s for the rest of ``import backplane`` and the load; ONNX Runtime's session, imported and
loaded, 0.06-0.2 s: issue 27, item 5). So a session given no backends, in a process that has not
imported torch, on a machine with no GPU device, loads the model on the backends that need no
torch (CpuRef) and returns; a background thread imports torch and loads the same model, with the
same options, as a session given the default backends (CpuAcc, CpuRef) would. The first run
(or a read of the placement: ``report``, ``get_providers``) waits for that load and takes it over
(``adopt``): every run, the first included, runs on what
the default session would have run, and its outputs are that session's. The torch import is then
paid by the first run instead of the load (the caller's code between the two overlaps it), and a
failed background load leaves the CpuRef session running, with a warning saying why (so does a
fork during the load, in the child: ``_forked``).

A run does not take the CpuRef session while the build is under way: CpuRef runs the demo model in
0.6 s a call here, a model of the full tier in seconds, where the build is done in 1.5-3 s; a run
that waited is never slower than the session that loaded at once. ``DEFAULT`` False (the tests'
conftest) loads as before. What is not deferred: a backend list given, provider options, a
Runtime given, an artifact or a compile cache, profiling, a model that is not a file, torch
imported already (then the load takes 0.06 s), a GPU device present (GpuAcc may come first).

Nor is torch imported at all where the session needs none (``later``): a model whose default
session ran on no backend of torch's here before (the route cache remembers it: ``remember``)
loads on CpuRef alone, and a model CpuAcc would run whole in backplane's C runs that plan on NumPy
arrays (``backplane.torch_free``) until a run needs more.
"""

from __future__ import annotations

import atexit
import contextvars
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

log = logging.getLogger("backplane.session")

DEFAULT = True
"""Whether a default session defers its torch backends where it may (the module's docstring)."""

TORCH_BACKENDS = ("GpuAcc", "CpuAcc")
_GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Device nodes of the drivers torch's CUDA (or ROCm) builds use: with none, GpuAcc cannot run."""


def deferrable(model: Any, given: dict[str, Any], profiling: bool) -> tuple[str, ...] | None:
    """The default backends (``CpuAcc``, ``CpuRef``) where this session's load may leave them to the
    background, else None (the session takes ``default_backends()`` as before). ``given``: the
    session's arguments that turn it off (provider_options, runtime, cache_dir, pins), None where
    absent."""
    from backplane.backends.registry import registry

    if not DEFAULT or "torch" in sys.modules or profiling or any(v is not None for v in
                                                                     given.values()):
        return None
    if not isinstance(model, (str, os.PathLike)) or os.environ.get("BACKPLANE_COMPILE_CACHE"):
        return None
    if importlib.util.find_spec("torch") is None or any(map(os.path.exists, _GPU_DEVICES)):
        return None
    if any(not registry.is_registered(b) or registry.origin(b) != "built in"
           for b in TORCH_BACKENDS):
        return None  # a backend registered in their place: it says itself what it needs
    return ("CpuAcc", "CpuRef")


def later(session: Any, make: Callable[[], Any], model: str | os.PathLike[str]) -> Any:
    """The session's stand-in for the default backends' load: None where the default session of
    this model file ran on no backend of torch's here before (``remembered``: the session stays on
    CpuRef), ``torch_free.TorchFree`` where its model may run natively without torch (torch
    imported only where a run needs it), else the load begun in the background now (``Later``)."""
    from backplane import torch_free
    from backplane.optimizer.optimize import OptimizerOptions, _run_passes

    if remembered(session, model):
        return None
    network = session._optimized
    if session._overrides is None and not any(
            layer.op_type in ("If", "Loop", "Scan") for layer in session.graph.layers):
        graph = session.graph.private_copy()  # as the default session's optimizer has it
        _run_passes(graph, network.options or OptimizerOptions())
        if torch_free.candidate(graph, session.backend_options):
            return torch_free.TorchFree(graph, session.backend_options, make)
    return Later(make)


def remembered(session: Any, model: str | os.PathLike[str]) -> bool:
    """Whether the route cache says the default session of ``model`` with these options ran on no
    backend of torch's (``remember``); else the key to remember it by is set on ``session``.
    Why: a control-flow model that CpuAcc runs slower than CpuRef (cond_nested_dyn18,
    loop_scripted_ts16: ``against_cpu``) imported torch (2.4-3.2 CPU s here) only to be timed
    against CpuRef and dropped, at every session's load. Not with ``CpuAcc.route_cache`` False."""
    from backplane.backends.torch import route_cache

    if not session.backend_options.get("CpuAcc.route_cache", True):
        return False
    key = route_cache.placement_key(model, session.backend_options)
    if key is not None and route_cache.lookup(key) == route_cache.WITHOUT_TORCH:
        log.info("this model's default session ran on no backend of torch's on this machine "
                 "before (the route cache): it loads on %s alone",
                 ", ".join(session._optimized.report.preferences))
        return True
    session._placement_key = key
    return False


def remember(session: Any) -> None:
    """A default session whose placement is settled (timed against CpuRef at load or at its first
    run, or never timed) and has no layer on a backend of torch's: remembered by its key."""
    from backplane.backends.torch import route_cache

    key = getattr(session, "_placement_key", None)
    if key is None or session._against_cpu is not None:
        return
    session._placement_key = None
    if not any(b in session._optimized.report.counts() for b in TORCH_BACKENDS):
        route_cache.store(key, route_cache.WITHOUT_TORCH)


BRIDGE_SECONDS = 0.25
"""A run on the session's own backends (CpuRef) while the load is under way (``Later.bridged``)
that took longer ends the bridging: such runs take CPU from the load they wait for."""


class _LoadDone(Exception):
    """A bridged run stopped between two layers: the load it bridged is done."""


class Later:
    """The background load of one session (``make``: the session on the full backend list),
    taken over by the session at a run once done (``adopt``) or dropped with it (``cancel``).
    Until then a run takes the session's own network (``bridged``: CpuRef), stopped between two
    layers where the load is done first (it then runs on the load's)."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.made: Any = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.feeds: dict[str, Any] | None = None  # a first run's, run by the build once made
        self.bridge = True  # runs take the session's own network until the load is done
        self.bridging = 0  # such runs under way: the runtime they run on is closed after them
        self.closing: Any = None
        self.lock = threading.Lock()
        self.done = threading.Event()
        context = contextvars.copy_context()  # the loader's scopes (log, cache) in its build
        self.thread = threading.Thread(target=context.run, args=(self._build, make),
                                       name="backplane-deferred-load", daemon=True)
        _PENDING.add(self)
        self.thread.start()

    def _build(self, make: Callable[[], Any]) -> None:
        try:
            made = make()
            if self.feeds is not None and not self.cancelled and made._against_cpu is None \
                    and not made._builds_at_run:  # what those time at a first run: the caller's
                self._first_run(made, self.feeds)
        except BaseException as exc:  # noqa: BLE001  # the CpuRef session runs on: say why
            self.error = exc
            (log.debug if self.cancelled else log.warning)(
                "the default backends' load in the background failed (%s: %s): the session runs "
                "on CpuRef", type(exc).__name__, exc)  # cancelled: no session will run
            made = None
        with self.lock:
            if self.cancelled and made is not None:
                made.close()
                made = None
            self.made = made
        self.done.set()
        _PENDING.discard(self)

    @staticmethod
    def _first_run(made: Any, feeds: dict[str, Any]) -> None:
        """The built session's first run, here: what it leaves to a first run (oneDNN Graph's
        compile, ``at_first_run``: 0.2-0.5 s of the demo's) is not paid by the caller's run that
        takes it over. Its outputs are dropped; an error is the caller's run's to raise. Not
        where a run builds (Specialized: ``small.fewer_threads`` reads the running thread's
        count, and a build here kept yolo_v8_ts17 off one thread in the caller's: 1.74-1.85 ms
        a run against 1.39-1.48 at load 7.4-8.6) or times a placement (``against_cpu``)."""
        try:
            made.run(None, feeds)
        except Exception as exc:  # noqa: BLE001
            log.debug("the background load's first run failed (%s: %s)", type(exc).__name__, exc)

    def warm(self, feeds: Mapping[str, Any]) -> None:
        """Feeds the build runs once it is made (the first given, copied: the caller's arrays
        are its own again when its run returns), while runs bridge the load. NumPy arrays only
        (a tensor on a device is not copied here)."""
        if self.feeds is None and not self.done.is_set() and all(
                type(value) is np.ndarray for value in feeds.values()):
            self.feeds = {name: value.copy() for name, value in feeds.items()}

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    def bridged(self, session: Any, feeds: Mapping[str, Any]) -> list[Any] | None:
        """The outputs of ``feeds`` on the session's own network (CpuRef) while the load is under
        way; None where the load is done first (the run stopped between two layers), the bridge
        is off (a run took longer than ``BRIDGE_SECONDS``, or failed) or does not apply (an
        input's default fed). The feeds go to the load's first run (``warm``)."""
        import time

        from backplane.runtime.steps import STOP

        with self.lock:
            if not self.bridge or self.done.is_set() or session._later is not self or \
                    session._overrides is not None or session._against_cpu is not None:
                return None
            self.bridging += 1
            runtime, network_id = session.runtime, session.network_id
        started, token = time.perf_counter(), STOP.set(self._stop)
        try:
            self.warm(feeds)
            return runtime.run(network_id, feeds)
        except _LoadDone:
            return None
        except Exception as exc:  # noqa: BLE001  # the load's session runs it, and says why
            log.debug("a run bridging the load failed (%s: %s)", type(exc).__name__, exc)
            self.bridge = False
            return None
        finally:
            STOP.reset(token)
            self._bridged(time.perf_counter() - started)

    def _stop(self) -> None:
        if self.done.is_set():
            raise _LoadDone

    def _bridged(self, took: float) -> None:
        """A bridged run ended: the runtime it ran on closed where the session let go of it."""
        with self.lock:
            self.bridging -= 1
            self.bridge = self.bridge and took <= BRIDGE_SECONDS
            closing = self.closing if not self.bridging else None
            if closing is not None:
                self.closing = None
        if closing is not None:
            closing.close()

    def adopt(self, session: Any, feeds: Mapping[str, Any] | None = None) -> list[Any] | None:
        """Outputs of ``feeds`` while the load is under way (``bridged``), or wait for the build;
        then ``session`` takes the built session's state (its runtime, network, report), its own
        runtime closed (after the bridged runs on it), and None (the run goes on with it).
        Where the build failed it keeps its own."""
        if feeds is not None and not self.done.is_set():
            outputs = self.bridged(session, feeds)
            if outputs is not None:
                return outputs
        self.done.wait()
        with self.lock:
            if session._later is not self:  # another thread took it over first
                return
            made, self.made = self.made, None
            if made is None:
                session._later = None
                session._update_fast_path()
                return
            old, own = session.runtime, session._own_runtime
            state = dict(vars(made))
            state["_later"] = None
            vars(session).update(state)
            made._closed = True  # its runtime is the session's now: nothing to close twice
            if own and self.bridging:
                self.closing, own = old, False  # the last bridged run closes it
        _threads_here(session.backend_options)
        if own:
            old.close()
        remember(session)
        session._update_fast_path()
        return None

    def cancel(self) -> None:
        """The session closed before its first run: the build, when done, is closed too."""
        with self.lock:
            self.cancelled = True
            made, self.made = self.made, None
        if made is not None:
            made.close()


def _threads_here(options: dict[str, Any]) -> None:
    """A count of threads given (``CpuAcc.threads``) set in the thread that takes the build over:
    torch's count is per thread, and the background thread's setting stays in it."""
    from backplane.backends.torch import threads as policy

    count = policy.thread_setting(options.get("CpuAcc.threads"))
    if count:
        import torch

        torch.set_num_threads(count)


_PENDING: set[Later] = set()


def pending() -> int:
    """How many background loads are not done."""
    return len(_PENDING)


def wait(timeout: float | None = None) -> bool:
    """Block until every background load is done (True), or ``timeout`` seconds pass (False).
    A load does not wait for itself: its session times a control-flow model against CpuRef at
    load (``against_cpu``), which waits for the background (``background.settle``) twice, and
    cond_nested_dyn18's first output came after 130 s (60 s a wait), 3.1 CPU s of it."""
    import time

    end = None if timeout is None else time.perf_counter() + timeout
    free = sys.modules.get("backplane.torch_free")  # its static builds first: one may start a load
    for built in list(free.BUILDING) if free is not None else ():
        if built.thread is not threading.current_thread() and not built.ready.wait(
                None if end is None else max(0.0, end - time.perf_counter())):
            return False
    for later in [p for p in list(_PENDING) if p.thread is not threading.current_thread()]:
        left = None if end is None else max(0.0, end - time.perf_counter())
        if not later.wait(left):
            return False
    return True


def _at_exit() -> None:
    """A process that exits during a background load waits for it (torch must not be importing
    or inside a call while the interpreter finalizes). Before the atexit functions
    (``threading._register_atexit``, where this Python has it; a thread not a daemon may still
    run the session after): ``weakref.finalize``'s closed the build's Runtime under it, and a
    script that loaded a model and exited without a run printed the warning of a failed load."""
    wait(60.0)


atexit.register(_at_exit)  # and after: a load that a thread not a daemon began after the first
try:
    threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another Python; or imported while the process exits
    pass


def _forked() -> None:
    """In a child forked during a background load: the thread that made it is not here, and an
    import it held (torch's) would never finish, so each such load is failed, the session running
    on CpuRef with the warning; one done before the fork is taken over as in the parent."""
    free = sys.modules.get("backplane.torch_free")
    for built in list(free.BUILDING) if free is not None else ():  # built again at a first run
        built.lock = threading.Lock()
        built.ready.set()
        free.BUILDING.discard(built)
    for later in list(_PENDING):
        later.lock = threading.Lock()  # the locks the thread may have held
        if not later.done.is_set():
            later.made, later.error = None, RuntimeError("the process forked during the load")
            log.warning("a default session's load was in the background when the process "
                        "forked: in the child the session runs on CpuRef")
        later.done = threading.Event()
        later.done.set()
    _PENDING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _forked())  # looked up at each fork
