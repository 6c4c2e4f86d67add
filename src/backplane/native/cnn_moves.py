"""The plan's layers that move, broadcast or reduce elements (``cnn_layers.PLANNERS`` takes
them): Reshape, Transpose, Slice, Split as views or gathers, a Concat on any axis, Add, Sub, Mul,
Div and Pow that broadcast, AffineChain, the Reduces.

Why tables: a detector's head and a CRNN's neck rearrange a few thousand values in shapes of any
rank; each such layer's places (which input element goes where, in the arena's channels-last
orders) are worked out once at load by NumPy on index arrays, and a run is a loop over an int32
table (``cnn.c``'s gather, scatter, reduce). A move that keeps the order in memory is a view.
"""

from __future__ import annotations

import math

import numpy as np

from backplane.ir.graph import Layer
from backplane.native import cnn
from backplane.native.cnn import Unplannable, _Planner


def reduce_mean(p: _Planner, layer: Layer) -> None:
    """ReduceMean over the spatial axes of a 4-d tensor (dynamo's global average pool)."""
    x = p.value(layer.inputs[0])
    axes = layer.attrs.get("axes")
    if axes is None and len(layer.inputs) > 1 and layer.inputs[1]:
        axes = p.constants.get(layer.inputs[1])
    if len(x.shape) != 4 or axes is None or sorted(int(a) % 4 for a in axes) != [2, 3]:
        raise Unplannable(f"{layer.name}: ReduceMean over axes {axes} of {x.shape}")
    n, c = x.dims[:2]
    y = p.new(layer.outputs[0], (n, c, 1, 1) if layer.attrs.get("keepdims", 1) else (n, c))
    p.record("gap", in_=x.offset, out=y.offset, dims=x.dims)


def view(p: _Planner, layer: Layer) -> None:
    """Flatten, Reshape, Squeeze, Unsqueeze, Identity: the same place where channels-last
    orders the elements as the new shape's channels-last does (a tensor of 1x1 pixels or of one
    channel, (N, C, 1, W) as (N, C, W)), else a gather."""
    x = p.value(layer.inputs[0])
    shape = _target(p, layer, x.shape)
    if math.prod(shape) != x.size:
        raise Unplannable(f"{layer.name}: {layer.op_type} {x.shape} -> {shape}")
    p.moved(x, layer.outputs[0], p.places(x).reshape(shape))


def transpose(p: _Planner, layer: Layer) -> None:
    """A view where the order in memory stays (CRNN's (1, C, W) -> (W, 1, C): channels-last
    already), else a gather."""
    x = p.value(layer.inputs[0])
    perm = layer.attrs.get("perm") or list(range(len(x.shape)))[::-1]
    p.moved(x, layer.outputs[0], p.places(x).transpose([int(a) for a in perm]))


def slice_(p: _Planner, layer: Layer) -> None:
    """Slice with constant starts, ends, axes and steps (Python's slices clamp as ONNX's do)."""
    x, a = p.value(layer.inputs[0]), layer.attrs
    rank = len(x.shape)
    if layer.opset < 10:
        starts, ends = a["starts"], a["ends"]
        axes, steps = a.get("axes") or list(range(len(starts))), [1] * len(starts)
    else:
        given = []
        for index in range(1, 5):
            name = layer.inputs[index] if len(layer.inputs) > index else ""
            if name and name not in p.constants:
                raise Unplannable(f"{layer.name}: a Slice of computed bounds")
            given.append(np.asarray(p.constants[name]).reshape(-1).tolist() if name else None)
        starts, ends, axes, steps = given
        axes = axes if axes is not None else list(range(len(starts)))
        steps = steps if steps is not None else [1] * len(starts)
    index = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[int(axis) % rank] = slice(int(start), int(end), int(step))
    places = p.places(x)[tuple(index)]
    if places.size == 0:
        raise Unplannable(f"{layer.name}: an empty Slice")
    p.moved(x, layer.outputs[0], places)


