"""64-bit integers in OpenVINO: which layers may compute on them there.

OpenVINO 2026.4's CPU plugin has no int64 arithmetic: it converts every int64 (and uint64) tensor
to int32 on the way in, truncating (measured, ``bench/hostile.py``'s ``int64_mul_overflow``):
INT64_MIN * -1 gives 0 where ONNX wraps to INT64_MIN, 2**40 + 1 gives 1, an Identity of 2**40 + 5
gives 5, ``Equal(2**40 + 5, 5)`` is true and a Cast of 2**40 to bool is false. Its Cast from int64
to a float or a narrower integer is right. So OpenVINO computes with int64 only what is known to
fit in 32 bits:

- ``int64_reason``, when the partition is made: a layer that makes int64 values (Add, Mul, CumSum,
  a Cast from float, any op not in KEEPS) from values not known to fit (``narrow``: constants
  that do, and what is computed from tensor shapes, indices and such constants by shape
  arithmetic; a product of shapes past 2**31 is not caught, no tensor that large is made), or any
  layer reading a constant that does not fit, goes to CpuRef;
- ``checked_inputs``, at run time: the partition's int64 inputs its layers read as data (the
  user's, or another backend's, read by KEEPS ops: Concat, Equal, Cast to bool ...) are checked
  to fit before the infer call; the run is refused where one does not.

Sizes, axes and indices are not data here: ``checks.py`` checks them (Gather's indices against
their axis, on the caller's int64 values, also through the Reshapes that move them), or OpenVINO
clamps them as ONNX does (Slice's starts and ends).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np

from backplane.ir.graph import Graph, Layer

INT32 = np.iinfo(np.int32)
MOVES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose",
                   "Expand"})
"""Ops whose output holds its first input's values (checks.SAME_VALUES)."""
INDEX_OPS = ("Gather", "GatherND")
PARAMETERS: dict[str, tuple[int, ...]] = {
    "Gather": (1,), "GatherND": (1,), "Reshape": (1,), "Expand": (1,), "Tile": (1,),
    "Squeeze": (1,), "Unsqueeze": (1,), "Slice": (1, 2, 3, 4), "Pad": (1, 3),
    "ConstantOfShape": (0,), "OneHot": (1,), "TopK": (1,), "Resize": (1, 2, 3), "Split": (1,),
    "CumSum": (1,), "Trilu": (1,), "Shape": (0,), "Size": (0,), "NonMaxSuppression": (2,),
    **{op: (1,) for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                           "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
                           "ReduceLogSumExp")}}
"""Inputs that are sizes, axes or indices (not values OpenVINO computes with): by position."""
KEEPS = MOVES | {
    "Concat", "Gather", "GatherND", "GatherElements", "Slice", "Split", "Where", "Max", "Min",
    "ReduceMax", "ReduceMin", "TopK", "Tile", "Compress", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Shape", "Size", "ArgMax", "ArgMin", "NonZero", "Trilu",
    "ReverseSequence", "DepthToSpace", "SpaceToDepth", "Unique", "Pad", "ScatterND",
    "ScatterElements", "Clip", "Sign"}
"""Ops whose int64 results are their inputs' values or compare them: right in OpenVINO when
every value they read fits in 32 bits. Any other op reading or making int64 values not known to
fit (Add, Mul, CumSum, a Cast from float ...) is left to CpuRef."""
INDEX_OUTPUTS = {"Shape": 0, "Size": 0, "ArgMax": 0, "ArgMin": 0, "NonZero": 0, "TopK": 1,
                 "NonMaxSuppression": 0}
"""Outputs that are sizes or indices, which fit in 32 bits."""
SHAPE_ARITHMETIC = frozenset({
    "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Add", "Sub", "Mul", "Div",
    "Reshape", "Identity", "Max", "Min", "ReduceProd", "Where", "Equal", "Abs", "Neg", "Range",
    "Expand", "Flatten", "Transpose", "Mod", "ConstantOfShape", "Tile", "Floor", "Ceil", "Round",
    "Sqrt"})
"""Ops of exporters' shape arithmetic: narrow where what they read is (ConstantOfShape: where its
value is)."""


def is_wide(dtype: np.dtype | None) -> bool:
    """Whether ``dtype`` is one OpenVINO computes in 32 bits: int64 or uint64."""
    return dtype is not None and dtype.kind in "iu" and dtype.itemsize == 8


Edges = tuple[tuple[int, int], dict[str, Layer], dict[str, list[Layer]]]
_EDGES: weakref.WeakKeyDictionary[Graph, Edges] = weakref.WeakKeyDictionary()


def _edges(graph: Graph) -> tuple[dict[str, Layer], dict[str, list[Layer]]]:
    """The producers and consumers of the whole graph (a value's width does not depend on the
    partition it is in), kept while the graph's layers are the same list."""
    stamp = (id(graph.layers), len(graph.layers))
    kept = _EDGES.get(graph)
    if kept is None or kept[0] != stamp:
        kept = _EDGES[graph] = (stamp, graph.producers(), graph.consumers())
    return kept[1], kept[2]


