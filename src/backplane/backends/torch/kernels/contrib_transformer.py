"""ONNX Runtime's transformer fusions (com.microsoft domain, as its transformer optimizer writes them)
on torch tensors, computing CpuRef's values (``reference/kernels/contrib_transformer.py``) step for
step: the normalizations with a residual (SkipLayerNormalization, SkipSimplifiedLayerNormalization,
and SimplifiedLayerNormalization of the default domain) and the GELU family (Gelu, BiasGelu,
FastGelu, QuickGelu), BiasAdd and BERT's EmbedLayerNormalization. An optimized BERT ran these on
CpuRef, between CpuAcc's partitions (issue 29). The attention ops are in ``contrib_attention.py``.
Table keys carry the domain ("com.microsoft::BiasGelu").
"""

from __future__ import annotations

import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.torch.kernels.common import gelu
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


def embed_layer_normalization(input_ids, segment_ids, word_embedding, position_embedding,
                              segment_embedding, gamma, beta, mask=None, position_ids=None,
                              epsilon=1e-12, mask_index_type=1):
    positions = torch.arange(input_ids.shape[1], device=input_ids.device) \
        if position_ids is None else position_ids.long()
    total = word_embedding[input_ids.long()] + position_embedding[positions]
    if segment_embedding is not None:
        total = total + segment_embedding[segment_ids.long()]
    (y,) = layer_normalization(total, gamma, beta, epsilon=epsilon)
    # mask_index: each sequence's count of unmasked tokens (zeros without a mask)
    count = torch.zeros(input_ids.shape[0], dtype=torch.int32, device=input_ids.device) \
        if mask is None else (mask != 0).sum(dim=1, dtype=torch.int32)
    return y, count, total


KERNELS: KernelTable = {
    MS + "SkipLayerNormalization": {1: skip_layer_normalization},
    MS + "SkipSimplifiedLayerNormalization": {1: skip_simplified_layer_normalization},
    "SimplifiedLayerNormalization": {1: simplified_layer_normalization},  # default domain
    MS + "Gelu": {1: ms_gelu},
    MS + "BiasGelu": {1: bias_gelu},
    MS + "FastGelu": {1: fast_gelu},
    MS + "QuickGelu": {1: quick_gelu},
    MS + "BiasAdd": {1: bias_add},
    MS + "EmbedLayerNormalization": {1: embed_layer_normalization},
}
