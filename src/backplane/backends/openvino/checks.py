"""What backplane checks before OpenVINO sees a layer: what OpenVINO would crash on, or answer
silently wrong, where CpuRef refuses.

OpenVINO 2026.4's CPU plugin reads recurrent weights by the weights' own shapes whatever
``hidden_size`` says (an LSTM of hidden_size 64 on weights of 4 returned 64 columns of whatever lay
past them), makes an empty tensor of an Expand or Tile to a negative size, returns zeros (Gather)
or other memory (GatherND) for an index out of range, makes ``|limit - start| / |delta|`` elements of
a Range whose delta points away from its limit, and allocates a data-sized tensor (Expand,
ConstantOfShape, Tile, Pad, Resize, OneHot) of whatever size its inputs say. So, per layer:

- ``refusal``: a reason to leave the layer to the next backend (CpuRef checks what OpenVINO does
  not), decided when the partition is made: recurrent weights that contradict the attributes (or
  whose sizes are not known then), constant sizes and indices out of range, a constant data-sized
  output past the allocation limit (``api.memory.check_allocation``), sizes computed inside the
  partition other than from tensor shapes alone (Shape, Gather, Concat ... as exporters write
  them), and GatherND indices computed inside (OpenVINO's GatherND reads past its data).
- ``plan``: the run-time checks of the rest (``Check``), one pass over an index or size tensor
  each: before the infer call for the partition's inputs, after it for Gather indices and Range
  arguments computed inside, which the compiled model then also outputs (``Plan.added``, with the
  Shape of each tensor in ``Plan.shapes`` whose indexed axis is a free dimension). A check after
  the run refuses it: OpenVINO's Gather gives zeros for such an index, nothing worse, and its
  outputs are never returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from backplane.backends.api.memory import AllocationError, check_allocation
from backplane.backends.openvino.int64 import check_int32, checked_inputs, int64_reason
from backplane.backends.openvino.refusals import (GATES, compress_reason, empty_reduction_reason,
                                                  integer_division_reason, recurrent_reason, reduced_axes)
from backplane.ir.graph import Graph, Layer

SIZE_INPUT = {"Expand": 1, "ConstantOfShape": 0, "Tile": 1, "OneHot": 1, "Pad": 1}
"""Ops whose output size comes from the values of this input (Resize's, Range's: see below)."""
INDEX_OPS = ("Gather", "GatherND")
"""Ops OpenVINO answers silently for an index out of range (GatherElements, ScatterND and
ScatterElements raise in OpenVINO itself)."""
SHAPE_OPS = frozenset({"Shape", "Size"})
SHAPE_ARITHMETIC = frozenset({
    "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Add", "Sub", "Mul", "Div",
    "Reshape", "Identity", "Max", "Min", "ReduceProd", "Where", "Equal", "Constant", "Abs", "Neg"})

REDUCTIONS = ("ReduceMax", "ReduceMin", "ArgMax", "ArgMin")
"""Reductions without an identity OpenVINO answers wrongly over an empty axis."""
SAME_VALUES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose",
                         "Expand"})
"""Ops whose output holds its first input's values, no other: the indices of GPT-2's embedding
Gather are its input_ids reshaped, checked as the partition's input."""

Ref = tuple[str, int]
"""Where a checked tensor is at run time: ("in", i), the partition's input i, or ("out", k), the k-th
output added to the compiled model for the checks (a tensor computed inside it)."""
Bound = int | tuple[str, int, int]
"""An axis's size: known when the partition is made, ("in", i, axis) of the partition's input i, or
("out", k, axis): entry ``axis`` of added output k, the Shape of a tensor computed inside."""


