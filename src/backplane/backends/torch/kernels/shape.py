"""Layout torch kernels: Reshape, Flatten, Transpose, Concat, Split, Slice, (Un)Squeeze, Gather,
Expand, Tile, Shape, Identity; and the reductions.

Shape-like inputs are read with ``ints`` (host lists), so these kernels never compute on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.api.memory import check_allocation
from backplane.backends.torch.kernels.common import FLOATS, NUMBERS, ints
from backplane.backends.torch.kernels.nn import spatial_mean
from backplane.ir.graph import Layer, TensorInfo

BOOL = np.dtype(np.bool_)


def reshape(data, shape, allowzero=0):
    dims = ints(shape)
    if not allowzero:
        dims = [data.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return (data.reshape(dims),)


def flatten(input, axis=1):  # noqa: A002
    axis = axis + input.dim() if axis < 0 else axis  # axis == rank is allowed
    return (input.reshape(math.prod(input.shape[:axis]), math.prod(input.shape[axis:])),)


def transpose(data, perm=None):
    perm = perm if perm is not None else list(reversed(range(data.dim())))
    return (data.permute(perm),)


def concat(*inputs, axis):
    return (torch.cat(inputs, axis),)


def split_v13(input, split=None, axis=0, *, n_outputs=1):  # noqa: A002
    sizes = ints(split) if split is not None else _even(input.shape[axis], n_outputs)
    return tuple(torch.split(input, sizes, axis))


def split(input, split=None, axis=0, num_outputs=None, *, n_outputs=1):  # noqa: A002
    if split is not None:
        return tuple(torch.split(input, ints(split), axis))
    count = num_outputs or n_outputs
    size = input.shape[axis]
    chunk = -(-size // count)  # the last one is smaller when it does not divide
    # the sizes spelled out: torch.split(input, chunk) makes fewer parts than asked where the last
    # ones are empty (4 in 3 parts: 2, 2 and 0) and refuses a chunk of 0 (an empty axis)
    sizes = [max(0, min(chunk, size - i * chunk)) for i in range(count)]
    return tuple(torch.split(input, sizes, axis))


def _even(size, parts):
    return [size // parts] * parts


def slice_(data, starts, ends, axes=None, steps=None):
    """ONNX Slice as one torch view per axis it narrows: an axis it takes whole is no op.

    Why: indexing by a tuple of slices is traced as an ``aten::slice`` of every axis, the whole
    ones too, and a trace runs each as an op of TorchScript's interpreter: a YOLO's channel
    splits (Slice of axis 1 of an (N, C, H, W) map) left 4 ops each between oneDNN Graph's
    partitions, where 1 does the work."""
    starts, ends = ints(starts), ints(ends)
    axes = ints(axes) if axes is not None else list(range(len(starts)))
    steps = ints(steps) if steps is not None else [1] * len(starts)
    result = data
    flips = []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        size = data.shape[axis]
        axis %= data.dim()
        begin, stop, stride = slice(start, end, step).indices(size)
        # A step past the axis's size takes one element, as a step of the size does; torch's own
        # arithmetic overflows on a huge one (INT64_MAX: no element at all, or a negative stride).
        if stride > 0:
            first, last, every = begin, max(begin, stop), min(stride, max(size, 1))
        else:  # torch slices forward only: take the same elements forward, then flip the axis.
            count = max(0, -(-(begin - stop) // -stride))
            first = begin + (count - 1) * stride if count else 0
            last = first + (count - 1) * -stride + 1 if count else 0
            every = min(-stride, max(size, 1))
            flips.append(axis)
        if (first, min(last, size), every) == (0, size, 1):
            continue  # the whole axis
        result = (result.narrow(axis, first, min(last, size) - first) if every == 1 else
                  torch.ops.aten.slice(result, axis, first, last, every))
    return (result.flip(flips) if flips else result,)


def squeeze_v1(data, axes=None):
    return squeeze(data, axes)


def squeeze(data, axes=None):
    if axes is None:
        return (data.reshape([d for d in data.shape if d != 1]),)
    dims = {a % data.dim() for a in ints(axes)}
    return (data.reshape([d for i, d in enumerate(data.shape) if i not in dims]),)


def unsqueeze_v1(data, axes):
    return unsqueeze(data, axes)


def unsqueeze(data, axes):
    rank = data.dim() + len(ints(axes))
    dims = sorted(a % rank for a in ints(axes))
    shape = list(data.shape)
    for axis in dims:
        shape.insert(axis, 1)
    return (data.reshape(shape),)


def gather(data, indices, axis=0):
    axis = axis % data.dim()
    size = data.shape[axis]
    on_cpu = indices.device.type == "cpu"
    if indices.dim() == 0 and on_cpu:  # one index (a column of NMS's selected rows): a view, one
        return (data.select(axis, int(indices)),)  # call (select counts negatives from the end)
    flat = indices.reshape(-1).long()
    if not on_cpu or (flat.numel() and int(flat.min()) < 0):  # where() costs 10 us on the CPU
        flat = torch.where(flat < 0, flat + size, flat)
    picked = torch.index_select(data, axis, flat)
    # one tuple: a 0-d index into a 1-D tensor gives a 0-d result, and reshape() of no sizes at all
    # is a TypeError
    return (picked.reshape((*data.shape[:axis], *indices.shape, *data.shape[axis + 1:])),)


def expand(input, shape):  # noqa: A002
    target = np.broadcast_shapes(tuple(input.shape), tuple(ints(shape)))
    check_allocation(target, input.dtype, "Expand's output")
    return (input.expand(target),)


def tile(input, repeats):  # noqa: A002
    repeats = ints(repeats)
    check_allocation([n * r for n, r in zip(input.shape, repeats)], input.dtype, "Tile's output")
    return (input.repeat(repeats),)


def shape(data, start=0, end=None):
    return (torch.tensor(list(data.shape)[start:end], dtype=torch.int64, device=data.device),)


def identity(input):  # noqa: A002
    return (input,)


# -- reductions ------------------------------------------------------------------------------------
def _reduce(fn, keeps_dtype=True):
    def kernel(data, axes=None, keepdims=1, noop_with_empty_axes=0):
        dims = ints(axes) if axes is not None else []
        if not dims:
            if noop_with_empty_axes:
                return (data,)
            dims = list(range(data.dim()))
        return (fn(data, dims, bool(keepdims)),)
    kernel.__name__ = fn.__name__
    return kernel


def _reduce_v1(fn):
    inner = _reduce(fn)

    def kernel(data, axes=None, keepdims=1):
        return inner(data, axes, keepdims)
    kernel.__name__ = f"{fn.__name__}_v1"
    return kernel


def _sum(x, dims, keep):
    return torch.sum(x, dims, keep, dtype=x.dtype)


def _mean(x, dims, keep):
    return spatial_mean(x, dims, keep)  # a pool where traced for oneDNN Graph


def _max(x, dims, keep):
    if x.numel() == 0:  # torch's amax refuses an empty slice; CpuRef gives the lowest value
        low = False if x.dtype == torch.bool else (
            -math.inf if x.dtype.is_floating_point else torch.iinfo(x.dtype).min)
        return _filled(x, dims, keep, low)
    return torch.amax(x, dims, keep)


def _min(x, dims, keep):
    if x.numel() == 0:
        high = True if x.dtype == torch.bool else (
            math.inf if x.dtype.is_floating_point else torch.iinfo(x.dtype).max)
        return _filled(x, dims, keep, high)
    return torch.amin(x, dims, keep)


def _filled(x, dims, keep, value):
    """The result of reducing the empty ``x`` over ``dims``: ``value`` everywhere."""
    reduced = {d % x.dim() for d in dims}
    shape = [1 if i in reduced else n for i, n in enumerate(x.shape) if keep or i not in reduced]
    return torch.full(shape, value, dtype=x.dtype, device=x.device)


KERNELS: KernelTable = {
    "Reshape": {5: reshape},
    "Flatten": {1: flatten},
    "Transpose": {1: transpose},
    "Concat": {4: concat},
    "Split": {2: split_v13, 18: split},  # split: an attribute before 13, an input after
    "Slice": {1: slice_},  # starts, ends, axes: attributes before 10, inputs after
    "Squeeze": {1: squeeze_v1, 13: squeeze},
    "Unsqueeze": {1: unsqueeze_v1, 13: unsqueeze},
    "Gather": {1: gather},
    "Expand": {8: expand},
    "Tile": {6: tile},
    "Shape": {1: shape},  # start and end (15) default to the whole shape
    "Identity": {1: identity},
    "ReduceSum": {1: _reduce_v1(_sum), 13: _reduce(_sum)},
    "ReduceMean": {1: _reduce_v1(_mean), 18: _reduce(_mean)},
    "ReduceMax": {1: _reduce_v1(_max), 18: _reduce(_max)},
    "ReduceMin": {1: _reduce_v1(_min), 18: _reduce(_min)},
}

def check_identity(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if inputs and inputs[0].dtype is None:
        return "Identity of a sequence or an optional (torch kernels take tensors only)"
    return None


CHECKS = {"Identity": check_identity}

INPUT_DTYPES = {"ReduceSum": NUMBERS, "ReduceMean": FLOATS, "ReduceMax": NUMBERS | {BOOL},
                "ReduceMin": NUMBERS | {BOOL}}  # bool since opset 20: amax / amin are any / all
