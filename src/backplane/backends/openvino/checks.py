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
  whose sizes are not known then), constant shapes, sizes and indices out of range, a data-sized
  output past the allocation limit (``api.memory.check_allocation``), and sizes or indices computed
  inside the partition (OpenVINO reads them before anyone can look), except those computed from
  tensor shapes alone (Shape, Gather, Concat ... as exporters write them).
- ``run_checks``: for sizes and indices that are inputs of the partition, the checks the workload
  makes on them before each infer call (``Check``): cheap, one pass over an index or size tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backplane.backends.api.memory import AllocationError, check_allocation
from backplane.ir.graph import Graph, Layer

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
SIZE_INPUT = {"Expand": 1, "ConstantOfShape": 0, "Tile": 1, "OneHot": 1, "Pad": 1}
"""Ops whose output size comes from the values of this input (Resize's, Range's: see below)."""
INDEX_OPS = ("Gather", "GatherND")
"""Ops OpenVINO answers silently for an index out of range (GatherElements, ScatterND and
ScatterElements raise in OpenVINO itself)."""
SHAPE_OPS = frozenset({"Shape", "Size"})
SHAPE_ARITHMETIC = frozenset({
    "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Add", "Sub", "Mul", "Div",
    "Reshape", "Identity", "Max", "Min", "ReduceProd", "Where", "Equal", "Constant", "Abs", "Neg"})

SAME_VALUES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose",
                         "Expand"})
"""Ops whose output holds its first input's values, no other: the indices of GPT-2's embedding
Gather are its input_ids reshaped, checked as the partition's input."""

Bound = int | tuple[int, int]
"""A dimension: known when the partition is made, or (input position, axis) read at run time."""


@dataclass(frozen=True)
class Check:
    """A run-time check of the partition's input at ``position`` before OpenVINO reads it."""

    layer: str
    op: str
    position: int
    bounds: tuple[Bound, ...] = ()  # index checks: the size of each indexed axis
    dims: tuple[Bound | None, ...] = ()  # size checks: the data's dims (None: unknown, taken as 1)
    dtype: str = "float32"  # size checks: the output's element type

    def __call__(self, inputs: Sequence[np.ndarray]) -> None:
        values = np.asarray(inputs[self.position])
        if self.bounds:
            _check_indices(self, values, [_dim(b, inputs) for b in self.bounds])
        else:
            shape = _output_shape(self.op, self.layer, values, [_dim(d, inputs) if d is not None else 1
                                                    for d in self.dims])
            _check_size(self.layer, self.op, shape, self.dtype)


def _dim(bound: Bound, inputs: Sequence[np.ndarray]) -> int:
    return bound if isinstance(bound, int) else int(np.shape(inputs[bound[0]])[bound[1]])


def refusal(layer: Layer, graph: Graph, produced: dict[str, Layer]) -> str | None:
    """Why ``layer`` must not reach OpenVINO, in a partition whose layers produce ``produced``."""
    if layer.op_type in GATES:
        return _recurrent_reason(layer, graph)
    if layer.op_type == "Range":
        return _range_reason(layer, graph)
    for name in _checked_inputs(layer, graph, produced):
        if name in graph.constants:
            reason = _constant_reason(layer, graph, name)
        elif name in produced and not _from_shapes(name, graph, produced, set()):
            reason = (f"{layer.op_type} '{layer.name}' reads '{name}' as "
                      f"{'indices' if layer.op_type in INDEX_OPS else 'a size'}, computed in the "
                      f"partition: OpenVINO would use it unchecked (CpuRef checks it)")
        elif name not in produced and not _bounds_known(layer, graph, produced):
            reason = (f"{layer.op_type} '{layer.name}': the size of the axis its indices "
                      f"'{name}' index is known only inside OpenVINO; CpuRef checks them")
        else:
            reason = None
        if reason:
            return reason
    return None


