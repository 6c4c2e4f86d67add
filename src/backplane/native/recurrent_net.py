"""A CpuAcc partition of recurrent layers and the moves around them, planned at load and run as
one C call (``recurrent_net.h``, in the ``recurrent`` library): the route "native" of a Traced
partition that ``fusion/recurrent_net.py`` finds whole of these.

Why: in a trace each recurrent op cost 10-15 us of Python dispatch (``backplane::native_stack``,
torch's custom op) and each of the trace's other ops 2-5 us (a Transpose, the Slices of the
initial states, the head's ``addmm``, a Concat), around layers whose arithmetic takes 5-20 us at
the corpus's sizes (lstm_bi2_ts14, gru_tm3_ts13, the VAD's one-step LSTM); ONNX Runtime runs such
a whole net in 60-100 us.

What a plan takes: ONNX's LSTM and GRU (the default activations, no clip, no peepholes or all
zero, no input_forget, layout 0, no sequence_lens, constant float32 weights), CpuAcc's fused
``LstmStack`` and ``GruStack``, its ``Linear`` (a constant weight, a bias, Relu, Sigmoid or Tanh
after it), and Transpose, Squeeze, Unsqueeze, Reshape, Flatten, Identity, Slice (steps of 1 or
more), Gather of constant indices, Concat. The moves are views (a value is a place, a shape and
strides in floats) where they can be, else strided copies; every output is copied into the
caller's fresh tensor at the end. Anything else raises ``Unplannable`` and the partition keeps
its trace.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.native.arena import ArenaExecutor

REC = 32
"""Int64 fields a record (``recurrent_net.h``'s ``REC``)."""
RNN, LINEAR, COPY, SOFTMAX = 1, 2, 3, 4
ACTS = {None: 0, "relu": 1, "sigmoid": 2, "tanh": 3}
ARENA, PARAMS, EXT = 0, 1, 2
DIRECTIONS = {"forward": 0, "reverse": 1, "bidirectional": 2}
ALIGN = 16  # floats: each buffer and constant starts on a 64-byte line
LINEAR_MACS = 1 << 22
"""The largest product (rows x inputs x outputs: a Linear head, a large layer's input projection)
a plan takes where the library's tile is AVX2's (6 rows x 16 outputs, ``panel_product.h``):
about MKL's speed at the corpus's small sizes but not at large ones on the AVX2 EPYC it was
measured on, where the call's cost no longer matters; such a partition keeps its trace. 1 thread,
thread CPU us, C / torch's F.linear (load 7.8): 100 x 64 x 1024 446-500 / 534-670, 100 x 256 x
1024 (the full-tier lstm_bi2's second projection) 1471-1495 / 945-1080, 80 x 192 x 40 49 / 41,
8 x 48 x 6 2.2 / 9.1. (With the product in C the full-tier lstm_bi2_ts14 ran 6594 us against
5106 traced: ``python bench/recurrent_native.py --tier full``.) No bound with AVX-512's tile
(``largest_product``)."""
WIDE_ROWS = 12
"""``backplane_rnet_rows()`` of a library built with AVX-512's tile (12 rows x 32 outputs)."""


def largest_product() -> float:
    """The largest product a plan takes on this machine's library: ``LINEAR_MACS`` with AVX2's
    tile, none with AVX-512's, which runs 2.3-2.5 times torch's MKL here at every size measured
    (AMD EPYC family 26, 1 thread, thread CPU us, C / F.linear, load 3-9: 80 x 64 x 256 11.5 /
    27.3, 32 x 256 x 768 50 / 129, 100 x 256 x 1024 212 / 493; torch's 2 threads would at best
    halve its figures): the full-tier lstm_bi2_ts14 at 2 threads, load 8.4, 1773 -> 1049 us a
    run, its projections in the plan (ONNX Runtime 1.5 ms)."""
    if not _WIDE:
        from backplane.native.build import NativeUnavailable, library

        try:
            rows = library("recurrent").backplane_rnet_rows()
        except NativeUnavailable:  # not kept: no library now (switched off) says nothing of
            return LINEAR_MACS     # the tile a later build has (a test's switch latched it)
        _WIDE.append(rows >= WIDE_ROWS)
    return math.inf if _WIDE[0] else LINEAR_MACS


_WIDE: list[bool] = []


class Unplannable(Exception):
    """A layer the plan does not take (the partition keeps its trace)."""


class View:
    """A value: where it starts (slot, offset in floats), its shape and strides in floats."""

    __slots__ = ("slot", "offset", "shape", "strides")

    def __init__(self, slot: int, offset: int, shape: Sequence[int],
                 strides: Sequence[int] | None = None) -> None:
        self.slot, self.offset, self.shape = slot, offset, tuple(int(d) for d in shape)
        self.strides = tuple(strides) if strides is not None else _dense(self.shape)

    def ref(self) -> int:
        return self.slot << 40 | self.offset

    def dense(self) -> bool:
        """Whether it is contiguous (row-major, sizes of 1 aside)."""
        return all(s == d for n, s, d in zip(self.shape, self.strides, _dense(self.shape))
                   if n != 1)

    def moved(self, shape: Sequence[int], strides: Sequence[int], offset: int = 0) -> View:
        return View(self.slot, self.offset + offset, shape, strides)


def _dense(shape: Sequence[int]) -> tuple[int, ...]:
    strides, size = [], 1
    for d in reversed(shape):
        strides.append(size)
        size *= int(d)
    return tuple(reversed(strides))


def _merged(shape: Sequence[int], src: Sequence[int],
            dst: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """A copy's dimensions without those of size 1, neighbours merged where both sides step
    over them as one: a dense copy is one run of floats (one ``memcpy`` in the C, where it was
    one a row: the CRNN's 80 rows of 40, 2.5 -> 0.5 us)."""
    dims = [(n, s, d) for n, s, d in zip(shape, src, dst) if n != 1] or [(1, 1, 1)]
    merged = [list(dims[0])]
    for n, s, d in dims[1:]:
        outer = merged[-1]
        if outer[1] == s * n and outer[2] == d * n:
            outer[0], outer[1], outer[2] = outer[0] * n, s, d
        else:
            merged.append([n, s, d])
    return [m[0] for m in merged], [m[1] for m in merged], [m[2] for m in merged]


class Plan:
    """The records, constants and arena of a partition; ``output_shapes`` and ``input_shapes``
    for the caller's buffers (``fusion/native_cnn._workload`` reads them)."""

    def __init__(self, input_shapes: Sequence[Sequence[int]]) -> None:
        self.input_shapes = [tuple(s) for s in input_shapes]
        self.output_shapes: list[tuple[int, ...]] = []
        self.rows: list[list[int]] = []
        self.kinds: list[str] = []  # each record's layer, for the profile
        self.pieces: list[np.ndarray] = []
        self.size = 0  # constant floats so far
        self.arena = 0  # arena floats so far
        self.flops = 0

    @property
    def records(self) -> np.ndarray:
        return np.array(self.rows, np.int64).reshape(-1, REC)

    @property
    def params(self) -> np.ndarray:
        return np.concatenate(self.pieces) if self.pieces else np.zeros(ALIGN, np.float32)

    def const(self, array: Any) -> View:
        values = np.ascontiguousarray(np.asarray(array, np.float32))
        at = self.size
        padded = -(-max(values.size, 1) // ALIGN) * ALIGN
        self.pieces.append(np.concatenate([values.reshape(-1),
                                           np.zeros(padded - values.size, np.float32)]))
        self.size += padded
        return View(PARAMS, at, values.shape)

    def panels(self, weight: Any, bias: Any) -> tuple[int, int]:
        """A Linear's weight (N, K) as ``recurrent_net.h``'s product reads it (its outputs in
        panels of 16, each panel's K rows of 16 contiguous, the last padded with zeros) and its
        bias padded so (-1 where none): their references."""
        weight = np.asarray(weight, np.float32)
        n, k = weight.shape
        count = -(-n // 16)
        padded = np.zeros((count * 16, k), np.float32)
        padded[:n] = weight
        packed = padded.reshape(count, 16, k).transpose(0, 2, 1)  # (panels, K, 16)
        if bias is None:
            return self.const(packed).ref(), -1
        wide = np.zeros(count * 16, np.float32)
        wide[:n] = np.asarray(bias, np.float32).reshape(-1)
        return self.const(packed).ref(), self.const(wide).ref()

    def buffer(self, shape: Sequence[int]) -> View:
        at = self.arena
        self.arena += -(-max(math.prod(shape), 1) // ALIGN) * ALIGN
        return View(ARENA, at, shape)

    def record(self, kind: str, fields: Sequence[int]) -> None:
        self.rows.append([int(f) for f in fields] + [0] * (REC - len(fields)))
        self.kinds.append(kind)

    def copy(self, src: View, dst: View, kind: str) -> None:
        shape, ss, ds = _merged(src.shape, src.strides, dst.strides)
        if len(shape) > 6:
            raise Unplannable("a move of more than 6 dimensions")
        pad = 6 - len(shape)
        self.record(kind, [COPY, *([1] * pad), *shape, src.ref(), *([0] * pad), *ss,
                           dst.ref(), *([0] * pad), *ds])

    def dense(self, view: View, kind: str) -> View:
        """``view``, or a contiguous copy of it."""
        if view.dense():
            return view.moved(view.shape, _dense(view.shape))
        made = self.buffer(view.shape)
        self.copy(view, made, kind)
        return made


def plan(layers: Sequence[Any], constants: dict[str, Any], inputs: Sequence[str],
         shapes: Sequence[Sequence[int]], outputs: Sequence[str]) -> Plan:
    """The partition's plan; raises ``Unplannable``."""
    from backplane.native import recurrent_layers as kinds

    planned = Plan(shapes)
    values: dict[str, View] = {n: View(EXT + i, 0, s) for i, (n, s) in enumerate(zip(inputs,
                                                                                        shapes))}
    made: dict[int, View] = {}  # a constant's view by the array's id

    def get(name: str) -> View:
        found = values.get(name)
        if found is None:
            array = constants.get(name)
            if array is None or np.asarray(array).dtype != np.float32:
                raise Unplannable(f"{name}: neither a value made here nor a float32 constant")
            found = made.get(id(array))
            if found is None:
                found = made[id(array)] = planned.const(array)
        return found

    for layer in layers:
        planner = kinds.PLANNERS.get(layer.op_type)
        if planner is None or layer.domain not in ("", "ai.onnx", kinds.FUSED):
            raise Unplannable(f"{layer.op_type} is not planned")
        results = planner(layer, planned, get, constants)
        for name, view in zip(layer.outputs, results):
            if name:
                values[name] = view
    for index, name in enumerate(outputs):
        src = get(name)
        planned.output_shapes.append(src.shape)
        planned.copy(src, View(EXT + len(inputs) + index, 0, src.shape), "output")
    return planned


def _aligned(size: int) -> np.ndarray:
    """``size`` float32 zeros from a 64-byte line. Why: the products read 16 floats at once
    (a whole line with AVX-512) from offsets planned as multiples of ``ALIGN``; NumPy's memory
    starts 16 bytes aligned, and every such load of a misaligned start spans two lines (the
    small-tier CRNN's LSTM layer, its loop over R alone, 1 thread: 20 -> 13 us)."""
    raw = np.zeros(size + ALIGN, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + size]


class Executor(ArenaExecutor):
    """A plan bound to the library: ``run(pointers)`` makes one call (the inputs' then the
    outputs' data, contiguous float32); see ``arena.ArenaExecutor``."""

    def __init__(self, planned: Plan, library: ctypes.CDLL) -> None:
        self.plan, self.library = planned, library
        if library.backplane_rnet_rec() != REC:
            raise RuntimeError("the recurrent library's records are not this module's")
        params = planned.params
        aligned = _aligned(params.size)  # each constant on a 64-byte line, as planned
        aligned[:] = params
        self._bind(library.backplane_rnet_run, planned.records, aligned,
                   self._fresh_arena(), len(planned.input_shapes) + len(planned.output_shapes))

    def _fresh_arena(self) -> np.ndarray:
        return _aligned(max(self.plan.arena, ALIGN))

    def _failure(self, index: int) -> Exception:
        return MemoryError(f"native recurrent net: record {index} ({self.plan.kinds[index]}) "
                           "could not run")

    def profile(self, values: Sequence[np.ndarray], times: int = 1) -> list[float]:
        """The whole call's thread CPU seconds (one share: the records are not timed apart)."""
        import time

        outputs = [np.empty(shape, np.float32) for shape in self.plan.output_shapes]
        values = [np.ascontiguousarray(v, np.float32) for v in values]
        start = time.thread_time()
        for _ in range(times):
            self.run([v.ctypes.data for v in (*values, *outputs)])
        return [(time.thread_time() - start) / times]

    def numpy(self, *values: np.ndarray) -> list[np.ndarray]:
        """The plan run on NumPy arrays (tests): fresh outputs."""
        values = tuple(np.ascontiguousarray(v, np.float32) for v in values)
        outputs = [np.empty(shape, np.float32) for shape in self.plan.output_shapes]
        self.run([v.ctypes.data for v in (*values, *outputs)])
        return outputs
