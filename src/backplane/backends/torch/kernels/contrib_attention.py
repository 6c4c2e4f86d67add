"""ONNX Runtime's attention ops (com.microsoft domain) on torch tensors, computing CpuRef's values
(``reference/kernels/contrib_attention.py``): Attention (the packed projection its transformer
optimizer writes for BERT and GPT-2), QAttention (the same, its projection quantized),
MultiHeadAttention, GroupQueryAttention and RotaryEmbedding.

On the CPU the product of queries and keys, the softmax and the product by the values are one
``scaled_dot_product_attention`` call, the masks made into one additive bias (ONNX Runtime's
``mask_filter_value`` where a key is masked; -inf for GroupQueryAttention), except where
GroupQueryAttention caps its scores or has a sink, which SDPA has no form for; its softmax runs in
float32 for float16 inputs, as CpuRef's. On the GPU the three steps are written out (a float32
softmax): torch 2.11's memory-efficient SDPA kernel was 1e-4 off CpuRef on a (B, S, T) mask and
crashed its process on a (1, n, 5, 5) attention bias (the H100 machine).

Masks are made on the device from the mask tensors (no host read), so a trace or a CUDA graph may
hold Attention, QAttention and MultiHeadAttention. GroupQueryAttention reads its total sequence
length on the host (it sizes the present caches), so a trace leaves it to run as a layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.contrib_attention import (
    check_attention,
    check_group_query_attention,
    check_multi_head_attention,
    check_q_attention,
    check_rotary,
)
from backplane.backends.torch.kernels.attention import rotary_embedding
from backplane.backends.torch.kernels.contrib_quant import mat_mul_integer_to_float

MS = "com.microsoft::"


# -- shared steps ------------------------------------------------------------------------------
def _heads(x, num_heads):
    """(B, S, n * h) -> (B, n, S, h). No sizes read: in a trace each read of a size is three
    more nodes run every call (``aten::size``, ``NumToTensor``, ``Int``)."""
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def _attend(q, k, v, bias, scale):
    """(B, n, S, h) queries over (B, n, T, h) keys and values, ``bias`` (or None) added to the
    scaled scores; returns (B, S, n * hv)."""
    if q.device.type == "cuda":  # see the module's docstring
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        scores = scores if bias is None else scores + bias
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)  # (B, n, S, hv)
    return out.transpose(1, 2).flatten(2)


def _mask_bias(mask, total, filter_value, like):
    """CpuRef's additive (B, 1, S or 1, T) bias from a key mask: raw 0/1 (B, T) or (B, S, T),
    each sequence's length (B,), or exclusive ends then inclusive starts (2B,)."""
    if mask.dim() == 1:
        positions, batch = torch.arange(total, device=like.device), like.shape[0]
        if mask.shape[0] == batch:
            keep = positions < mask[:, None]
        else:
            keep = (positions < mask[:batch, None]) & (positions >= mask[batch:, None])
    else:
        keep = mask > 0
    keep = keep[:, None] if keep.dim() == 3 else keep[:, None, None]
    bias = torch.where(keep, 0.0, float(filter_value))
    return bias if bias.dtype == like.dtype else bias.to(like.dtype)


def _score_bias(mask, attention_bias, unidirectional, filter_value, q, total):
    """The one additive bias of the scores (q's type), or None where nothing is masked."""
    bias = None if mask is None else _mask_bias(mask, total, filter_value, q)
    if unidirectional:  # query i (at position total - seq + i) sees keys up to its own
        seq = q.shape[2]
        later = torch.arange(total, device=q.device)[None, :] > \
            (total - seq) + torch.arange(seq, device=q.device)[:, None]
        causal = torch.where(later, float(filter_value), 0.0).to(q.dtype)
        bias = causal if bias is None else bias + causal
    if attention_bias is not None:
        bias = attention_bias.to(q.dtype) if bias is None else bias + attention_bias
    return bias