def split(p: _Planner, layer: Layer) -> None:
    x, a = p.value(layer.inputs[0]), layer.attrs
    axis = int(a.get("axis", 0)) % len(x.shape)
    size, count = x.shape[axis], len(layer.outputs)
    sizes = a.get("split")
    if len(layer.inputs) > 1 and layer.inputs[1]:
        if layer.inputs[1] not in p.constants:
            raise Unplannable(f"{layer.name}: a Split of computed sizes")
        sizes = np.asarray(p.constants[layer.inputs[1]]).reshape(-1).tolist()
    if sizes is None:
        step = -(-size // count) if a.get("num_outputs") else size // count
        sizes = [min(step, size - i * step) for i in range(count)]
    if sum(sizes) != size or len(sizes) != count or min(sizes) < 1 or not all(layer.outputs):
        raise Unplannable(f"{layer.name}: Split {sizes} of {size}")
    parts = np.split(p.places(x), np.cumsum(sizes)[:-1], axis=axis)
    for name, part in zip(layer.outputs, parts):
        p.moved(x, name, part)


def _target(p: _Planner, layer: Layer, shape: tuple[int, ...]) -> tuple[int, ...]:
    op, a = layer.op_type, layer.attrs
    if op == "Identity":
        return shape
    if op == "Flatten":
        axis = a.get("axis", 1) % len(shape)
        return (math.prod(shape[:axis]), math.prod(shape[axis:]))
    if op == "Reshape":
        target = p.constants.get(layer.inputs[1]) if len(layer.inputs) > 1 else None
        if target is None:
            raise Unplannable(f"{layer.name}: a Reshape to a computed shape")
        return tuple(np.empty(shape, np.uint8).reshape(
            [d if d != 0 or a.get("allowzero") else shape[i] for i, d in enumerate(target)]).shape)
    axes = a.get("axes")
    if axes is None and len(layer.inputs) > 1 and layer.inputs[1]:
        axes = p.constants.get(layer.inputs[1])
    if op == "Squeeze":
        keep = [i for i, d in enumerate(shape) if not (d == 1 and (axes is None or i in
                [x % len(shape) for x in axes]))]
        return tuple(shape[i] for i in keep)
    if axes is None:
        raise Unplannable(f"{layer.name}: Unsqueeze without axes")
    out = list(shape)
    for axis in sorted(int(x) % (len(shape) + len(axes)) for x in axes):
        out.insert(axis, 1)
    return tuple(out)


def arith(p: _Planner, layer: Layer) -> None:
    """Add, Sub, Mul, Div, Pow of two tensors that broadcast (an operand of another shape
    gathered to the output's first), or of a tensor and a constant (laid out at load)."""
    names = layer.inputs[:2]
    if all(n in p.constants for n in names):
        raise Unplannable(f"{layer.name}: {layer.op_type} of two constants")
    shapes = [np.shape(p.constants[n]) if n in p.constants else p.value(n).shape for n in names]
    shape = tuple(int(d) for d in np.broadcast_shapes(*shapes))
    operands, temporary = [], []
    for name in names:
        if name in p.constants:
            operands.append(("param", p.param(p.laid(shape, np.asarray(p.constants[name],
                                                                       np.float32)))))
            continue
        v = p.value(name)
        if v.shape != shape:  # its elements repeated as the output's shape has them
            p.moved(v, f"{layer.outputs[0]}#{len(temporary)}",
                    np.broadcast_to(p.places(v), shape))
            v = p.values.pop(f"{layer.outputs[0]}#{len(temporary)}")
            temporary.append(v)
        operands.append(("arena", v.offset))
    if operands[0][0] == "param" and layer.op_type in ("Add", "Mul"):  # c + x is x + c
        operands.reverse()
    if operands[0][0] == "param" and layer.op_type == "Sub":  # c - x as x * -1 + c (exact)
        y = p.new(layer.outputs[0], shape)
        p.record("arith", in_=operands[1][1], out=y.offset, dims=(y.size, 1, 1, 1),
                 x1=cnn.ARITH["AffineChain"], woff=p.param(np.full(y.size, -1, np.float32)),
                 boff=operands[0][1])
        for v in temporary:
            p.arena.give(v.offset, v.size)
        return
    if operands[0][0] == "param":  # a constant first: c / x, c ** x as x's record
        raise Unplannable(f"{layer.name}: {layer.op_type} of a constant by a tensor")
    y = p.new(layer.outputs[0], shape)
    kind, second = operands[1]
    p.record("arith", in_=operands[0][1], out=y.offset, dims=(y.size, 1, 1, 1),
             in2=second if kind == "arena" else -1, woff=second if kind == "param" else 0,
             x1=cnn.ARITH[layer.op_type])
    for v in temporary:
        p.arena.give(v.offset, v.size)


def affine(p: _Planner, layer: Layer) -> None:
    """AffineChain (a detector's box decode, folded at load): x * scale + shift."""
    x, a = p.value(layer.inputs[0]), layer.attrs
    if np.broadcast_shapes(x.shape, np.shape(a["scale"]), np.shape(a["shift"])) != x.shape:
        raise Unplannable(f"{layer.name}: constants wider than {x.shape}")
    y = p.new(layer.outputs[0], x.shape)
    p.record("arith", in_=x.offset, out=y.offset, dims=(y.size, 1, 1, 1), x1=cnn.ARITH[
        "AffineChain"], woff=p.param(p.laid(x.shape, np.asarray(a["scale"], np.float32))),
        boff=p.param(p.laid(x.shape, np.asarray(a["shift"], np.float32))))


def reduce(p: _Planner, layer: Layer) -> None:
    """ReduceMax, Min, Sum, Mean over any axes (a table of each output's inputs); a mean over
    a 4-d tensor's H and W is a global average pool (``reduce_mean``)."""
    x, a = p.value(layer.inputs[0]), layer.attrs
    axes = a.get("axes")
    if axes is None and len(layer.inputs) > 1 and layer.inputs[1]:
        if layer.inputs[1] not in p.constants:
            raise Unplannable(f"{layer.name}: {layer.op_type} over computed axes")
        axes = np.asarray(p.constants[layer.inputs[1]]).reshape(-1).tolist()
    rank = len(x.shape)
    if layer.op_type == "ReduceMean" and rank == 4 and axes is not None \
            and sorted(int(i) % 4 for i in axes) == [2, 3]:
        return reduce_mean(p, layer)
    if layer.op_type in ("ReduceMax", "ReduceMean") and rank in (3, 4) and axes is not None \
            and sorted(int(i) % rank for i in axes) == list(range(2, rank)):
        return _global(p, layer, x)
    if not axes:
        if a.get("noop_with_empty_axes", 0):
            raise Unplannable(f"{layer.name}: a Reduce of no axes")
        axes = list(range(rank))
    axes = sorted({int(i) % rank for i in axes})
    keep = [i for i in range(rank) if i not in axes]
    places = p.places(x).transpose(keep + axes)
    count = math.prod(x.shape[i] for i in axes)
    kept = tuple(x.shape[i] for i in keep)
    shape = tuple(1 if i in axes else x.shape[i] for i in range(rank)) \
        if a.get("keepdims", 1) else kept
    if count == 0 or 0 in kept:
        raise Unplannable(f"{layer.name}: an empty Reduce")
    rows = places.reshape(-1, count)[p.laid(shape, np.arange(math.prod(kept)).reshape(shape))]
    y = p.new(layer.outputs[0], shape)
    p.record("reduce", in_=x.offset, out=y.offset, dims=(y.size, count, 1, 1),
             x1=cnn.REDUCE[layer.op_type], woff=p.table(rows))


def _global(p: _Planner, layer: Layer, x: cnn.Value) -> None:
    """A max or mean over an (N, C, L) line's L or an image's H and W: a global pool, the
    channels innermost (a vector of them a pixel), where the table's gather read one element at
    a time (bytes_int32_dyn20's ReduceMax over 63 of 64 channels: 8.0 -> ~0.5 us)."""
    n, c = x.dims[:2]
    y = p.new(layer.outputs[0], (n, c) + (1,) * (len(x.shape) - 2)
              if layer.attrs.get("keepdims", 1) else (n, c))
    p.record("gmp" if layer.op_type == "ReduceMax" else "gap", in_=x.offset, out=y.offset,
             dims=x.dims)


def _concat_any(p: _Planner, layer: Layer, parts: list, axis: int) -> None:
    """A Concat on any axis: each part's elements written to their places in the output."""
    shape = list(parts[0].shape)
    shape[axis] = sum(v.shape[axis] for v in parts)
    if any(len(v.shape) != len(shape) or [d for i, d in enumerate(v.shape) if i != axis]
           != [d for i, d in enumerate(shape) if i != axis] for v in parts):
        raise Unplannable(f"{layer.name}: Concat of {[v.shape for v in parts]}")
    y = p.new(layer.outputs[0], tuple(shape))
    regions = np.split(p.places(y), np.cumsum([v.shape[axis] for v in parts])[:-1], axis=axis)
    for v, region in zip(parts, regions):
        p.record("scatter", in_=v.offset, out=y.offset, dims=(v.size, 1, 1, 1),
                 woff=p.table(p.laid(v.shape, region)))
