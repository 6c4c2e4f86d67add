"""CpuAcc's routes timed where they run: in the thread that runs the network, over its calls.

Why: a route timed in another thread is not the route that will run. OpenMP gives each thread its
own team of workers, and a measurement made in CpuAcc's background thread (``background.py``) ran
beside the loading thread's spinning team: on the corpus's layout_hswish_ts11 it measured oneDNN's
convolution route faster (0.047 against torch's 0.059 ms) where the loading thread runs torch's in
0.011 against 0.031, and the model then ran at 4.64 ms against 2.38 (issue 27, item 5).

So the background builds (packs, traces, compiles and checks) every candidate of a layer, and
``fastest`` hands back a ``Trial`` of them instead of timing them. The network's own calls then
time them: each call of a Trial runs one candidate, its output is that call's (every candidate
computes the layer: the routes are kernels the tests hold to CpuRef, and a compile was checked
against the layers when it was made), after
one untimed call of each the candidates alternate until each has ``SAMPLES`` timed calls, and the
fastest by median is kept for every call after that. A timing counts only where nothing else of
backplane's was working: not while the background thread makes a workload (``background.epoch``),
not across a nested Trial still choosing (a OneDnnGraph's layers holding convolutions' Trials: the
parent times its layers once they have chosen), and all at one thread count (the thread policy's
change of the count begins the samples again). The choice is written to the route cache, under
that count, only where every candidate got its samples so and the machine was not busy
(``threads.crowded``) when it chose; after ``MOST_CALLS`` calls without that, it chooses from
what it has and keeps nothing.

A choice holds at the thread count it was timed at. A partition's own thread count is chosen after
its routes (``small.Undecided``), and often goes from the caller's two threads to one: the full
tier's lstm_bi2_ts14 chose its layers over its trace at 2 threads (5.4 against 9.6 ms), then ran
those layers at one thread (3.3 ms) where the trace runs in 2.7 (an Intel Xeon, 2 CPUs, quiet). So
a chosen Trial keeps its candidates for ``WATCH`` more calls; where ``MOVED`` calls in a row run
at another count (the partition's choice, not the comparison of counts, whose calls alternate),
it times its candidates again at that count.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from backplane.backends.api.backend import Workload
from backplane.backends.torch.wrapped import Wrapper

SAMPLES = 7
"""Timed calls of each candidate before the choice (the median of them is compared)."""
MOST_CALLS = 400
"""Calls of a Trial after which it chooses from the samples it has, and keeps nothing."""
WATCH = 100
"""Calls after a choice during which another thread count times the candidates again; then the
others are dropped (their packed weights and compiled modules with them)."""
MOVED = 8
"""Calls in a row at another thread count than the samples' that begin them again at that count
(``small.fewer_threads`` runs at most 4 in a row at one count while it compares counts)."""

_local = threading.local()  # .choosing: undecided Trial calls in this thread; .watching: chosen
# ones still watching the thread count (``watching``); .made: a collector
_roots: weakref.WeakSet[Trial] = weakref.WeakSet()
_roots_lock = threading.Lock()


class Trial(Wrapper):
    """A layer's candidate workloads, timed over the network's calls; then the fastest one."""

    __slots__ = ("candidates", "children", "key", "at", "samples", "calls", "total", "chosen",
                 "run", "watched", "away", "final", "lock", "__weakref__", "__dict__")

    def __init__(self, candidates: dict[str, Workload], children: dict[str, list[Trial]],
                 key: tuple[str, dict[str, Any]] | None) -> None:
        self.candidates, self.children, self.key = candidates, children, key
        self.at = 0  # the thread count the samples were taken at
        self.samples: dict[str, list[float]] = {name: [] for name in candidates}
        self.calls = dict.fromkeys(candidates, 0)  # since the samples began
        self.total = 0
        self.chosen: Workload | None = None
        self.run: Callable[..., tuple[Any, ...]] = self._timing  # what a call calls
        self.watched = self.away = 0  # calls since the choice; of them, in a row at another count
        self.final = False  # chosen for good: the other candidates dropped
        self.lock = threading.Lock()

    def __call__(self, *inputs: Any) -> tuple[Any, ...]:
        return self.run(*inputs)

    def _timing(self, *inputs: Any) -> tuple[Any, ...]:
        return self._timed(inputs)

    def _watch(self, *inputs: Any) -> tuple[Any, ...]:
        """A call of the chosen candidate, counting the calls at another thread count than the
        samples' (``MOVED`` in a row: the samples begin again there) up to ``WATCH``."""
        import torch

        chosen = self.chosen
        if chosen is None:  # another thread began the samples again
            return self._timed(inputs)
        _local.watching = getattr(_local, "watching", 0) + 1
        if torch.get_num_threads() == self.at:
            self.away, self.watched = 0, self.watched + 1
            if self.watched >= WATCH:
                self._keep()
        else:
            self.away += 1
            if self.away >= MOVED:
                self._again()
        return chosen(*inputs)

    def _timed(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        import torch

        from backplane.backends.torch import background

        if torch.jit.is_tracing():  # a trace keeps one candidate's calls: the first, untimed
            return self.candidates[next(iter(self.candidates))](*inputs)
        name, run = self._next()
        _local.choosing = getattr(_local, "choosing", 0) + 1
        nested, epoch, count = _local.choosing, background.epoch(), torch.get_num_threads()
        start = time.perf_counter()
        outputs = run(*inputs)
        elapsed = time.perf_counter() - start
        alone = _local.choosing == nested and epoch is not None and epoch == background.epoch()
        self._record(name, elapsed if alone else None, count)
        return outputs

    def _next(self) -> tuple[str, Workload]:
        """The candidate short of samples that was called least (one whose calls never count,
        its nested Trials still choosing, is called until they have chosen), and its workload."""
        with self.lock:
            short = [n for n in self.candidates if len(self.samples[n]) < SAMPLES]
            name = min(short or self.candidates, key=lambda n: self.calls.get(n, 0))
            return name, self.candidates[name]

    def _record(self, name: str, elapsed: float | None, count: int) -> None:
        """One call's time (None: it does not count), taken at ``count`` threads: another count
        than the samples' begins them again (the thread policy changed it; a compiled partition
        compiles again at its first call at a new count)."""
        with self.lock:
            if self.chosen is not None:
                return
            self.total += 1
            if count != self.at:
                self.at, self.calls = count, dict.fromkeys(self.candidates, 0)
                self.samples = {n: [] for n in self.candidates}
            self.calls[name] += 1
            if elapsed is not None and self.calls[name] > 1:  # a candidate's first call: untimed
                self.samples[name].append(elapsed)
            full = all(len(s) >= SAMPLES for s in self.samples.values())
            if full or self.total >= MOST_CALLS:
                self._choose(full)

    def _choose(self, full: bool) -> None:
        from backplane.backends.torch import route_cache, threads
        from backplane.backends.torch.fusion.patterns import because

        medians = {n: statistics.median(s) for n, s in self.samples.items() if s}
        name = min(medians, key=medians.__getitem__) if medians else next(iter(self.candidates))
        keep = full and self.key is not None and not threads.crowded()
        if keep:
            kind, description = self.key  # type: ignore[misc]
            route_cache.store(route_cache.key(kind, description, self.at), name)
        others = ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in medians.items() if n != name)
        how = (f"median {medians[name] * 1e3:.3f} ms ({others})" if name in medians
               else "no call could be timed")
        why = f"{name}: timed fastest in the running thread, {how}"
        self.chosen = because(self.candidates[name], why if keep else f"{why}; not kept")
        self.watched = self.away = 0
        self.run = self._watch

    def _again(self) -> None:
        """The samples begun again at the calling thread's count (``_record`` sees it changed)."""
        with self.lock:
            if self.final or self.chosen is None:
                return
            self.chosen, self.total, self.run = None, 0, self._timing

    def _keep(self) -> None:
        """The choice kept for good: the other candidates and their nested Trials dropped."""
        with self.lock:
            chosen = self.chosen
            if self.final or chosen is None:
                return
            name = next(n for n, run in self.candidates.items() if run is chosen)
            for loser, trials in self.children.items():  # never called again: not waited for
                if loser != name:
                    for trial in trials:
                        trial.abandon()
            # the others dropped: their packed weights and compiled modules go with them
            self.children = {name: self.children.get(name, [])}
            self.candidates, self.run, self.final = {name: chosen}, chosen, True

    def abandon(self) -> None:
        """This Trial's network part will not run: it and its nested Trials are not waited for."""
        with self.lock:
            if not self.final:
                chosen = self.chosen or next(iter(self.candidates.values()))
                name = next(n for n, run in self.candidates.items() if run is chosen)
                self.candidates, self.chosen, self.run = {name: chosen}, chosen, chosen
                self.final = True
        for trials in self.children.values():
            for trial in trials:
                trial.abandon()
        self.children = {}

    def settled(self) -> bool:
        """Whether this Trial has chosen for good and every Trial of its candidate has too."""
        if not self.final:
            return False
        name = next(iter(self.candidates))
        return all(trial.settled() for trial in self.children.get(name, ()))

    def _target(self) -> Workload:
        """The chosen candidate, or the first while none is."""
        return self.chosen or next(iter(self.candidates.values()))

    def __getattr__(self, name: str) -> Any:
        if name == "why" and self.chosen is None:
            return "being timed in the running thread: " + ", ".join(self.candidates)
        return super().__getattr__(name)

    def __repr__(self) -> str:
        return f"Trial({', '.join(self.candidates)}{'' if self.chosen is None else ': chosen'})"


