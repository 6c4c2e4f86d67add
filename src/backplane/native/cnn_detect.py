"""The plan's layers of a detector's head after its convolutions (``cnn_layers.PLANNERS`` takes
them; ``cnn_detect.h`` runs them): TopK, Gather, GatherElements and GatherND (by constant
indices a move, by computed ones a gather that reads them at the run), Expand, ArgMax and
ArgMin, Cast between floats and indices, Softmax.

Why: detect_nms_ts14's and _dyn21's partitions ended in a TopK of the best candidates and the
gathers of their boxes and scores, which kept those layers traced after the native backbone
(route ``native+traced``: the trace's call, its TopK and gathers ~70 us around ~2 us of work).
With them planned the partition is one C call.

Indices (a TopK's, an ArgMax's) are kept in the arena as floats, exact below 2^24 (every place
of a planned tensor is an int32), their values marked ``integer`` (``cnn.INTEGER``: only moves
and gathers read them) and exported as int64. A place in the arena is an affine function of a
tensor's ONNX coordinates (``_Planner.places``: channels-last of ``_dims``), so a gather by
computed indices is a table of each output's place with the index 0 plus the index read at the
run times its axis's step.
"""

from __future__ import annotations

import math

import numpy as np

from backplane.ir.graph import Layer
from backplane.native import cnn_seq
from backplane.native.cnn import Unplannable, Value, _dims, _Planner


def top_k(p: _Planner, layer: Layer) -> None:
    """TopK by a constant k: its values and indices in CpuRef's order (stable: equal values
    lower index first, a NaN above every number)."""
    x, a = p.value(layer.inputs[0]), layer.attrs
    if layer.opset < 10:
        k = int(a["k"])
    elif layer.inputs[1] in p.constants:
        k = int(np.asarray(p.constants[layer.inputs[1]]).reshape(-1)[0])
    else:
        raise Unplannable(f"{layer.name}: a TopK of a computed k")
    rank = len(x.shape)
    axis = int(a.get("axis", -1)) % max(rank, 1)
    if not rank or not 0 < k <= x.shape[axis]:
        raise Unplannable(f"{layer.name}: TopK {k} of {x.shape}")
    rows = _rows(p, x, axis)
    out_shape = tuple(k if i == axis else d for i, d in enumerate(x.shape))
    count = rows.shape[0] * k
    made = p.arena.take(count), p.arena.take(count)
    p.record("topk", in_=x.offset, out=made[0], dims=(rows.shape[0], rows.shape[1], 1, 1), oc=k,
             x1=int(a.get("largest", 1)), x2=made[1], woff=p.table(rows))
    for name, at, integer in zip(layer.outputs, made, (False, True)):
        _placed(p, name, at, out_shape, axis, integer)


def _rows(p: _Planner, x: Value, axis: int) -> np.ndarray:
    """``x``'s places as rows along ``axis``, the rows in ONNX order of the other axes."""
    return np.moveaxis(p.places(x), axis, -1).reshape(-1, x.shape[axis])


def _placed(p: _Planner, name: str, at: int, shape: tuple[int, ...], axis: int,
            integer: bool) -> None:
    """``name`` of ``shape``, written at ``at`` row by row along ``axis`` (``[row][k]``): there
    where the arena's order is that, else gathered to its own place; nothing where no layer
    reads it."""
    size = math.prod(shape)
    if not name or name not in p.last:
        p.arena.give(at, size)
        return
    order = np.moveaxis(np.arange(size).reshape(np.moveaxis(np.empty(shape), axis, -1).shape),
                        -1, axis)
    table = p.laid(shape, order)
    if np.array_equal(table, np.arange(size)):
        p.values[name] = Value(at, _dims(shape), shape, integer)
        return
    y = p.new(name, shape)
    y.integer = integer
    p.record("gather", in_=at, out=y.offset, dims=(size, 1, 1, 1), woff=p.table(table))
    p.arena.give(at, size)


def _indices(p: _Planner, layer: Layer) -> tuple[Value | None, np.ndarray | None]:
    """A gather's indices: a planned integer value, or a constant (int64)."""
    name = layer.inputs[1]
    if name in p.constants:
        return None, np.asarray(p.constants[name]).astype(np.int64)
    index = p.value(name)
    if not index.integer:
        raise Unplannable(f"{layer.name}: indices the plan did not make ({name!r})")
    return index, None