# -- Attention, QAttention, MultiHeadAttention -------------------------------------------------
def attention(input, weights, bias=None, mask_index=None, past=None,  # noqa: A002
              attention_bias=None, past_sequence_length=None, *, num_heads, do_rotary=0,
              mask_filter_value=-10000.0, past_present_share_buffer=0, qkv_hidden_sizes=None,
              rotary_embedding_dim=0, scale=None, unidirectional=0, n_outputs=1):
    sizes = list(qkv_hidden_sizes) if qkv_hidden_sizes else [weights.shape[1] // 3] * 3
    qkv = F.linear(input, weights.t(), bias)  # one addmm (a matmul and an add were two)
    return _packed(qkv, sizes, mask_index, past, attention_bias, num_heads, mask_filter_value,
                   scale, unidirectional, n_outputs)


def q_attention(input, weight, bias, input_scale, weight_scale, mask_index=None,  # noqa: A002
                input_zero_point=None, weight_zero_point=None, past=None, *, num_heads,
                do_rotary=0, mask_filter_value=-10000.0, past_present_share_buffer=0,
                scale=None, unidirectional=0, n_outputs=1):
    # Attention whose projection is the integer product of the centred operands, rescaled.
    (qkv,) = mat_mul_integer_to_float(input, weight, input_scale, weight_scale,
                                      input_zero_point, weight_zero_point, bias)
    return _packed(qkv, [weight.shape[1] // 3] * 3, mask_index, past, None, num_heads,
                   mask_filter_value, scale, unidirectional, n_outputs)


def _packed(qkv, sizes, mask, past, attention_bias, num_heads, filter_value, scale,
            unidirectional, n_outputs):
    """Attention over the projected (B, S, q + k + v) with Attention's masks and past."""
    parts = qkv.chunk(3, dim=-1) if len(set(sizes)) == 1 else qkv.split(sizes, dim=-1)
    q, k, v = (_heads(t, num_heads) for t in parts)
    if past is not None:  # (2, B, n, P, h)
        k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
    bias = _score_bias(mask, attention_bias, unidirectional, filter_value, q, k.shape[2])
    head_scale = 1 / math.sqrt(sizes[0] // num_heads) if scale is None else scale
    out = _attend(q, k, v, bias, head_scale).to(qkv.dtype)
    return (out, torch.stack((k, v))) if n_outputs > 1 else (out,)  # present: (2, B, n, T, h)


def multi_head_attention(query, key=None, value=None, bias=None, key_padding_mask=None,
                         attention_bias=None, past_key=None, past_value=None,
                         past_sequence_length=None, cache_indirection=None, *, num_heads,
                         mask_filter_value=-10000.0, scale=None, unidirectional=0):
    q, k, v = _mha_heads(query, key, value, bias, num_heads)
    if past_key is not None:  # (B, n, P, h)
        k, v = torch.cat((past_key, k), dim=2), torch.cat((past_value, v), dim=2)
    score_bias = _score_bias(key_padding_mask, attention_bias, unidirectional, mask_filter_value,
                             q, k.shape[2])
    head_scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _attend(q, k, v, score_bias, head_scale).to(query.dtype), k, v


def _mha_heads(query, key, value, bias, num_heads):
    """Q, K, V as (B, n, S, h): key and value (B, T, d) projected like the query, or already
    (B, n, T, h) (cross attention's cached keys and values, no bias)."""
    if bias is not None:
        d_q = query.shape[-1]
        d_k = key.shape[-1] if key.dim() == 3 else d_q
        q_bias, k_bias, v_bias = bias[:d_q], bias[d_q:d_q + d_k], bias[d_q + d_k:]
        query = query + q_bias
        if key.dim() == 3:
            key, value = key + k_bias, value + v_bias
    q = _heads(query, num_heads)
    if key.dim() == 4:
        return q, key, value
    return q, _heads(key, num_heads), _heads(value, num_heads)


def ms_rotary_embedding(input, position_ids, cos_cache, sin_cache, interleaved=0,  # noqa: A002
                        is_packed_batching=0, num_heads=0, rotary_embedding_dim=0, scale=1.0):
    # position_ids: (B, S), or (1,) the position of the first token of every sequence.
    seq = input.shape[-2] if input.dim() == 4 else input.shape[1]
    positions = position_ids if position_ids.dim() == 2 else \
        (position_ids.reshape(-1)[:1] + torch.arange(seq, device=input.device)).expand(
            input.shape[0], seq)
    if input.dim() == 3 and not num_heads:  # heads as wide as the caches' rotation
        num_heads = input.shape[-1] // (rotary_embedding_dim or 2 * cos_cache.shape[-1])
    return rotary_embedding(input, cos_cache, sin_cache, positions.long(), interleaved,
                            num_heads, rotary_embedding_dim)


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
        query, key, value = torch.split(query, [num_heads * h, kv_num_heads * h,
                                                kv_num_heads * h], dim=-1)
    q, k, v = _heads(query, num_heads), _heads(key, kv_num_heads), _heads(value, kv_num_heads)
    seq = q.shape[2]
    total = seqlens_k.long() + 1  # (B,): keys after this step
    past = total - seq  # (B,): keys cached before it
    if do_rotary:
        positions = past[:, None] + torch.arange(seq, device=q.device) if position_ids is None \
            else position_ids.long()
        q = rotary_embedding(q, cos_cache, sin_cache, positions, rotary_interleaved)[0]
        k = rotary_embedding(k, cos_cache, sin_cache, positions, rotary_interleaved)[0]
    width = int(total_sequence_length.reshape(-1)[0])  # read on the host: it sizes the caches
    present_k, present_v = (_gqa_cache(cache, new, past, width)
                            for cache, new in ((past_key, k), (past_value, v)))
    group = num_heads // kv_num_heads  # query heads per key / value head
    keys = present_k.repeat_interleave(group, dim=1)
    values = present_v.repeat_interleave(group, dim=1)
    head_scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    visible = _gqa_visible(past, seq, total, keys.shape[2], causal, local_window_size)
    sink = head_sink if head_sink is not None else (
        torch.zeros(num_heads, device=q.device) if smooth_softmax else None)
    if softcap > 0 or sink is not None:  # no SDPA form: written out as CpuRef
        out = _capped_attention(q, keys, values, visible, attention_bias, head_scale, softcap,
                                sink)
    else:
        bias = torch.where(visible, 0.0, -math.inf).to(q.dtype)
        bias = bias if attention_bias is None else bias + attention_bias
        out = _attend(q, keys, values, bias, head_scale)
    return out.to(query.dtype), present_k, present_v


def _gqa_cache(cache, new, past, width):
    """The present cache (B, kv_n, max(cached, width), h): each sequence's ``past`` cached rows,
    then its new ones, zeros after them (ONNX Runtime's), made by index, not per sequence."""
    batch, heads, seq, size = new.shape
    cached = 0 if cache is None else cache.shape[2]
    length = max(cached, width)
    slots = torch.arange(length, device=new.device)
    if cache is None:
        present = new.new_zeros((batch, heads, length, size))
    else:
        kept = (slots[None, :] < past[:, None])[:, None, :, None]  # (B, 1, L, 1)
        present = torch.where(kept, F.pad(cache, (0, 0, 0, length - cached)), 0).to(new.dtype)
    where = (past[:, None] + torch.arange(seq, device=new.device))  # (B, S)
    return present.scatter(2, where[:, None, :, None].expand(batch, heads, seq, size), new)


def _gqa_visible(past, seq, total, width, causal, window):
    """(B, 1, S, T): which keys each query sees: those of its sequence, and with ``causal`` none
    after its own position, and with a window the last ``window`` of those (its own included)."""
    key = torch.arange(width, device=past.device)[None, None, :]
    position = (past[:, None] + torch.arange(seq, device=past.device))[:, :, None]  # (B, S, 1)
    visible = key < total[:, None, None]
    if causal:
        visible = visible & (key <= position)
    if window >= 0:
        visible = visible & (key > position - window)
    return visible[:, None]


def _capped_attention(q, keys, values, visible, attention_bias, scale, softcap, sink):
    """CpuRef's steps: float32 scores, scaled, capped, biased, masked, a softmax with a sink."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (B, n, S, T)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_bias is not None:
        scores = scores + attention_bias
    scores = torch.where(visible, scores, -math.inf)
    if sink is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sink.float().reshape(1, -1, 1, 1)
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        exp = torch.exp(scores - top)
        probs = exp / (exp.sum(dim=-1, keepdim=True) + torch.exp(sink - top))
    out = torch.matmul(probs.to(q.dtype), values)
    b, n, s, hv = out.shape
    return out.transpose(1, 2).reshape(b, s, n * hv)


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
