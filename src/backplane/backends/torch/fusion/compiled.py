"""A compiled OneDnnGraph's call: its frozen modules per thread count (``CompiledPerThreads``), its
inputs in the layout it was traced for (``_layout_guard``), the check of a compile's outputs
against the layers' (``_close``), and a workload made at its first call (``AtFirstRun``: a load
compiles nothing). Used by ``onednn_graph``, ``traced`` and an artifact's load (``delegate``);
importable from ``onednn_graph`` as before."""

from __future__ import annotations

import math
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from backplane.backends.api.backend import Workload
from backplane.backends.torch.wrapped import Wrapper


_SWITCH = threading.Condition(threading.Lock())  # never held across a block: no re-entry
_HELD: dict[int, list[bool]] = {}
"""The threads inside ``fusion_switch`` and the modes each asked for, innermost last."""
_BEFORE: list[bool] = []
"""The switch as it was before the first of them (put back after the last)."""
_WAITING: list[tuple[int, bool]] = []
"""The threads waiting to enter and the mode each wants, in the order they came."""


class _Switch:
    """``fusion_switch``'s block for one mode: a class, not a generator, and a plain lock, because
    a compiled partition enters it on every call (the generator and a reentrant lock cost about 20
    us of resnet_basic_ts16's 190 us run, load 3.8)."""

    __slots__ = ("on",)

    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        import torch

        on, me = self.on, threading.get_ident()
        with _SWITCH:
            if _WAITING or any(mode != on for modes in _HELD.values() for mode in modes):
                _WAITING.append((me, on))
                while _blocked(on, me):
                    _SWITCH.wait()
                _WAITING.remove((me, on))
            if not _HELD:
                _BEFORE[:] = [torch.jit.onednn_fusion_enabled()]
            _HELD.setdefault(me, []).append(on)
            torch.jit.enable_onednn_fusion(on)

    def __exit__(self, *exc: Any) -> None:
        import torch

        me = threading.get_ident()
        with _SWITCH:
            mine = _HELD[me]
            mine.pop()
            if not mine:
                del _HELD[me]
            held = mine or next(iter(_HELD.values()), None)
            torch.jit.enable_onednn_fusion(held[-1] if held else _BEFORE[0])
            if _WAITING:
                _SWITCH.notify_all()


_SWITCHES = {True: _Switch(True), False: _Switch(False)}


def fusion_switch(on: bool) -> _Switch:
    """oneDNN Graph fusion, a process-wide TorchScript switch, ``on`` (or off) for the block, and
    put back as it was after the last block that holds it. Blocks that want it the same way run
    at once; one that wants it the other way waits until the other threads' blocks end (a trace
    reads the switch too: ``kernels.common``). Saved and restored by each call instead, two
    threads' first runs of one session left it on for the process, and every later trace was
    fused by oneDNN Graph (NaN lost, routes changed; test_fusion_switch.py)."""
    return _SWITCHES[bool(on)]


def _blocked(on: bool, me: int) -> bool:
    """Whether a block that wants the switch ``on`` waits: another thread holds it the other way,
    or (not to starve a thread that waits for the other way under a stream of calls) a thread
    that came before it waits for the other way and this one holds it not at all."""
    if any(mode != on for thread, modes in _HELD.items() if thread != me for mode in modes):
        return True
    if me in _HELD:
        return False
    ahead = _WAITING[:_WAITING.index((me, on))]
    return any(mode != on for _, mode in ahead)


def compiled_run(modules: CompiledPerThreads, sample: Sequence[Any]) -> Workload:
    """The call of a compiled OneDnnGraph: its inputs in the layout it was traced for
    (``_layout_guard``), below autograd (``traced.below_autograd``: the same ops, less dispatch
    per op); oneDNN Graph fusion on for a call that compiles (the first calls at a thread count)
    and put back after. A module compiled runs its partitions whatever the switch says (the
    switch is read where TorchScript optimizes a graph, at the call that compiles), and taking
    the switch cost about 2.6 us a call (its lock, two writes of TorchScript's flag), of the 100
    that resnet_basic_ts16's compiled module takes (1 thread, this 2-core AMD EPYC). Its results
    are ``fresh_outputs.Made`` where the frozen graph's every output is an op's own result
    (``static_sizes.outputs_made``; a oneDNN Graph partition hands back an input only for an output
    that is that input, none of these): the runtime then reads their references only."""
    from backplane.backends.torch.fusion.static_sizes import outputs_made
    from backplane.backends.torch.fusion.traced import below_autograd_guard
    from backplane.runtime.fresh_outputs import Made

    conform = _layout_guard(sample)
    strides = [tuple(value.stride()) for value in sample]
    forwards, count, guard = modules._forwards, modules._count, below_autograd_guard()
    graphs = [getattr(module, "graph", None) for module in modules.modules.values()]
    made = Made if graphs and all(g is not None and outputs_made(g) for g in graphs) else tuple

    def run(*values: Any) -> tuple[Any, ...]:
        forward = forwards.get(count())  # modules.compiled(), without its frame
        for value, expected in zip(values, strides):  # conform's check, without its generator
            if value.stride() != expected:
                values = tuple(conform(values))
                break
        if forward is not None:
            with guard():
                outputs = forward(*values)
        else:
            with fusion_switch(True), guard():
                outputs = modules(*values)
        return made(outputs) if type(outputs) is tuple else made((outputs,))

    run.relayouts = conform.relayouts  # type: ignore[attr-defined]
    run.modules = modules  # type: ignore[attr-defined]
    return run


