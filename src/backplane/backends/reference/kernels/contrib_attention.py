"""ONNX Runtime's attention ops (com.microsoft domain), from its contrib-op documentation:
Attention (packed QKV weights, BERT and GPT-2 as its transformer optimizer fuses them), QAttention
(the same, its projection quantized by its dynamic quantizer), MultiHeadAttention,
GroupQueryAttention (grouped heads over a BNSH key / value cache, as its language-model builders
write it) and RotaryEmbedding.

Masks of Attention and MultiHeadAttention follow ONNX Runtime: a masked position gets
``mask_filter_value`` (-10000) added to its score, not -inf, so that a row masked throughout
averages its values instead of giving NaN. GroupQueryAttention's causal rows always see a key, so
it leaves masked positions out (-inf).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.attention import rotary_embedding
from backplane.backends.reference.kernels.contrib_quant import mat_mul_integer_to_float
from backplane.backends.reference.kernels.reduce import softmax
from backplane.ir.graph import Layer, TensorInfo

MS = "com.microsoft::"


# -- Attention and MultiHeadAttention --------------------------------------------------------------
def _heads(x, num_heads):
    """(B, S, n * h) -> (B, n, S, h)."""
    b, s, d = x.shape
    return x.reshape(b, s, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def _attend(q, k, v, bias, scale):
    """(B, n, S, h) queries over (B, n, T, h) keys and values, ``bias`` added to the scores;
    returns (B, S, n * hv)."""
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * np.float32(scale) + bias  # (B, n, S, T)
    (probs,) = softmax(scores.astype(np.float32), axis=-1)
    out = np.matmul(probs.astype(q.dtype), v)  # (B, n, S, hv)
    b, n, s, hv = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, s, n * hv)


def _mask_bias(mask, batch, seq, total, filter_value):
    """An additive (B, 1, S, T) bias from a key mask: raw 0/1 (B, T) or (B, S, T), or each
    sequence's length (B,) for right padding, or exclusive ends then inclusive starts (2B,)."""
    if mask is None:
        return np.zeros((1, 1, 1, 1), np.float32)
    if mask.ndim == 1:
        positions = np.arange(total)
        keep = positions[None, :] < mask[:batch, None]
        if len(mask) == 2 * batch:
            keep &= positions[None, :] >= mask[batch:, None]
        mask = keep
    keep = (mask > 0).reshape(batch, 1, -1, total)
    return np.where(keep, np.float32(0), np.float32(filter_value))


def _causal_bias(seq, total, filter_value):
    """Query i (at position total - seq + i) sees keys up to its own position."""
    past = total - seq
    later = np.arange(total)[None, :] > past + np.arange(seq)[:, None]
    return np.where(later, np.float32(filter_value), np.float32(0))


