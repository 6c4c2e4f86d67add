"""A small CNN partition's layers as one plan for ``cnn.c``: run in one ctypes call.

Why: a 32x32 CNN's layers each do a few microseconds of arithmetic, and torch's oneDNN Graph
partitions cost 6-9 us each beyond it (its bridge 1-3 more): resnet_basic_ts16's seven partitions
can never reach ONNX Runtime's ~5 us a layer. Planned here at load, once: every tensor a place in
one arena (reused after its last reader), channels-last; the weights packed for the kernels'
register tiles; the layers a flat array of int64 records. A run is then one call of C.

``plan`` takes a partition's layers (CpuAcc's fused layers: FusedConv, Linear, and the plain ops
of ``OPS``) and gives a ``Plan``, or raises ``Unplannable`` naming the first layer it cannot take
(the partition then keeps its torch route).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane.ir.graph import Layer
from backplane.native.arena import ArenaExecutor

FIELDS = ("op in in2 out n h w c oh ow oc kh kw sh sw dh dw pt pl g woff boff act aoff scr ph pw "
          "vb x1 x2 macs split").split()
"""A record's fields, in cnn.c's order (its enum F_*; ``macs``, its multiply-adds, only read
here; ``split``, set by ``plan``: the record's work shared by the run's threads); a record is
NF = 32 int64s."""
NF = 32
OPS = {name: code for code, name in enumerate(
    "import export conv dwconv maxpool avgpool gap gmp linear add mul act slice deconv resize "
    "gather scatter arith reduce gnorm lnorm topk dgather export_int argreduce softmax "
    "embed rownorm".split(), 1)}
ARITH = {name: code for code, name in enumerate("Add Sub Mul Div Pow AffineChain".split())}
REDUCE = {name: code for code, name in enumerate(
    "ReduceMax ReduceMin ReduceSum ReduceMean".split())}
ACTS = {name: code for code, name in enumerate(
    "none relu clip hswish hsigmoid sigmoid swish leaky tanh gelu erf".split())}
UNARY = {"relu": "relu", "hardtanh": "clip", "hardswish": "hswish", "hardsigmoid": "hsigmoid",
         "sigmoid": "sigmoid", "swish": "swish", "leaky_relu": "leaky", "tanh": "tanh"}
"""FusedConv's and Linear's post-ops (``patterns.post_op``'s names) the kernels apply."""
ELEMENTWISE = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "HardSwish": "hswish",
               "HardSigmoid": "hsigmoid", "LeakyRelu": "leaky", "Clip": "clip",
               "GeluChain": "gelu", "Erf": "erf"}
VIEWS = ("Flatten", "Reshape", "Identity", "Squeeze", "Unsqueeze")
INTEGER = frozenset((*VIEWS, "Transpose", "Slice", "Split", "Concat", "Expand", "Gather",
                     "GatherElements", "GatherND", "Cast", "Embedding"))
"""The layers that may read integer values (they move them, or gather by them): any other
reading one is not planned (float arithmetic is not int64's: a Div, an overflow)."""
TO_FLOATS = frozenset(("Cast", "Embedding"))
"""Of those, the layers whose outputs are not indices (a Cast's marks its own)."""
GATHERED = {("Embedding", 0), ("Gather", 1), ("GatherElements", 1), ("GatherND", 1)}
"""(layer, input) pairs where an int32 or int64 input of the partition may be read: as indices
only, where one without an exact float (above 2^24, whose import fails the call) is out of any
planned axis's range anyway, as CpuRef's gather raises; a bool input (0, 1) anywhere."""
OUTPUTS = {"Split": 0, "TopK": 2, "WindowedConv": 0}
"""The layers of more than one output (0: any count)."""
ALIGN = 16  # floats: each tensor's place starts on a 64-byte line
SPLIT_MACS = 1_000_000
"""The fewest multiply-adds of a split convolution: ~20 us of one thread's work, where waking a
worker and waiting for its last grain (1-5 us, more where it slept) is a small part."""
SPLIT_ELEMENTS = 32_768
"""The fewest elements (read or written, a window's taps counted) of another split record: a
move or an elementwise pass of ~30-50 us."""


