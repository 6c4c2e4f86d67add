"""Attention torch kernels: Attention (opset 23-25: masks, causal and sliding windows, grouped
heads, soft capping, past key / value), RotaryEmbedding, LinearAttention and CausalConvWithState.

Attention follows the spec's function body as CpuRef does, rounding where it rounds (Q and K each
scaled by sqrt(scale) before their product, every product cast back to the input type, the softmax
in ``softmax_precision`` when given), written out in torch rather than handed to
``scaled_dot_product_attention``, whose fused kernels scale and round otherwise and have no soft
cap or qk output. LinearAttention and CausalConvWithState compute in float32 and round once, as
CpuRef.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.linear_attention import (
    check_causal_conv,
    check_linear_attention,
)
from backplane.backends.torch.kernels.common import FLOATS, torch_dtype
from backplane.ir.graph import Layer, TensorInfo


def attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None,
              is_causal=0, kv_num_heads=None, q_num_heads=None, qk_matmul_output_mode=0,
              scale=None, softcap=0.0, softmax_precision=None, left_window_size=-1,
              right_window_size=-1, *, n_outputs):
    dtype, rank = Q.dtype, Q.dim()
    if rank == 3:  # (B, S, H*D) -> (B, H, S, D)
        Q, K, V = _split_heads(Q, q_num_heads), _split_heads(K, kv_num_heads), \
            _split_heads(V, kv_num_heads)
    present_key = K if past_key is None else torch.cat((past_key, K), dim=2)
    present_value = V if past_value is None else torch.cat((past_value, V), dim=2)
    q_len, kv_len = Q.shape[2], present_key.shape[2]
    if past_key is not None:  # where the queries sit among the keys
        offset = past_key.shape[2]
    elif nonpad_kv_seqlen is not None:
        offset = nonpad_kv_seqlen.reshape(-1, 1, 1, 1).to(torch.int64) - q_len  # (B, 1, 1, 1)
    else:
        offset = 0
    bias = _bias(attn_mask, is_causal, left_window_size, right_window_size, offset,
                 nonpad_kv_seqlen, q_len, kv_len, Q)
    groups = Q.shape[1] // present_key.shape[1]  # grouped-query attention
    keys = present_key.repeat_interleave(groups, dim=1)
    values = present_value.repeat_interleave(groups, dim=1)
    root = math.sqrt(1 / math.sqrt(Q.shape[3]) if scale is None else scale)
    root_scale = torch.tensor(root, dtype=dtype, device=Q.device)  # rounded to Q's type, as CpuRef
    raw = torch.matmul(Q * root_scale, (keys * root_scale).transpose(-1, -2))  # (B, H, q, kv)
    capped = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    scores = capped + bias
    precision = torch_dtype(softmax_precision) if softmax_precision else dtype
    probs = _softmax(scores.to(precision))
    fully_masked = torch.isneginf(torch.amax(bias, dim=-1, keepdim=True)) if kv_len else None
    if fully_masked is not None:
        probs = probs.masked_fill(fully_masked, 0)
    probs = probs.to(dtype)
    Y = torch.matmul(probs, values)
    if rank == 3:  # (B, H, q, D) -> (B, q, H*D)
        Y = Y.transpose(1, 2).reshape(Y.shape[0], q_len, -1)
    qk_output = (raw, capped, scores, probs)[qk_matmul_output_mode].to(dtype)
    return (Y, present_key, present_value, qk_output)[:n_outputs]


def _split_heads(x, num_heads):
    batch, length, hidden = x.shape
    return x.reshape(batch, length, num_heads, hidden // num_heads).transpose(1, 2)


def _bias(mask, is_causal, left, right, offset, nonpad_kv_seqlen, q_len, kv_len, like):
    """The additive bias (..., q, kv): 0 where query i may attend key j, -inf where not, plus a
    float mask."""
    device = like.device
    position = torch.arange(q_len, device=device)[:, None] + offset  # (..., q, 1)
    key = torch.arange(kv_len, device=device)
    allowed = torch.ones((q_len, kv_len), dtype=torch.bool, device=device)
    if is_causal:
        allowed = allowed & (key <= position)
    if left >= 0:
        allowed = allowed & (position - key <= left)
    if right >= 0:
        allowed = allowed & (key - position <= right)
    if nonpad_kv_seqlen is not None:  # keys past each batch's valid length are padding
        allowed = allowed & (key < nonpad_kv_seqlen.reshape(-1, 1, 1, 1))
    zero = torch.zeros((), dtype=like.dtype, device=device)
    bias = torch.where(allowed, zero, -math.inf)
    if mask is None:
        return bias
    # a mask shorter than the keys (the keys grew by the cache) leaves the new keys masked out
    missing = kv_len - mask.shape[-1]
    if mask.dtype == torch.bool:
        return torch.where(F.pad(mask, (0, missing), value=False), bias, -math.inf)
    return F.pad(mask, (0, missing), value=-math.inf) + bias


def _softmax(x):
    # a row of -inf (every key masked) gives zeros, not exp(-inf + inf) = NaN
    peak = torch.amax(x, dim=-1, keepdim=True) if x.shape[-1] else torch.zeros_like(x[..., :1])
    exp = torch.exp(x - torch.where(torch.isneginf(peak), 0, peak).to(x.dtype))
    total = torch.sum(exp, dim=-1, keepdim=True)
    return exp / torch.where(total == 0, 1, total).to(x.dtype)


def rotary_embedding(X, cos_cache, sin_cache, position_ids=None, interleaved=0, num_heads=0,
                     rotary_embedding_dim=0):
    x = X.transpose(1, 2) if X.dim() == 4 else X.reshape(*X.shape[:2], num_heads, -1)
    dim = rotary_embedding_dim or x.shape[-1]  # (B, S, H, D): the first `dim` of D rotate
    if position_ids is not None:  # the caches are (max_position, dim/2); else (B, S, dim/2)
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    cos, sin = cos_cache[:, :, None, :], sin_cache[:, :, None, :]  # (B, S, 1, dim/2)
    rotated = x[..., :dim]
    if interleaved:  # pairs (0, 1), (2, 3), ...; else (i, i + dim/2)
        x1, x2 = rotated[..., 0::2], rotated[..., 1::2]
    else:
        x1, x2 = rotated.chunk(2, dim=-1)
    real, imag = cos * x1 - sin * x2, sin * x1 + cos * x2
    if interleaved:
        rotated = torch.stack((real, imag), dim=-1).reshape(rotated.shape)
    else:
        rotated = torch.cat((real, imag), dim=-1)
    Y = torch.cat((rotated, x[..., dim:]), dim=-1)
    return (Y.transpose(1, 2) if X.dim() == 4 else Y.reshape(X.shape),)


def linear_attention(query, key, value, past_state=None, decay=None, beta=None, chunk_size=64,
                     kv_num_heads=None, q_num_heads=None, scale=0.0, update_rule="gated_delta",
                     *, n_outputs):
    # per step t and KV head (S is d_k x d_v): S = exp(g_t) * S (gated); v_t = beta_t * (v_t -
    # S^T k_t) (delta); S = S + k_t v_t^T; o_t = scale * S^T q_t. chunk_size only tunes chunking.
    batch, steps, _ = query.shape
    q, k, v = _heads(query, q_num_heads), _heads(key, kv_num_heads), _heads(value, kv_num_heads)
    g = _heads(decay, kv_num_heads) if decay is not None else None  # (B, Hkv, T, 1 or d_k)
    b = beta.reshape(batch, steps, -1, 1).transpose(1, 2).float() if beta is not None else None
    d_k, d_v = q.shape[-1], v.shape[-1]
    state = past_state.float() if past_state is not None else \
        q.new_zeros((batch, kv_num_heads, d_k, d_v))
    scale = scale or 1 / math.sqrt(d_k)
    group = q_num_heads // kv_num_heads
    outputs = []
    for t in range(steps):
        k_t, v_t = k[:, :, t], v[:, :, t]
        if g is not None:
            state = state * torch.exp(g[:, :, t])[..., None]
        if b is not None:
            v_t = b[:, :, t] * (v_t - torch.einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[..., :, None] * v_t[..., None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, :, t],
                                            state.repeat_interleave(group, dim=1)))
    output = torch.stack(outputs, dim=2) if outputs else \
        q.new_zeros((batch, q_num_heads, 0, d_v))
    output = output.transpose(1, 2).reshape(batch, steps, -1).to(query.dtype)
    present = state.to(query.dtype if past_state is None else past_state.dtype)
    return (output, present)[:n_outputs]


def _heads(x, num_heads):
    """(B, T, H*D) -> (B, H, T, D), in float32."""
    batch, steps, hidden = x.shape
    return x.reshape(batch, steps, num_heads, hidden // num_heads).transpose(1, 2).float()


def causal_conv_with_state(input, weight, bias=None, past_state=None,  # noqa: A002
                           activation="none", *, n_outputs):
    # input (B, C, T), weight (C, 1, k): each channel convolved with its own k taps over the k - 1
    # past steps and the new ones; the last k - 1 steps are the next call's state
    taps = weight.shape[2]
    if past_state is None:
        past_state = input.new_zeros((*input.shape[:2], taps - 1))
    padded = torch.cat([past_state, input], dim=2)
    windows = padded.float().unfold(2, taps, 1)  # (B, C, T, k)
    output = torch.einsum("bctk,ck->bct", windows, weight[:, 0].float())
    if bias is not None:
        output = output + bias.float()[:, None]
    output = output.to(input.dtype).float()  # the convolution rounds first
    if activation in ("silu", "swish"):
        output = output * (1 / (1 + torch.exp(-output)))
    state = padded[:, :, padded.shape[2] - (taps - 1):]
    return (output.to(input.dtype), state)[:n_outputs]


def check_attention(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    precision = layer.attrs.get("softmax_precision")
    if precision:
        from backplane.frontends.onnx_types import onnx_to_numpy_dtype

        if onnx_to_numpy_dtype(precision) not in FLOATS:
            return f"Attention softmax_precision {onnx_to_numpy_dtype(precision)} (no torch type)"
    return None


KERNELS: KernelTable = {
    "Attention": {23: attention},  # nonpad_kv_seqlen (24) and windows (25) default to the old ways
    "RotaryEmbedding": {23: rotary_embedding},
    "LinearAttention": {27: linear_attention},
    "CausalConvWithState": {27: causal_conv_with_state},
}

CHECKS = {"Attention": check_attention, "LinearAttention": check_linear_attention,
          "CausalConvWithState": check_causal_conv}

INPUT_DTYPES = {op: FLOATS for op in KERNELS}
"""Per op, the element types its first input may have (other inputs follow ONNX's type rules)."""
