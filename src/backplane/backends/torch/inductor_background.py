"""``CpuAcc.inductor``: a transformer's Traced subgraph compiled by TorchInductor in the background
and swapped in where the network's own runs time it faster (issue 27).

Why: inductor's C++ (``inductor.py``) runs the transformer traces in 0.62-0.88 of the frozen
trace's time at 1 thread on this project's AVX2 EPYC, but compiles for 20-100 s a subgraph, so
``CpuAcc.compile=inductor`` (compiled at load) is opt-in. Here a default load (``CpuAcc.compile``
auto) returns with its own route, and each Traced subgraph without convolutions or recurrent
layers (``inductor.CONVOLUTIONS``, ``RECURRENT``) computing in float32 is queued for a
background thread at the lowest priority (``background.later``, ``background.NICE``: the
compiler processes inherit it) that compiles it, checked against its layers on a sample as
``CpuAcc.compile=inductor`` does. The compiled code then joins the running route in a
``Timed`` trial: its first call runs both on the caller's inputs and keeps the running route for
good where their outputs differ by more than the trace's check allows; then the network's own
calls alternate the two, each timed in the calling thread's CPU time (at one thread; wall time at
more, where the other threads' work counts), and the faster by median runs from then on. The
verdict goes to the route cache (keyed by the subgraph's shapes and the thread count, as the
trace's routes are) where the machine was not crowded (``threads.crowded``): the next load
compiles only a subgraph whose verdict was inductor, and swaps it in untimed, or compiles
nothing. A float input holding NaN or an infinity runs the running route (``inductor._finite_or``).

Values of ``CpuAcc.inductor`` (``MODES``): "auto" (the above), "off" (no compile; ``DEFAULT``),
"swap" (compiled in the background and swapped in after the first call's check, untimed: where
the user has measured, and the tests). With no C++ compiler nothing is compiled (said once, in
the log). ``background.wait`` and ``settle`` wait for the compiles and the timing: a bench that
settles first times what will run.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from backplane.backends.api.backend import OptionError, Workload
from backplane.backends.torch import trials
from backplane.backends.torch.background import Swapped
from backplane.ir.graph import Layer, TensorInfo

log = logging.getLogger("backplane.torch")

MODES = ("auto", "off", "swap")
DEFAULT = "off"
"""``CpuAcc.inductor``'s default: "off" until the swap's verdict holds at two threads. The
seventeenth session's final bench (``bench/wild.py``, 2 threads, quiet 2-core AMD EPYC, one
round each, the same tree with and without a C++ compiler) read gpt_causal_ts15 0.306 -> 0.533
ms and char_tagger_ts14 0.792 -> 1.73 with it on, encoder_padmask_dyn17 0.267 -> 0.232, where
its 1-thread thread-CPU figures had gained 0.83-0.84 (the tests' conftest sets "off" too). The
cause found: the Specialized build's threads were chosen at its first calls after the compile,
while the thread governor held one thread (its reading spanned the compile's g++), so the build ran
unwrapped at two once the machine was quiet (``threads.quiet_count`` mends it); a quiet 2-thread
run of ``bench/wild.py --inductor auto`` against ``off`` decides the default."""
KIND = "inductor"
"""The route cache's kind of a verdict: "inductor" or "own"."""
MARGIN = 0.9
"""Inductor's code is taken where its median time is below this share of the running route's: 7
calls each on a busy machine tell 10 % apart, not less. ``encoder_padmask_dyn17``'s two routes
timed within 1 % (0.443 against 0.444 ms, load 7.5) and inductor's was swapped in on that tie; the
whole runs after, old tree against new, one process each, read 0.189 -> 0.291 ms (thread CPU, load
7), though an A/A of two default sessions in one process differed by 1.23 there too: the tie is
no gain either way. ``gpt_causal_ts15``'s took 0.83 of the trace's time, ``char_tagger_ts14``'s
0.84 (the full tier)."""
MEASURE: Callable[[str, float], float] | None = None
"""A test's hook on each timed call (the candidate's name, its seconds -> the seconds counted):
the verdict forced without a measurement at load."""

_said_missing = False


def mode(options: Any) -> str:
    value = options.get("CpuAcc.inductor", DEFAULT)
    if value not in MODES:
        raise OptionError(f"CpuAcc.inductor {value!r} is not one of {', '.join(MODES)}")
    return value


def workloads(own: dict[str, Callable[..., Workload]],
              options: Any) -> dict[str, Callable[..., Workload]]:
    """``own`` with its Traced workloads queued for inductor where ``CpuAcc.inductor`` says
    (only under ``CpuAcc.compile`` auto: another value is the user's choice of route)."""
    if mode(options) == "off" or options.get("CpuAcc.compile", "auto") != "auto":
        return own
    traced = own["Traced"]
    return {**own, "Traced": lambda layer, backend, inputs: queued(layer, backend, inputs,
                                                                    traced)}


def queued(layer: Layer, backend: Any, inputs: Sequence[TensorInfo],
           own: Callable[..., Workload]) -> Workload:
    """``own``'s workload, in a ``Swapped`` whose work a background compile replaces where the
    subgraph is inductor's kind (``wanted``) and the route cache says nothing against it."""
    import torch

    from backplane.backends.torch import background, route_cache

    work = own(layer, backend, inputs)
    if not wanted(layer, backend):
        return work
    count = torch.get_num_threads()
    key = route_cache.key(KIND, _description(layer), count)
    verdict = route_cache.lookup(key) if backend.options.get("CpuAcc.route_cache", True) else None
    if verdict == "own":
        return work
    swapped = Swapped(work)
    untimed = verdict == KIND or mode(backend.options) == "swap"
    background.later(_compile, weakref.ref(swapped), layer, backend, list(inputs), count,
                     not untimed, name=f"{layer.name} (TorchInductor)")
    return swapped


def wanted(layer: Layer, backend: Any) -> bool:
    """Whether the subgraph is compiled: float32, no convolution or recurrent layer, not a
    stand-in a background build replaces (``threads.deferring``), no artifact's routes being kept
    (``route_cache.KEPT``), and a C++ compiler here."""
    from backplane.backends.torch import inductor, route_cache, threads

    if layer.attrs.get("compute") is not None or inductor._convolutions(layer):
        return False
    if threads.deferring() or route_cache.KEPT.get() is not None:
        return False
    missing = _compiler_missing()
    if missing:
        global _said_missing
        if not _said_missing:
            _said_missing = True
            log.info("CpuAcc: no TorchInductor compile in the background: %s", missing)
        return False
    return True


def _compiler_missing() -> str:
    """Why inductor would find no C++ compiler here ("" where one is on the PATH): looked up
    without importing inductor (``inductor.compiler`` does, which took 6-7 s of a default
    session's first run on the busy machine; the compile itself checks it again)."""
    import os
    import shutil

    names = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++", "clang++"]
    if any(shutil.which(name) for name in names):
        return ""
    return f"no C++ compiler ({', '.join(names)}) on the PATH"


def _description(layer: Layer) -> dict[str, Any]:
    return {"traced": layer.attrs["shapes"], "layers": [lay.op_type for lay in
                                                        layer.attrs["layers"]]}


def _compile(target: weakref.ref[Swapped], layer: Layer, backend: Any,
             inputs: list[TensorInfo], count: int, timed: bool) -> None:
    """The job (on the low-priority thread): the subgraph compiled for ``count`` threads and
    swapped in as a ``Timed`` trial against the running route, or (not ``timed``) alone after its
    first call's check."""
    import resource

    import torch

    from backplane.backends.torch import inductor, route_cache

    if target() is None:  # its network was unloaded
        return
    torch.set_num_threads(count)
    start, cpu = time.perf_counter(), time.thread_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with warnings.catch_warnings(), torch._inductor.config.patch({"compile_threads": 1}):
        warnings.simplefilter("ignore")
        try:
            compiled = inductor.compile_partition(layer, backend, inputs)
        except Exception as error:  # noqa: BLE001  # the running route stays: say why
            log.info("CpuAcc: TorchInductor could not compile %s (%s: %s); it keeps its route",
                     layer.name, type(error).__name__, str(error).splitlines()[0][:200]
                     if str(error) else "")
            compiled = None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    compilers = after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
    swapped = target()
    if swapped is None:
        return
    if compiled is None:
        if timed and backend.options.get("CpuAcc.route_cache", True):  # so at every load
            route_cache.store(route_cache.key(KIND, _description(layer), count), "own")
        return
    running = swapped.work
    fast = inductor._finite_or(compiled, lambda: running)
    swapped.work = Timed({"own": running, KIND: fast}, _description(layer), timed,
                         backend.options.get("CpuAcc.route_cache", True))
    log.info("CpuAcc: %s compiled by TorchInductor in the background in %.1f s (%.1f s of "
             "this thread's CPU, %.1f s of the compilers'); %s", layer.name,
             time.perf_counter() - start, time.thread_time() - cpu, compilers,
             "timed against its route by its runs" if timed else "swapped in untimed")


class Timed(trials.Trial):
    """The running route ("own") and inductor's, checked alike on the first call's inputs, then
    timed by the network's calls in the calling thread's CPU time (wall time at more than one
    thread); ``timed`` False: inductor's after the check, untimed."""

    def __init__(self, candidates: dict[str, Workload], description: dict[str, Any],
                 timed: bool, keep: bool = True) -> None:
        super().__init__(candidates, {name: [] for name in candidates}, None)
        self.description, self.timed, self.keep, self.checked = description, timed, keep, False
        trials._adopt([self])

    def _timed(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        import torch

        from backplane.backends.torch import background

        if not self.checked:
            return self._check(inputs)
        epoch = background.epoch()
        if torch.jit.is_tracing() or epoch is None:  # beside a compile: untimed, not counted
            return self.candidates["own"](*inputs)
        name, run = self._next()
        trials._local.choosing = getattr(trials._local, "choosing", 0) + 1
        nested, count = trials._local.choosing, torch.get_num_threads()
        clock = time.thread_time if count == 1 else time.perf_counter
        start = clock()
        outputs = run(*inputs)
        elapsed = clock() - start
        if MEASURE is not None:
            elapsed = MEASURE(name, elapsed)
        alone = trials._local.choosing == nested and epoch == background.epoch()
        self._record(name, elapsed if alone else None, count)
        return outputs

    def _check(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """The first call: both routes on its inputs; the running route's outputs returned, and
        kept for good where inductor's differ (or, untimed, inductor's taken for good)."""
        from backplane.backends.torch.fusion.compiled import _close

        self.checked = True
        trials._local.choosing = getattr(trials._local, "choosing", 0) + 1  # a call choosing
        own = self.candidates["own"](*inputs)
        got = tuple(self.candidates[KIND](*inputs))
        if len(got) != len(own) or not all(map(_close, got, own)):
            log.warning("CpuAcc: TorchInductor's code computes otherwise than the running route; "
                        "the running route stays")
            self._settle("own")
            self._store("own")
        elif not self.timed:
            self._settle(KIND)
        return own

    def _settle(self, name: str) -> None:
        with self.lock:
            self.chosen = self.candidates[name]
        self.abandon()

    def _store(self, name: str, count: int | None = None) -> None:
        from backplane.backends.torch import route_cache

        if self.timed and self.keep:  # untimed: from the cache or the option, nothing new
            route_cache.store(route_cache.key(KIND, self.description, count), name)

    def _choose(self, full: bool) -> None:
        """Inductor's code where its median is below ``MARGIN`` of the running route's, else the
        running route; kept under this subgraph's own key (``KIND``) where every candidate had
        its samples on a machine that was not crowded."""
        import statistics

        from backplane.backends.torch import threads
        from backplane.backends.torch.fusion.patterns import because

        medians = {n: statistics.median(s) for n, s in self.samples.items() if s}
        wins = len(medians) == 2 and medians[KIND] < MARGIN * medians["own"]
        name = KIND if wins else "own"
        kept = full and not threads.crowded()
        if kept:
            self._store(name, self.at)
        how = ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in medians.items()) or "none timed"
        why = (f"{name}: timed in the running thread, medians {how} (inductor's taken below "
               f"{MARGIN} of the route's){'' if kept else '; not kept'}")
        self.chosen = because(self.candidates[name], why)
        self.watched = self.away = 0
        self.run = self._watch
        log.info("CpuAcc: %s", why)
