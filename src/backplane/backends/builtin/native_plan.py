"""The plan of a native Loop (``native_loop.py``) for one signature: a buffer per value of the
body (float32, int64 or bool: the arena's, or an array given per call or fixed at load), a record
of eight int64 per layer (``native/loop.c``'s enum), a branch of an If in the body as records of
its own that the If record runs, and what a call fills in and returns."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.runtime.steps import NONE_SLOT

log = logging.getLogger(__name__)

(COPY, GATHER_I, APPEND_I, GEMM, ADD, SUB, MUL, DIV, TANH, SIGMOID, RELU, ABS, NEG, ADD_I, SUB_I,
 MUL_I, GT, LT, EQ, GT_I, LT_I, EQ_I, MAX_ALL, GATHER_C, IF, SUM_ALL, MEAN_ALL) = range(1, 28)
F32, I64, BOOL = np.dtype(np.float32), np.dtype(np.int64), np.dtype(np.bool_)
BINARY = {F32: {"Add": ADD, "Sub": SUB, "Mul": MUL, "Div": DIV},
          I64: {"Add": ADD_I, "Sub": SUB_I, "Mul": MUL_I}}
COMPARE = {F32: {"Greater": GT, "Less": LT, "Equal": EQ},
           I64: {"Greater": GT_I, "Less": LT_I, "Equal": EQ_I}}
UNARY = {"Tanh": TANH, "Sigmoid": SIGMOID, "Relu": RELU, "Abs": ABS, "Neg": NEG}
REDUCE_ALL = {"ReduceMax": MAX_ALL, "ReduceSum": SUM_ALL, "ReduceMean": MEAN_ALL}
RESHAPES = frozenset({"Squeeze", "Unsqueeze", "Reshape", "Flatten"})
"""Layers that keep the values in their order (a copy into a buffer of the new shape, which
CpuRef's kernel gives on an empty array of the input's shape and the layer's constant inputs)."""
OPS = frozenset({"Add", "Sub", "Mul", "Div", "Greater", "Less", "Equal", *UNARY, "Gemm",
                 "Identity", "Gather", "SequenceInsert", *REDUCE_ALL, "Cast", "If", *RESHAPES})
"""The layers a body's iterations may hold (each further checked by types and shapes)."""
MOST_ROWS = 1 << 16
"""A Loop whose body computes its condition and makes rows (scan outputs, a grown sequence) is
the C's only up to this trip count (its rows are made for every trip at once)."""


def address(array: np.ndarray) -> int:
    """A C-contiguous array's address: through its buffer (about 1 us), where ``.ctypes.data``
    makes an object of NumPy's helper (3-4 us here); a read-only array goes that way."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except TypeError:
        return array.ctypes.data  # type: ignore[no-any-return]


class Refused(Exception):
    """A body or a signature the C does not take."""


def _size(shape: Sequence[int]) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _trailing(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``out`` by repetition along leading axes alone (then
    element k of the output reads element k % size of it)."""
    stripped = list(shape)
    while stripped and stripped[0] == 1:
        stripped.pop(0)
    return tuple(out[len(out) - len(stripped):]) == tuple(stripped) if stripped else True


class Scope:
    """The slots of one network (the Loop's body, or a branch of an If in it) -> buffers."""

    def __init__(self, plan: Plan, env: list[Any] | None, template: list[Any],
                 at: dict[int, int] | None = None) -> None:
        self.plan, self.env, self.template = plan, env, template
        self.at = dict(at or {})
        self.alias: dict[int, int] = {}

    def value(self, slot: int) -> Any:
        """What the slot holds before the iterations (a constant, a given value), or None."""
        if self.env is not None:
            return self.env[slot]
        return self.template[slot]

    def constant(self, slot: int) -> np.ndarray | None:
        """The value of a slot the same at every call (a constant of the network): None for an
        absent input; Refused for a value made or given per call."""
        if slot == NONE_SLOT:
            return None
        slot = self.alias.get(slot, slot)
        value = self.template[slot]
        if slot in self.plan.produced or type(value) is not np.ndarray or \
                (self.env is not None and self.env[slot] is not value):
            raise Refused
        return value

    def of(self, slot: int) -> int:
        slot = self.alias.get(slot, slot)
        if slot not in self.at:
            value = self.value(slot)
            if type(value) is not np.ndarray or value.dtype not in (F32, I64, BOOL):
                raise Refused
            if self.env is None or self.env[slot] is self.template[slot]:
                self.at[slot] = self.plan.constant(value)
            else:
                self.at[slot] = self.plan.buffer(value.shape, value.dtype, given=slot)
        return self.at[slot]


class Plan:
    """One signature's records, buffers and what a call fills in."""

    def __init__(self, inputs: set[int]) -> None:
        self.inputs = inputs
        self.shapes: list[tuple[int, ...]] = []  # per buffer
        self.dtypes: list[np.dtype] = []
        self.given: dict[int, int] = {}  # buffer -> the slot whose array it is at a call
        self.fixed: dict[int, np.ndarray] = {}  # buffer -> a constant (the same at every call)
        self.rows: set[int] = set()  # buffers of (trips, ...) rows, made per call
        self.produced: set[int] = set()  # the body's slots the records write
        self.pre: list[list[int]] = []
        self.body: list[list[int]] = []
        self.branches: list[list[int]] = []
        self.params: dict[int, tuple[float, float]] = {}  # id of a Gemm record -> alpha, beta
        self.scans: list[int] = []
        self.carried: list[tuple[str, Any]] = []
        self.condition = -1  # the bool buffer the body hands back, where it computes it
        self.most_trips = 1 << 63  # past any trip count

    def buffer(self, shape, dtype, given: int | None = None, rows: bool = False) -> int:
        self.shapes.append(tuple(int(d) for d in shape))
        self.dtypes.append(np.dtype(dtype))
        k = len(self.shapes) - 1
        if given is not None:
            self.given[k] = given
        if rows:
            self.rows.add(k)
        return k

    def constant(self, value: np.ndarray) -> int:
        k = self.buffer(value.shape, value.dtype)
        self.fixed[k] = np.ascontiguousarray(value)
        return k

    def bytes_of(self, k: int) -> int:
        return _size(self.shapes[k]) * self.dtypes[k].itemsize

    # -- planning --------------------------------------------------------------------------------
    @classmethod
    def make(cls, body: Any, layers: Sequence[Any], env: list[Any]) -> Plan | None:
        plan = cls({*body.captured_slots, *body.carried_slots})
        try:
            plan._build(body, layers, env)
        except (Refused, ValueError):
            return None
        except Exception:  # a body shaped as no plan foresaw: its kernels run it, as before
            log.debug("native Loop: no plan", exc_info=True)
            return None
        plan._freeze()
        return plan

    def _build(self, body: Any, layers: Sequence[Any], env: list[Any]) -> None:
        i_slot, cond_slot = body.varying_slots[0], body.varying_slots[1]
        scope = Scope(self, env, body.template)
        targets = {t for c in body.state for t in c.targets}
        sequences: dict[int, tuple[int, int]] = {}  # a grown sequence's slot -> (rows, out slot)
        for c in body.state:  # carried tensors: a buffer each, first filled from the given value
            for target in c.targets:
                value = env[target]
                if isinstance(value, list):
                    continue
                if type(value) is not np.ndarray or value.dtype not in (F32, I64, BOOL):
                    raise Refused
                scope.at[target] = self.buffer(value.shape, value.dtype)
                self.produced.add(target)
                given = self.buffer(value.shape, value.dtype, given=target)
                self.pre.append([COPY, scope.at[target], given, -1, -1, self.bytes_of(given), 0, 0])
        for step, layer in zip(body.rest, layers):
            if (i_slot in step.inputs and layer.op_type != "Gather") \
                    or (cond_slot in step.inputs and layer.op_type != "Identity"):
                raise Refused
            if layer.op_type == "SequenceInsert":
                self._grow(step, scope, env, targets, sequences)
                continue
            self._emit(step, layer, scope, self.body, i_slot)
            self.produced.update(step.outputs)
        watched = [scope.alias.get(s, s) for s in body.watched_slots]
        if watched[0] in self.produced:  # the body computes its condition: read after each trip
            self.condition = scope.of(watched[0])
            if self.dtypes[self.condition] != BOOL or self.shapes[self.condition] not in ((), (1,)):
                raise Refused
        elif watched[0] != cond_slot:  # a constant or a given value: true, or the loop is not ours
            given = env[watched[0]]
            if given is None or watched[0] in sequences or not bool(np.all(given)):
                raise Refused
        for slot in watched[1:]:  # scan outputs: a row each iteration, before the carried move
            source = scope.of(slot)
            rows = self.buffer((0, *self.shapes[source]), self.dtypes[source], rows=True)
            self.scans.append(rows)
            self.body.append([APPEND_I, rows, source, -1, -1, self.bytes_of(source), 0, 0])
        for c in body.state:
            self._carry(c, scope, targets, sequences)

    def _grow(self, step, scope: Scope, env, targets, sequences) -> None:
        seq, ins = step.inputs[0], step.inputs
        if (len(ins) > 2 and ins[2] != NONE_SLOT) or seq not in targets \
                or not isinstance(env[seq], list) or seq in sequences:
            raise Refused
        tensor = scope.of(ins[1])
        rows = self.buffer((0, *self.shapes[tensor]), self.dtypes[tensor], rows=True)
        sequences[seq] = (rows, step.outputs[0])
        self.body.append([APPEND_I, rows, tensor, -1, -1, self.bytes_of(tensor), 0, 0])

    def _carry(self, c, scope: Scope, targets, sequences) -> None:
        source = scope.alias.get(c.source, c.source)
        if len(c.targets) != 1:
            raise Refused
        (target,) = c.targets
        if target in sequences:
            rows, grown = sequences[target]
            if source != grown:
                raise Refused
            self.carried.append(("sequence", (rows, target)))
            return
        if target not in scope.at or (source in targets and source != target):
            raise Refused  # a value carried into another's slot: the order would matter
        if source != target:
            buffer = scope.of(source)
            mine = scope.at[target]
            if self.shapes[buffer] != self.shapes[mine] or self.dtypes[buffer] != self.dtypes[mine]:
                raise Refused
            self.body.append([COPY, mine, buffer, -1, -1, self.bytes_of(buffer), 0, 0])
        self.carried.append(("tensor", scope.at[target]))

    def _emit(self, step, layer, scope: Scope, into: list[list[int]], i_slot: int) -> None:
        """The records of one layer (an If: its branches' too) appended to ``into``."""
        op, ins, outs = layer.op_type, step.inputs, step.outputs
        if layer.domain or op not in OPS or op == "SequenceInsert":
            raise Refused
        if op == "If":
            self._if(step, scope, into, i_slot)
            return
        if len(outs) != 1:
            raise Refused
        out = outs[0]
        if op == "Identity" or (op == "Cast" and self.dtypes[scope.of(ins[0])]
                                == np.dtype(_onnx_type(layer.attrs.get("to")))):
            scope.alias[out] = scope.alias.get(ins[0], ins[0])
            return
        record = self._record(op, layer, ins, scope, i_slot)
        scope.at[out] = record[1]
        into.append(record)
        if op == "Gemm":
            self.params[id(record)] = (float(layer.attrs.get("alpha", 1.0)),
                                       float(layer.attrs.get("beta", 1.0)))

    def _record(self, op, layer, ins, scope: Scope, i_slot: int) -> list[int]:
        if op == "Gather":
            data = scope.of(ins[0])
            shape, dtype = self.shapes[data], self.dtypes[data]
            if not shape:
                raise Refused
            axis = layer.attrs.get("axis", 0) % len(shape)
            inner = _size(shape[axis + 1:]) * dtype.itemsize
            kept = shape[:axis] + shape[axis + 1:]
            if ins[1] == i_slot:
                self.most_trips = min(self.most_trips, shape[axis])
                return [GATHER_I, self.buffer(kept, dtype), data, -1, -1, _size(shape[:axis]),
                        shape[axis], inner]
            index = scope.of(ins[1])  # read at each iteration (C checks its range)
            if self.dtypes[index] != I64 or self.shapes[index] not in ((), (1,)):
                raise Refused
            if self.shapes[index]:  # a (1,) index keeps the axis, of size 1
                kept = shape[:axis] + (1,) + shape[axis + 1:]
            return [GATHER_C, self.buffer(kept, dtype), data, -1, index, _size(shape[:axis]),
                    shape[axis], inner]
        if op == "Gemm":
            return self._gemm(layer, ins, scope)
        if op in ("Add", "Sub", "Mul", "Div", "Greater", "Less", "Equal"):
            a, b = scope.of(ins[0]), scope.of(ins[1])
            sa, sb, dtype = self.shapes[a], self.shapes[b], self.dtypes[a]
            table = COMPARE if op in ("Greater", "Less", "Equal") else BINARY
            if dtype != self.dtypes[b] or op not in table.get(dtype, {}):
                raise Refused
            shape = np.broadcast_shapes(sa, sb)
            if not (_trailing(sa, shape) and _trailing(sb, shape)):
                raise Refused
            out = self.buffer(shape, BOOL if table is COMPARE else dtype)
            return [table[dtype][op], out, a, b, -1, _size(shape), _size(sa), _size(sb)]
        if op in REDUCE_ALL:
            a = scope.of(ins[0])
            shape = self.shapes[a]
            axes = layer.attrs.get("axes")
            if len(ins) > 1 and ins[1] != NONE_SLOT:
                axes = scope.constant(ins[1])
            if axes is not None and len(axes) and (not shape or sorted(
                    int(x) % len(shape) for x in np.ravel(axes)) != list(range(len(shape)))):
                raise Refused  # some of the axes only
            if self.dtypes[a] != F32 or not _size(shape) or (
                    layer.attrs.get("noop_with_empty_axes", 0) and (axes is None or not len(axes))):
                raise Refused
            kept = (1,) * len(shape) if layer.attrs.get("keepdims", 1) else ()
            return [REDUCE_ALL[op], self.buffer(kept, F32), a, -1, -1, _size(shape), 0, 0]
        if op in RESHAPES:
            a = scope.of(ins[0])
            shape = _reshaped(layer, self.shapes[a], self.dtypes[a],
                              [scope.constant(s) for s in ins[1:]])
            return [COPY, self.buffer(shape, self.dtypes[a]), a, -1, -1, self.bytes_of(a), 0, 0]
        if op in UNARY:
            a = scope.of(ins[0])
            if self.dtypes[a] != F32:
                raise Refused
            return [UNARY[op], self.buffer(self.shapes[a], F32), a, -1, -1,
                    _size(self.shapes[a]), 0, 0]
        raise Refused

    def _gemm(self, layer, ins, scope: Scope) -> list[int]:
        a, b = scope.of(ins[0]), scope.of(ins[1])
        c = scope.of(ins[2]) if len(ins) > 2 and ins[2] != NONE_SLOT else -1
        sa, sb = self.shapes[a], self.shapes[b]
        ta, tb = int(layer.attrs.get("transA", 0)), int(layer.attrs.get("transB", 0))
        if len(sa) != 2 or len(sb) != 2 or any(self.dtypes[k] != F32 for k in (a, b, c) if k >= 0):
            raise Refused
        m, k = (sa[1], sa[0]) if ta else sa
        kb, n = (sb[1], sb[0]) if tb else sb
        if k != kb:
            raise Refused
        if tb and b in self.fixed:  # a constant weight read as (K, N) rows: its transpose, once
            b = self.constant(np.ascontiguousarray(self.fixed[b].T))
            tb = 0
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
                raise Refused
        return [GEMM | flags, self.buffer((m, n), F32), a, b, c, m, k, n]

    def _if(self, step, scope: Scope, into: list[list[int]], i_slot: int) -> None:
        """An If of the body: each branch (a flat body: ``flat.FlatBody``) planned in a scope of
        its own over the If's inputs' buffers, its records kept apart, its outputs copied into
        the If's; the If record picks one by the predicate at run time."""
        runs = getattr(step.workload, "runs", None)
        pred = scope.of(step.inputs[0])
        if runs is None or len(runs) != 2 or self.dtypes[pred] != BOOL \
                or self.shapes[pred] not in ((), (1,)):
            raise Refused
        outputs: list[int] | None = None
        spans = []
        for run in runs:
            if not hasattr(run, "layer_of") or not hasattr(run, "template"):
                raise Refused  # not a flat body
            inner = Scope(self, None, run.template,
                          {slot: scope.of(given) for slot, given
                           in zip(run.input_slots, step.inputs[1:])})
            records: list[list[int]] = []
            for inner_step in run.host_plan.steps:
                layer = run.layer_of.get(id(inner_step.workload))
                if layer is None or i_slot in inner_step.inputs:
                    raise Refused
                self._emit(inner_step, layer, inner, records, -1)
            made = [inner.of(slot) for slot in run.output_slots]
            if outputs is None:
                outputs = [self.buffer(self.shapes[k], self.dtypes[k]) for k in made]
            if len(made) != len(outputs) or any(
                    self.shapes[k] != self.shapes[o] or self.dtypes[k] != self.dtypes[o]
                    for k, o in zip(made, outputs)):
                raise Refused
            records += [[COPY, o, k, -1, -1, self.bytes_of(k), 0, 0] for k, o in zip(made, outputs)]
            spans.append(len(self.branches))
            self.branches += records
            spans.append(len(records))
        assert outputs is not None
        for slot, buffer in zip(step.outputs, outputs):
            scope.at[slot] = buffer
        into.append([IF, outputs[0] if outputs else -1, pred, -1, spans[3], spans[0], spans[1],
                     spans[2]])

    def _freeze(self) -> None:
        """The arena's layout, the records as one array (pre, body, branches: an If's offsets
        made absolute), the addresses of the constants."""
        offsets, size = [], 0
        for k, _ in enumerate(self.shapes):
            if k in self.given or k in self.rows or k in self.fixed:
                offsets.append(-1)
                continue
            offsets.append(size)
            size += -(-max(self.bytes_of(k), 1) // 64) * 64
        self.offsets, self.arena = offsets, size
        branch_at = len(self.pre) + len(self.body)
        records = self.pre + self.body + self.branches
        for record in records:
            if record[0] == IF:  # branch spans: then [n0, n0 + n1), else [n2, n2 + c)
                record[5] += branch_at
                record[7] += branch_at
        params = [self.params.get(id(r), (1.0, 1.0)) for r in records]
        self.records = np.array(records, np.int64).reshape(-1, 8)
        self.param_array = np.array(params or [(1.0, 1.0)], np.float64).reshape(-1)
        self.base = np.zeros(len(self.shapes), np.int64)
        for k, value in self.fixed.items():
            self.base[k] = address(value)
        self.in_arena = np.array([k for k, o in enumerate(offsets) if o >= 0], np.int64)
        self.arena_bytes = np.array([o for o in offsets if o >= 0], np.int64)
        self.per_call = list(self.given.items())
        self.addresses = (address(self.records), address(self.param_array))
        self.carried = [(kind, (offsets[what], self.bytes_of(what), self.shapes[what],
                                self.dtypes[what])) if kind == "tensor" else (kind, what)
                        for kind, what in self.carried]
        self.row_shapes = [(k, self.shapes[k][1:], self.dtypes[k]) for k in sorted(self.rows)]
        if self.condition >= 0 and self.rows:
            self.most_trips = min(self.most_trips, MOST_ROWS)

    # -- a call ----------------------------------------------------------------------------------
    def run(self, env: list[Any], trips: int, function: Any) -> tuple[Any, ...]:
        ptrs = self.base.copy()
        kept = []
        for buffer, slot in self.per_call:
            value = np.ascontiguousarray(env[slot])
            kept.append(value)
            ptrs[buffer] = address(value)
        arena = np.empty(max(self.arena, 1), np.uint8)
        ptrs[self.in_arena] = address(arena) + self.arena_bytes
        rows = {}
        for k, shape, dtype in self.row_shapes:
            rows[k] = np.empty((trips, *shape), dtype)
            ptrs[k] = address(rows[k])
        records, params = self.addresses
        count = function(records, params, len(self.pre), len(self.pre), len(self.body),
                         address(ptrs), trips, self.condition)
        if count < 0:
            return None  # an index out of range: the kernels run and say so
        carried: list[Any] = []
        for kind, what in self.carried:
            if kind == "tensor":
                start, size, shape, dtype = what
                carried.append(arena[start:start + size].view(dtype).reshape(shape).copy())
            else:
                buffer, slot = what  # the sequence given to this call, grown
                carried.append([*env[slot], *rows[buffer][:count]])
        return (*carried, *(rows[buffer][:count] for buffer in self.scans))


def _reshaped(layer: Any, shape: tuple[int, ...], dtype: np.dtype,
              constants: Sequence[Any]) -> tuple[int, ...]:
    """The shape ``layer`` (one of RESHAPES) gives an input of ``shape``: its CpuRef kernel run on
    an empty array of it and the layer's other inputs, which must be constants (Refused else)."""
    from backplane.backends.api.backend import kernel_key
    from backplane.backends.api.kernels import bind_kernel, select_kernel
    from backplane.backends.reference.kernels import KERNELS

    kernel = select_kernel(KERNELS, kernel_key(layer), layer.opset)
    if kernel is None:
        raise Refused
    (out,) = bind_kernel(kernel, layer.attrs, 1)(np.empty(shape, dtype), *constants)
    return tuple(int(d) for d in out.shape)


def _onnx_type(to: Any) -> Any:
    from onnx.helper import tensor_dtype_to_np_dtype

    try:
        return tensor_dtype_to_np_dtype(int(to))
    except (TypeError, ValueError, KeyError):
        return object
