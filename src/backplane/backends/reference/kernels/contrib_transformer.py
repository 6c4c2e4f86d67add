"""ONNX Runtime's transformer fusions (com.microsoft domain, written by its transformer optimizer),
from its contrib-op documentation: the normalizations with a residual (Skip*), the BERT embedding,
the GELU family, Attention (packed QKV weights) and MultiHeadAttention, FusedMatMul, FusedGemm,
FusedConv, RotaryEmbedding; and SimplifiedLayerNormalization, which ONNX Runtime adds to the
default domain.

Masks follow ONNX Runtime: a masked position gets ``mask_filter_value`` (-10000) added to its score,
not -inf, so that a row masked throughout averages its values instead of giving NaN.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.attention import rotary_embedding
from backplane.backends.reference.kernels.conv import conv
from backplane.backends.reference.kernels.elementwise import gelu
from backplane.backends.reference.kernels.matmul import gemm
from backplane.backends.reference.kernels.normalization import layer_normalization
from backplane.backends.reference.kernels.reduce import softmax
from backplane.ir.graph import Layer, TensorInfo

MS = "com.microsoft::"


# -- normalizations ----------------------------------------------------------------------------
def skip_layer_normalization(input, skip, gamma, beta=None, bias=None,  # noqa: A002
                             epsilon=1e-12):
    total = input + skip if bias is None else input + skip + bias
    y, mean, inv_std = layer_normalization(total, gamma, beta, epsilon=epsilon, n_outputs=3)
    return y, mean, inv_std, total


def _rms(x, gamma, epsilon):
    inv_std = 1 / np.sqrt(np.square(x.astype(np.float32)).mean(axis=-1, keepdims=True) + epsilon)
    return (x * inv_std * gamma).astype(x.dtype), inv_std


def skip_simplified_layer_normalization(input, skip, gamma, bias=None,  # noqa: A002
                                        epsilon=1e-12):
    total = input + skip if bias is None else input + skip + bias
    y, inv_std = _rms(total, gamma, epsilon)
    return y, np.zeros_like(inv_std), inv_std, total  # no mean: ONNX Runtime writes zeros


def simplified_layer_normalization(X, scale, axis=-1, epsilon=1e-5, stash_type=1):  # noqa: N803
    axes = tuple(range(axis % X.ndim, X.ndim))
    x = X.astype(np.float32)
    inv_std = 1 / np.sqrt(np.square(x).mean(axis=axes, keepdims=True) + epsilon)
    return (x * inv_std * scale).astype(X.dtype), inv_std


def embed_layer_normalization(input_ids, segment_ids, word_embedding, position_embedding,
                              segment_embedding, gamma, beta, mask=None, position_ids=None,
                              epsilon=1e-12, mask_index_type=1):
    positions = np.arange(input_ids.shape[1]) if position_ids is None else position_ids
    total = word_embedding[input_ids] + position_embedding[positions]
    if segment_embedding is not None:
        total = total + segment_embedding[segment_ids]
    (y,) = layer_normalization(total, gamma, beta, epsilon=epsilon)
    # mask_index: each sequence's count of unmasked tokens (zeros without a mask)
    count = np.zeros(len(input_ids), np.int32) if mask is None else \
        (mask != 0).sum(axis=1).astype(np.int32)
    return y, count, total


# -- activations -------------------------------------------------------------------------------
def ms_gelu(X):  # noqa: N803
    return gelu(X)


def bias_gelu(A, B):  # noqa: N803
    return gelu(A + B)


def fast_gelu(X, bias=None):  # noqa: N803
    return gelu(X if bias is None else X + bias, approximate="tanh")


def quick_gelu(X, alpha=1.702):  # noqa: N803
    return ((X / (1 + np.exp(-np.float32(alpha) * X))).astype(X.dtype),)


def bias_add(X, bias, skip):  # noqa: N803
    return (X + bias + skip,)


ACTIVATIONS = {
    "Relu": lambda x: np.maximum(x, 0),
    "Tanh": np.tanh,
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "LeakyRelu": lambda x, alpha=0.01: np.where(x >= 0, x, alpha * x),
    "Clip": lambda x, low=-np.inf, high=np.inf: np.clip(x, low, high),
    "HardSigmoid": lambda x, alpha=0.2, beta=0.5: np.clip(alpha * x + beta, 0, 1),
}


def fused_conv(X, W, B=None, Z=None, activation="", activation_params=None,  # noqa: N803
               auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
               strides=None):
    # Conv, plus Z (a residual), then the activation.
    (y,) = conv(X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides)
    if Z is not None:
        y = y + Z
    if activation:
        y = ACTIVATIONS[activation](y, *(activation_params or ()))
    return (y.astype(X.dtype),)


def fused_gemm(A, B, C=None, activation="", activation_alpha=None,  # noqa: N803
               activation_beta=None, activation_gamma=None, alpha=1.0, beta=1.0, transA=0,
               transB=0):  # noqa: N803
    # Gemm, then the activation with its attributes (alpha, beta) in order.
    (y,) = gemm(A, B, C, alpha=alpha, beta=beta, transA=transA, transB=transB)
    if activation:
        params = [p for p in (activation_alpha, activation_beta, activation_gamma) if p is not None]
        y = ACTIVATIONS[activation](y, *params)
    return (y.astype(A.dtype),)


def fused_mat_mul(A, B, alpha=1.0, transA=0, transB=0, transBatchA=0,  # noqa: N803
                  transBatchB=0):  # noqa: N803
    a = np.swapaxes(A, -1, -2) if transA else A
    b = np.swapaxes(B, -1, -2) if transB else B
    return ((np.matmul(a, b) * np.float32(alpha)).astype(A.dtype),)


# -- attention ---------------------------------------------------------------------------------
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
    q, k, v = np.split(qkv, np.cumsum(sizes)[:2], axis=-1)
    q, k, v = (_heads(t, num_heads) for t in (q, k, v))
    if past is not None:  # (2, B, n, P, h)
        k, v = np.concatenate((past[0], k), axis=2), np.concatenate((past[1], v), axis=2)
    batch, seq, total = input.shape[0], input.shape[1], k.shape[2]
    score_bias = _mask_bias(mask_index, batch, seq, total, mask_filter_value)
    if unidirectional:
        score_bias = score_bias + _causal_bias(seq, total, mask_filter_value)
    if attention_bias is not None:
        score_bias = score_bias + attention_bias
    head_scale = 1 / math.sqrt(sizes[0] // num_heads) if scale is None else scale
    out = _attend(q, k, v, score_bias, head_scale).astype(input.dtype)
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


# -- checks ------------------------------------------------------------------------------------
def check_attention(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    for name in ("do_rotary", "past_present_share_buffer"):
        if layer.attrs.get(name, 0):
            return f"Attention with {name}=1 not supported"
    return _check_mask(_input_info(layer, inputs, 3), "mask_index")


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


def check_activation(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    activation = layer.attrs.get("activation", "")
    if activation and activation not in ACTIVATIONS:
        return (f"{layer.op_type} activation '{activation}' not supported (takes "
                f"{', '.join(ACTIVATIONS)})")
    return None


def check_fused_mat_mul(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("transBatchA", 0) or layer.attrs.get("transBatchB", 0):
        return "FusedMatMul with transBatchA or transBatchB not supported"
    return None


def check_rotary(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("is_packed_batching", 0) or layer.attrs.get("scale", 1.0) != 1.0:
        return "RotaryEmbedding with is_packed_batching or a scale other than 1 not supported"
    return None


KERNELS: KernelTable = {
    MS + "SkipLayerNormalization": {1: skip_layer_normalization},
    MS + "SkipSimplifiedLayerNormalization": {1: skip_simplified_layer_normalization},
    "SimplifiedLayerNormalization": {1: simplified_layer_normalization},  # default domain
    MS + "EmbedLayerNormalization": {1: embed_layer_normalization},
    MS + "Gelu": {1: ms_gelu},
    MS + "BiasGelu": {1: bias_gelu},
    MS + "FastGelu": {1: fast_gelu},
    MS + "QuickGelu": {1: quick_gelu},
    MS + "BiasAdd": {1: bias_add},
    MS + "FusedConv": {1: fused_conv},
    MS + "FusedGemm": {1: fused_gemm},
    MS + "FusedMatMul": {1: fused_mat_mul},
    MS + "Attention": {1: attention},
    MS + "MultiHeadAttention": {1: multi_head_attention},
    MS + "RotaryEmbedding": {1: ms_rotary_embedding},
}

CHECKS = {
    MS + "Attention": check_attention,
    MS + "MultiHeadAttention": check_multi_head_attention,
    MS + "FusedConv": check_activation,
    MS + "FusedGemm": check_activation,
    MS + "FusedMatMul": check_fused_mat_mul,
    MS + "RotaryEmbedding": check_rotary,
}