def _checked(layer: Layer, index: np.ndarray, size: int) -> np.ndarray:
    if index.size and (index.min() < -size or index.max() >= size):
        raise Unplannable(f"{layer.name}: a constant index outside {size}")
    return np.where(index < 0, index + size, index)


def _strides(p: _Planner, x: Value) -> list[int]:
    """Each ONNX axis's step between places in ``x`` (0 where the axis has one element)."""
    places = p.places(x)
    first = places[(0,) * len(x.shape)] if x.shape else 0
    return [int(places[tuple(1 if j == i else 0 for j in range(len(x.shape)))] - first)
            if d > 1 else 0 for i, d in enumerate(x.shape)]


def gather(p: _Planner, layer: Layer) -> None:
    x = p.value(layer.inputs[0])
    rank = len(x.shape)
    if not rank:
        raise Unplannable(f"{layer.name}: a Gather of a scalar")
    axis = int(layer.attrs.get("axis", 0)) % rank
    index, constant = _indices(p, layer)
    if constant is not None:
        places = np.take(p.places(x), _checked(layer, constant, x.shape[axis]), axis=axis)
        return _moved(p, layer, x, places)
    q = index.shape
    shape = (*x.shape[:axis], *q, *x.shape[axis + 1:])
    base = np.expand_dims(np.take(p.places(x), 0, axis=axis),
                          tuple(range(axis, axis + len(q))))
    where = p.places(index).reshape((1,) * axis + q + (1,) * (rank - axis - 1))
    _dynamic(p, layer, x, index, shape, base, where, [(_strides(p, x)[axis], x.shape[axis], 0)])


def gather_elements(p: _Planner, layer: Layer) -> None:
    x = p.value(layer.inputs[0])
    rank = len(x.shape)
    axis = int(layer.attrs.get("axis", 0)) % max(rank, 1)
    index, constant = _indices(p, layer)
    shape = constant.shape if index is None else index.shape
    if len(shape) != rank or any(s > d for i, (s, d) in enumerate(zip(shape, x.shape))
                                 if i != axis) or 0 in shape:
        raise Unplannable(f"{layer.name}: GatherElements of {x.shape} by {shape}")
    coords = list(np.indices(shape))
    if constant is not None:
        coords[axis] = _checked(layer, constant, x.shape[axis])
        return _moved(p, layer, x, p.places(x)[tuple(coords)])
    coords[axis] = np.zeros(shape, np.int64)
    _dynamic(p, layer, x, index, shape, p.places(x)[tuple(coords)], p.places(index),
             [(_strides(p, x)[axis], x.shape[axis], 0)])


def gather_nd(p: _Planner, layer: Layer) -> None:
    x = p.value(layer.inputs[0])
    index, constant = _indices(p, layer)
    q = constant.shape if index is None else index.shape
    depth = q[-1] if q else 0
    if layer.attrs.get("batch_dims", 0) or not q or not 0 < depth <= len(x.shape):
        raise Unplannable(f"{layer.name}: GatherND of {x.shape} by {q}")
    if constant is not None:
        where = tuple(_checked(layer, constant[..., j], x.shape[j]) for j in range(depth))
        return _moved(p, layer, x, p.places(x)[where])
    rest = x.shape[depth:]
    shape = (*q[:-1], *rest)
    base = p.places(x)[(0,) * depth].reshape((1,) * (len(q) - 1) + rest)
    places = p.places(index)
    step = int(places[(0,) * (len(q) - 1) + (1,)] - places[(0,) * len(q)]) if depth > 1 else 0
    where = places[..., 0].reshape(q[:-1] + (1,) * len(rest))
    strides = _strides(p, x)
    _dynamic(p, layer, x, index, shape, base, where,
             [(strides[j], x.shape[j], step) for j in range(depth)])


def _moved(p: _Planner, layer: Layer, x: Value, places: np.ndarray) -> None:
    if places.size == 0:
        raise Unplannable(f"{layer.name}: an empty {layer.op_type}")
    p.moved(x, layer.outputs[0], places)