@dataclass(frozen=True)
class Check:
    """A check of a layer's indices (Gather, GatherND), size input (SIZE_INPUT, Resize) or Range
    arguments, or ("Int32") that an int64 input of the partition fits in 32 bits (``layer``: the
    input's name; ``int64.py``), made before the infer call, or after it where it reads added
    outputs (``after``): the run is refused then, its outputs never returned."""

    layer: str
    op: str
    values: tuple[Any, ...]  # Refs or constants: the indices or size; Range's start, limit, delta
    bounds: tuple[Bound, ...] = ()  # Gather, GatherND: the size of each indexed axis
    dims: tuple[Bound | None, ...] = ()  # size checks: the data's dims (None: unknown, taken as 1)
    dtype: str = "float32"  # size checks: the output's element type

    @property
    def after(self) -> bool:
        return any(_is_ref(r) and r[0] == "out"  # type: ignore[index]
                   for r in (*self.values, *self.bounds, *self.dims))

    def __call__(self, inputs: Sequence[Any], added: Sequence[Any] = ()) -> None:
        values = [np.asarray(_value(v, inputs, added)) for v in self.values]
        if self.op == "Int32":
            check_int32(self.layer, values[0])
        elif self.op in REDUCTIONS:
            _check_nonempty(self.layer, self.op, [_dim(d, inputs, added) for d in self.dims
                                                  if d is not None])
        elif self.op == "Range":
            _check_range(self.layer, *(float(v.reshape(-1)[0]) for v in values), self.dtype)
        elif self.bounds:
            _check_indices(self.layer, self.op, values[0],
                           [_dim(b, inputs, added) for b in self.bounds])
        else:
            dims = [_dim(d, inputs, added) if d is not None else None for d in self.dims]
            _check_size(self.layer, self.op, _output_shape(self.op, self.layer, values[0], dims),
                        self.dtype)


@dataclass
class Plan:
    """The checks of a partition, and what the compiled model must output for them: ``added``,
    tensors computed inside (indices, Range arguments), then the Shape of each of ``shapes``."""

    checks: list[Check] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)


def _is_ref(value: Any) -> bool:
    return isinstance(value, tuple) and bool(value) and isinstance(value[0], str)


def _value(ref: Any, inputs: Sequence[Any], added: Sequence[Any]) -> Any:
    if not _is_ref(ref):
        return ref  # a constant
    return inputs[ref[1]] if ref[0] == "in" else added[ref[1]]  # type: ignore[index]


def _dim(bound: Bound, inputs: Sequence[Any], added: Sequence[Any]) -> int:
    if isinstance(bound, int):
        return bound
    where, index, axis = bound
    return int(np.shape(inputs[index])[axis]) if where == "in" else int(added[index][axis])


class _Outside(dict):  # type: ignore[type-arg]
    """Every tensor neither produced in the partition nor a constant, as a partition input."""

    def __init__(self, graph: Graph, produced: dict[str, Layer]) -> None:
        super().__init__()
        self.graph, self.produced = graph, produced

    def __contains__(self, name: object) -> bool:
        return name not in self.produced and name not in self.graph.constants

    def __getitem__(self, name: str) -> int:
        return 0


def refusal(layer: Layer, graph: Graph, produced: dict[str, Layer]) -> str | None:
    """Why ``layer`` must not reach OpenVINO, in a partition whose layers produce ``produced``: what
    is wrong already (constants), or what nothing could check before OpenVINO uses it."""
    if layer.op_type in GATES:
        return recurrent_reason(layer, graph)
    wide = int64_reason(layer, graph)
    if wide:
        return wide
    if layer.op_type in ("Squeeze", "Compress", "Reshape") and len(layer.inputs) > 1 \
            and _traced(layer.inputs[1], graph, produced) in graph.inputs:  # the user's values
        what = {"Compress": "condition", "Reshape": "shape"}.get(layer.op_type, "axes")
        return (f"{layer.op_type} '{layer.name}': its {what} '{layer.inputs[1]}' is given at run "
                f"time, and OpenVINO answers one that does not fit the data silently "
                f"(an axis of size 3 squeezed, a condition longer than its axis, a shape of another "
                f"size); CpuRef checks it")
    if layer.op_type == "Compress":
        return compress_reason(layer, graph)
    if layer.op_type in ("Div", "Mod") and len(layer.inputs) > 1:
        return integer_division_reason(layer, graph)
    if layer.op_type in REDUCTIONS:
        return empty_reduction_reason(layer, graph)
    if layer.op_type == "Slice" and len(layer.inputs) > 4 and layer.inputs[4]:
        return _slice_reason(layer, graph, produced)
    try:
        planned = _plan_layer(Plan(), layer, graph, produced, _Outside(graph, produced))
    except (IndexError, ValueError, AllocationError) as exc:
        return f"{exc}; left to the next backend (CpuRef refuses it when it runs)"
    return planned


