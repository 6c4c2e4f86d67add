"""A network of small float32 layers and Ifs run whole as one C call on the caller's NumPy arrays
(``native/loop.c``'s ``backplane_net``; ``builtin.native`` "auto", as a native Loop).

Why: a model with control flow that CpuRef runs best (a ``torch.cond`` export such as
cond_nested_dyn18: Gemm, ReduceMean, Squeeze and Greater, then an If whose branches are a Gemm
and two elementwise layers, one of them a nested If) pays NumPy's call per layer on a few dozen
values: 1-1.5 us a Gemm, 1.4 a mean, 0.3 a comparison, where the arithmetic is nanoseconds.
cond_nested_dyn18 ran in 8.5 us of thread CPU a run (1 thread), about 5.3 of them NumPy's calls
and the rest the steps around them; ONNX Runtime runs it in 6.

How: the records a native Loop's body is planned into (``native_plan.Plan``: Gemm, elementwise
and comparison layers broadcasting along leading axes, reductions over all axes, reshapes, an If
whose branches are such layers) are made here for the whole network, run once: builtin's If
offers ``plans_network`` (this module's ``planner``), which the runtime's straight run of a
network (``steps.straight_run``) asks at load. Per signature (the inputs' shapes) a plan is made
at the first call with it: each value a buffer of the plan's arena, the inputs' and the outputs'
data written into its table of addresses per call; an output a fresh array, the caller's alone.
A network with a layer the C does not run (any other op, a MemImport, a body that is not flat), a
signature it refuses (an If's branches of two shapes, a shape computed from data, a value of more
than MOST_VALUES elements), a call under a stop or from a second thread at once runs the steps as
before. Values are CpuRef's to float32 rounding (a Gemm's sum in k's order, BLAS's in blocks;
libm's tanhf and expf); a sum or a mean over all axes is NumPy's pairwise sum, CpuRef's bit for
bit. cond_nested_dyn18 then: 2.3 us of thread CPU a run (1 thread, load 6).
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.builtin.native_plan import BOOL, COPY, F32, I64, OPS, Plan, Refused, Scope
from backplane.native.arena import DIRECT, HEADER, at
from backplane.native.build import NativeUnavailable, library
from backplane.runtime.host_route import Hosted

log = logging.getLogger(__name__)

SIGNATURES = 64
"""The most input signatures a network keeps a plan for (past them, new ones run the steps)."""
MOST_VALUES = 512
"""The most values (elements) a plan's buffer may hold: past a few hundred, NumPy's own loops
(its SIMD tanh, BLAS's products) beat this C's plain ones and the calls it saves no longer
count (cond_nested_dyn18 at 1 thread: batch 32, tensors of 512 values, 6.8-9.1 us in C against
10.2-15.8 through the kernels; batch 128, 2048 values, 21-31 against 12-19)."""
_FUNCTIONS: list[Any] = []


def _function() -> Any:
    if not _FUNCTIONS:
        from backplane.backends.builtin.native_loop import VERSION

        fn = library("loop", VERSION).backplane_net
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int64
        _FUNCTIONS.append(fn)
    return _FUNCTIONS[0]


def planner(steps: Sequence[Any], layers: Sequence[Any], template: Sequence[Any],
            input_slots: Sequence[int], output_slots: Sequence[int]) -> NativeNetwork | None:
    """The native form of a network of ``steps`` (its layers ``layers``, its constants in
    ``template``), or None where a layer is not one the C runs or the library is not here."""
    if not input_slots or not output_slots or any(
            layer.domain or layer.op_type not in OPS or layer.op_type == "SequenceInsert"
            or step.convert is not None for step, layer in zip(steps, layers)):
        return None
    try:
        _function()
    except NativeUnavailable:
        return None
    return NativeNetwork(steps, layers, template, input_slots, output_slots)


class NativeNetwork:
    """A network's plans by signature (``hosted``: input shapes -> the NumPy run of its plan, the
    direct run's lookup; a refused signature's run declines, returning None) and the call that
    makes one at a signature's first call (``make``)."""

    def __init__(self, steps: Sequence[Any], layers: Sequence[Any], template: Sequence[Any],
                 input_slots: Sequence[int], output_slots: Sequence[int]) -> None:
        self.steps, self.layers, self.template = list(steps), list(layers), list(template)
        self.input_slots, self.output_slots = tuple(input_slots), tuple(output_slots)
        self.hosted = Hosted()
        self.refused: set[tuple[Any, ...]] = set()
        self.lock = threading.Lock()  # one plan made at a time

    def __call__(self, values: Sequence[Any]) -> list[Any] | None:
        """The outputs of one run on ``values`` (the inputs, in order), or None where this call
        is not the C's (the caller runs the steps)."""
        shapes = []
        for value in values:
            if type(value) is not np.ndarray:
                return None
            shapes.append(value.shape)
        key = tuple(shapes)
        host = self.hosted.get(key) or self.make(key, values)
        return host(*values) if host is not None else None  # type: ignore[no-any-return]

    def make(self, key: tuple[Any, ...], values: Sequence[Any]) -> Callable[..., Any] | None:
        """The NumPy run for the signature ``key`` of ``values``: made and kept at its first call,
        None where it is refused (remembered) or past SIGNATURES."""
        with self.lock:
            found = self.hosted.get(key)
            if found is not None or key in self.refused:
                return found
            if len(self.hosted) >= SIGNATURES:
                return None
            try:
                found = _host(self._plan(values), _function())
            except (Refused, ValueError):
                found = None
            except Exception:  # a network shaped as no plan foresaw: its steps run it
                log.debug("native network: no plan", exc_info=True)
                found = None
            if found is None:
                self.refused.add(key)
            self.hosted[key] = found or _declined  # a refused signature's lookup: no lock again
            return found

    def _plan(self, values: Sequence[Any]) -> Built:
        plan = Plan(set())
        given = {}
        for slot, value in zip(self.input_slots, values):
            if value.dtype not in (F32, I64, BOOL):
                raise Refused
            given[slot] = plan.buffer(value.shape, value.dtype, given=slot)
        scope = Scope(plan, None, self.template, given)
        for step, layer in zip(self.steps, self.layers):
            plan._emit(step, layer, scope, plan.body, -1)
            plan.produced.update(step.outputs)
        outputs = []
        for j, slot in enumerate(self.output_slots):  # each output a buffer of its own, copied
            made = scope.of(slot)  # into (an input or a constant may be an output too)
            out = plan.buffer(plan.shapes[made], plan.dtypes[made], given=-1 - j)
            plan.body.append([COPY, out, made, -1, -1, plan.bytes_of(made), 0, 0])
            outputs.append(out)
        if max(map(math.prod, plan.shapes), default=0) > MOST_VALUES:
            raise Refused  # the kernels' turn (above)
        plan._freeze()
        return Built(plan, [given[slot] for slot in self.input_slots], outputs)


