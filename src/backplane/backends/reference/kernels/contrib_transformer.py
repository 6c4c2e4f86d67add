"""ONNX Runtime's transformer fusions (com.microsoft domain, written by its transformer optimizer
and into the optimized models it saves), from its contrib-op documentation: the normalizations with
a residual (Skip*), the BERT embedding, the GELU family, FusedMatMul, FusedGemm, FusedConv; and
SimplifiedLayerNormalization, which ONNX Runtime adds to the default domain. The attention ops are
in ``contrib_attention.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.conv import conv
from backplane.backends.reference.kernels.elementwise import gelu
from backplane.backends.reference.kernels.matmul import gemm
from backplane.backends.reference.kernels.normalization import layer_normalization
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


# -- checks ------------------------------------------------------------------------------------
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
}

CHECKS = {
    MS + "FusedConv": check_activation,
    MS + "FusedGemm": check_activation,
    MS + "FusedMatMul": check_fused_mat_mul,
}