def attention(input, weights, bias=None, mask_index=None, past=None,  # noqa: A002
              attention_bias=None, past_sequence_length=None, *, num_heads,
              do_rotary=0, mask_filter_value=-10000.0, past_present_share_buffer=0,
              qkv_hidden_sizes=None, rotary_embedding_dim=0, scale=None, unidirectional=0,
              n_outputs=1):
    sizes = qkv_hidden_sizes or [weights.shape[1] // 3] * 3
    qkv = np.matmul(input, weights) + (0 if bias is None else bias)
    return _packed_attention(qkv, sizes, mask_index, past, attention_bias, num_heads,
                             mask_filter_value, scale, unidirectional, n_outputs)


def q_attention(input, weight, bias, input_scale, weight_scale, mask_index=None,  # noqa: A002
                input_zero_point=None, weight_zero_point=None, past=None, *, num_heads,
                do_rotary=0, mask_filter_value=-10000.0, past_present_share_buffer=0,
                scale=None, unidirectional=0, n_outputs=1):
    # Attention whose projection is an integer product of the centred operands, rescaled.
    (qkv,) = mat_mul_integer_to_float(input, weight, input_scale, weight_scale, input_zero_point,
                                      weight_zero_point, bias)
    return _packed_attention(qkv, [weight.shape[1] // 3] * 3, mask_index, past, None, num_heads,
                             mask_filter_value, scale, unidirectional, n_outputs)


def _packed_attention(qkv, sizes, mask_index, past, attention_bias, num_heads, mask_filter_value,
                      scale, unidirectional, n_outputs):
    """Attention over the projected (B, S, q + k + v) with Attention's masks and past."""
    q, k, v = np.split(qkv, np.cumsum(sizes)[:2], axis=-1)
    q, k, v = (_heads(t, num_heads) for t in (q, k, v))
    if past is not None:  # (2, B, n, P, h)
        k, v = np.concatenate((past[0], k), axis=2), np.concatenate((past[1], v), axis=2)
    batch, seq, total = qkv.shape[0], qkv.shape[1], k.shape[2]
    score_bias = _mask_bias(mask_index, batch, seq, total, mask_filter_value)
    if unidirectional:
        score_bias = score_bias + _causal_bias(seq, total, mask_filter_value)
    if attention_bias is not None:
        score_bias = score_bias + attention_bias
    head_scale = 1 / math.sqrt(sizes[0] // num_heads) if scale is None else scale
    out = _attend(q, k, v, score_bias, head_scale).astype(qkv.dtype)
    return (out, np.stack((k, v))) if n_outputs > 1 else (out,)  # present: (2, B, n, T, h)


def multi_head_attention(query, key=None, value=None, bias=None, key_padding_mask=None,
                         attention_bias=None, past_key=None, past_value=None,
                         past_sequence_length=None, cache_indirection=None, *, num_heads,
                         mask_filter_value=-10000.0, scale=None, unidirectional=0):
    q, k, v = _mha_heads(query, key, value, bias, num_heads)
    if past_key is not None:  # (B, n, P, h)
        k, v = np.concatenate((past_key, k), axis=2), np.concatenate((past_value, v), axis=2)
    batch, seq, total = q.shape[0], q.shape[2], k.shape[2]
    score_bias = _mask_bias(key_padding_mask, batch, seq, total, mask_filter_value)
    if unidirectional:
        score_bias = score_bias + _causal_bias(seq, total, mask_filter_value)
    if attention_bias is not None:
        score_bias = score_bias + attention_bias
    head_scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = _attend(q, k, v, score_bias, head_scale).astype(query.dtype)
    return out, k, v


def _mha_heads(query, key, value, bias, num_heads):
    """Q, K, V as (B, n, S, h): key and value (B, T, d) projected like the query, or already
    (B, n, T, h) (cross attention's cached keys and values, no bias)."""
    sizes = [query.shape[-1], key.shape[-1] if key.ndim == 3 else 0]
    if bias is not None:
        q_bias, k_bias, v_bias = np.split(bias, [sizes[0], sizes[0] + (sizes[1] or sizes[0])])
        query = query + q_bias
        if key.ndim == 3:
            key, value = key + k_bias, value + v_bias
    q = _heads(query, num_heads)
    if key.ndim == 4:
        return q, key, value
    return q, _heads(key, num_heads), _heads(value, num_heads)


def ms_rotary_embedding(input, position_ids, cos_cache, sin_cache, interleaved=0,  # noqa: A002
                        is_packed_batching=0, num_heads=0, rotary_embedding_dim=0, scale=1.0):
    # position_ids: (B, S), or (1,) the position of the first token of every sequence.
    seq = input.shape[-2] if input.ndim == 4 else input.shape[1]
    positions = position_ids if position_ids.ndim == 2 else \
        np.broadcast_to(position_ids[0] + np.arange(seq), (input.shape[0], seq))
    if input.ndim == 3 and not num_heads:  # heads as wide as the caches' rotation
        num_heads = input.shape[-1] // (rotary_embedding_dim or 2 * cos_cache.shape[-1])
    return rotary_embedding(input, cos_cache, sin_cache, positions, interleaved, num_heads,
                            rotary_embedding_dim)


# -- GroupQueryAttention -----------------------------------------------------------------------
def group_query_attention(query, key=None, value=None, past_key=None, past_value=None,
                          seqlens_k=None, total_sequence_length=None, cos_cache=None,
                          sin_cache=None, position_ids=None, attention_bias=None, head_sink=None,
                          k_scale=None, v_scale=None, q_norm_weight=None, k_norm_weight=None,
                          query_seqlens=None, *, num_heads, kv_num_heads, causal=1, do_rotary=0,
                          k_norm_epsilon=None, k_quant_type="NONE", kv_cache_bit_width=0,
                          local_window_size=-1, q_norm_epsilon=None, qk_norm_epsilon=1e-6,
                          qk_output=0, rotary_interleaved=0, scale=None, sliding_window_cache=0,
                          smooth_softmax=0, softcap=0.0, v_quant_type="NONE"):
    if key is None:  # packed QKV: (B, S, (n + 2 kv_n) h)
        h = query.shape[-1] // (num_heads + 2 * kv_num_heads)
        query, key, value = np.split(query, [num_heads * h, (num_heads + kv_num_heads) * h], -1)
    q, k, v = _heads(query, num_heads), _heads(key, kv_num_heads), _heads(value, kv_num_heads)
    seq = q.shape[2]
    total = seqlens_k.astype(np.int64) + 1  # (B,): keys after this step
    past = total - seq  # (B,): keys cached before it
    if do_rotary:
        positions = past[:, None] + np.arange(seq) if position_ids is None else position_ids
        q = rotary_embedding(q, cos_cache, sin_cache, positions, rotary_interleaved)[0]
        k = rotary_embedding(k, cos_cache, sin_cache, positions, rotary_interleaved)[0]
    present_k, present_v = _gqa_caches(past_key, past_value, k, v, past,
                                       int(total_sequence_length.reshape(-1)[0]))
    group = num_heads // kv_num_heads  # query heads per key / value head
    keys, values = np.repeat(present_k, group, axis=1), np.repeat(present_v, group, axis=1)
    scores = np.matmul(q, np.swapaxes(keys, -1, -2)).astype(np.float32)  # (B, n, S, T)
    scores *= np.float32(1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if softcap > 0:
        scores = np.float32(softcap) * np.tanh(scores / np.float32(softcap))
    if attention_bias is not None:
        scores = scores + attention_bias
    visible = _gqa_visible(past, seq, total, keys.shape[2], causal, local_window_size)
    scores = np.where(visible, scores, -np.inf)
    sink = head_sink if head_sink is not None else (np.zeros(num_heads) if smooth_softmax
                                                    else None)
    out = np.matmul(_softmax_with_sink(scores, sink).astype(q.dtype), values)  # (B, n, S, h)
    b, n, s, hv = out.shape
    return out.transpose(0, 2, 1, 3).reshape(b, s, n * hv), present_k, present_v


def _gqa_caches(past_key, past_value, k, v, past, total_length):
    """The present caches (B, kv_n, max(cache, total_length), h): each sequence's cached keys and
    values, then its new ones; zeros after them (ONNX Runtime's; the documentation leaves them
    unspecified)."""
    batch, kv_heads, seq, head = k.shape
    cached = 0 if past_key is None else past_key.shape[2]
    shape = (batch, kv_heads, max(cached, total_length), head)
    present_k, present_v = np.zeros(shape, k.dtype), np.zeros(shape, v.dtype)
    for b, start in enumerate(past):
        if start:
            present_k[b, :, :start], present_v[b, :, :start] = past_key[b, :, :start], \
                past_value[b, :, :start]
        present_k[b, :, start:start + seq], present_v[b, :, start:start + seq] = k[b], v[b]
    return present_k, present_v


def _gqa_visible(past, seq, total, width, causal, window):
    """(B, 1, S, T): which keys each query sees: those of its sequence, and with ``causal`` none
    after its own position, and with a window the last ``window`` of those (its own included)."""
    key = np.arange(width)[None, None, :]
    position = (past[:, None] + np.arange(seq))[:, :, None]  # (B, S, 1)
    visible = key < total[:, None, None]
    if causal:
        visible = visible & (key <= position)
    if window >= 0:
        visible = visible & (key > position - window)
    return visible[:, None]


def _softmax_with_sink(scores, sink):
    """Softmax over the last axis; a sink (per head) is one more logit in the denominator."""
    if sink is None:
        return softmax(scores, axis=-1)[0]
    sink = np.asarray(sink, np.float32).reshape(1, -1, 1, 1)
    top = np.maximum(scores.max(axis=-1, keepdims=True), sink)
    exp = np.exp(scores - top)
    return exp / (exp.sum(axis=-1, keepdims=True) + np.exp(sink - top))


# -- checks ------------------------------------------------------------------------------------
def check_attention(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    for name in ("do_rotary", "past_present_share_buffer"):
        if layer.attrs.get(name, 0):
            return f"Attention with {name}=1 not supported"
    return _check_mask(_input_info(layer, inputs, 3), "mask_index")


def check_q_attention(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    for name in ("do_rotary", "past_present_share_buffer"):
        if layer.attrs.get(name, 0):
            return f"QAttention with {name}=1 not supported"
    return _check_mask(_input_info(layer, inputs, 5), "mask_index")


def check_multi_head_attention(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    for k, name in ((8, "past_sequence_length"), (9, "cache_indirection")):
        if len(layer.inputs) > k and layer.inputs[k]:
            return f"MultiHeadAttention with {name} (shared buffers, beam search) not supported"
    if len(layer.outputs) > 3 and layer.outputs[3]:
        return "MultiHeadAttention's qk output not supported"
    query = _input_info(layer, inputs, 0)
    if query is not None and query.shape is not None and len(query.shape) == 5:
        return "MultiHeadAttention with packed QKV (B, S, n, 3, h) not supported"
    return _check_mask(_input_info(layer, inputs, 4), "key_padding_mask")


def _input_info(layer: Layer, inputs: Sequence[TensorInfo], k: int) -> TensorInfo | None:
    """The info of the layer's input k, or None where it is absent (``inputs`` skips those)."""
    if len(layer.inputs) <= k or not layer.inputs[k]:
        return None
    return inputs[sum(1 for name in layer.inputs[:k] if name)]


def _check_mask(info: TensorInfo | None, name: str) -> str | None:
    rank = None if info is None or info.shape is None else len(info.shape)
    if rank is not None and rank > 3:
        return f"a {rank}-D {name} (Megatron's (B, 1, M, M)) not supported; it takes 1-D to 3-D"
    return None


def check_rotary(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("is_packed_batching", 0) or layer.attrs.get("scale", 1.0) != 1.0:
        return "RotaryEmbedding with is_packed_batching or a scale other than 1 not supported"
    return None


def check_group_query_attention(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    attrs = layer.attrs
    for name in ("sliding_window_cache", "qk_output"):
        if attrs.get(name, 0):
            return f"GroupQueryAttention with {name}={attrs[name]} not supported"
    if attrs.get("k_quant_type", "NONE") != "NONE" or attrs.get("v_quant_type", "NONE") != "NONE":
        return "GroupQueryAttention with a quantized key / value cache not supported"
    for k, name in ((12, "k_scale"), (14, "q_norm_weight"), (16, "query_seqlens")):
        if len(layer.inputs) > k and layer.inputs[k]:
            return f"GroupQueryAttention with {name} not supported"
    return None


KERNELS: KernelTable = {
    MS + "Attention": {1: attention},
    MS + "QAttention": {1: q_attention},
    MS + "MultiHeadAttention": {1: multi_head_attention},
    MS + "GroupQueryAttention": {1: group_query_attention},
    MS + "RotaryEmbedding": {1: ms_rotary_embedding},
}

CHECKS = {
    MS + "Attention": check_attention,
    MS + "QAttention": check_q_attention,
    MS + "MultiHeadAttention": check_multi_head_attention,
    MS + "GroupQueryAttention": check_group_query_attention,
    MS + "RotaryEmbedding": check_rotary,
}