def _dynamic(p: _Planner, layer: Layer, x: Value, index: Value, shape: tuple[int, ...],
             base: np.ndarray, where: np.ndarray, axes: list[tuple[int, int, int]]) -> None:
    """The record of a gather by indices read at the run: each output's place with the
    indices 0 (``base``) and its first index's place (``where``), both broadcast to ``shape``;
    ``axes``: each index component's (step, size, index step)."""
    if 0 in shape:
        raise Unplannable(f"{layer.name}: an empty {layer.op_type}")
    y = p.new(layer.outputs[0], tuple(int(d) for d in shape))
    p.record("dgather", in_=x.offset, out=y.offset, in2=index.offset, dims=(y.size, len(axes), 1, 1),
             woff=p.table(p.laid(y.shape, base)), boff=p.table(p.laid(y.shape, where)),
             x2=p.table(np.array(axes, np.int64).reshape(-1)))


def expand(p: _Planner, layer: Layer) -> None:
    x = p.value(layer.inputs[0])
    if layer.inputs[1] not in p.constants:
        raise Unplannable(f"{layer.name}: an Expand to a computed shape")
    target = tuple(int(d) for d in np.asarray(p.constants[layer.inputs[1]]).reshape(-1))
    try:
        shape = np.broadcast_shapes(x.shape, target)
    except ValueError as why:
        raise Unplannable(f"{layer.name}: Expand {x.shape} to {target}") from why
    _moved(p, layer, x, np.broadcast_to(p.places(x), shape))


def arg_reduce(p: _Planner, layer: Layer) -> None:
    """ArgMax, ArgMin: NumPy's (CpuRef's) first or last index of the extreme, a NaN winning."""
    x, a = p.value(layer.inputs[0]), layer.attrs
    rank = len(x.shape)
    axis = int(a.get("axis", 0)) % max(rank, 1)
    if not rank or not x.shape[axis]:
        raise Unplannable(f"{layer.name}: {layer.op_type} of {x.shape}")
    kept = tuple(d for i, d in enumerate(x.shape) if i != axis)
    shape = tuple(1 if i == axis else d for i, d in enumerate(x.shape)) \
        if a.get("keepdims", 1) else kept
    rows = _rows(p, x, axis)[p.laid(shape, np.arange(math.prod(kept)).reshape(shape))]
    y = p.new(layer.outputs[0], shape)
    y.integer = True
    p.record("argreduce", in_=x.offset, out=y.offset, dims=(y.size, x.shape[axis], 1, 1),
             x1=int(layer.op_type == "ArgMin"), x2=int(a.get("select_last_index", 0)),
             woff=p.table(rows))


def cast(p: _Planner, layer: Layer) -> None:
    """A Cast of indices to float32 or int64, or of a float32 to itself: the same place."""
    x, to = p.value(layer.inputs[0]), int(layer.attrs["to"])
    if to not in (1, 7) or to == 7 and not x.integer:
        raise Unplannable(f"{layer.name}: a Cast to {to} of {'indices' if x.integer else 'floats'}")
    p.values[layer.outputs[0]] = Value(x.offset, x.dims, x.shape, to == 7)


def softmax(p: _Planner, layer: Layer) -> None:
    """Softmax (opset 13: along one axis) as CpuRef's: exp(x - max) / sum."""
    x = p.value(layer.inputs[0])
    rank = len(x.shape)
    if layer.opset < 13 or not rank:
        raise Unplannable(f"{layer.name}: Softmax of opset {layer.opset}")
    axis = int(layer.attrs.get("axis", -1)) % rank
    rows = _rows(p, x, axis)
    y = p.new(layer.outputs[0], x.shape)
    p.record("softmax", in_=x.offset, out=y.offset, dims=(rows.shape[0], rows.shape[1], 1, 1),
             woff=p.table(rows))


PLANNERS = {"TopK": top_k, "Gather": gather, "GatherElements": gather_elements,
            "GatherND": gather_nd, "Expand": expand, "ArgMax": arg_reduce,
            "ArgMin": arg_reduce, "Cast": cast, "Softmax": softmax, **cnn_seq.PLANNERS}
