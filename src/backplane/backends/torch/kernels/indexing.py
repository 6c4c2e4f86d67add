"""Indexing and layout torch kernels: Pad, CenterCropPad, GatherND / GatherElements, Scatter,
ScatterND / ScatterElements, TensorScatter, OneHot, NonZero, Compress, TopK, Unique,
ReverseSequence, DepthToSpace / SpaceToDepth, Trilu, EyeLike, NonMaxSuppression (its kernel in
nms.py); the tensor makers Size, ConstantOfShape and Range, and Dropout at inference.

Indices are computed on the device (``torch.arange`` and arithmetic), never uploaded from the host,
so that these kernels stay capturable where their sizes are static. Sizes, pads and counts (Pad's
pads, TopK's K, OneHot's depth) are read on the host with ``ints`` / ``scalar``. The selections
(NonZero, Compress, Unique, NonMaxSuppression) make shapes from data and wait for it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.api.memory import check_allocation
from backplane.backends.torch.kernels.common import FLOATS, NUMBERS, ints, scalar, torch_dtype
from backplane.backends.torch.kernels.nms import non_max_suppression
from backplane.ir.graph import Layer, TensorInfo


def _wrap(indices, size):
    """int64 indices, negative ones counted from the end (as in ONNX)."""
    indices = indices.long()  # where() always: a kernel a trace holds reads no value on the host
    return torch.where(indices < 0, indices + size, indices)


def _along(index, axis, rank):
    """A 1-D tensor shaped to broadcast along ``axis`` of a rank-``rank`` tensor."""
    return index.reshape([-1 if d == axis else 1 for d in range(rank)])


# -- Pad -------------------------------------------------------------------------------------------
def _source(positions, size, mode):
    """The input position each output position reads, for the modes that read the input."""
    if mode == "edge":
        return positions.clamp(0, size - 1)
    if mode == "wrap":
        return positions.remainder(size)
    if size == 1:  # reflect
        return positions.clamp(0, 0)
    period = 2 * (size - 1)  # NumPy reflects again past the far edge: a period of 2 (n - 1)
    folded = positions.remainder(period)
    return torch.where(folded < size, folded, period - folded)


def _padded(x, widths, mode, value):
    """x with (begin, end) added on each axis: negative widths crop, the rest is ``value`` or
    read from the input as ``mode`` says."""
    made = [n + b + e for n, (b, e) in zip(x.shape, widths)]
    if any(n < 0 for n in made):
        raise ValueError(f"Pad's pads {widths} would make the {list(x.shape)} input {made}: a "
                         f"negative pad removes at most what the axis has")
    check_allocation(made, x.dtype, "Pad's output")
    if mode == "constant":
        shape = [n + b + e for n, (b, e) in zip(x.shape, widths)]
        out = torch.full([max(n, 0) for n in shape], value, dtype=x.dtype, device=x.device)
        source = tuple(slice(max(-b, 0), n - max(-e, 0)) for n, (b, e) in zip(x.shape, widths))
        target = tuple(slice(max(b, 0), max(b, 0) + max(n - max(-b, 0) - max(-e, 0), 0))
                       for n, (b, e) in zip(x.shape, widths))
        if all(s.stop > s.start for s in source):
            out[target] = x[source]
        return out
    for axis, (begin, end) in enumerate(widths):
        if begin or end:
            positions = torch.arange(-begin, max(x.shape[axis] + end, -begin), device=x.device)
            x = torch.index_select(x, axis, _source(positions, x.shape[axis], mode))
    return x


def pad(data, pads, constant_value=None, axes=None, mode="constant"):
    rank = data.dim()
    axes = [a % rank for a in ints(axes)] if axes is not None else list(range(rank))
    pads = ints(pads)
    widths = [(0, 0)] * rank
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[i + len(axes)])
    value = 0 if constant_value is None else scalar(constant_value)
    return (_padded(data, widths, mode, value),)


def pad_v2(data, pads, mode="constant", value=0.0):
    rank = data.dim()
    widths = [(pads[i], pads[i + rank]) for i in range(rank)]
    # the attribute is a float; the output keeps the data's type, as a cast of it
    fill = torch.tensor(value, dtype=torch.float64).to(data.dtype).item()
    return (_padded(data, widths, mode, fill),)


def center_crop_pad(input_data, shape, axes=None):
    rank = input_data.dim()
    axes = [a % rank for a in ints(axes)] if axes is not None else list(range(rank))
    widths = [(0, 0)] * rank
    for axis, target in zip(axes, ints(shape)):
        diff = target - input_data.shape[axis]
        begin = diff // 2 if diff >= 0 else -(-diff // 2)
        widths[axis] = (begin, diff - begin)
    return (_padded(input_data, widths, "constant", 0),)


PAD_MODES = ("constant", "reflect", "edge", "wrap")


def check_pad(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "constant")
    return None if mode in PAD_MODES else f"Pad mode {mode!r} not known (known: {list(PAD_MODES)})"


# -- gathers ---------------------------------------------------------------------------------------
def gather_elements(data, indices, axis=0):
    axis = axis % data.dim()
    # NumPy's take_along_axis (CpuRef) broadcasts the other axes of data and indices
    others = [max(d, i) if 1 in (d, i) else d for d, i in zip(data.shape, indices.shape)]
    data, indices = _broadcast(data, others, axis), _broadcast(indices, others, axis)
    return (torch.gather(data, axis, _wrap(indices, data.shape[axis])),)


def _broadcast(value, sizes, axis):
    """``value`` expanded to ``sizes`` but along ``axis``; itself where it has them (no op in a
    trace: a YOLO head's two GatherElements expanded each operand to its own shape)."""
    if all(a == axis or n == m for a, (n, m) in enumerate(zip(value.shape, sizes))):
        return value
    return value.expand([-1 if a == axis else n for a, n in enumerate(sizes)])


def gather_nd(data, indices, batch_dims=0):
    batch_shape, depth = tuple(data.shape[:batch_dims]), indices.shape[-1]
    if not batch_dims and depth == 1 and data.dim():  # rows by one index each (NMS's boxes)
        rows = data.index_select(0, _wrap(indices.reshape(-1), data.shape[0]))
        if indices.dim() == 2:  # rows has the shape already (a reshape is an op in a trace)
            return (rows,)
        return (rows.reshape((*indices.shape[:-1], *data.shape[1:])),)
    batches = math.prod(batch_shape)
    flat_data = data.reshape((batches, *data.shape[batch_dims:]))
    flat_indices = indices.reshape(batches, -1, depth)  # (B, M, depth)
    coords = [_wrap(flat_indices[..., j], flat_data.shape[1 + j]) for j in range(depth)]
    rows = torch.arange(batches, device=data.device)[:, None]
    gathered = flat_data[(rows, *coords)]  # (B, M, *rest)
    shape = (*batch_shape, *indices.shape[batch_dims:-1], *data.shape[batch_dims + depth:])
    return (gathered.reshape(shape),)


# -- scatters --------------------------------------------------------------------------------------
_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}
"""ONNX's scatter reductions as torch's scatter_reduce names them."""


