"""LinearAttention (a recurrent state instead of a softmax over keys) and its companion
CausalConvWithState (the short causal depthwise convolution of gated-delta-net layers). Both carry
a state between calls: past_state in, present_state out.

Both compute in float32 and round their results to the input types once, as the spec's reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo

UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


def linear_attention(query, key, value, past_state=None, decay=None, beta=None, chunk_size=64,
                     kv_num_heads=None, q_num_heads=None, scale=0.0, update_rule="gated_delta",
                     *, n_outputs):
    # Per step t and KV head (S is d_k x d_v):
    #   S = exp(g_t) * S                         (gated rules)
    #   v_t = beta_t * (v_t - S^T k_t)           (delta rules: write only what S does not hold)
    #   S = S + k_t v_t^T;  o_t = scale * S^T q_t
    # chunk_size only tunes chunked implementations; the result is that of this recurrence.
    batch, steps, _ = query.shape
    q = _heads(query, q_num_heads)  # (B, Hq, T, d_k)
    k = _heads(key, kv_num_heads)  # (B, Hkv, T, d_k)
    v = _heads(value, kv_num_heads)  # (B, Hkv, T, d_v)
    if decay is not None:  # per head, or per head and key channel
        g = _heads(decay, kv_num_heads)  # (B, Hkv, T, 1 or d_k)
    if beta is not None:  # per head, or one for all heads
        b = beta.reshape(batch, steps, -1, 1).transpose(0, 2, 1, 3).astype(np.float32)
    d_k, d_v = q.shape[-1], v.shape[-1]
    state = np.zeros((batch, kv_num_heads, d_k, d_v), np.float32) if past_state is None \
        else past_state.astype(np.float32)
    scale = scale or 1 / math.sqrt(d_k)
    group = q_num_heads // kv_num_heads  # Q heads per KV head
    output = np.zeros((batch, q_num_heads, steps, d_v), np.float32)
    for t in range(steps):
        k_t, v_t = k[:, :, t], v[:, :, t]
        if decay is not None:
            state = state * np.exp(g[:, :, t])[..., None]
        if beta is not None:
            v_t = b[:, :, t] * (v_t - np.einsum("bhkv,bhk->bhv", state, k_t))
        state = state + k_t[..., :, None] * v_t[..., None, :]
        output[:, :, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, :, t],
                                            np.repeat(state, group, axis=1))
    output = output.transpose(0, 2, 1, 3).reshape(batch, steps, -1).astype(query.dtype)
    present_state = state.astype(query.dtype if past_state is None else past_state.dtype)
    return (output, present_state)[:n_outputs]


def _heads(x, num_heads):
    """(B, T, H*D) -> (B, H, T, D), in float32."""
    batch, steps, hidden = x.shape
    return x.reshape(batch, steps, num_heads, hidden // num_heads).transpose(0, 2, 1, 3) \
        .astype(np.float32)


def check_linear_attention(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    rule = layer.attrs.get("update_rule", "gated_delta")
    if rule not in UPDATE_RULES:
        return f"LinearAttention update_rule {rule!r} not known (known: {UPDATE_RULES})"
    present = [bool(name) for name in (*layer.inputs, "", "", "")[4:6]]  # decay, beta
    needed = [rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")]
    if present != needed:
        return f"LinearAttention {rule!r} needs decay {needed[0]}, beta {needed[1]}"
    return None


def causal_conv_with_state(input, weight, bias=None, past_state=None,  # noqa: A002
                           activation="none", *, n_outputs):
    # input (B, C, T), weight (C, 1, k): each channel convolved with its own k taps over the
    # k - 1 past steps and the new ones; the last k - 1 steps are the next call's state.
    taps = weight.shape[2]
    if past_state is None:
        past_state = np.zeros((*input.shape[:2], taps - 1), input.dtype)
    padded = np.concatenate([past_state, input], axis=2)
    windows = np.lib.stride_tricks.sliding_window_view(padded, taps, axis=2)  # (B, C, T, k)
    output = np.einsum("bctk,ck->bct", windows.astype(np.float32),
                       weight[:, 0].astype(np.float32))
    if bias is not None:
        output = output + bias.astype(np.float32)[:, None]
    output = output.astype(input.dtype).astype(np.float32)  # the convolution rounds first
    if activation in ("silu", "swish"):
        output = output * (1 / (1 + np.exp(-output)))
    return (output.astype(input.dtype), padded[:, :, padded.shape[2] - (taps - 1):])[:n_outputs]


def check_causal_conv(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    activation = layer.attrs.get("activation", "none")
    known = ("none", "silu", "swish")
    return None if activation in known else f"activation {activation!r} not known (known: {known})"


KERNELS: KernelTable = {
    "LinearAttention": {27: linear_attention},
    "CausalConvWithState": {27: causal_conv_with_state},
}

CHECKS = {"LinearAttention": check_linear_attention, "CausalConvWithState": check_causal_conv}