def plan(layers: Sequence[Layer], inputs: Sequence[str], graph: Graph) -> Plan:
    """The checks of a partition of ``layers`` reading ``inputs`` (``refusal`` let each through)."""
    produced = {out: layer for layer in layers for out in layer.outputs if out}
    position = {name: index for index, name in enumerate(inputs)}
    made = Plan()
    for layer in layers:
        _plan_layer(made, layer, graph, produced, position)
        if layer.op_type in REDUCTIONS:
            _plan_reduction(made, layer, graph, position)
    made.checks += [Check(name, "Int32", (("in", position[name]),))
                    for name in checked_inputs(layers, inputs, graph)]
    shapes_at = len(made.added)  # the Shape outputs come after the added tensors
    made.checks = [replace(check, bounds=_absolute(check.bounds, shapes_at),
                           dims=_absolute(check.dims, shapes_at)) for check in made.checks]
    return made


def _absolute(bounds: tuple[Any, ...], shapes_at: int) -> tuple[Any, ...]:
    """``_shape_ref``'s refs (negative) as the index of their Shape output, after ``shapes_at``."""
    return tuple(("out", shapes_at - 1 - b[1], b[2]) if _is_ref(b) and b[1] < 0 else b
                 for b in bounds)


def _plan_layer(made: Plan, layer: Layer, graph: Graph, produced: dict[str, Layer],
                position: dict[str, int]) -> str | None:
    """Add ``layer``'s checks to ``made``, checking constants now; why it is refused, or None."""
    op = layer.op_type
    names = _checked_inputs(layer, graph, produced)
    if not names:
        return None
    inside = [n for n in names if n in produced]
    if op == "GatherND" and inside or op not in ("Range", "Gather", "GatherND") and any(
            not _from_shapes(n, graph, produced, set()) for n in inside):
        return (f"{op} '{layer.name}' reads {', '.join(repr(n) for n in inside)} computed in the "
                f"partition: OpenVINO would use {'them' if op == 'GatherND' else 'it'} unchecked "
                f"(CpuRef checks it)")
    if op not in ("Range", "Gather", "GatherND") and inside:
        return None  # sizes computed from tensor shapes alone
    values = tuple(_ref(made, n, graph, position) for n in names)
    out = graph.info(layer.outputs[0]).dtype
    dtype = str(out if out is not None else "float32")
    if op in INDEX_OPS:
        bounds = _index_bounds(made, layer, graph, produced, position)
        if bounds is None:
            return (f"GatherND '{layer.name}': the size of an axis its indices index is known "
                    f"only inside OpenVINO; CpuRef checks them")
        check = Check(layer.name, op, values, bounds=tuple(bounds))
    else:
        dims = () if op in ("ConstantOfShape", "Range") else \
            tuple(_data_dims(layer.inputs[0], graph, position))
        check = Check(layer.name, op, values, dims=dims, dtype=dtype)
    if not any(_is_ref(r) for r in (*values, *check.bounds, *check.dims)):
        check([], [])  # all known now: checked once, here
    else:
        made.checks.append(check)
    return None


def _ref(made: Plan, name: str, graph: Graph, position: dict[str, int]) -> Any:
    if name in graph.constants:  # kept as plain data (the check goes into an artifact's graph)
        return np.asarray(graph.constants[name]).tolist()
    if name in position:
        return ("in", position[name])
    if name not in made.added:
        made.added.append(name)
    return ("out", made.added.index(name))


def _shape_ref(made: Plan, name: str, axis: int) -> Bound:
    if name not in made.shapes:
        made.shapes.append(name)
    return ("out", -1 - made.shapes.index(name), axis)  # made absolute by ``plan``


