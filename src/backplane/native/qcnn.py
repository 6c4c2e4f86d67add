"""An int8 CNN partition's ONNX layers as one plan for ``qcnn.c``: run in one ctypes call.

Why: on this AVX2 machine torch's int8 kernels are slower than its float ones, and the small
int8 CNNs' layers each do microseconds of work beneath torch's per-call costs; ONNX Runtime runs
them as uint8 x int8 -> int32 products requantized in float (MLAS). ``qcnn.c`` does the same
arithmetic, and the planning here makes the QDQ format's chains into its operators as ONNX
Runtime's QDQ transformer does: DequantizeLinear(x_q) -> Conv / Gemm / MatMul -> QuantizeLinear is
one quantized convolution of x_q (weights and bias recovered as integers from their folded float
constants), DequantizeLinear -> MaxPool -> QuantizeLinear of one step a max pool of the bytes,
QuantizeLinear(DequantizeLinear(x_q)) of the same step x_q itself. A DequantizeLinear is made
only where a float layer reads its output (Relu, Add, AveragePool, GlobalAveragePool, the
partition's outputs), so the QOperator format's float glue runs as written.

``plan`` takes the layers of a static partition (the ONNX ops of ``qcnn_layers.PLANNERS``) and
gives a ``Plan``, or raises ``Unplannable`` naming the first layer it cannot take.
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

FIELDS = ("op in in2 out n h w c oh ow oc kh kw sh sw dh dw pt pl woff boff moff scr ph pw icp "
          "zx zy lo hi signed x1 cs ocs split").split()
"""A record's fields, in qcnn.c's order (its enum F_*): NF = 35 int64s a record (``split``, set
by ``plan``: the record's work shared by the run's threads, ``qcnn_pool.h``)."""
NF = 35
OPS = {name: code for code, name in enumerate(
    "import export quant dequant qconv maxpool_f maxpool_q avgpool_f gap_f add_f addc_f relu_f "
    "qdwconv linear_f fdwconv_q hsig_f mul_f qconv8 lut8 qadd8 qdw8".split(), 1)}
SPLIT_CONVS = ("qconv", "qconv8", "qdwconv", "qdw8")
"""The convolutions ``qcnn_pool.h`` splits across a run's threads (output pixel strips or rows,
after the scratch's rows): each item written by one thread with the one-thread run's arithmetic."""
SPLIT_ELEMENTWISE = ("quant", "dequant", "add_f", "addc_f", "hsig_f", "mul_f", "relu_f", "lut8",
                     "qadd8", "import", "export", "maxpool_q")
"""The elementwise records it splits, in chunks of values (an import or export, NCHW to NHWC
and back, in chunks of pixels; a max pool of bytes by output rows), from ``SPLIT_VALUES`` of
their input."""
SPLIT_MACS = 1_000_000
"""The fewest multiply-adds of a split convolution: ~15 us of one thread's work, where waking a
worker and waiting for its last item (1-5 us, more where it slept) is a small part."""
SPLIT_VALUES = 65_536
"""The fewest values of a split elementwise record (~5-10 us of one thread's work)."""
TABLES = True
"""Whether single-source float glue between byte tensors becomes a ``lut8`` table
(``qcnn_lookup``; the tests turn it off to compare)."""
ALIGN = 64  # bytes: each tensor's and parameter's place starts on a cache line
OCB = 16  # output channels a packed weight block (qcnn.c's OCB)


class Unplannable(NotImplementedError):
    """A layer (or the partition's edges) the int8 plan does not take; the message says which."""


@dataclass
class Value:
    """A tensor in the arena, channels-last: ``dims`` (n, c, h, w); ``kind`` "f" (float32), "u8"
    or "s8"; for an 8-bit one its step (scale, zero point)."""

    offset: int
    dims: tuple[int, int, int, int]
    shape: tuple[int, ...]
    kind: str
    step: tuple[np.float32, int] | None = None

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return self.size * (4 if self.kind == "f" else 1)


@dataclass
class Pending:
    """A DequantizeLinear not made yet: its 8-bit input and step."""

    source: str
    scale: np.float32
    zero: int


@dataclass
class Plan:
    """The records, the packed parameters (bytes), the arena's size in bytes, the edges' shapes."""

    records: np.ndarray
    params: np.ndarray
    arena: int
    input_shapes: list[tuple[int, ...]]
    output_shapes: list[tuple[int, ...]]
    ops: list[str] = field(default_factory=list)
    names: list[tuple[str, str]] = field(default_factory=list)
    macs: int = 0


def dims_of(shape: Sequence[int]) -> tuple[int, int, int, int]:
    """An ONNX shape's (n, c, h, w): (N, C, H, W); (N, K) as N pixels of K channels."""
    if len(shape) == 4:
        return tuple(int(d) for d in shape)  # type: ignore[return-value]
    if len(shape) == 2:
        return (int(shape[0]), int(shape[1]), 1, 1)
    raise Unplannable(f"a tensor of shape {tuple(shape)}: only 2- and 4-d tensors")


class Planner:
    def __init__(self, layers: Sequence[Layer], constants: Mapping[str, np.ndarray],
                 inputs: Sequence[str], outputs: Sequence[str]):
        self.layers, self.constants, self.outputs = list(layers), constants, list(outputs)
        self.inputs = list(inputs)
        self.values: dict[str, Value] = {}
        self.pending: dict[str, Pending] = {}
        self.records: list[np.ndarray] = []
        self.params: list[np.ndarray] = []
        self.param_size, self.end, self.scratch, self.macs = 0, 0, 0, 0
        self.ops: list[str] = []
        self.names: list[tuple[str, str]] = []
        self.done: set[int] = set()  # layers taken by an earlier one's pattern
        self.readers: dict[str, list[Layer]] = {}
        for layer in self.layers:
            for name in dict.fromkeys(layer.inputs):
                if name:
                    self.readers.setdefault(name, []).append(layer)
        self.current = ("the partition's inputs", "QcnnImport")

    # places
    def new(self, name: str, shape: Sequence[int], kind: str,
            step: tuple[np.float32, int] | None = None) -> Value:
        dims = dims_of(shape)
        value = Value(self.end, dims, tuple(int(d) for d in shape), kind, step)
        self.end += -(-value.bytes // ALIGN) * ALIGN
        self.values[name] = value
        return value

    def param(self, array: np.ndarray) -> int:
        """``array``'s bytes in the parameters; their offset."""
        offset = self.param_size
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        padded = -(-raw.size // ALIGN) * ALIGN
        self.params.append(np.pad(raw, (0, padded - raw.size)))
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

    # what the layers read
    def const(self, name: str) -> np.ndarray | None:
        return self.constants.get(name) if name else None

    def sole_reader(self, name: str) -> Layer | None:
        """The one layer reading ``name``, where it is no output of the partition."""
        found = self.readers.get(name, [])
        return found[0] if len(found) == 1 and name not in self.outputs else None

    def quantized(self, name: str) -> Value:
        """The 8-bit tensor ``name``."""
        value = self.values.get(name)
        if value is None or value.kind == "f":
            raise Unplannable(f"{name!r} is not an 8-bit tensor of the partition")
        return value

    def real(self, name: str) -> Value:
        """The float tensor ``name``, its DequantizeLinear made here where it was pending."""
        if name in self.values and self.values[name].kind == "f":
            return self.values[name]
        pending = self.pending.get(name)
        if pending is None:
            raise Unplannable(f"{name!r} is neither an input of the partition nor planned")
        source = self.quantized(pending.source)
        y = self.new(name, source.shape, "f")
        self.record("dequant", in_=source.offset, out=y.offset, dims=source.dims,
                    moff=self.param(np.array([pending.scale], np.float32)), zx=pending.zero,
                    signed=int(source.kind == "s8"))
        return y


def plan(layers: Sequence[Layer], constants: Mapping[str, np.ndarray], inputs: Sequence[str],
         input_shapes: Sequence[Sequence[int]], outputs: Sequence[str]) -> Plan:
    """The plan of a static partition whose inputs and outputs are float32: ``layers`` in order,
    reading ``inputs`` of ``input_shapes`` (and ``constants``), writing ``outputs``. Raises
    ``Unplannable``."""
    from backplane.native import qcnn_contrib, qcnn_layers, qcnn_lookup

    p = Planner(layers, constants, inputs, outputs)
    for index, (name, shape) in enumerate(zip(inputs, input_shapes)):
        value = p.new(name, tuple(shape), "f")
        p.record("import", in_=index, out=value.offset, dims=value.dims)
    for index, layer in enumerate(p.layers):
        if index in p.done:
            continue
        make = qcnn_layers.PLANNERS.get(layer.op_type) if layer.domain in ("", "ai.onnx") \
            else qcnn_contrib.PLANNERS.get(layer.op_type) if layer.domain == "com.microsoft" \
            else None
        if make is None or len(layer.outputs) != 1:
            raise Unplannable(f"{layer.name}: {layer.domain or 'ai.onnx'} {layer.op_type} is "
                              "not planned natively in int8")
        p.current = (layer.name, layer.op_type)
        make(p, layer, index)
    if not any(op in ("qconv", "qconv8", "qdwconv", "qdw8", "fdwconv_q") for op in p.ops):
        raise Unplannable("no quantized convolution or product in the partition")
    shapes, p.current = [], ("the partition's outputs", "QcnnExport")
    for index, name in enumerate(outputs):
        if name in inputs:
            raise Unplannable(f"the output {name!r} is an input of the partition")
        value = p.real(name)
        p.record("export", in_=value.offset, out=len(inputs) + index, dims=value.dims)
        shapes.append(value.shape)
    if TABLES:
        qcnn_lookup.tables(p)
        qcnn_lookup.sums(p)
    scratch = p.end
    for row in p.records:  # one scratch place after the tensors, for every convolution
        if row[0] in (OPS["qconv"], OPS["qconv8"], OPS["qdwconv"], OPS["qdw8"], OPS["fdwconv_q"]):
            row[FIELDS.index("scr")] = scratch
    params = np.concatenate(p.params) if p.params else np.zeros(ALIGN, np.uint8)
    records = np.stack(p.records)
    split(records, SPLIT_MACS, SPLIT_VALUES)
    return Plan(records, params, p.end + p.scratch + 4 * ALIGN,
                [tuple(s) for s in input_shapes], shapes, p.ops, p.names, p.macs)


def split(records: np.ndarray, macs: int, values: int) -> None:
    """Marks the convolutions of at least ``macs`` multiply-adds and the elementwise records of
    at least ``values`` values as split across the run's threads (0, 0: every one of them, as the
    tests run them)."""
    column = {name: records[:, FIELDS.index(name)] for name in
              ("op", "n", "c", "h", "w", "oh", "ow", "oc", "kh", "kw")}
    op, size = column["op"], column["n"] * column["c"] * column["h"] * column["w"]
    depthwise = np.isin(op, [OPS["qdwconv"], OPS["qdw8"]])
    work = (column["n"] * column["oh"] * column["ow"] * column["kh"] * column["kw"]
            * np.where(depthwise, column["c"], column["c"] * column["oc"]))
    convs = np.isin(op, [OPS[name] for name in SPLIT_CONVS]) & (work >= macs)
    elementwise = np.isin(op, [OPS[name] for name in SPLIT_ELEMENTWISE]) & (size >= values)
    records[:, FIELDS.index("split")] = convs | elementwise


class Executor(ArenaExecutor):
    """A plan bound to the library: ``run(pointers)`` makes one call, ``pointers`` the inputs'
    then the outputs' data (contiguous, NCHW); see ``arena.ArenaExecutor``.

    ``splits``: whether the plan has records its run's threads share; then the threads a call
    uses are those ``ask(count)`` asked for last in the calling thread (``qcnn_pool.h``; the
    workload asks for torch's count before each call, ``native_cnn._workload``), ``threads`` in
    ``numpy``'s runs."""

    def __init__(self, planned: Plan, library: ctypes.CDLL, threads: int = 1) -> None:
        self.plan, self.library, self.threads = planned, library, threads
        params = _aligned(planned.params.size)
        params[:] = planned.params
        self._bind(library.backplane_qcnn_run, np.ascontiguousarray(planned.records), params,
                   _aligned(planned.arena), len(planned.input_shapes) + len(planned.output_shapes))
        self.splits = bool(planned.records[:, FIELDS.index("split")].any())
        self.ask = library.backplane_qcnn_threads
        self.ask.argtypes, self.ask.restype = [ctypes.c_int64], ctypes.c_int64

    def _fresh_arena(self) -> np.ndarray:
        return _aligned(self.plan.arena)

    def _failure(self, index: int) -> Exception:
        return RuntimeError(f"native qcnn: record {index} has an unknown op")

    def profile(self, values: Sequence[np.ndarray], times: int = 1) -> list[float]:
        """Each record's thread CPU seconds, the mean of ``times`` runs on NumPy ``values``."""
        fn = self.library.backplane_qcnn_profile
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        values = [np.ascontiguousarray(v, np.float32) for v in values]
        outputs = [np.empty(shape, np.float32) for shape in self.plan.output_shapes]
        ext = (ctypes.c_void_p * self.edges)(*[a.ctypes.data for a in (*values, *outputs)])
        seconds = np.zeros(self.count)
        with self.lock:
            fn(self.pointers[0], self.count, self.pointers[1], self.arena.ctypes.data, ext,
               seconds.ctypes.data, times)
        return list(seconds / times)

    def numpy(self, *values: np.ndarray) -> list[np.ndarray]:
        """The plan run on NumPy arrays (the torch-free session's run, tests, the bench): fresh
        outputs, the caller's alone. Plain loops (a comprehension is a Python frame on 3.11);
        an array's address read from its object (``_address``: numpy's ``.ctypes.data`` makes
        an object a read, ~2 us, three a run)."""
        pointers, held, address = [], [], _address
        for v in values:
            if type(v) is not np.ndarray or v.dtype != F32 or not v.flags.c_contiguous:
                v = np.ascontiguousarray(v, np.float32)
                held.append(v)  # alive through the call
            pointers.append(address(v))
        outputs = []
        for shape in self.plan.output_shapes:
            o = np.empty(shape, F32)
            outputs.append(o)
            pointers.append(address(o))
        if self.splits:
            self.ask(self.threads)
        self.run(pointers)
        return outputs


F32 = np.dtype(np.float32)


def _addresses() -> Any:
    """A function giving a base-class ndarray's data address: read from the array object (its
    first field after the object's header, ``PyArrayObject.data``) where a probe finds it there,
    else numpy's ``.ctypes.data``."""
    at, header = ctypes.c_void_p.from_address, object.__basicsize__
    probe = np.empty(3, F32)
    if at(id(probe) + header).value != probe.ctypes.data:
        return lambda array: array.ctypes.data

    def address(array: np.ndarray) -> int:
        return at(id(array) + header).value

    return address


_address = _addresses()


def _aligned(size: int) -> np.ndarray:
    raw = np.zeros(size + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size]