def run_checks(layers: Sequence[Layer], inputs: Sequence[str], graph: Graph) -> list[Check]:
    """The checks of the partition's inputs that ``layers`` read as sizes or indices."""
    position = {name: index for index, name in enumerate(inputs)}
    produced = {out: layer for layer in layers for out in layer.outputs if out}
    checks = []
    for layer in layers:
        for name in _checked_inputs(layer, graph, produced):
            if name not in position:
                continue  # a constant (checked when the partition was made) or shapes
            if layer.op_type in INDEX_OPS:
                bounds = _index_bounds(layer, graph, position)
                assert bounds is not None, "refusal() let through only known bounds"
                checks.append(Check(layer.name, layer.op_type, position[name], tuple(bounds)))
            else:
                data = graph.info(layer.inputs[0]) if layer.op_type != "ConstantOfShape" else None
                dims = _dims(layer.inputs[0], graph, position) if data is not None else ()
                out = graph.info(layer.outputs[0]).dtype
                checks.append(Check(layer.name, layer.op_type, position[name], dims=tuple(dims),
                                    dtype=str(out if out is not None else "float32")))
    return checks


def _checked_inputs(layer: Layer, graph: Graph, produced: dict[str, Layer]) -> list[str]:
    """The size or index inputs of ``layer``, each traced back through ops that keep its values."""
    if layer.op_type in INDEX_OPS:
        names = [layer.inputs[1]]
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


def _dims(name: str, graph: Graph, position: dict[str, int]) -> list[Bound | None]:
    shape = graph.info(name).shape or ()
    return [d if isinstance(d, int) else (position[name], axis) if name in position else None
            for axis, d in enumerate(shape)]


def _index_bounds(layer: Layer, graph: Graph, position: dict[str, int]) -> list[Bound] | None:
    """The size of each axis the indices index, or None where one is not known."""
    data, indices = (graph.info(n) for n in layer.inputs[:2])
    dims = _dims(layer.inputs[0], graph, position)
    if data.shape is None:
        return None
    if layer.op_type == "Gather":
        axes = [int(layer.attrs.get("axis", 0)) % len(dims)]
    else:
        depth = indices.shape[-1] if indices.shape else None
        if not isinstance(depth, int):
            return None
        batch = int(layer.attrs.get("batch_dims", 0))
        axes = list(range(batch, batch + depth))
    bounds = [dims[axis] if axis < len(dims) else None for axis in axes]
    return None if any(b is None for b in bounds) else bounds  # type: ignore[return-value]


def _bounds_known(layer: Layer, graph: Graph, produced: dict[str, Layer]) -> bool:
    if layer.op_type not in INDEX_OPS:
        return True
    inputs = {n: 0 for n in layer.inputs if n and n not in produced and n not in graph.constants}
    return _index_bounds(layer, graph, inputs) is not None


def _constant_reason(layer: Layer, graph: Graph, name: str) -> str | None:
    """Check a constant size or index input now, as the run-time check would."""
    values = np.asarray(graph.constants[name])
    inputs: dict[str, int] = {}
    try:
        if layer.op_type in INDEX_OPS:
            bounds = _index_bounds(layer, graph, inputs)
            if bounds is None:
                return (f"{layer.op_type} '{layer.name}': the size of the axis its constant "
                        f"indices index is known only inside OpenVINO; CpuRef checks them")
            _check_indices(Check(layer.name, layer.op_type, 0, tuple(bounds)), values,
                           [int(b) for b in bounds])  # type: ignore[arg-type]
            return None
        dims = [d if isinstance(d, int) else 1 for d in (graph.info(layer.inputs[0]).shape or ())]
        out = graph.info(layer.outputs[0]).dtype
        shape = _output_shape(layer.op_type, layer.name, values, dims)
        _check_size(layer.name, layer.op_type, shape, str(out if out is not None else "float32"))
    except (IndexError, ValueError, AllocationError) as exc:
        return f"{exc}; left to CpuRef, which refuses it when it runs"
    return None