def _checked_inputs(layer: Layer, graph: Graph, produced: dict[str, Layer]) -> list[str]:
    """The size, index or Range inputs of ``layer``, traced back through ops that keep values."""
    if layer.op_type in INDEX_OPS:
        names = [layer.inputs[1]]
    elif layer.op_type == "Range":
        names = list(layer.inputs[:3])
    elif layer.op_type == "Resize":  # opset 10: (X, scales); 11 on: (X, roi, scales, sizes)
        names = [n for n in layer.inputs[1 if layer.opset < 11 else 2:] if n]
    elif layer.op_type == "Pad" and layer.opset < 11:
        names = []
    else:
        index = SIZE_INPUT.get(layer.op_type)
        names = [layer.inputs[index]] if index is not None and len(layer.inputs) > index else []
    return [_traced(name, graph, produced) for name in names]


def _traced(name: str, graph: Graph, produced: dict[str, Layer]) -> str:
    while name in produced and produced[name].op_type in SAME_VALUES \
            and produced[name].inputs[0] not in graph.constants:
        name = produced[name].inputs[0]
    return name


def _from_shapes(name: str, graph: Graph, produced: dict[str, Layer], seen: set[str]) -> bool:
    """Whether ``name`` is computed in the partition from tensor shapes and constants alone."""
    if name in graph.constants or name in seen:
        return True
    seen.add(name)
    layer = produced.get(name)
    if layer is None:
        return False
    if layer.op_type in SHAPE_OPS:
        return True
    return layer.op_type in SHAPE_ARITHMETIC and all(
        _from_shapes(n, graph, produced, seen) for n in layer.inputs if n)


def _data_dims(name: str, graph: Graph, position: dict[str, int]) -> list[Bound | None]:
    shape = graph.info(name).shape or ()
    return [d if isinstance(d, int) else ("in", position[name], axis) if name in position else None
            for axis, d in enumerate(shape)]


def _index_bounds(made: Plan, layer: Layer, graph: Graph, produced: dict[str, Layer],
                  position: dict[str, int]) -> list[Bound] | None:
    """The size of each axis the indices index; None where GatherND's cannot be known before."""
    data, indices = (graph.info(n) for n in layer.inputs[:2])
    if data.shape is None:  # Gather's axis may be negative here: it indexes the shape as numpy does
        axis = int(layer.attrs.get("axis", 0))
        if layer.op_type == "GatherND":
            return None
        return [("in", position[layer.inputs[0]], axis) if layer.inputs[0] in position
                else _shape_ref(made, layer.inputs[0], axis)]
    if layer.op_type == "Gather":
        axes = [int(layer.attrs.get("axis", 0)) % len(data.shape)]
    else:
        depth = indices.shape[-1] if indices.shape else None
        if not isinstance(depth, int):
            return None
        batch = int(layer.attrs.get("batch_dims", 0))
        axes = list(range(batch, batch + depth))
    bounds: list[Bound] = []
    for axis in axes:
        dim = data.shape[axis] if axis < len(data.shape) else None
        if isinstance(dim, int):
            bounds.append(dim)
        elif layer.inputs[0] in position:
            bounds.append(("in", position[layer.inputs[0]], axis))
        elif layer.op_type == "GatherND":
            return None  # OpenVINO's GatherND reads past its data: checked before, or refused
        else:
            bounds.append(_shape_ref(made, layer.inputs[0], axis))
    return bounds


def _check_indices(layer: str, op: str, values: np.ndarray, bounds: list[int]) -> None:
    if values.size == 0:
        return
    columns = values.reshape(-1, len(bounds)) if op == "GatherND" else values.reshape(-1, 1)
    for column, size in enumerate(bounds):
        low, high = int(columns[:, column].min()), int(columns[:, column].max())
        bad = low if low < -size else high if high >= size else None
        if bad is not None:
            raise IndexError(f"{op} '{layer}': index {bad} is out of range for an axis of size "
                             f"{size} (valid: {-size} to {size - 1})")