def int64_reason(layer: Layer, graph: Graph) -> str | None:
    """Why ``layer`` must leave OpenVINO: it makes int64 values that may not fit in 32 bits, or
    reads a constant that does not. (What it reads from outside the partition is checked at run
    time: ``checked_inputs``.)"""
    produced, consumers = _edges(graph)
    if layer.op_type in MOVES and _only_indices(layer, graph, consumers):
        return None  # the Gather's check reads the values this layer moves, untruncated
    keeps = layer.op_type in KEEPS or layer.op_type == "Cast" and not is_wide(
        graph.info(layer.outputs[0]).dtype)
    for name in data_inputs(layer, graph):
        if not narrow(name, graph, produced, set()) and (not keeps or name in graph.constants):
            return _reason(layer, f"reads '{name}'")
    for name in layer.outputs:
        if name and not keeps and is_wide(graph.info(name).dtype) \
                and not narrow(name, graph, produced, set()):
            return _reason(layer, f"makes '{name}'")
    return None


def data_inputs(layer: Layer, graph: Graph) -> list[str]:
    """The int64 inputs ``layer`` computes with (not its sizes, axes or indices)."""
    skipped = PARAMETERS.get(layer.op_type, ())
    to = graph.info(layer.outputs[0]).dtype if layer.outputs else None
    if layer.op_type == "Cast" and to is not None and to.kind in "fiu" and not is_wide(to):
        return []  # OpenVINO's Cast from int64 to a float or narrower integer is right
    return [name for index, name in enumerate(layer.inputs)
            if name and index not in skipped and is_wide(graph.info(name).dtype)]


def checked_inputs(layers: Sequence[Layer], inputs: Sequence[str], graph: Graph) -> list[str]:
    """The partition's int64 inputs its layers read as data, whose values are not known to fit in
    32 bits: each is checked before the run (``checks.Check`` "Int32"), the run refused where one
    does not fit (int64_reason left only layers that keep their inputs' values to read them)."""
    produced, consumers = _edges(graph)
    read = {name for layer in layers
            if not (layer.op_type in MOVES and _only_indices(layer, graph, consumers))
            for name in data_inputs(layer, graph)}
    return [name for name in inputs if name in read and not narrow(name, graph, produced, set())]


def check_int32(name: str, values: np.ndarray) -> None:
    """An int64 input OpenVINO computes with must fit in 32 bits: it computes int64 as int32."""
    if values.size == 0:
        return
    low, high = int(values.min()), int(values.max())
    bad = low if low < INT32.min else high if high > INT32.max else None
    if bad is not None:
        raise ValueError(f"'{name}' holds {bad}, past 32 bits: OpenVINO's CPU plugin computes "
                         f"int64 as int32 and would answer it silently wrong (int64 values from "
                         f"-2**31 to 2**31 - 1 run on OpenVINO; CpuRef computes any)")


def _only_indices(layer: Layer, graph: Graph, consumers: dict[str, list[Layer]]) -> bool:
    """Whether ``layer`` (one of MOVES) feeds nothing but Gather indices, through MOVES: the
    Gather's run-time check traces its indices back through these to the values given, which it
    checks against the axis (none past 32 bits passes)."""
    readers = [(reader, index) for out in layer.outputs for reader in consumers.get(out, ())
               for index, name in enumerate(reader.inputs) if name == out]
    return bool(readers) and not any(name in graph.outputs for name in layer.outputs) and all(
        (reader.op_type in INDEX_OPS and index == 1)
        or (reader.op_type in MOVES and index == 0 and _only_indices(reader, graph, consumers))
        for reader, index in readers)


def _reason(layer: Layer, what: str) -> str:
    return (f"{layer.op_type} '{layer.name}' {what}, int64 values not known to fit in 32 bits: "
            f"OpenVINO's CPU plugin computes int64 as int32 (INT64_MIN * -1 gives 0, 2**40 + 1 "
            f"gives 1); CpuRef computes it")


def narrow(name: str, graph: Graph, produced: dict[str, Layer], seen: set[str]) -> bool:
    """Whether the values of ``name`` are known to fit in 32 bits: a tensor of a narrower integer
    type, a constant that does, or what is computed from shapes, indices and such constants
    (through floats too: ``Cast(Floor(Div(Cast(Shape), 2.0)), to=INT64)``)."""
    dtype = graph.info(name).dtype
    if dtype is not None and dtype.kind in "iub" and not is_wide(dtype):
        return True
    if name in graph.constants:
        values = np.asarray(graph.constants[name])
        return values.size == 0 or values.dtype.kind in "iuf" and bool(
            np.all(np.abs(values.astype(np.float64)) <= INT32.max))  # NaN, inf: not narrow
    if name in seen:
        return True
    seen.add(name)
    layer = produced.get(name)
    if layer is None:  # the partition's input: the user's values, or another backend's
        return False
    if INDEX_OUTPUTS.get(layer.op_type) == layer.outputs.index(name):
        return True
    if layer.op_type == "ConstantOfShape":
        value = layer.attrs.get("value")
        return value is None or bool(np.all(np.abs(np.asarray(value, np.float64)) <= INT32.max))
    if layer.op_type not in SHAPE_ARITHMETIC:
        return False
    skipped = PARAMETERS.get(layer.op_type, ())
    return all(narrow(n, graph, produced, seen) for index, n in enumerate(layer.inputs)
               if n and index not in skipped)