def _check_indices(check: Check, values: np.ndarray, bounds: list[int]) -> None:
    if values.size == 0:
        return
    columns = values.reshape(-1, len(bounds)) if check.op == "GatherND" else values.reshape(-1, 1)
    for column, size in enumerate(bounds):
        low, high = int(columns[:, column].min()), int(columns[:, column].max())
        bad = low if low < -size else high if high >= size else None
        if bad is not None:
            raise IndexError(f"{check.op} '{check.layer}': index {bad} is out of range for an "
                             f"axis of size {size} (valid: {-size} to {size - 1})")


def _output_shape(op: str, layer: str, values: np.ndarray, dims: list[int]) -> list[int]:
    """The output shape ``op`` makes of its size input ``values`` and its data's ``dims``."""
    flat = [float(v) for v in values.reshape(-1)]
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
        return [d + int(a) + int(b) for d, a, b in zip(dims, flat[:half], flat[half:])]
    if op == "OneHot":
        return [*dims, int(flat[0]) if flat else 0]
    if op == "Resize" and values.dtype.kind == "f":  # scales
        return [int(d * s) for d, s in zip(dims, flat)]
    return [int(v) for v in flat]  # ConstantOfShape, Resize's sizes


def _check_size(layer: str, op: str, shape: list[int], dtype: str) -> None:
    check_allocation([max(s, 0) for s in shape], np.dtype(dtype), f"the output of {op} '{layer}'")


def _range_reason(layer: Layer, graph: Graph) -> str | None:
    names = layer.inputs[:3]
    if not all(n in graph.constants for n in names):
        return (f"Range '{layer.name}': OpenVINO makes |limit - start| / |delta| elements where "
                f"delta points away from limit (ONNX: none), and its inputs are known only at run "
                f"time; CpuRef computes it")
    start, limit, delta = (float(np.asarray(graph.constants[n]).reshape(-1)[0]) for n in names)
    if delta == 0 or (limit - start) * delta < 0:
        return (f"Range '{layer.name}': start {start}, limit {limit}, delta {delta}: OpenVINO "
                f"answers otherwise than ONNX here; CpuRef computes it")
    return None


def _recurrent_reason(layer: Layer, graph: Graph) -> str | None:
    """OpenVINO reads the weights by their own shapes: they must agree with the attributes."""
    gates = GATES[layer.op_type]
    directions = 2 if layer.attrs.get("direction", "forward") == "bidirectional" else 1
    w, r = (graph.info(n).shape for n in layer.inputs[1:3])
    x = graph.info(layer.inputs[0]).shape
    hidden = layer.attrs.get("hidden_size")
    if w is None or r is None or len(w) != 3 or len(r) != 3 \
            or not all(isinstance(d, int) for d in (*w, *r)):
        return (f"{layer.op_type} '{layer.name}': the shapes of its weights W and R ({w}, {r}) "
                f"are not known before the run; OpenVINO reads them unchecked")
    hidden = int(hidden) if hidden is not None else r[2]
    inputs = x[2] if x and len(x) == 3 and isinstance(x[2], int) else None
    want = {"W": (w, [directions, gates * hidden, inputs]),
            "R": (r, [directions, gates * hidden, hidden])}
    optional = {3: ("B", [directions, 2 * gates * hidden]), 5: ("initial_h", [directions, None, hidden]),
                6: ("initial_c", [directions, None, hidden]), 7: ("P", [directions, 3 * hidden])}
    for index, (what, dims) in optional.items():
        if len(layer.inputs) > index and layer.inputs[index]:
            want[what] = (graph.info(layer.inputs[index]).shape, dims)  # type: ignore[assignment]
    for what, (shape, dims) in want.items():
        if shape is None or len(shape) != len(dims) or any(
                d is not None and s != d for s, d in zip(shape, dims)):
            return (f"{layer.op_type} '{layer.name}': {what} has shape {shape}, which contradicts "
                    f"hidden_size {hidden} and direction {layer.attrs.get('direction', 'forward')} "
                    f"(expected {['?' if d is None else d for d in dims]}); OpenVINO would read "
                    f"past it")
    return None
