"""ONNX Runtime's transformer fusions (com.microsoft domain, as its transformer optimizer writes them)
on torch tensors, computing CpuRef's values (``reference/kernels/contrib_transformer.py``) step for
step: the normalizations with a residual (SkipLayerNormalization, SkipSimplifiedLayerNormalization,
and SimplifiedLayerNormalization of the default domain) and the GELU family (Gelu, BiasGelu,
FastGelu, QuickGelu), BiasAdd and Attention (the packed-projection one its optimizer writes for
BERT, with its masks, past and bias; not rotary or shared buffers, refused as on CpuRef). An
optimized BERT ran these on CpuRef, between CpuAcc's partitions (issue 29). Masks are made on the
device from the mask tensor (no host read), so a trace or a CUDA graph may hold them. Table keys
carry the domain ("com.microsoft::BiasGelu").
"""

from __future__ import annotations

import math

import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.torch.kernels.common import gelu
from backplane.backends.reference.kernels.contrib_attention import check_attention
from backplane.backends.torch.kernels.nn import layer_normalization

MS = "com.microsoft::"


def skip_layer_normalization(input, skip, gamma, beta=None, bias=None, epsilon=1e-12,  # noqa: A002
                             *, n_outputs=1):
    """LayerNormalization of input + skip (+ bias); also its mean, inverse deviation and sum."""
    total = input + skip if bias is None else input + skip + bias
    if n_outputs == 1:
        return layer_normalization(total, gamma, beta, epsilon=epsilon)
    y, mean, inv_std = layer_normalization(total, gamma, beta, epsilon=epsilon, n_outputs=3)
    return (y, mean, inv_std, total)[:n_outputs]


def _rms(x, gamma, epsilon, dims=(-1,)):
    inv_std = 1 / torch.sqrt(x.float().square().mean(dim=dims, keepdim=True) + epsilon)
    return (x * inv_std * gamma).to(x.dtype), inv_std


def skip_simplified_layer_normalization(input, skip, gamma, bias=None,  # noqa: A002
                                        epsilon=1e-12, *, n_outputs=1):
    total = input + skip if bias is None else input + skip + bias
    y, inv_std = _rms(total, gamma, epsilon)
    return (y, torch.zeros_like(inv_std), inv_std, total)[:n_outputs]  # no mean: ORT writes zeros


def simplified_layer_normalization(X, scale, axis=-1, epsilon=1e-5, stash_type=1,  # noqa: N803
                                   *, n_outputs=1):
    dims = tuple(range(axis % X.dim(), X.dim()))
    x = X.float()
    inv_std = 1 / torch.sqrt(x.square().mean(dim=dims, keepdim=True) + epsilon)
    return ((x * inv_std * scale).to(X.dtype), inv_std)[:n_outputs]


def ms_gelu(X):  # noqa: N803
    return (gelu(X),)


def bias_gelu(A, B):  # noqa: N803
    return (gelu(A + B),)


def fast_gelu(X, bias=None):  # noqa: N803
    return (gelu(X if bias is None else X + bias, approximate="tanh"),)


def quick_gelu(X, alpha=1.702):  # noqa: N803
    return (X / (1 + torch.exp(-float(alpha) * X)),)


def bias_add(X, bias, skip):  # noqa: N803
    return (X + bias + skip,)


def attention(input, weights, bias=None, mask_index=None, past=None,  # noqa: A002
              attention_bias=None, past_sequence_length=None, *, num_heads, do_rotary=0,
              mask_filter_value=-10000.0, past_present_share_buffer=0, qkv_hidden_sizes=None,
              rotary_embedding_dim=0, scale=None, unidirectional=0, n_outputs=1):
    """CpuRef's Attention: the packed projection, split into heads, masked and scaled scores, a
    float32 softmax, and the present (past and new keys and values) where asked."""
    sizes = list(qkv_hidden_sizes) if qkv_hidden_sizes else [weights.shape[1] // 3] * 3
    qkv = torch.matmul(input, weights)
    qkv = qkv if bias is None else qkv + bias
    q, k, v = (_heads(t, num_heads) for t in torch.split(qkv, sizes, dim=-1))
    if past is not None:  # (2, B, n, P, h)
        k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
    batch, seq, total = qkv.shape[0], qkv.shape[1], k.shape[2]
    score_bias = _mask_bias(mask_index, batch, seq, total, mask_filter_value, qkv.device)
    if unidirectional:
        later = torch.arange(total, device=qkv.device)[None, :] > \
            (total - seq) + torch.arange(seq, device=qkv.device)[:, None]
        score_bias = score_bias + torch.where(later, mask_filter_value, 0.0).float()
    if attention_bias is not None:
        score_bias = score_bias + attention_bias
    head_scale = 1 / math.sqrt(sizes[0] // num_heads) if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * torch.tensor(head_scale, dtype=torch.float32) \
        + score_bias
    out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)  # (B, n, S, hv)
    b, n, s, hv = out.shape
    out = out.transpose(1, 2).reshape(b, s, n * hv).to(qkv.dtype)
    return (out, torch.stack((k, v))) if n_outputs > 1 else (out,)


def _heads(x, num_heads):
    """(B, S, n * h) -> (B, n, S, h)."""
    b, s, d = x.shape
    return x.reshape(b, s, num_heads, d // num_heads).transpose(1, 2)


def _mask_bias(mask, batch, seq, total, filter_value, device):
    """CpuRef's additive (B, 1, S, T) bias from a key mask: raw 0/1 (B, T) or (B, S, T), each
    sequence's length (B,), or exclusive ends then inclusive starts (2B,)."""
    if mask is None:
        return torch.zeros((1, 1, 1, 1), dtype=torch.float32, device=device)
    if mask.dim() == 1:
        positions = torch.arange(total, device=device)
        keep = positions[None, :] < mask[:batch, None]
        if mask.shape[0] == 2 * batch:
            keep = keep & (positions[None, :] >= mask[batch:, None])
        mask = keep
    keep = (mask > 0).reshape(batch, 1, -1, total)
    return torch.where(keep, 0.0, float(filter_value)).float()


KERNELS: KernelTable = {
    MS + "SkipLayerNormalization": {1: skip_layer_normalization},
    MS + "SkipSimplifiedLayerNormalization": {1: skip_simplified_layer_normalization},
    "SimplifiedLayerNormalization": {1: simplified_layer_normalization},  # default domain
    MS + "Gelu": {1: ms_gelu},
    MS + "BiasGelu": {1: bias_gelu},
    MS + "FastGelu": {1: fast_gelu},
    MS + "QuickGelu": {1: quick_gelu},
    MS + "BiasAdd": {1: bias_add},
    MS + "Attention": {1: attention},
}

CHECKS = {MS + "Attention": check_attention}