def _work(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each record's multiply-adds where it is a convolution, and elements where it is one of
    the other kinds ``cnn_split.h`` shares (0 for any other; an edge of float32, whose F_X1 is
    0: ``cnn_split.h`` leaves a float16 or integer one to the caller)."""
    col = {name: records[:, FIELDS.index(name)] for name in
           ("op", "n", "c", "oh", "ow", "kh", "kw", "macs")}
    op, macs = col["op"], col["macs"]
    convolutions = np.where(np.isin(op, [OPS["conv"], OPS["dwconv"]]), macs, 0)
    out = col["n"] * col["oh"] * col["ow"] * col["c"]
    edges = np.isin(op, [OPS["import"], OPS["export"]]) & (records[:, FIELDS.index("x1")] == 0)
    elements = np.select(
        [edges, np.isin(op, [OPS["maxpool"], OPS["avgpool"]]), op == OPS["resize"],
         np.isin(op, [OPS["slice"], OPS["softmax"]]),
         np.isin(op, [OPS["gather"], OPS["scatter"], OPS["arith"], OPS["act"]])],
        [col["n"] * col["c"] * records[:, FIELDS.index("h")] * records[:, FIELDS.index("w")],
         out * col["kh"] * col["kw"], out * 4, col["n"] * col["c"], col["n"]], 0)
    return convolutions, elements


class Unplannable(NotImplementedError):
    """A layer (or the partition's edges) the native plan does not take; the message says which."""


@dataclass
class Value:
    """A tensor in the arena, channels-last: ``dims`` (n, c, h, w); ``shape`` its ONNX shape;
    ``integer``: indices (a TopK's, an ArgMax's) kept as floats, exact below 2^24 (``INTEGER``);
    ``rows``: kept in ONNX's order instead (a product's rows, ``cnn_seq``), which only the plan's
    outputs read as it is: ``_Planner.value`` gives any other reader a channels-last copy."""

    offset: int
    dims: tuple[int, int, int, int]
    shape: tuple[int, ...]
    integer: bool = False
    rows: bool = False

    @property
    def size(self) -> int:
        return math.prod(self.dims)


@dataclass
class Plan:
    """The records, the packed parameters, the arena's size, and the edges' ONNX shapes."""

    records: np.ndarray
    params: np.ndarray
    arena: int
    input_shapes: list[tuple[int, ...]]
    output_shapes: list[tuple[int, ...]]
    ops: list[str] = field(default_factory=list)
    names: list[tuple[str, str]] = field(default_factory=list)
    """Each record's layer (name, op type): the profile's rows."""
    input_dtypes: list[Any] = field(default_factory=list)
    output_dtypes: list[Any] = field(default_factory=list)
    """The edges' NumPy types: float32, or float16 where ``halved`` made them so."""

    def halved(self, inputs: Sequence[bool], outputs: Sequence[bool]) -> None:
        """The edges marked True as float16, converted by the import and export records
        (``cnn.c``'s ``half_edge``; only where ``backplane_cnn_half`` says the build has it)."""
        column = FIELDS.index("x1")
        self.records[:len(inputs), column] = inputs
        self.records[len(self.records) - len(outputs):, column] = outputs
        self.input_dtypes = [np.float16 if h else np.float32 for h in inputs]
        self.output_dtypes = [np.float16 if h else np.float32 for h in outputs]

    @property
    def flops(self) -> int:
        """Multiply-adds of the convolutions and products (what the route's size rule reads)."""
        return int(self.records[:, FIELDS.index("macs")].sum())


class _Arena:
    """Places in one arena: a tensor's place freed after its last reader is given to a later one."""

    def __init__(self) -> None:
        self.end, self.free = 0, []  # free: (offset, size)

    def take(self, size: int) -> int:
        size = -(-size // ALIGN) * ALIGN
        for i, (offset, room) in enumerate(self.free):
            if room >= size:
                self.free[i:i + 1] = [(offset + size, room - size)] if room > size else []
                return offset
        offset, self.end = self.end, self.end + size
        return offset

    def give(self, offset: int, size: int) -> None:
        self.free.append((offset, -(-size // ALIGN) * ALIGN))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for at, room in self.free:
            if merged and merged[-1][0] + merged[-1][1] == at:
                merged[-1] = (merged[-1][0], merged[-1][1] + room)
            else:
                merged.append((at, room))
        self.free = merged


def _dims(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """An ONNX shape's (n, c, h, w): (N, C, H, W); (N, C, L) as a line of height 1; (N, K)."""
    if len(shape) == 4:
        return tuple(shape)  # type: ignore[return-value]
    if len(shape) == 3:
        return (shape[0], shape[1], 1, shape[2])
    if len(shape) == 2:
        return (shape[0], shape[1], 1, 1)
    return (shape[0] if shape else 1, math.prod(shape[1:]), 1, 1)  # 1-, 5-d...: ONNX's order


class _Planner:
    def __init__(self, layers: Sequence[Layer], constants: Mapping[str, np.ndarray],
                 inputs: Sequence[str], shapes: Sequence[Sequence[int]], outputs: Sequence[str]):
        self.layers, self.constants, self.outputs = list(layers), constants, list(outputs)
        self.arena, self.values, self.records, self.params = _Arena(), {}, [], []
        self.param_size, self.slack, self.ops, self.names = 0, 0, [], []
        self.index, self.made = -1, {}  # the layer planned now; each value's maker's index
        self.current = ("the partition's inputs", "NativeImport")
        self.last = {n: i for i, lay in enumerate(self.layers) for n in lay.inputs if n}
        self.last.update({n: len(self.layers) for n in outputs})
        for index, (name, shape) in enumerate(zip(inputs, shapes)):
            value = self.new(name, tuple(shape))
            self.record("import", in_=index, out=value.offset, dims=value.dims)

    def new(self, name: str, shape: tuple[int, ...]) -> Value:
        dims = _dims(shape)
        value = Value(self.arena.take(math.prod(dims)), dims, shape)
        self.values[name] = value
        return value

    def param(self, array: np.ndarray) -> int:
        offset = self.param_size
        flat = np.ascontiguousarray(array, np.float32).reshape(-1)
        padded = -(-flat.size // ALIGN) * ALIGN
        self.params.append(np.pad(flat, (0, padded - flat.size)))
        self.param_size += padded
        return offset

    def record(self, op: str, in_: int = -1, out: int = -1, dims: Sequence[int] = (1, 1, 1, 1),
               **fields: int) -> None:
        row = np.zeros(NF, np.int64)
        row[FIELDS.index("in2")] = row[FIELDS.index("scr")] = -1
        values = {"op": OPS[op], "in": in_, "out": out, **dict(zip("nchw", dims)), **fields}
        for name, number in values.items():
            row[FIELDS.index(name)] = int(number)
        self.records.append(row)
        self.ops.append(op)
        self.names.append(self.current)

    def places(self, value: Value) -> np.ndarray:
        """Each element's place in ``value`` (from its offset), in ONNX order of its shape."""
        if value.rows:
            return np.arange(value.size).reshape(value.shape)
        n, c, h, w = value.dims
        return np.arange(value.size).reshape(n, h, w, c).transpose(0, 3, 1, 2).reshape(
            value.shape)

    def moved(self, x: Value, name: str, places: np.ndarray) -> None:
        """``name``, of ``places``' shape, made of ``x``'s elements at ``places`` (``places``
        of ``x``, rearranged): the same place where channels-last orders them alike, else a
        gather record."""
        shape = tuple(int(d) for d in places.shape)
        n, c, h, w = _dims(shape)
        table = places.reshape(n, c, h, w).transpose(0, 2, 3, 1).reshape(-1)
        if table.size == x.size and np.array_equal(table, np.arange(x.size)):
            self.values[name] = Value(x.offset, (n, c, h, w), shape, x.integer)
            return
        y = self.new(name, shape)
        y.integer = x.integer
        self.record("gather", in_=x.offset, out=y.offset, dims=(y.size, 1, 1, 1),
                    woff=self.param(table.astype(np.int32).view(np.float32)))

    def table(self, array: np.ndarray) -> int:
        """An int32 table (places) in the parameters: its offset."""
        return self.param(np.ascontiguousarray(array, np.int32).reshape(-1).view(np.float32))

    def laid(self, shape: tuple[int, ...], logical: np.ndarray) -> np.ndarray:
        """``logical`` (ONNX order, broadcast to ``shape``) in the order a value of ``shape``
        keeps in the arena."""
        n, c, h, w = _dims(shape)
        return np.ascontiguousarray(np.broadcast_to(logical, shape)).reshape(
            n, c, h, w).transpose(0, 2, 3, 1).reshape(-1)

    def value(self, name: str, rows: bool = False) -> Value:
        """The planned ``name``, channels-last (a value kept in ONNX's order gathered to a
        copy, which stands for it after), or as it is with ``rows``."""
        if name not in self.values:
            raise Unplannable(f"{name!r} is neither an input of the partition nor planned "
                              "(a constant operand)")
        found = self.values[name]
        if found.rows and not rows:
            self.moved(found, name, self.places(found))
        return self.values[name]

    def release(self, index: int, layer: Layer) -> None:
        """The places of the tensors whose last reader was ``layer``."""
        given = set()
        for name in dict.fromkeys(layer.inputs):
            if name and self.last.get(name) == index and name in self.values:
                value = self.values[name]  # a view shares its place: given with the last reader
                if value.offset not in given and not any(
                        v.offset == value.offset for n, v in self.values.items()
                        if n != name and self.last.get(n, -1) > index):
                    self.arena.give(value.offset, value.size)
                    given.add(value.offset)

    def folding(self, name: str) -> np.ndarray | None:
        """The record of the convolution or product that made ``name`` in the layer just before,
        where the layer now planned can be its post-op (its residual, then its activation): the
        value read by no later layer, no output, no view of it, the record without either yet.
        Why: a float16 partition's layers come unfused (Conv, then Clip), and a pass of its own
        over the tensor costs what the kernel's ``finish`` does while the rows are in L1."""
        row, value = self.records[-1], self.values.get(name)
        if value is None or self.made.get(name) != self.index - 1 or name in self.outputs \
                or self.last.get(name) != self.index or row[FIELDS.index("act")] \
                or row[FIELDS.index("op")] not in (OPS["conv"], OPS["dwconv"], OPS["linear"]) \
                or row[FIELDS.index("out")] != value.offset or any(
                    v.offset == value.offset for n, v in self.values.items()
                    if n != name and self.last.get(n, -1) >= self.index):
            return None
        return row

    def activation(self, unary: Any) -> tuple[int, int]:
        """(act code, params offset) of a post-op ``(name, scalars, algorithm)``."""
        if unary is None:
            return ACTS["none"], 0
        name, scalars, _ = unary
        if name not in UNARY:
            raise Unplannable(f"the post-op {name!r}")
        kind = UNARY[name]
        numbers = {"clip": list(scalars), "hsigmoid": [1 / 6, 0.5],
                   "leaky": [scalars[0] if scalars else 0.01]}.get(kind, [0.0])
        return ACTS[kind], self.param(np.array(numbers, np.float32))


def plan(layers: Sequence[Layer], constants: Mapping[str, np.ndarray], inputs: Sequence[str],
         input_shapes: Sequence[Sequence[int]], outputs: Sequence[str],
         input_dtypes: Sequence[Any] | None = None) -> Plan:
    """The plan of a static partition: ``layers`` in order, reading ``inputs`` of
    ``input_shapes`` (float32, or ``input_dtypes``: int32, int64 and bool inputs become indices,
    ``cnn_seq``) and ``constants``, writing ``outputs``. Raises ``Unplannable``."""
    from backplane.native import cnn_layers, cnn_seq

    kinds = [cnn_seq.integer_kind(t) for t in input_dtypes or [np.float32] * len(inputs)]
    if -1 in kinds:
        raise Unplannable(f"inputs of types {[np.dtype(t).name for t in input_dtypes or ()]}")
    planner = _Planner(cnn_seq.fold(layers, constants, outputs), constants, inputs, input_shapes,
                       outputs)
    for index, kind in enumerate(kinds):
        if kind in (2, 3) and any(name == inputs[index] and (lay.op_type, at) not in GATHERED
                                  for lay in planner.layers for at, name in enumerate(lay.inputs)):
            raise Unplannable(f"the integer input {inputs[index]!r} read other than as indices")
        if kind:  # indices: read as floats, exact below 2^24 (cnn_seq.h's import)
            planner.records[index][FIELDS.index("x1")] = kind
            planner.values[inputs[index]].integer = True
    for index, layer in enumerate(planner.layers):
        make = cnn_layers.PLANNERS.get(layer.op_type)
        fused = layer.op_type in cnn_layers.FUSED_OPS or layer.op_type in cnn_seq.FUSED_OPS
        if make is None or OUTPUTS.get(layer.op_type, 1) not in (0, len(layer.outputs)) \
                or fused != (layer.domain == cnn_layers.FUSED) \
                or not fused and layer.domain not in ("", "ai.onnx"):
            raise Unplannable(f"{layer.name}: {layer.op_type} is not planned natively")
        if layer.op_type not in INTEGER and any(
                planner.values[n].integer for n in layer.inputs if n in planner.values):
            raise Unplannable(f"{layer.name}: {layer.op_type} of integer values")
        planner.current, planner.index = (layer.name, layer.op_type), index
        make(planner, layer)
        data = planner.values.get(layer.inputs[0]) if layer.inputs else None
        if layer.op_type in INTEGER and layer.op_type not in TO_FLOATS and data and data.integer:
            for name in layer.outputs:  # moved integers stay integers (a Concat's made anew)
                planner.values[name].integer = True
        planner.made.update(dict.fromkeys(layer.outputs, index))
        planner.release(index, layer)
    shapes, types, planner.current = [], [], ("the partition's outputs", "NativeExport")
    for index, name in enumerate(outputs):
        if name in inputs:
            raise Unplannable(f"the output {name!r} is an input of the partition")
        value = planner.value(name, rows=True)
        planner.record("export_int" if value.integer else "export", in_=value.offset,
                       out=len(inputs) + index, dims=(1, value.size, 1, 1) if value.rows
                       else value.dims)  # in ONNX's order already: one copy
        shapes.append(value.shape)
        types.append(np.int64 if value.integer else np.float32)
    params = np.concatenate(planner.params) if planner.params else np.zeros(ALIGN, np.float32)
    records = np.stack(planner.records)
    split(records)
    return Plan(records, params, planner.arena.end + planner.slack + 4 * ALIGN,
                [tuple(s) for s in input_shapes], shapes, planner.ops, planner.names,
                [np.dtype(t).type for t in input_dtypes or [np.float32] * len(inputs)], types)


def split(records: np.ndarray, macs: int = SPLIT_MACS, elements: int = SPLIT_ELEMENTS) -> None:
    """Marks the records whose work the run's threads share (``cnn_split.h``): a convolution of
    at least ``macs`` multiply-adds, a pool, resize, move, elementwise pass or softmax of at least
    ``elements`` (0 and 0: every one of them, as the tests run them)."""
    convolutions, others = _work(records)
    records[:, FIELDS.index("split")] = (convolutions > 0) & (convolutions >= macs) | (
        others > 0) & (others >= elements)


class Executor(ArenaExecutor):
    """A plan bound to the library: ``run(pointers)`` makes one call, ``pointers`` the inputs'
    then the outputs' data (contiguous float32, NCHW); see ``arena.ArenaExecutor``.

    ``splits``: whether the plan has records its run's threads share; then the threads a call
    uses are those ``ask(count)`` asked for last in the calling thread (``cnn_pool.h``; the
    workload asks for torch's count before each call), ``threads`` in ``numpy``'s runs."""

    def __init__(self, planned: Plan, library: ctypes.CDLL, threads: int = 1) -> None:
        self.plan, self.library, self.threads = planned, library, threads
        self._bind(library.backplane_cnn_run, np.ascontiguousarray(planned.records),
                   planned.params, _aligned(planned.arena),
                   len(planned.input_shapes) + len(planned.output_shapes))
        self.splits = bool(planned.records[:, FIELDS.index("split")].any())
        self.ask = library.backplane_cnn_threads
        self.ask.argtypes, self.ask.restype = [ctypes.c_int64], ctypes.c_int64

    def _fresh_arena(self) -> np.ndarray:
        return _aligned(self.plan.arena)

    def _failure(self, index: int) -> Exception:
        return RuntimeError(f"native cnn: record {index} ({self.plan.ops[index]}) failed: an op "
                            "this library does not know, or an index out of range")

    def profile(self, values: Sequence[np.ndarray], times: int = 1) -> list[float]:
        """Each record's thread CPU seconds, the mean of ``times`` runs on NumPy ``values``."""
        fn = self.library.backplane_cnn_profile
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        values = [np.ascontiguousarray(v, t) for v, t in zip(values, self.plan.input_dtypes)]
        outputs = [np.empty(shape, t) for shape, t in zip(self.plan.output_shapes,
                                                          self.plan.output_dtypes)]
        ext = (ctypes.c_void_p * self.edges)(*[a.ctypes.data for a in (*values, *outputs)])
        seconds = np.zeros(self.count)
        with self.lock:
            fn(*self.pointers[:1], self.count, self.pointers[1], self.arena.ctypes.data, ext,
               seconds.ctypes.data, times)
        return list(seconds / times)

    def profile_best(self, values: Sequence[np.ndarray], times: int = 20,
                     threads: int = 1) -> list[float]:
        """Each record's best wall seconds of ``times`` runs on ``threads`` threads (split records
        on the pool): the per-layer figures of a run at more than one thread."""
        fn = self.library.backplane_cnn_profile_best
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        values = [np.ascontiguousarray(v, t) for v, t in zip(values, self.plan.input_dtypes)]
        outputs = [np.empty(shape, t) for shape, t in zip(self.plan.output_shapes,
                                                          self.plan.output_dtypes)]
        ext = (ctypes.c_void_p * self.edges)(*[a.ctypes.data for a in (*values, *outputs)])
        seconds = np.full(self.count, np.inf)
        with self.lock:
            was = self.ask(threads)
            try:
                fn(*self.pointers[:1], self.count, self.pointers[1], self.arena.ctypes.data, ext,
                   seconds.ctypes.data, times)
            finally:
                self.ask(was)
        return list(seconds)

    def numpy(self, *values: np.ndarray) -> list[np.ndarray]:
        """The plan run on NumPy arrays (the torch-free session's run, tests, the bench): fresh
        outputs, the caller's alone; ``host``'s loop, which reads each address from the array
        object (``.ctypes.data`` made an object a read: resnet_basic_dyn21's torch-free run
        ~5 us slower than the session's direct run of ``host``); on ``threads`` threads where
        the plan splits records."""
        if self.splits:
            self.ask(self.threads)
        return self.host(*values)


def _aligned(size: int) -> np.ndarray:
    raw = np.zeros(size + ALIGN, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start:start + size]
