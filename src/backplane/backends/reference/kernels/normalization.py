"""Normalizations: BatchNormalization, LayerNormalization, InstanceNormalization, GroupNormalization,
RMSNormalization, LRN, LpNormalization and MeanVarianceNormalization.

Statistics are computed in float32 at least (``stash_type`` 1), then results cast back to the input's
dtype, so float16 models normalize as ONNX Runtime does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo


def _per_channel(values, ndim: int):
    """(C,) as (C, 1, 1, ...) to broadcast over (N, C, *spatial)."""
    return values.reshape(-1, *[1] * (ndim - 2))


def _stash(x):
    return x.astype(np.promote_types(x.dtype, np.float32))


def batch_normalization(X, scale, B, input_mean, input_var, epsilon=1e-5, momentum=0.9,
                        training_mode=0, *, n_outputs=1):
    if not training_mode:
        return (_batch_norm(X, scale, B, input_mean, input_var, epsilon),)
    # Training: normalize with the batch's statistics and update the running ones.
    axes = (0, *range(2, X.ndim))
    mean, var = X.mean(axis=axes), X.var(axis=axes)
    y = _batch_norm(X, scale, B, mean, var, epsilon)
    running_mean = (input_mean * momentum + mean * (1 - momentum)).astype(input_mean.dtype)
    running_var = (input_var * momentum + var * (1 - momentum)).astype(input_var.dtype)
    return (y, running_mean, running_var)[:n_outputs]


def batch_normalization_v7(X, scale, B, mean, var, epsilon=1e-5, momentum=0.9, spatial=1):
    return (_batch_norm(X, scale, B, mean, var, epsilon),)


def _batch_norm(x, scale, bias, mean, var, epsilon):
    rank = x.ndim
    inv_std = 1 / np.sqrt(_per_channel(var, rank) + epsilon)
    y = (x - _per_channel(mean, rank)) * inv_std * _per_channel(scale, rank) + _per_channel(bias, rank)
    return y.astype(x.dtype)


def check_batch_normalization(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("spatial", 1) != 1:
        return "BatchNormalization with spatial=0 (per-element statistics) is not supported"
    if not layer.attrs.get("training_mode", 0) and len(layer.outputs) > 1:
        return "BatchNormalization's training outputs (mean, var, saved statistics) are not supported"
    return None


def layer_normalization(X, Scale, B=None, axis=-1, epsilon=1e-5, stash_type=1,  # noqa: N803
                        *, n_outputs=1):
    axes = tuple(range(axis % X.ndim, X.ndim))
    x = _stash(X)
    mean = x.mean(axis=axes, keepdims=True)
    y = x - mean
    inv_std = 1 / np.sqrt(np.square(y).mean(axis=axes, keepdims=True) + epsilon)
    y *= inv_std
    y *= Scale
    if B is not None:
        y += B
    return (y.astype(X.dtype, copy=False), mean, inv_std)[:n_outputs]


def rms_normalization(X, scale, axis=-1, epsilon=1e-5, stash_type=1):
    axes = tuple(range(axis % X.ndim, X.ndim))
    x = _stash(X)
    rms = np.sqrt((x * x).mean(axis=axes, keepdims=True) + epsilon)
    return ((x / rms * scale).astype(X.dtype),)


def instance_normalization(input, scale, B, epsilon=1e-5):  # noqa: A002
    axes = tuple(range(2, input.ndim))
    x = _stash(input)
    mean, var = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    y = (x - mean) / np.sqrt(var + epsilon)
    y = y * _per_channel(scale, x.ndim) + _per_channel(B, x.ndim)
    return (y.astype(input.dtype),)


def group_normalization(X, scale, bias, epsilon=1e-5, num_groups=1, stash_type=1):
    return (_group_norm(X, num_groups, epsilon) * _per_channel(scale, X.ndim)
            + _per_channel(bias, X.ndim)).astype(X.dtype),


def group_normalization_v18(X, scale, bias, epsilon=1e-5, num_groups=1):
    # Opset 18: one scale and bias per group, repeated over the group's channels.
    repeat = X.shape[1] // num_groups
    return group_normalization(X, np.repeat(scale, repeat), np.repeat(bias, repeat), epsilon,
                               num_groups)


def _group_norm(x, groups, epsilon):
    grouped = _stash(x).reshape(x.shape[0], groups, -1)
    mean, var = grouped.mean(axis=-1, keepdims=True), grouped.var(axis=-1, keepdims=True)
    return ((grouped - mean) / np.sqrt(var + epsilon)).reshape(x.shape)


def lrn(X, size, alpha=0.0001, beta=0.75, bias=1.0):
    # Sum of squares over a window of channels [c - floor((size-1)/2), c + ceil((size-1)/2)].
    squares = np.pad(X * X, [(0, 0), ((size - 1) // 2, size // 2)] + [(0, 0)] * (X.ndim - 2))
    windows = np.lib.stride_tricks.sliding_window_view(squares, size, axis=1)
    square_sum = windows.sum(axis=-1)
    return ((X / (bias + alpha / size * square_sum) ** beta).astype(X.dtype),)


def lp_normalization(input, axis=-1, p=2):  # noqa: A002
    norm = np.sum(np.abs(input) ** p, axis=axis, keepdims=True) ** (1 / p)
    return (np.where(norm == 0, 0, input / norm).astype(input.dtype),)


def mean_variance_normalization(X, axes=(0, 2, 3)):
    axes = tuple(axes)
    mean = X.mean(axis=axes, keepdims=True)
    std = np.sqrt((X * X).mean(axis=axes, keepdims=True) - mean * mean)
    return (((X - mean) / (std + 1e-9)).astype(X.dtype),)


KERNELS: KernelTable = {
    "BatchNormalization": {7: batch_normalization_v7, 9: batch_normalization},
    # ONNX's from opset 17; ONNX Runtime's own, the same op, before it (frontends/onnx_contrib.py)
    "LayerNormalization": {1: layer_normalization},
    "RMSNormalization": {23: rms_normalization},
    "InstanceNormalization": {6: instance_normalization},
    "GroupNormalization": {18: group_normalization_v18, 21: group_normalization},
    "LRN": {1: lrn},
    "LpNormalization": {1: lp_normalization},
    "MeanVarianceNormalization": {9: mean_variance_normalization},
}

CHECKS = {"BatchNormalization": check_batch_normalization}
