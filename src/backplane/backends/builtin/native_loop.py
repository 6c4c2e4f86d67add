"""A Loop of small layers as one C call for all its iterations (``native/loop.c``).

Why: a scripted RNN's Loop body (Gather of step t, three Gemms, Add, Tanh, SequenceInsert) is
seven CpuRef calls an iteration at 1-3 us each on 16-value tensors: loop_scripted_ts16's first
Loop 150-200 us of thread CPU for 8 steps, ONNX Runtime's whole model 116. The body's values are
a few hundred numbers; in C an iteration is well under a microsecond.

How: at a call, the body's steps that read only what the enclosing scope gives run first as
before (``IteratedBody.hoisted``); the shapes of what the iterations read then make a plan
(``native_plan.Plan``, cached per signature): each value of the body a buffer of one arena, each
layer a record, an If's branches records of their own, each carried value copied into its input's
buffer after an iteration, each scan output and each sequence the body grows by SequenceInsert
written into a (trips, ...) buffer at row i, the condition the body computes read after each
iteration. Taken only where every per-iteration layer is one the C runs (``native_plan.OPS``:
float32 Gemm, Add/Sub/Mul/Div (int64 Add/Sub/Mul) broadcasting along leading axes, Greater, Less,
Equal, ReduceMax over all axes, Tanh, Sigmoid, Relu, Abs, Neg, Identity, a Cast to its own type,
a Gather of the iteration number or of an int64 index, an If of such branches, an append to a
carried sequence) and the trip count is given: else (and under a stop, the debug trace,
``builtin.native`` "off", no compiler, an index out of range) the Loop runs as before. Values are
CpuRef's to float32 rounding (a Gemm's sum in another order than BLAS's; libm's tanhf and expf).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.backends.builtin.native_plan import OPS, Plan
from backplane.native.arena import DIRECT, HEADER, at
from backplane.native.build import NativeUnavailable, library

ndarray = np.ndarray

VERSION = 4
"""``loop.c``'s ``backplane_loop_version``: the records and the call this module makes."""
_FUNCTIONS: list[Any] = []


def _function() -> Any:
    if not _FUNCTIONS:
        lib = library("loop", VERSION)
        fn = lib.backplane_loop
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int64] * 3,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        fn.restype = ctypes.c_int64
        _FUNCTIONS.append(fn)
    return _FUNCTIONS[0]


def planner(body: Any, n_carried: int, mode: str) -> NativeLoop | None:
    """The native form of a Loop over ``body`` (an ``IteratedBody``), or None where its
    per-iteration layers are not all ``OPS`` or the library is not here."""
    if mode != "auto" or body.plain or body.renew or any(c.to_host is not None for c in body.state):
        return None
    layers = [body.layer_of.get(id(step.workload)) for step in body.rest]
    if any(layer is None or layer.op_type not in OPS or layer.domain for layer in layers):
        return None
    try:
        _function()
    except NativeUnavailable:
        return None
    return NativeLoop(body, layers, n_carried)


class NativeLoop:
    """Plans per signature (``Plan``) and the calls."""

    def __init__(self, body: Any, layers: Sequence[Any], n_carried: int) -> None:
        self.body, self.layers, self.n_carried = body, list(layers), n_carried
        self.plans: dict[tuple[Any, ...], Bound | None] = {}
        self.off = False
        written = {slot for step in body.rest for slot in step.outputs}
        template = body.template  # the body's constants: the same arrays at every call
        self.read = sorted(slot for slot in {s for step in body.rest for s in step.inputs}
                           if slot not in written and template[slot] is None)

    def __call__(self, max_trips: int | None, keep_going: bool,
                 rest: Sequence[Any]) -> tuple[Any, ...] | None:
        """The Loop's outputs, or None where this call is not the C's (then the caller runs it)."""
        if max_trips is None or max_trips <= 0 or not keep_going or self.off:
            return None
        body = self.body
        env = body.slots(rest[:self.n_carried], rest[self.n_carried:])
        if body.hoisted:
            body.execute(body.hoisted, env)
        key = []  # a plain loop: a generator is a frame of its own a step (3.11)
        for slot in self.read:
            value = env[slot]
            key.append((value.shape, value.dtype.str) if type(value) is ndarray
                       else _signature(value))
        found = self.plans.get(tuple(key), False)
        if found is False:
            plan = Plan.make(self.body, self.layers, env)
            found = self.plans[tuple(key)] = None if plan is None else Bound(plan)
            # a body the first signature's plan refused is most likely refused for its layers,
            # whatever the shapes: later calls go straight to the kernels (no hoisted steps twice)
            self.off = found is None and not any(self.plans.values())
        if found is None or max_trips > found.plan.most_trips:
            return None
        return found(env, max_trips, _function())


class Bound:
    """A plan with its table of addresses and its arena made once: a call writes the addresses
    of the values given to it and of the rows it makes into the table, then calls the C (the
    table's constants and arena addresses stay). Why: ``Plan.run`` makes them per call (a copy
    of the table, an arena, a fancy-indexed write, an address read through a ctypes object per
    value: about 4 us of the 7 a ten-trip Loop costs). A second thread at the same time runs
    ``Plan.run``, its own."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.arena = np.empty(max(plan.arena, 1), np.uint8)
        self.table = plan.base.copy()
        self.table[plan.in_arena] = self.arena.ctypes.data + plan.arena_bytes
        self.lock = threading.Lock()
        records, params = plan.addresses
        start = len(plan.pre)
        self.args = (records, params, start, start, len(plan.body), self.table.ctypes.data)
        self.carried = [(kind, self._view(*what) if kind == "tensor" else what)
                        for kind, what in plan.carried]

    def _view(self, start: int, size: int, shape: Any, dtype: Any) -> np.ndarray:
        return self.arena[start:start + size].view(dtype).reshape(shape)

    def __call__(self, env: list[Any], trips: int, function: Any) -> tuple[Any, ...] | None:
        plan = self.plan
        if not self.lock.acquire(blocking=False):
            return plan.run(env, trips, function)
        try:
            table, kept = self.table, []  # kept: copies made here, alive through the call
            for buffer, slot in plan.per_call:
                value = env[slot]
                if type(value) is not ndarray or not value.flags.c_contiguous:
                    value = np.ascontiguousarray(value)
                    kept.append(value)
                table[buffer] = at(id(value) + HEADER).value if DIRECT else value.ctypes.data
            rows = {}
            for k, shape, dtype in plan.row_shapes:
                made = rows[k] = np.empty((trips, *shape), dtype)
                table[k] = at(id(made) + HEADER).value if DIRECT else made.ctypes.data
            records, params, pre, start, count, address = self.args
            done = function(records, params, pre, start, count, address, trips, plan.condition)
            if done < 0:
                return None  # an index out of range: the kernels run and say so
            carried: list[Any] = []
            for kind, what in self.carried:
                if kind == "tensor":
                    carried.append(what.copy())
                else:
                    buffer, slot = what  # the sequence given to this call, grown
                    carried.append([*env[slot], *rows[buffer][:done]])
            return (*carried, *(rows[buffer][:done] for buffer in plan.scans))
        finally:
            self.lock.release()


def _signature(value: Any) -> Any:
    if type(value) is np.ndarray:
        return value.shape, value.dtype.str
    if isinstance(value, list):
        return "sequence", len(value)
    return type(value).__name__, getattr(value, "shape", None)