def _scatter(out, axis, index, updates, reduction):
    if reduction == "none":
        return out.scatter_(axis, index, updates)
    return out.scatter_reduce_(axis, index, updates, _REDUCE[reduction], include_self=True)


def scatter_elements(data, indices, updates, axis=0, reduction="none"):
    axis = axis % data.dim()
    return (_scatter(data.clone(), axis, _wrap(indices, data.shape[axis]), updates, reduction),)


def scatter_nd(data, indices, updates, reduction="none"):
    depth = indices.shape[-1]
    rows = math.prod(data.shape[:depth])
    rest = tuple(data.shape[depth:])
    # the indexed axes as one: a row number per index tuple
    strides = [math.prod(data.shape[j + 1:depth]) for j in range(depth)]
    coords = indices.reshape(-1, depth)
    row = sum((_wrap(coords[:, j], data.shape[j]) * strides[j] for j in range(depth)),
              torch.zeros(coords.shape[0], dtype=torch.int64, device=data.device))
    flat = data.reshape(rows, *rest).clone()
    values = updates.reshape(-1, *rest)
    index = row.reshape(-1, *[1] * len(rest)).expand(values.shape)
    return (_scatter(flat, 0, index, values, reduction).reshape(data.shape),)


def tensor_scatter(past_cache, update, write_indices=None, axis=-2, mode="linear"):
    axis = axis % past_cache.dim()
    batch, length, size = update.shape[0], update.shape[axis], past_cache.shape[axis]
    starts = torch.zeros(batch, dtype=torch.int64, device=past_cache.device) \
        if write_indices is None else write_indices.long()
    positions = starts[:, None] + torch.arange(length, device=past_cache.device)  # (B, L)
    if mode == "circular":
        positions = positions.remainder(size)
    shape = [batch if d == 0 else length if d == axis else 1 for d in range(update.dim())]
    index = positions.reshape(shape).expand(update.shape)  # axis is past the batch axis
    return (past_cache.clone().scatter_(axis, index, update),)


