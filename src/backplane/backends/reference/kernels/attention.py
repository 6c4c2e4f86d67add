"""Attention (opset 23-25): scaled dot-product attention with masks, KV cache, grouped heads,
soft capping and sliding windows; its companions RotaryEmbedding and TensorScatter (the
KV-cache update outside Attention); and ai.onnx.preview's FlexAttention.

The steps follow the spec's function body, rounding where it rounds, so that float16 and bfloat16
results agree with it: Q and K are each scaled by sqrt(scale) before their product, every matmul
result is cast back to the input type, and the softmax runs in ``softmax_precision`` when given.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.backends.api.kernels import (
    Kernel,
    KernelTable,
    UnsupportedError,
    bind_kernel,
    select_kernel,
)
from backplane.frontends.onnx_types import onnx_to_numpy_dtype
from backplane.ir.graph import Graph, Layer, TensorInfo


def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None,
              is_causal=0, kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0,
              scale=None, softcap=0.0, softmax_precision=None, left_window_size=-1,
              right_window_size=-1, *, n_outputs):
    dtype = Q.dtype
    rank = Q.ndim
    if rank == 3:  # (B, S, H*D) -> (B, H, S, D)
        Q, K, V = _split_heads(Q, q_num_heads), _split_heads(K, kv_num_heads), \
            _split_heads(V, kv_num_heads)
    present_key = K if past_key is None else np.concatenate((past_key, K), axis=2)
    present_value = V if past_value is None else np.concatenate((past_value, V), axis=2)
    q_len, kv_len = Q.shape[2], present_key.shape[2]

    # Where each query sits among the keys: after the internal cache, or (external cache) so that
    # the last query meets the last valid key.
    if past_key is not None:
        offset = past_key.shape[2]
    elif nonpad_kv_seqlen is not None:
        offset = nonpad_kv_seqlen.reshape(-1, 1, 1, 1).astype(np.int64) - q_len  # (B, 1, 1, 1)
    else:
        offset = 0
    bias = _bias(attn_mask, is_causal, left_window_size, right_window_size, offset,
                 nonpad_kv_seqlen, q_len, kv_len, dtype)

    # Grouped-query attention: each K / V head serves q_heads / kv_heads consecutive Q heads.
    groups = Q.shape[1] // present_key.shape[1]
    keys = np.repeat(present_key, groups, axis=1)
    values = np.repeat(present_value, groups, axis=1)

    root_scale = math.sqrt(1 / math.sqrt(Q.shape[3]) if scale is None else scale)
    root_scale = dtype.type(root_scale)
    raw = _matmul(Q * root_scale, np.swapaxes(keys * root_scale, -1, -2))  # (B, H, q, kv)
    capped = softcap * np.tanh(raw / softcap) if softcap > 0 else raw
    scores = capped + bias

    probs = _softmax(scores.astype(onnx_to_numpy_dtype(softmax_precision) or dtype))
    fully_masked = np.isneginf(np.max(bias, axis=-1, keepdims=True))  # no key to attend: zeros
    probs = np.where(fully_masked, 0, probs).astype(dtype)

    Y = _matmul(probs, values)
    if rank == 3:  # (B, H, q, D) -> (B, q, H*D)
        Y = Y.transpose(0, 2, 1, 3).reshape(Y.shape[0], q_len, -1)
    qk_output = (raw, capped, scores, probs)[qk_matmul_output_mode].astype(dtype)
    return (Y, present_key, present_value, qk_output)[:n_outputs]


def flex_attention(Q, K, V, scale=None, softmax_precision=None, score_mod=None, prob_mod=None):
    # ai.onnx.preview's FlexAttention: 4-D attention with grouped heads, the softmax in float32 at
    # least; score_mod and prob_mod are one-tensor graphs applied to the scores and the probabilities.
    root_scale = Q.dtype.type(math.sqrt(np.float32(1 / math.sqrt(Q.shape[3]) if scale is None
                                                   else scale)))
    groups = Q.shape[1] // K.shape[1]
    keys, values = np.repeat(K, groups, axis=1), np.repeat(V, groups, axis=1)
    scores = _matmul(Q * root_scale, np.swapaxes(keys * root_scale, -1, -2))
    dtype = onnx_to_numpy_dtype(softmax_precision) if softmax_precision else \
        np.result_type(Q.dtype, np.float32)
    scores = scores.astype(dtype)
    scores = _run_body(score_mod, scores) if score_mod is not None else scores
    probs = _softmax(scores)
    probs = _run_body(prob_mod, probs) if prob_mod is not None else probs
    return (np.matmul(probs, values.astype(dtype)).astype(V.dtype),)


def _run_body(body: Graph, x: np.ndarray) -> np.ndarray:
    """A one-input, one-output graph attribute run on ``x`` with CpuRef's own kernels."""
    env: dict[str, Any] = {**body.constants, body.inputs[0]: x}
    for workload, layer in _bound(body):
        env.update(zip(layer.outputs, workload(*[env[n] if n else None for n in layer.inputs])))
    return env[body.outputs[0]]


