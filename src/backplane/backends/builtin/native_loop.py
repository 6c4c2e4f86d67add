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
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.backends.builtin.native_plan import OPS, Plan
from backplane.native.build import NativeUnavailable, library

VERSION = 3
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
        self.plans: dict[tuple[Any, ...], Plan | None] = {}
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
        key = tuple(_signature(env[slot]) for slot in self.read)
        plan = self.plans.get(key, False)
        if plan is False:
            plan = self.plans[key] = Plan.make(self.body, self.layers, env)
            # a body the first signature's plan refused is most likely refused for its layers,
            # whatever the shapes: later calls go straight to the kernels (no hoisted steps twice)
            self.off = plan is None and not any(self.plans.values())
        if plan is None or max_trips > plan.most_trips:
            return None
        return plan.run(env, max_trips, _function())


def _signature(value: Any) -> Any:
    if type(value) is np.ndarray:
        return value.shape, value.dtype.str
    if isinstance(value, list):
        return "sequence", len(value)
    return type(value).__name__, getattr(value, "shape", None)