class Built:
    """One signature's plan frozen: the call's block (the records' and params' addresses, their
    count, the table of buffer addresses: constants and the arena's filled here), where each
    input's and output's address goes in it, the outputs' shapes and dtypes."""

    def __init__(self, plan: Plan, inputs: Sequence[int], outputs: Sequence[int]) -> None:
        self.plan = plan  # holds the records, params and constants the block points at
        self.arena = np.empty(max(plan.arena, 1), np.uint8)
        block = np.zeros(3 + len(plan.shapes), np.int64)
        block[0], block[1] = plan.addresses
        block[2] = len(plan.pre) + len(plan.body)
        block[3:] = plan.base
        block[3 + plan.in_arena] = self.arena.ctypes.data + plan.arena_bytes
        self.block, self.address = block, block.ctypes.data
        self.inputs = [(3 + k, plan.shapes[k], plan.dtypes[k]) for k in inputs]
        self.outputs = [(3 + k, plan.shapes[k], plan.dtypes[k]) for k in outputs]


def _declined(*values: Any) -> None:
    """The run kept for a refused signature: none (the steps run)."""
    return None


def _host(built: Built, fn: Any) -> Callable[..., list[np.ndarray] | None]:
    """``built``'s run on NumPy arrays: fresh outputs; None where an input is not of the plan's
    dtype, shape and C order, where the C refuses (an index out of range) or where another thread
    runs the plan (its arena is one): the caller then runs the steps, which say what is wrong."""
    block, address, ins, outs, lock = built.block, built.address, built.inputs, built.outputs, \
        threading.Lock()
    empty, ndarray = np.empty, np.ndarray

    def host(*values: Any) -> list[np.ndarray] | None:
        if not lock.acquire(blocking=False):
            return None
        try:
            # plain loops, no comprehension: each is a Python frame of its own a call (3.11)
            for value, (k, shape, dtype) in zip(values, ins):
                if type(value) is not ndarray or value.dtype is not dtype or \
                        value.shape != shape or not value.flags.c_contiguous:
                    return None
                block[k] = at(id(value) + HEADER).value if DIRECT else value.ctypes.data
            made = []
            for k, shape, dtype in outs:
                out = empty(shape, dtype)
                made.append(out)
                block[k] = at(id(out) + HEADER).value if DIRECT else out.ctypes.data
            if fn(address):
                return None
            return made
        finally:
            lock.release()

    host.built = built  # type: ignore[attr-defined]  # alive with its run; for the tests
    return host