def _output_shape(op: str, layer: str, values: np.ndarray, given: list[int | None]) -> list[int]:
    """The output shape ``op`` makes of its size input ``values`` and its data's dims (None:
    unknown, counted as 1: the size checked is then the least the output can have)."""
    flat = [float(v) for v in values.reshape(-1)]
    dims = [1 if d is None else d for d in given]
    if op in ("Expand", "ConstantOfShape", "Tile", "Resize") and any(v < 0 for v in flat):
        raise ValueError(f"{op} '{layer}': a negative size {[int(v) for v in flat]} (negative "
                         f"dimensions are not allowed)")
    if op == "Expand":
        rank = max(len(flat), len(dims))
        left = [1] * (rank - len(dims)) + dims
        right = [1] * (rank - len(flat)) + [int(v) for v in flat]
        return [max(a, b) for a, b in zip(left, right)]
    if op == "Tile":
        return [d * int(r) for d, r in zip(dims, flat)]
    if op == "Pad":
        half = len(flat) // 2
        if len(flat) == 2 * len(given) and any(
                min(a, b) < 0 and (d is None or d + min(a, 0) < 0 or d + min(b, 0) < 0)
                for d, a, b in zip(given, flat[:half], flat[half:])):
            raise ValueError(f"Pad '{layer}': pads {[int(v) for v in flat]} crop more than the "
                             f"axes {['?' if d is None else d for d in given]} hold, or an axis "
                             f"of unknown size (OpenVINO crashes where a crop passes the axis)")
        return [d + int(a) + int(b) for d, a, b in zip(dims, flat[:half], flat[half:])]
    if op == "OneHot":
        return [*dims, int(flat[0]) if flat else 0]
    if op == "Resize" and values.dtype.kind == "f":  # scales
        return [int(d * s) for d, s in zip(dims, flat)]
    return [int(v) for v in flat]  # ConstantOfShape, Resize's sizes


def _check_size(layer: str, op: str, shape: list[int], dtype: str) -> None:
    check_allocation([max(s, 0) for s in shape], np.dtype(dtype), f"the output of {op} '{layer}'")


def _check_range(layer: str, start: float, limit: float, delta: float, dtype: str) -> None:
    """OpenVINO makes |limit - start| / |delta| elements where delta points away from limit, where
    ONNX makes none: such a Range is refused, as is a delta of 0."""
    if delta == 0 or (limit != start and (limit - start) * delta < 0):
        raise ValueError(f"Range '{layer}': start {start}, limit {limit}, delta {delta}: ONNX makes "
                         f"no element of it and OpenVINO would make "
                         f"{'infinitely many' if delta == 0 else abs((limit - start) / delta)}")
    count = max(int(np.ceil((limit - start) / delta)), 0)
    check_allocation([count], np.dtype(dtype), f"the output of Range '{layer}'")


def _slice_reason(layer: Layer, graph: Graph, produced: dict[str, Layer]) -> str | None:
    """OpenVINO dies of SIGFPE on a step of -2**63 or -(2**63 - 1) (bench/hostile.py's
    slice_extreme_bounds, slice_huge_step_backward): steps past 32 bits, or 0, go to CpuRef."""
    steps = layer.inputs[4]
    if steps not in graph.constants:
        if _from_shapes(steps, graph, produced, set()):
            return None
        return (f"Slice '{layer.name}': its steps '{steps}' are known only at run time, and "
                f"OpenVINO crashes on a step past 32 bits; CpuRef checks them")
    values = np.asarray(graph.constants[steps]).reshape(-1)
    if values.size and (not values.all() or int(np.abs(values.astype(np.float64)).max()) >= 2**31):
        return (f"Slice '{layer.name}': steps {values.tolist()} (0, or past 32 bits: OpenVINO "
                f"crashes on -2**63); left to the next backend")
    return None


def _plan_reduction(made: Plan, layer: Layer, graph: Graph, position: dict[str, int]) -> None:
    """A check that each reduced axis of a free dimension holds an element at run time."""
    data = layer.inputs[0]
    shape = graph.info(data).shape
    axes = [a for a in reduced_axes(layer, graph, shape) or () if not isinstance(shape[a], int)]
    if axes:
        dims = tuple(("in", position[data], a) if data in position else _shape_ref(made, data, a)
                     for a in axes)
        made.checks.append(Check(layer.name, layer.op_type, (), dims=dims))


def _check_nonempty(layer: str, op: str, dims: list[int]) -> None:
    if 0 in dims:
        raise ValueError(f"{op} '{layer}' over an empty axis (sizes {dims}): OpenVINO answers "
                         f"float32's lowest (ONNX: -inf) or an index where there is no element; "
                         f"CpuRef runs it")
