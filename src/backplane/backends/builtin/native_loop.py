"""A Loop of small float32 layers as one C call for all its iterations (``native/loop.c``).

Why: a scripted RNN's Loop body (Gather of step t, three Gemms, Add, Tanh, SequenceInsert) is
seven CpuRef calls an iteration at 1-3 us each on 16-value tensors: loop_scripted_ts16's first
Loop 150-200 us of thread CPU for 8 steps, ONNX Runtime's whole model 116. The body's values are
a few hundred floats; in C an iteration is well under a microsecond.

How: at a call, the body's steps that read only what the enclosing scope gives run first as
before (``IteratedBody.hoisted``); the shapes of what the iterations read then make a plan (cached
per signature): each value of the body a buffer of one arena, each layer a record, each carried
value copied into its input's buffer after an iteration, each scan output and each sequence the
body grows by SequenceInsert written into a (trips, ...) buffer at row i. Taken only where every
per-iteration layer is one the C runs (``OPS``: float32 Gemm, Add/Sub/Mul/Div broadcasting along
trailing axes, Tanh, Sigmoid, Relu, Abs, Neg, Identity, a Gather of the iteration number, an
append to a carried sequence), the trip count is given, and the condition the body hands back is
a constant true: else (and under a stop, the debug trace, ``builtin.native`` "off", no compiler)
the Loop runs as before. Values are CpuRef's to float32 rounding (a Gemm's sum in another order
than BLAS's; libm's tanhf and expf).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.native.build import NativeUnavailable, library
from backplane.runtime.steps import NONE_SLOT

VERSION = 1
COPY, GATHER_I, APPEND_I, GEMM, ADD, SUB, MUL, DIV, TANH, SIGMOID, RELU, ABS, NEG = range(1, 14)
BINARY = {"Add": ADD, "Sub": SUB, "Mul": MUL, "Div": DIV}
UNARY = {"Tanh": TANH, "Sigmoid": SIGMOID, "Relu": RELU, "Abs": ABS, "Neg": NEG}
OPS = frozenset({*BINARY, *UNARY, "Gemm", "Identity", "Gather", "SequenceInsert"})
F32 = np.dtype(np.float32)
_FUNCTIONS: list[Any] = []


def _function() -> Any:
    if not _FUNCTIONS:
        lib = library("loop")
        if lib.backplane_loop_version() != VERSION:
            raise NativeUnavailable(f"the loop library is version {lib.backplane_loop_version()}")
        fn = lib.backplane_loop
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
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


def _address(array: np.ndarray) -> int:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except TypeError:  # read-only: NumPy's slower helper
        return array.ctypes.data  # type: ignore[no-any-return]


class NativeLoop:
    """Plans per signature (``Plan``) and the calls."""

    def __init__(self, body: Any, layers: Sequence[Any], n_carried: int) -> None:
        self.body, self.layers, self.n_carried = body, list(layers), n_carried
        self.plans: dict[tuple[Any, ...], Plan | None] = {}
        written = {slot for step in body.rest for slot in step.outputs}
        template = body.template  # the body's constants: the same arrays at every call
        self.read = sorted(slot for slot in {s for step in body.rest for s in step.inputs}
                           if slot not in written and template[slot] is None)

    def __call__(self, max_trips: int | None, keep_going: bool,
                 rest: Sequence[Any]) -> tuple[Any, ...] | None:
        """The Loop's outputs, or None where this call is not the C's (then the caller runs it)."""
        if max_trips is None or max_trips <= 0 or not keep_going:
            return None
        body = self.body
        env = body.slots(rest[:self.n_carried], rest[self.n_carried:])
        if body.hoisted:
            body.execute(body.hoisted, env)
        key = tuple(_signature(env[slot]) for slot in self.read)
        plan = self.plans.get(key, False)
        if plan is False:
            plan = self.plans[key] = Plan.make(self, env)
        if plan is None or max_trips > plan.most_trips:
            return None
        return plan.run(env, max_trips)


def _signature(value: Any) -> Any:
    if type(value) is np.ndarray:
        return value.shape, value.dtype.str
    if isinstance(value, list):
        return "sequence", len(value)
    return type(value).__name__, getattr(value, "shape", None)


class Plan:
    """One signature's records, buffers and what a call fills in."""

    def __init__(self, template: list[Any], inputs: set[int]) -> None:
        self.template, self.inputs = template, inputs
        self.shapes: list[tuple[int, ...]] = []  # per buffer
        self.given: dict[int, int] = {}  # buffer -> the slot whose array it is
        self.rows: set[int] = set()  # buffers of (trips, ...) rows, made per call
        self.produced: set[int] = set()  # slots the records write
        self.pre: list[list[int]] = []
        self.body: list[list[int]] = []
        self.pre_params: list[float] = []
        self.params: list[float] = []
        self.scans: list[int] = []  # rows buffers of the scan outputs
        self.carried: list[tuple[str, Any]] = []  # ("tensor", buffer) / ("sequence", (rows, first))
        self.most_trips = 1 << 62

    # -- planning --------------------------------------------------------------------------------
    @classmethod
    def make(cls, loop: NativeLoop, env: list[Any]) -> Plan | None:
        body = loop.body
        plan = cls(body.template, {*body.captured_slots, *body.carried_slots})
        try:
            plan._build(loop, env)
        except (_Refused, ValueError):
            return None
        plan._freeze()
        return plan

    def _buffer(self, shape: tuple[int, ...], given: int | None = None, rows: bool = False) -> int:
        self.shapes.append(tuple(int(d) for d in shape))
        k = len(self.shapes) - 1
        if given is not None:
            self.given[k] = given
        if rows:
            self.rows.add(k)
        return k

    def _build(self, loop: NativeLoop, env: list[Any]) -> None:
        body = loop.body
        i_slot, cond_slot = body.varying_slots[0], body.varying_slots[1]
        at: dict[int, int] = {}  # slot -> buffer
        alias: dict[int, int] = {}  # an Identity's output slot -> its input's

        def of(slot: int) -> int:
            slot = alias.get(slot, slot)
            if slot not in at:
                value = env[slot]
                if type(value) is not np.ndarray or value.dtype != F32:
                    raise _Refused
                at[slot] = self._buffer(value.shape, given=slot)
            return at[slot]

        targets = {t for c in body.state for t in c.targets}
        sequences: dict[int, tuple[int, int]] = {}  # a grown sequence's slot -> (rows, out slot)
        for c in body.state:  # carried tensors: a buffer each, first filled from the given value
            for target in c.targets:
                value = env[target]
                if isinstance(value, list):
                    continue
                if type(value) is not np.ndarray or value.dtype != F32:
                    raise _Refused
                at[target] = self._buffer(value.shape)
                self.produced.add(target)
                self.pre.append([COPY, at[target], self._buffer(value.shape, given=target), -1,
                                 -1, value.size, 0, 0])
                self.pre_params += [0.0, 0.0]
        for step, layer in zip(body.rest, loop.layers):
            if (i_slot in step.inputs and layer.op_type != "Gather") \
                    or (cond_slot in step.inputs and layer.op_type != "Identity"):
                raise _Refused
            record = self._record(step, layer, env, of, at, alias, i_slot, targets, sequences)
            if record is not None:
                self.body.append(record)
                self.params += [float(layer.attrs.get("alpha", 1.0)),
                                float(layer.attrs.get("beta", 1.0))]
                self.produced.add(step.outputs[0])
        watched = [alias.get(s, s) for s in body.watched_slots]
        condition = env[watched[0]]  # handed back as given (the loop goes on), or a constant
        if watched[0] != cond_slot and (watched[0] in self.produced or watched[0] in sequences
                                        or condition is None or not bool(np.all(condition))):
            raise _Refused  # a condition computed by the body: each iteration's, not ours
        for slot in watched[1:]:  # scan outputs: a row each iteration, before the carried move
            source = of(slot)
            rows = self._buffer((0, *self.shapes[source]), rows=True)
            self.scans.append(rows)
            self._append(rows, source)
        for c in body.state:
            source = alias.get(c.source, c.source)
            if len(c.targets) != 1:
                raise _Refused
            (target,) = c.targets
            if target in sequences:
                rows, grown = sequences[target]
                if source != grown:
                    raise _Refused
                self.carried.append(("sequence", (rows, target)))
                continue
            if target not in at or (source in targets and source != target):
                raise _Refused  # a value carried into another's slot: the order would matter
            if source != target:
                buffer = of(source)
                if self.shapes[buffer] != self.shapes[at[target]]:
                    raise _Refused
                self.body.append([COPY, at[target], buffer, -1, -1, _size(self.shapes[buffer]),
                                  0, 0])
                self.params += [0.0, 0.0]
            self.carried.append(("tensor", at[target]))

    def _append(self, rows: int, source: int) -> None:
        self.body.append([APPEND_I, rows, source, -1, -1, _size(self.shapes[source]), 0, 0])
        self.params += [0.0, 0.0]

    def _record(self, step, layer, env, of, at, alias, i_slot, targets, sequences):
        op, ins, outs = layer.op_type, step.inputs, step.outputs
        if len(outs) != 1:
            raise _Refused
        out = outs[0]
        if op == "Identity":
            alias[out] = alias.get(ins[0], ins[0])
            return None
        if op == "SequenceInsert":
            seq = ins[0]
            if (len(ins) > 2 and ins[2] != NONE_SLOT) or seq not in targets \
                    or not isinstance(env[seq], list) or seq in sequences:
                raise _Refused
            tensor = of(ins[1])
            rows = self._buffer((0, *self.shapes[tensor]), rows=True)
            sequences[seq] = (rows, out)
            self._append(rows, tensor)
            return None
        if op == "Gather":
            data = env[ins[0]]
            if ins[1] != i_slot or ins[0] in self.produced or type(data) is not np.ndarray \
                    or data.dtype != F32 or not data.ndim:
                raise _Refused
            axis = layer.attrs.get("axis", 0) % data.ndim
            shape = data.shape
            at[out] = self._buffer(shape[:axis] + shape[axis + 1:])
            self.most_trips = min(self.most_trips, shape[axis])
            return [GATHER_I, at[out], of(ins[0]), -1, -1, _size(shape[:axis]), shape[axis],
                    _size(shape[axis + 1:])]
        if op == "Gemm":
            a, b = of(ins[0]), of(ins[1])
            c = of(ins[2]) if len(ins) > 2 and ins[2] != NONE_SLOT else -1
            sa, sb = self.shapes[a], self.shapes[b]
            ta, tb = int(layer.attrs.get("transA", 0)), int(layer.attrs.get("transB", 0))
            if len(sa) != 2 or len(sb) != 2:
                raise _Refused
            m, k = (sa[1], sa[0]) if ta else sa
            kb, n = (sb[1], sb[0]) if tb else sb
            if k != kb:
                raise _Refused
            flags = (ta << 8) | (tb << 9)
            if c >= 0:
                sc = self.shapes[c]
                if _size(sc) == 1:
                    flags |= 1 << 12
                elif sc in ((n,), (1, n)):
                    flags |= 1 << 10
                elif sc == (m, 1):
                    flags |= 1 << 11
                elif sc != (m, n):
                    raise _Refused
            at[out] = self._buffer((m, n))
            return [GEMM | flags, at[out], a, b, c, m, k, n]
        if op in BINARY:
            a, b = of(ins[0]), of(ins[1])
            sa, sb = self.shapes[a], self.shapes[b]
            shape = np.broadcast_shapes(sa, sb)
            if not (_trailing(sa, shape) and _trailing(sb, shape)):
                raise _Refused
            at[out] = self._buffer(shape)
            return [BINARY[op], at[out], a, b, -1, _size(shape), _size(sa), _size(sb)]
        if op in UNARY:
            a = of(ins[0])
            at[out] = self._buffer(self.shapes[a])
            return [UNARY[op], at[out], a, -1, -1, _size(self.shapes[a]), 0, 0]
        raise _Refused

    def _freeze(self) -> None:
        """The arena's layout, the records as arrays, the addresses known at load (the body's
        constants: the same arrays at every call)."""
        offsets, size = [], 0
        for k, shape in enumerate(self.shapes):
            if k in self.given or k in self.rows:
                offsets.append(-1)
                continue  # given arrays and rows: their own memory
            offsets.append(size)
            size += -(-max(_size(shape), 1) // 16) * 16
        self.offsets, self.arena = offsets, size
        self.records = (np.array(self.pre or [[0] * 8], np.int64),
                        np.array(self.body, np.int64),
                        np.array(self.pre_params + self.params or [0.0], np.float64))
        self.base = np.zeros(len(self.shapes), np.int64)
        self.per_call: list[tuple[int, int]] = []
        for buffer, slot in self.given.items():
            constant = self.template[slot]
            if type(constant) is np.ndarray and constant.flags.c_contiguous \
                    and slot not in self.inputs:
                self.base[buffer] = _address(constant)  # the template keeps it
            else:
                self.per_call.append((buffer, slot))
        self.in_arena = np.array([k for k, o in enumerate(offsets) if o >= 0], np.int64)
        self.arena_bytes = np.array([o * 4 for o in offsets if o >= 0], np.int64)
        self.addresses = tuple(_address(r) for r in self.records)
        self.carried = [(kind, (offsets[what], _size(self.shapes[what]), self.shapes[what]))
                        if kind == "tensor" else (kind, what) for kind, what in self.carried]
        self.row_shapes = [(k, self.shapes[k][1:]) for k in sorted(self.rows)]

    # -- a call ----------------------------------------------------------------------------------
    def run(self, env: list[Any], trips: int) -> tuple[Any, ...]:
        ptrs = self.base.copy()
        kept = []
        for buffer, slot in self.per_call:
            value = np.ascontiguousarray(env[slot])
            kept.append(value)
            ptrs[buffer] = _address(value)
        arena = np.empty(max(self.arena, 1), np.float32)
        ptrs[self.in_arena] = _address(arena) + self.arena_bytes
        rows = {}
        for k, shape in self.row_shapes:
            rows[k] = np.empty((trips, *shape), np.float32)
            ptrs[k] = _address(rows[k])
        pre, body, params = self.addresses
        _function()(pre, len(self.pre), body, len(self.body), params, _address(ptrs), trips)
        carried: list[Any] = []
        for kind, what in self.carried:
            if kind == "tensor":
                start, size, shape = what
                carried.append(arena[start:start + size].reshape(shape).copy())
            else:
                buffer, slot = what  # the sequence given to this call, grown
                carried.append([*env[slot], *rows[buffer]])
        return (*carried, *(rows[buffer] for buffer in self.scans))


def _size(shape: Sequence[int]) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _trailing(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``out`` by repetition along leading axes alone (then
    element k of the output reads element k % size of it)."""
    stripped = list(shape)
    while stripped and stripped[0] == 1:
        stripped.pop(0)
    return tuple(out[len(out) - len(stripped):]) == tuple(stripped) if stripped else True


class _Refused(Exception):
    """A body or a signature the C does not take."""
