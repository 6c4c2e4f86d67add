"""ONNX Runtime's transformer fusions (com.microsoft domain, as its transformer optimizer writes them)
on torch tensors, computing CpuRef's values (``reference/kernels/contrib_transformer.py``) step for
step: the normalizations with a residual (SkipLayerNormalization, SkipSimplifiedLayerNormalization,
and SimplifiedLayerNormalization of the default domain) and the GELU family (Gelu, BiasGelu,
FastGelu, QuickGelu), BiasAdd, BERT's EmbedLayerNormalization, and the fusions ONNX Runtime writes
into the optimized models it saves (FusedMatMul, FusedGemm, FusedConv: a product or convolution and
its activation). An optimized BERT ran these on CpuRef, between CpuAcc's partitions (issue 29); each
is a few torch ops a trace holds (no value read on the host). The attention ops are in
``contrib_attention.py``. Table keys carry the domain ("com.microsoft::BiasGelu").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.contrib_transformer import (
    check_activation,
    check_fused_mat_mul,
)
from backplane.backends.torch.kernels.common import gelu
from backplane.backends.torch.kernels.nn import check_conv, conv, gemm, layer_normalization
from backplane.ir.graph import Layer, TensorInfo

MS = "com.microsoft::"


def skip_layer_normalization(input, skip, gamma, beta=None, bias=None, epsilon=1e-12,  # noqa: A002
                             *, statistics=1, n_outputs=1):
    """LayerNormalization of input + skip (+ bias); also its mean, inverse deviation and sum.
    ``statistics`` 0 (set by CpuAcc's fusion, ``fusion/ort_fused.py``, where no layer reads them):
    None in their places, y by torch's one-pass layer_norm."""
    total = input + skip if bias is None else input + skip + bias
    if n_outputs == 1 or not statistics:
        (y,) = layer_normalization(total, gamma, beta, epsilon=epsilon)
        return (y,) if n_outputs == 1 else (y, None, None, total)[:n_outputs]
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


# -- ONNX Runtime's saved fusions: a product or a convolution, then an activation ------------------
ACTIVATIONS = {
    "Relu": torch.relu,
    "Tanh": torch.tanh,
    "Sigmoid": torch.sigmoid,
    "LeakyRelu": lambda x, alpha=0.01: F.leaky_relu(x, alpha),
    "Clip": lambda x, low=-math.inf, high=math.inf: torch.clamp(x, low, high),
    "HardSigmoid": lambda x, alpha=0.2, beta=0.5: torch.clamp(x * alpha + beta, 0, 1),
}
"""CpuRef's activations (``reference/kernels/contrib_transformer.ACTIVATIONS``), their parameters
in the order ONNX Runtime lists them."""


def fused_conv(X, W, B=None, Z=None, activation="", activation_params=None,  # noqa: N803
               auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
               strides=None):
    # Conv, plus Z (a residual), then the activation.
    (y,) = conv(X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides)
    y = y if Z is None else y + Z
    return (ACTIVATIONS[activation](y, *(activation_params or ())) if activation else y,)


def fused_gemm(A, B, C=None, activation="", activation_alpha=None,  # noqa: N803
               activation_beta=None, activation_gamma=None, alpha=1.0, beta=1.0, transA=0,
               transB=0):  # noqa: N803
    # Gemm (as one linear where it is one: a frozen trace's addmm of a transposed weight is what
    # oneDNN Graph's fuser failed on, fusion/traceable._gemm), then the activation.
    if transB and not transA and alpha == 1.0 and (C is None or beta == 1.0 and C.dim() == 1):
        y = F.linear(A, B, C)
    else:
        (y,) = gemm(A, B, C, alpha, beta, transA, transB)
    if not activation:
        return (y,)
    params = [p for p in (activation_alpha, activation_beta, activation_gamma) if p is not None]
    return (ACTIVATIONS[activation](y, *params),)


def fused_mat_mul(A, B, alpha=1.0, transA=0, transB=0, transBatchA=0,  # noqa: N803
                  transBatchB=0):  # noqa: N803
    # transBatch* are refused by check_fused_mat_mul
    y = torch.matmul(A.transpose(-1, -2) if transA else A, B.transpose(-1, -2) if transB else B)
    return (y if alpha == 1.0 else y * alpha,)


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
    MS + "FusedConv": {1: fused_conv},
    MS + "FusedGemm": {1: fused_gemm},
    MS + "FusedMatMul": {1: fused_mat_mul},
}


def _check_fused_conv(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    return check_activation(layer, inputs) or check_conv(layer, inputs)


CHECKS = {
    MS + "FusedConv": _check_fused_conv,
    MS + "FusedGemm": check_activation,
    MS + "FusedMatMul": check_fused_mat_mul,
}