class CompiledPerThreads:
    """A frozen module per torch thread count, each compiled by oneDNN Graph at its first call at
    that count, on that call's inputs: oneDNN Graph's partitions keep running on the threads they
    were compiled with (a module compiled at 2 threads kept 2 busy after
    ``torch.set_num_threads(1)``, 27 times slower on a loaded 2-core machine: ``threads.py``).

    ``modules`` holds those compiled already; ``make()`` makes a fresh frozen module for another
    count. Its first call is the profiling executor's profiled run (its result is not returned:
    it runs the layers as traced, not oneDNN Graph's partitions); the second compiles the
    partitions and runs them, and its result is the call's, as every later call's."""

    def __init__(self, make: Callable[[], Any], modules: dict[int, Any] | None = None) -> None:
        import torch

        self.make, self.modules = make, dict(modules or {})
        self._forwards = {count: _forward(module) for count, module in self.modules.items()}
        self._count = torch.get_num_threads
        self._lock = threading.Lock()

    def __call__(self, *values: Any) -> Any:
        forward = self._forwards.get(self._count())
        return forward(*values) if forward is not None else self._first(values)

    def compiled(self) -> Callable[..., Any] | None:
        """The forward compiled for the calling thread's count, None before its first call."""
        return self._forwards.get(self._count())

    def _first(self, values: Sequence[Any]) -> Any:
        with self._lock:  # one compile per count, also with threads running the network at once
            count = self._count()
            module = self.modules.get(count)
            if module is not None:
                return module(*values)
            module = self.make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TorchScript's deprecation
                module(*values)  # profiled: records the types the fuser needs
                outputs = module(*values)  # the partitions compiled, then run
            self.modules[count] = module
            self._forwards[count] = _forward(module)
            return outputs


def _forward(module: Any) -> Callable[..., Any]:
    """A frozen module's TorchScript ``forward`` itself, where it has one: no ``nn.Module`` call
    (hooks, its Python frames) in between on every run."""
    scripted = getattr(module, "_c", None)
    return scripted._get_method("forward") if scripted is not None else module


class AtFirstRun(Wrapper):
    """A workload that ``make()`` makes at its first call, in the thread and at the thread count
    that runs it, then calls; until then its attributes are ``planned`` (``route``, ``why``), after
    that the made workload's (``built``). Why: compiling a OneDnnGraph was most of a load (the demo
    model's 0.25-0.31 of 0.29-0.36 CPU s at one thread), and its first run compiled again where the
    thread policy ran it at another count than the load's; made at the first run, it is compiled
    once, at the count it runs at. A second caller waits for the first one's make (one compile)."""

    __slots__ = ("make", "built", "planned", "lock", "__dict__")

    def __init__(self, make: Callable[[], Workload], **planned: Any) -> None:
        self.make: Callable[[], Workload] | None = make
        self.built: Workload | None = None
        self.planned = types.SimpleNamespace(**planned)
        self.lock = threading.Lock()

    def _target(self) -> Any:
        built = self.built
        return self.planned if built is None else built

    def __call__(self, *values: Any) -> tuple[Any, ...]:
        built = self.built
        if built is None:
            built = self._made()
        return built(*values)

    def _made(self) -> Workload:
        with self.lock:
            if self.built is None:
                self.built = self.make()  # type: ignore[misc]  # a failure: the next call tries again
                self.make = None  # its captures (the layers to trace) go with it
            return self.built


def _layout_guard(sample: Sequence[Any]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """Inputs as the compiled graph was built for them: each with the strides of its sample, copied
    into those strides where it comes in another layout.

    A compiled graph is built for the memory layout of the sample it was traced on, and computes
    something else on another one: a partition after a split (a layer pinned elsewhere, a fallback)
    is handed the channels-last outputs of the partition before it, and gave answers up to 0.89
    apart from the layers' own on tiny_mobilenet_v3 before this guard. The check is one comparison
    of strides per input; ``relayouts`` counts the inputs copied (for tests and debugging)."""
    import torch

    expected = [tuple(value.stride()) for value in sample]
    relayouts = [0]

    def conform(values: Sequence[Any]) -> Sequence[Any]:
        if all(v.stride() == s for v, s in zip(values, expected)):
            return values
        conformed = []
        for value, strides in zip(values, expected):
            if value.stride() != strides:
                relayouts[0] += 1
                value = torch.empty_strided(value.shape, strides, dtype=value.dtype).copy_(value)
            conformed.append(value)
        return conformed

    conform.relayouts = relayouts  # type: ignore[attr-defined]
    return conform


def _close(got: Any, expected: Any) -> bool:
    """Equal dtypes and shapes, NaN and infinities in the same places (a sample may make them: an
    all-padding attention mask, whose softmax is NaN), the finite values within 1e-4 of the largest
    finite magnitude (fusion reorders sums; in bfloat16 or float16, 3e-2: each rounding there is up
    to 4e-3)."""
    import torch

    if not (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)):
        return False
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    if not got.dtype.is_floating_point:
        return bool(torch.equal(got, expected))
    finite = torch.isfinite(expected)
    if not bool(finite.all()):
        same = (got == expected) | (torch.isnan(got) & torch.isnan(expected))
        if not bool((same | finite).all()):
            return False
        got, expected = got[finite], expected[finite]
    scale = max(float(expected.abs().max()) if expected.numel() else 0.0, 1e-6)
    difference = float((got - expected).abs().max()) if got.numel() else 0.0
    tolerance = 1e-4 if got.dtype in (torch.float32, torch.float64) else 3e-2
    return math.isfinite(difference) and difference <= tolerance * scale