def trial(kind: str, description: dict[str, Any], routes: dict[str, Callable[[], Workload]],
          make_sample: Callable[[], list[Any]], backend: Any) -> Workload:
    """``routes`` all made, each run once on a sample (one that fails there is dropped), as one
    ``Trial``; where one route is left, that route."""
    from backplane.backends.torch.fusion.patterns import because

    made, children = {}, {}
    for name, make in routes.items():
        with _collecting() as nested:
            made[name] = make()
        children[name] = nested
    sample = make_sample()
    working = {name: run for name, run in made.items() if _runs(run, sample)}
    if len(working) <= 1:
        name = next(iter(working or made))
        _adopt(children[name])
        return because(made[name], f"{name}: the only route that ran on a sample")
    keep = backend.options.get("CpuAcc.route_cache", True)
    made_trial = Trial(working, {n: children[n] for n in working},
                       (kind, description) if keep else None)
    _adopt([made_trial])
    return made_trial


def _adopt(trials: list[Trial]) -> None:
    """``trials`` waited for by the Trial whose candidate is being made, or by ``undecided``."""
    collector = getattr(_local, "made", None)
    if collector is not None:
        collector.extend(trials)
    else:
        with _roots_lock:
            _roots.update(trials)


def choosing() -> int:
    """How many calls of a Trial still choosing this thread has made: unchanged over a run of a
    network, its routes are all chosen (``background.settle``, ``small.Undecided``)."""
    return getattr(_local, "choosing", 0)


def watching() -> int:
    """How many calls of a chosen Trial still watching the thread count this thread has made:
    unchanged over a run, its routes are chosen for good (``background.settle``)."""
    return getattr(_local, "watching", 0)


def undecided() -> int:
    """How many Trials not made inside another are still choosing (theirs or a nested one)."""
    with _roots_lock:
        roots = list(_roots)
    waiting = [t for t in roots if not t.settled()]
    with _roots_lock:
        for t in roots:
            if t not in waiting:
                _roots.discard(t)
    return len(waiting)


@contextlib.contextmanager
def _collecting() -> Iterator[list[Trial]]:
    """The Trials made in the block, gathered in the list it yields (not made roots)."""
    was, _local.made = getattr(_local, "made", None), []
    try:
        yield _local.made
    finally:
        _local.made = was


def _runs(run: Workload, sample: list[Any]) -> bool:
    """Whether ``run`` runs on ``sample`` (its first call, made here: packing, a compile's first
    partitions; a route that fails never wins)."""
    try:
        run(*sample)
    except RuntimeError:
        return False
    return True
