"""Indexing ops: Slice, Gather*, Scatter*, OneHot, NonZero, Compress, TopK, Unique, ReverseSequence."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo


def _wrap(indices, size: int):
    """Negative indices count from the end, as in ONNX."""
    return np.where(indices < 0, indices + size, indices)


# -- Slice -------------------------------------------------------------------------------------
def slice_(data, starts, ends, axes=None, steps=None):
    # Opsets 1-9 give starts / ends / axes as attributes, 10+ as inputs (and add steps).
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * data.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = int(axis) % data.ndim
        index[axis] = _clamped_slice(int(start), int(end), int(step), data.shape[axis])
    return (data[tuple(index)],)


def _clamped_slice(start: int, end: int, step: int, size: int) -> slice:
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), size), min(max(end, 0), size), step)
    # Counting down, start clamps to [0, size-1] and end to [-1, size-1]; -1 means "past index 0",
    # which a Python slice spells as None.
    start, end = min(max(start, -1), size - 1), min(max(end, -1), size - 1)
    if start < 0:
        return slice(0, 0)
    return slice(start, None if end < 0 else end, step)


# -- Gather ------------------------------------------------------------------------------------
def gather(data, indices, axis=0):
    # np.take counts negative indices from the end itself, and refuses one out of range either
    # side (a wrap first made a copy of the indices: a Loop body's Gather of its step, 3x the time);
    # an array's own take, without np.take's three Python frames (its dispatcher and wrapper)
    if type(data) is np.ndarray:
        return (data.take(indices, axis=axis),)
    return (np.take(data, indices, axis=axis),)


def gather_elements(data, indices, axis=0):
    return (np.take_along_axis(data, _wrap(indices, data.shape[axis]), axis=axis),)


def gather_nd(data, indices, batch_dims=0):
    # Flatten the batch dims into one, then index (batch, i0, i1, ...) for every index tuple.
    batch_shape, depth = data.shape[:batch_dims], indices.shape[-1]
    batches = math.prod(batch_shape)
    flat_data = data.reshape((batches,) + data.shape[batch_dims:])
    flat_indices = indices.reshape(batches, -1, depth)  # (B, M, depth)
    coords = [_wrap(flat_indices[..., j], flat_data.shape[1 + j]) for j in range(depth)]
    where = (np.arange(batches)[:, None], *coords)
    gathered = flat_data[where]  # (B, M, *rest)
    out_shape = batch_shape + indices.shape[batch_dims:-1] + data.shape[batch_dims + depth:]
    return (gathered.reshape(out_shape),)


# -- Scatter -----------------------------------------------------------------------------------
_SCATTER_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def scatter_elements(data, indices, updates, axis=0, reduction="none"):
    where = list(np.indices(indices.shape, sparse=True))
    where[axis] = _wrap(indices, data.shape[axis])
    return (_scatter(data, tuple(where), updates, reduction),)


def scatter_nd(data, indices, updates, reduction="none"):
    depth = indices.shape[-1]
    coords = indices.reshape(-1, depth)
    where = tuple(_wrap(coords[:, j], data.shape[j]) for j in range(depth))
    return (_scatter(data, where, updates.reshape((-1,) + data.shape[depth:]), reduction),)


def _scatter(data, where, updates, reduction):
    output = data.copy()
    if reduction == "none":
        output[where] = updates
    else:  # ufunc.at applies repeated indices one after another
        _SCATTER_UFUNCS[reduction].at(output, where, updates)
    return output


def check_scatter(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    reduction = layer.attrs.get("reduction", "none")
    known = ["none", *_SCATTER_UFUNCS]
    return None if reduction in known else f"reduction {reduction!r} not known (known: {known})"


# -- selections --------------------------------------------------------------------------------
def one_hot(indices, depth, values, axis=-1):
    depth = int(np.ravel(depth)[0])
    axis = axis % (indices.ndim + 1)
    classes = np.arange(depth).reshape([-1 if d == axis else 1 for d in range(indices.ndim + 1)])
    hot = np.expand_dims(_wrap(indices.astype(np.int64), depth), axis) == classes
    return (np.where(hot, values[1], values[0]).astype(values.dtype),)


def non_zero(X):
    return (np.array(np.nonzero(np.atleast_1d(X)), dtype=np.int64),)


def compress(input, condition, axis=None):  # noqa: A002
    return (np.compress(condition, input, axis=axis),)


def top_k(X, K, axis=-1, largest=1, sorted=1):  # noqa: A002
    k = int(np.ravel(K)[0])
    if largest:  # stable descending order: ties keep the lower index first
        flipped = np.argsort(np.flip(X, axis), axis=axis, kind="stable")
        order = X.shape[axis] - 1 - np.flip(flipped, axis)
    else:
        order = np.argsort(X, axis=axis, kind="stable")
    indices = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(X, indices, axis=axis), indices.astype(np.int64)


def top_k_v1(X, *, k, axis=-1):
    return top_k(X, np.array([k]), axis)


def unique(X, axis=None, sorted=1, *, n_outputs):  # noqa: A002
    values, first, inverse, counts = np.unique(X, return_index=True, return_inverse=True,
                                               return_counts=True, axis=axis)
    inverse = inverse.reshape(-1)
    if not sorted:  # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        values = np.take(values, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    outputs = values, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)
    return outputs[:n_outputs]


def reverse_sequence(input, sequence_lens, batch_axis=1, time_axis=0):  # noqa: A002
    output = input.copy()
    for batch, length in enumerate(sequence_lens):
        index = [slice(None)] * input.ndim
        index[batch_axis] = batch
        index[time_axis] = slice(0, int(length))
        output[tuple(index)] = np.flip(input[tuple(index)], axis=time_axis - (time_axis > batch_axis))
    return (output,)


KERNELS: KernelTable = {
    "Slice": {1: slice_},
    "Gather": {1: gather},
    "GatherElements": {11: gather_elements},
    "GatherND": {11: gather_nd},
    "Scatter": {9: scatter_elements},
    "ScatterElements": {11: scatter_elements},
    "ScatterND": {11: scatter_nd},
    "OneHot": {9: one_hot},
    "NonZero": {9: non_zero},
    "Compress": {9: compress},
    "TopK": {1: top_k_v1, 10: top_k},
    "Unique": {11: unique},
    "ReverseSequence": {10: reverse_sequence},
}

CHECKS = {"ScatterElements": check_scatter, "ScatterND": check_scatter}

# Selection moves elements and compares them (Unique); that is exact in every element type.
ANY_DTYPE = frozenset({"Slice", "Gather", "GatherElements", "GatherND", "OneHot", "Compress",
                       "Unique", "ReverseSequence"})