def check_scatter(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    reduction = layer.attrs.get("reduction", "none")
    known = ["none", *_REDUCE]
    if reduction not in known:
        return f"reduction {reduction!r} not known (known: {known})"
    if reduction != "none" and inputs and inputs[0].dtype == np.dtype(np.bool_):
        return f"reduction {reduction!r} of booleans (torch's scatter_reduce has none)"
    return None


def check_tensor_scatter(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "linear")
    known = ["linear", "circular"]
    return None if mode in known else f"TensorScatter mode {mode!r} not known (known: {known})"


# -- selections ------------------------------------------------------------------------------------
def one_hot(indices, depth, values, axis=-1):
    depth = int(scalar(depth))
    axis = axis % (indices.dim() + 1)
    classes = _along(torch.arange(depth, device=indices.device), axis, indices.dim() + 1)
    hot = _wrap(indices, depth).unsqueeze(axis) == classes
    values = values.reshape(-1)
    return (torch.where(hot, values[1], values[0]),)


def non_zero(X):
    return (torch.nonzero(X.reshape(-1) if X.dim() == 0 else X).t(),)


def compress(input, condition, axis=None):  # noqa: A002
    picked = torch.nonzero(condition.reshape(-1)).reshape(-1)
    if axis is None:
        return (input.reshape(-1)[picked],)
    return (torch.index_select(input, axis % input.dim(), picked),)


def top_k(X, K, axis=-1, largest=1, sorted=1):  # noqa: A002
    k = ints(K)[0]
    # a stable sort: of equal values the lower index comes first, as in CpuRef (torch.topk does
    # not say which)
    values, indices = torch.sort(X, dim=axis, descending=bool(largest), stable=True)
    return values.narrow(axis, 0, k), indices.narrow(axis, 0, k)


def top_k_v1(X, *, k, axis=-1):
    return top_k(X, [k], axis)


def reverse_sequence(input, sequence_lens, batch_axis=1, time_axis=0):  # noqa: A002
    rank = input.dim()
    time = _along(torch.arange(input.shape[time_axis], device=input.device), time_axis, rank)
    lengths = _along(sequence_lens.long(), batch_axis, rank)
    source = torch.where(time < lengths, lengths - 1 - time, time)
    return (torch.gather(input, time_axis, source.expand(input.shape)),)


# -- Unique ----------------------------------------------------------------------------------------
def unique(X, axis=None, sorted=1, *, n_outputs):  # noqa: A002
    if axis is None:
        rows = X.reshape(-1, 1)
    else:  # one row per slice along the axis
        rows = X.movedim(axis, 0).reshape(X.shape[axis], X.numel() // max(X.shape[axis], 1))
    order = torch.arange(rows.shape[0], device=X.device)
    for column in reversed(range(rows.shape[1])):  # lexicographic: a stable sort per column
        order = order[torch.sort(rows[order, column], stable=True).indices]
    ranked = rows[order]
    same = ranked[1:] == ranked[:-1]
    if ranked.dtype.is_floating_point:  # NumPy's unique takes NaNs as equal
        same |= torch.isnan(ranked[1:]) & torch.isnan(ranked[:-1])
    starts = torch.ones(rows.shape[0], dtype=torch.bool, device=X.device)
    starts[1:] = ~same.all(dim=1)
    group = torch.cumsum(starts, 0) - 1
    first = order[starts]  # the stable sort puts each value's first occurrence first
    counts = torch.bincount(group, minlength=int(first.shape[0]))
    inverse = torch.empty_like(group)
    inverse[order] = group
    if not sorted:  # in order of first occurrence
        by_first = torch.argsort(first)
        rank = torch.empty_like(by_first)
        rank[by_first] = torch.arange(by_first.shape[0], device=X.device)
        first, counts, inverse = first[by_first], counts[by_first], rank[inverse]
    values = X.reshape(-1)[first] if axis is None else torch.index_select(X, axis, first)
    return (values, first, inverse, counts)[:n_outputs]


# -- blocks and triangles --------------------------------------------------------------------------
def depth_to_space(input, blocksize, mode="DCR"):  # noqa: A002
    n, c, h, w = input.shape
    b = blocksize
    if mode == "DCR":  # depth is (b, b, c/b²)
        blocks = input.reshape(n, b, b, c // b**2, h, w).permute(0, 3, 4, 1, 5, 2)
    else:  # CRD: depth is (c/b², b, b)
        blocks = input.reshape(n, c // b**2, b, b, h, w).permute(0, 1, 4, 2, 5, 3)
    return (blocks.reshape(n, c // b**2, h * b, w * b),)


def space_to_depth(input, blocksize, mode="DCR"):  # noqa: A002
    n, c, h, w = input.shape
    b = blocksize
    blocks = input.reshape(n, c, h // b, b, w // b, b)
    order = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)
    return (blocks.permute(order).reshape(n, c * b * b, h // b, w // b),)


def check_blocks(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "DCR")
    if mode not in ("DCR", "CRD"):
        return f"{layer.op_type} mode {mode!r} not known (known: ['DCR', 'CRD'])"
    return None


def trilu(input, k=None, upper=1):  # noqa: A002
    rows, cols = input.shape[-2:]
    # a diagonal past the matrix keeps all or nothing; torch's own arithmetic overflows on INT64's
    diagonal = max(-rows - 1, min(cols + 1, 0 if k is None else ints(k)[0]))
    return (torch.triu(input, diagonal) if upper else torch.tril(input, diagonal),)


def eye_like(input, dtype=None, k=0):  # noqa: A002
    rows, cols = input.shape
    out_type = input.dtype if dtype is None else torch_dtype(dtype)
    row = torch.arange(rows, device=input.device)[:, None]
    col = torch.arange(cols, device=input.device)[None, :]
    return ((col - row == k).to(out_type),)


def check_eye_like(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    dtype = layer.attrs.get("dtype")
    if dtype is not None:
        try:
            torch_dtype(dtype)
        except (KeyError, ValueError, TypeError):
            return f"EyeLike to ONNX type {dtype} (torch kernels make no such tensor)"
    return None


# -- tensor makers and pass-through ----------------------------------------------------------------
def size(data):
    return (torch.tensor(data.numel(), dtype=torch.int64, device=data.device),)


def constant_of_shape(input, value=None):  # noqa: A002
    # the shape is read from the input where it is (on the GPU: a sync, never captured)
    shape = ints(input)
    check_allocation(shape, torch.float32 if value is None else torch.as_tensor(value).dtype,
                     "ConstantOfShape's output")
    if value is None:
        return (torch.zeros(shape, dtype=torch.float32, device=input.device),)
    fill = torch.as_tensor(value).reshape(-1)[0]  # 0-d: expands to any shape, () included
    return (fill.to(input.device).expand(shape).clone(),)


def range_(start, limit, delta, stash_type=1):
    # the count as CpuRef computes it (NumPy, in the inputs' type; float16 in float32), the values
    # as start + i * delta in float64 (NumPy widens a 0-d float to float64 against int64 indices)
    first, last, step = (np.asarray(v.cpu() if isinstance(v, torch.Tensor) else v).reshape(())
                         for v in (start, limit, delta))
    if first.dtype == np.float16:
        first, last, step = (v.astype(np.float32) for v in (first, last, step))
    count = max(math.ceil((last - first) / step), 0)
    check_allocation([count], torch.float64, "Range's output")  # made in float64 or int64
    wide = torch.float64 if first.dtype.kind == "f" else torch.int64
    steps = torch.arange(count, dtype=wide, device=start.device) * step.item()
    return ((steps + first.item()).to(start.dtype),)


def dropout_v7(data, ratio=0.5, *, n_outputs=1):
    return (data, torch.ones_like(data))[:n_outputs]


def dropout(data, ratio=None, training_mode=None, seed=None, *, n_outputs=1):
    # inference only (check_dropout): the data passes and the mask keeps everything
    return (data, torch.ones(data.shape, dtype=torch.bool, device=data.device))[:n_outputs]


def check_dropout(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if len(layer.inputs) > 2 and layer.inputs[2]:
        return "Dropout with a training_mode input (training draws a random mask; CpuRef's is NumPy's)"
    return None


KERNELS: KernelTable = {
    "Pad": {2: pad_v2, 11: pad},
    "CenterCropPad": {18: center_crop_pad},
    "GatherElements": {11: gather_elements},
    "GatherND": {11: gather_nd},
    "Scatter": {9: scatter_elements},
    "ScatterElements": {11: scatter_elements},
    "ScatterND": {11: scatter_nd},
    "TensorScatter": {24: tensor_scatter},
    "OneHot": {9: one_hot},
    "NonZero": {9: non_zero},
    "Compress": {9: compress},
    "TopK": {1: top_k_v1, 10: top_k},
    "Unique": {11: unique},
    "ReverseSequence": {10: reverse_sequence},
    "DepthToSpace": {1: depth_to_space},
    "SpaceToDepth": {1: space_to_depth},
    "Trilu": {14: trilu},
    "EyeLike": {9: eye_like},
    "NonMaxSuppression": {10: non_max_suppression},
    "Size": {1: size},
    "ConstantOfShape": {9: constant_of_shape},
    "Range": {11: range_},
    "Dropout": {7: dropout_v7, 10: dropout},
}

CHECKS = {
    "Pad": check_pad,
    "ScatterElements": check_scatter,
    "ScatterND": check_scatter,
    "TensorScatter": check_tensor_scatter,
    "DepthToSpace": check_blocks,
    "SpaceToDepth": check_blocks,
    "EyeLike": check_eye_like,
    "Dropout": check_dropout,
}

INPUT_DTYPES = {"TopK": NUMBERS, "NonMaxSuppression": FLOATS}