@functools.lru_cache(maxsize=64)
def _bound(body: Graph) -> list[tuple[Kernel, Layer]]:
    """The body's layers with their kernels bound, once per graph."""
    from backplane.backends.api.backend import kernel_key
    from backplane.backends.reference.kernels import KERNELS  # this module is one of its parts

    steps = []
    for layer in body.layers:
        kernel = select_kernel(KERNELS, kernel_key(layer), layer.opset)
        if kernel is None:
            raise UnsupportedError(f"no kernel for {layer.describe()} in a FlexAttention modifier")
        steps.append((bind_kernel(kernel, layer.attrs, len(layer.outputs)), layer))
    return steps


def _split_heads(x, num_heads):
    batch, length, hidden = x.shape
    return x.reshape(batch, length, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


def _bias(mask, is_causal, left, right, offset, nonpad_kv_seqlen, q_len, kv_len, dtype):
    """The additive bias (..., q, kv): 0 where query i may attend key j, -inf where not, plus a
    float mask."""
    position = np.arange(q_len)[:, None] + offset  # the query's absolute position (..., q, 1)
    key = np.arange(kv_len)  # (kv,)
    allowed = np.ones((q_len, kv_len), dtype=bool)
    if is_causal:
        allowed = allowed & (key <= position)
    if left >= 0:
        allowed = allowed & (position - key <= left)
    if right >= 0:
        allowed = allowed & (key - position <= right)
    if nonpad_kv_seqlen is not None:  # keys past each batch's valid length are padding
        allowed = allowed & (key < nonpad_kv_seqlen.reshape(-1, 1, 1, 1))
    bias = np.where(allowed, dtype.type(0), dtype.type(-np.inf))
    if mask is None:
        return bias
    # A mask shorter than the keys (the keys grew by the cache) leaves the new keys masked out.
    widths = [(0, 0)] * (mask.ndim - 1) + [(0, kv_len - mask.shape[-1])]
    if mask.dtype == bool:
        return np.where(np.pad(mask, widths, constant_values=False), bias, dtype.type(-np.inf))
    return np.pad(mask, widths, constant_values=-np.inf) + bias


def _softmax(x):
    # A row of -inf (every key masked) would be exp(-inf + inf) = NaN: it gives zeros instead.
    peak = np.max(x, axis=-1, keepdims=True)
    exp = np.exp(x - np.where(np.isneginf(peak), 0, peak).astype(x.dtype))
    total = np.sum(exp, axis=-1, keepdims=True)
    return exp / np.where(total == 0, 1, total).astype(x.dtype)


def _matmul(a, b):
    return np.matmul(a, b).astype(a.dtype)  # NumPy gives float32 for ml_dtypes' bfloat16


def rotary_embedding(X, cos_cache, sin_cache, position_ids=None, interleaved=0, num_heads=0,
                     rotary_embedding_dim=0):
    x = X.transpose(0, 2, 1, 3) if X.ndim == 4 else X.reshape(*X.shape[:2], num_heads, -1)
    dim = rotary_embedding_dim or x.shape[-1]  # (B, S, H, D): the first `dim` of D rotate
    if position_ids is not None:  # the caches are (max_position, dim/2); else (B, S, dim/2)
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    cos, sin = cos_cache[:, :, None, :], sin_cache[:, :, None, :]  # (B, S, 1, dim/2)
    rotated = x[..., :dim]
    # The pairs rotated together: (0, 1), (2, 3), ... interleaved, else (i, i + dim/2).
    if interleaved:
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x1, x2 = np.split(rotated, 2, axis=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rotated = np.stack((real, imag), axis=-1).reshape(rotated.shape)
    else:
        rotated = np.concatenate((real, imag), axis=-1)
    Y = np.concatenate((rotated, x[..., dim:]), axis=-1)
    return (Y.transpose(0, 2, 1, 3) if X.ndim == 4 else Y.reshape(X.shape),)


def tensor_scatter(past_cache, update, write_indices=None, axis=-2, mode="linear"):
    # Batch b's update goes along `axis` from write_indices[b], wrapping around if circular.
    axis = axis % past_cache.ndim
    present = past_cache.copy()
    starts = np.zeros(len(past_cache), np.int64) if write_indices is None else write_indices
    for b, start in enumerate(starts):
        positions = int(start) + np.arange(update.shape[axis])
        if mode == "circular":
            positions %= past_cache.shape[axis]
        np.moveaxis(present[b], axis - 1, 0)[positions] = np.moveaxis(update[b], axis - 1, 0)
    return (present,)


def check_tensor_scatter(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "linear")
    return None if mode in ("linear", "circular") else f"TensorScatter mode {mode!r} not known"


KERNELS: KernelTable = {
    "Attention": {23: attention},  # nonpad_kv_seqlen (24) and windows (25) default to the old ways
    "RotaryEmbedding": {23: rotary_embedding},
    "TensorScatter": {24: tensor_scatter},
    "ai.onnx.preview::FlexAttention": {1: flex_attention},
}

CHECKS = {"TensorScatter": check_tensor_scatter}

ANY_DTYPE = frozenset({"Attention"})  # bfloat16 rounds where the function body rounds (module doc)
