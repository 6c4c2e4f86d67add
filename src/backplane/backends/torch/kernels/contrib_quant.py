"""ONNX Runtime's quantized ops (com.microsoft domain: the QOperator format its quantizer writes)
on torch tensors, computing CpuRef's values (``reference/kernels/contrib_quant.py``) step for step:
dequantize ((x - z) * s in float32), compute in float32, quantize (rint(y / s) + z, saturated).

Bit for bit with CpuRef wherever its steps are single float32 operations: QLinearAdd, QLinearMul,
QLinearLeakyRelu, QLinearConcat, and the integer products (QGemm, MatMulIntegerToFloat,
DynamicQuantizeMatMul), computed in float64, which holds every sum of 8-bit products exactly
(float32 could not past 2^24). Where CpuRef calls NumPy's exp or sums in its own order
(QLinearSigmoid, QLinearSoftmax, the average pools), torch's float32 rounding may put a value
lying at a half step on the other side: one quantization step at most, as against ONNX Runtime.

MatMulNBits (2-, 4- and 8-bit blocks) dequantizes its blocks as CpuRef does, then a float32
product: the same values up to the product's summation order. CpuAcc's fusion dequantizes
constant blocks once at load instead (``fusion/contrib_quant.match_mat_mul_n_bits``).

Nothing is read on the host: scales and zero points stay tensors, so a trace or a CUDA graph may
hold these kernels. Table keys carry the domain ("com.microsoft::QLinearAdd").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.contrib_quant import check_mat_mul_n_bits
from backplane.backends.torch.kernels.nn import average_pool, check_average_pool, softmax
from backplane.ir.graph import Layer, TensorInfo

MS = "com.microsoft::"
EIGHT_BIT = frozenset({np.dtype(np.uint8), np.dtype(np.int8)})
_ZERO32, _ZERO64 = torch.zeros(()), torch.zeros((), dtype=torch.float64)
_STEPS32, _STEPS64 = torch.tensor(255.0), torch.tensor(255.0, dtype=torch.float64)
"""255 in each float type: a frozen trace holds a Python 255 as an int64 0-d tensor, which an
operation on a float tensor then casts at every call, a tensor call more (an add of a 0-d result
and a 0-d constant casts one too, unless the constant comes first): ``product_grid``'s casts 5 ->
3, the small tier's quantized GPT's 54 -> 27 a run."""


def dequantize(x, scale, zero_point=None):
    """(x - zero point) * scale in float32, as CpuRef: an exact integer times the scale. An 8-bit
    x less its zero point is exact in float32, and the product rounds once: one new tensor."""
    if x.dtype in (torch.uint8, torch.int8):
        centred = x.float() if zero_point is None else x.float().sub_(zero_point)
        return centred.mul_(scale.float())
    centred = x.int() if zero_point is None else x.int() - zero_point.int()
    return centred.float() * scale.float()


def quantize(y, scale, zero_point, dtype):
    """rint(y / scale) + zero point, saturated to ``dtype``; torch.round rounds half to even."""
    info = torch.iinfo(dtype)
    q = torch.round(y / scale.float())
    if zero_point is not None:
        q = q.add_(zero_point.float())
    return q.clamp_(info.min, info.max).to(dtype)


# -- elementwise -------------------------------------------------------------------------------
def q_linear_add(A, A_scale, A_zero_point, B, B_scale, B_zero_point, C_scale,  # noqa: N803
                 C_zero_point=None):
    real = dequantize(A, A_scale, A_zero_point) + dequantize(B, B_scale, B_zero_point)
    return (quantize(real, C_scale, C_zero_point, A.dtype),)


def q_linear_mul(A, A_scale, A_zero_point, B, B_scale, B_zero_point, C_scale,  # noqa: N803
                 C_zero_point=None):
    real = dequantize(A, A_scale, A_zero_point) * dequantize(B, B_scale, B_zero_point)
    return (quantize(real, C_scale, C_zero_point, A.dtype),)


def q_linear_sigmoid(X, X_scale, X_zero_point, Y_scale, Y_zero_point=None):  # noqa: N803
    # CpuRef's formula, 1 / (1 + exp(-x)), rather than torch.sigmoid's
    y = torch.exp(dequantize(X, X_scale, X_zero_point).neg_()).add_(1).reciprocal_()
    return (quantize(y, Y_scale, Y_zero_point, X.dtype),)


def q_linear_leaky_relu(X, X_scale, X_zero_point, Y_scale, Y_zero_point=None,  # noqa: N803
                        alpha=0.01):
    x = dequantize(X, X_scale, X_zero_point)
    y = torch.where(x >= 0, x, x * torch.tensor(alpha, dtype=torch.float32, device=x.device))
    return (quantize(y, Y_scale, Y_zero_point, X.dtype),)


def q_linear_concat(Y_scale, Y_zero_point, *inputs, axis):  # noqa: N803
    # inputs: (tensor, scale, zero point) triples, each requantized to Y's scale and zero point
    parts = [quantize(dequantize(x, s, z), Y_scale, Y_zero_point, Y_zero_point.dtype)
             for x, s, z in zip(inputs[0::3], inputs[1::3], inputs[2::3])]
    return (torch.cat(parts, dim=axis),)


# -- pooling and softmax -----------------------------------------------------------------------
def q_linear_global_average_pool(X, x_scale, x_zero_point, y_scale, y_zero_point,  # noqa: N803
                                 channels_last=0):
    # the mean of the integers, then centred and scaled: one pass over X where dequantizing it
    # first took three (the same value up to float32 rounding: within a step of CpuRef's)
    spatial = tuple(range(1, X.dim() - 1)) if channels_last else tuple(range(2, X.dim()))
    mean = torch.mean(X, dim=spatial, keepdim=True, dtype=torch.float32)
    x = mean.sub_(x_zero_point.float()).mul_(x_scale.float())
    return (quantize(x, y_scale, y_zero_point, X.dtype),)


def q_linear_average_pool(X, x_scale, x_zero_point, y_scale, y_zero_point=None,  # noqa: N803
                          auto_pad="NOTSET", ceil_mode=0, channels_last=0, count_include_pad=0,
                          kernel_shape=None, pads=None, strides=None):
    x = dequantize(X, x_scale, x_zero_point)
    if channels_last:  # (N, *spatial, C) -> (N, C, *spatial) and back
        x = torch.movedim(x, -1, 1)
    (y,) = average_pool(x, auto_pad=auto_pad, ceil_mode=ceil_mode,
                        count_include_pad=count_include_pad, kernel_shape=kernel_shape, pads=pads,
                        strides=strides)
    if channels_last:
        y = torch.movedim(y, 1, -1)
    return (quantize(y, y_scale, y_zero_point, X.dtype),)


def q_linear_softmax(X, X_scale, x_zero_point, y_scale, y_zero_point, *, opset,  # noqa: N803
                     axis=None):
    x = dequantize(X, X_scale, x_zero_point)
    if opset >= 13:  # along one axis, as Softmax-13
        y = softmax(x, -1 if axis is None else axis)[0]
    else:  # over the trailing dimensions from axis on, as Softmax-1 and -11
        axis = (1 if axis is None else axis) % X.dim()
        y = softmax(x.reshape(int(np.prod(X.shape[:axis])), -1), -1)[0].reshape(X.shape)
    return (quantize(y, y_scale, y_zero_point, X.dtype),)


# -- matrix products ---------------------------------------------------------------------------
def _centred(x, zero_point):
    """An integer operand less its zero point (scalar, or per column of a matrix B), float64."""
    return x.double() if zero_point is None else x.double() - zero_point.double()


def q_gemm(A, a_scale, a_zero_point, B, b_scale, b_zero_point, C=None, y_scale=None,  # noqa: N803
           y_zero_point=None, alpha=1.0, transA=0, transB=0):  # noqa: N803
    a = _centred(A, a_zero_point)
    b = _centred(B.t(), b_zero_point) if transB else _centred(B, b_zero_point)  # (K, N)
    acc = (a.t() if transA else a) @ b  # exact: float64 holds the integer sums
    if C is not None:  # int32, quantized at the product's scale with zero point 0
        acc = acc.add_(C.double())
    multiplier = torch.tensor(alpha, dtype=torch.float32, device=acc.device) \
        * a_scale.float() * b_scale.float()
    y = acc.float().mul_(multiplier)
    if y_scale is None:
        return (y,)
    dtype = A.dtype if y_zero_point is None else y_zero_point.dtype
    return (quantize(y, y_scale, y_zero_point, dtype),)


def mat_mul_integer_to_float(A, B, a_scale, b_scale, a_zero_point=None,  # noqa: N803
                             b_zero_point=None, bias=None):
    acc = torch.matmul(_centred(A, a_zero_point), _centred(B, b_zero_point))
    y = acc.float().mul_(a_scale.float() * b_scale.float()).to(a_scale.dtype)
    return (y if bias is None else y + bias,)


def dynamic_quantize_mat_mul(A, B, b_scale, b_zero_point=None, bias=None):  # noqa: N803
    # A quantized to uint8 over its range (DynamicQuantizeLinear), then MatMulIntegerToFloat
    centred, a_scale = product_grid(A.float())
    acc = torch.matmul(centred.double(), _centred(B, b_zero_point))
    y = acc.float().mul_(a_scale * b_scale.float())
    return (y if bias is None else y + bias,)


def dynamic_grid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DynamicQuantizeLinear's uint8 x minus its zero point (float32 integers, a new tensor) and
    its scale (a 0-d float32 tensor), as CpuRef computes them
    (``reference/kernels/quant.dynamic_quantize_linear``: the range widened to hold 0, the scale
    divided in float64 and rounded once, a NaN in x making the range NaN, the scale 1 and the zero
    point 0, and x's NaN quantized to the zero point), all on tensors: nothing read on the host,
    so a trace (``traced``) may hold it."""
    lowest, highest = torch.aminmax(x)
    low, high = lowest.clamp_max(0), highest.clamp_min(0)  # NaN stays NaN
    spread = ((high.double() - low.double()) / 255).float()
    scale = torch.where(high > low, spread, torch.ones_like(spread))
    zero = torch.round(low.neg() / scale).clamp_(0, 255).nan_to_num_(0.0)
    centred = torch.div(x, scale).round_().clamp_(zero.neg(), 255 - zero)
    return torch.where(centred.isnan(), zero.neg(), centred), scale


def product_grid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dynamic_grid`` in 14 tensor calls where it makes 25 (a trace's cost is per call, about
    1.4 us each on this AMD EPYC): the same integers, and the same scale but where x is all zeros
    (then 0, not 1: every product by it is 0 all the same). For products only: its scale
    multiplies an integer sum.

    Why each step is the reference's: ``fmin`` maps a NaN low to 0 where ``maximum`` keeps a NaN
    high, in float64 (``_ZERO64``); the range, high - low in float64 as CpuRef's Python floats,
    is then NaN, taken to 255 (scale 1, zero point 0: CpuRef's NaN case). -zero is
    round(low / scale) (float32 division and rounding half to even are odd functions: CpuRef's
    rint(-low / scale), negated), within [-255, 0] without a clamp (low <= 0 <= high, the scale
    rounded once); x's grid lies between -zero and 255 - zero. A NaN left in the grid (x's own
    NaN, 0 / 0 where x is all zeros, inf / inf) is the zero point, 0 in each of those cases."""
    lowest, highest = torch.aminmax(x)
    # 0-d CPU tensors: operands of a CUDA tensor's op too, as scalars; a trace keeps them
    low = torch.fmin(lowest, _ZERO32)  # NaN -> 0
    high = torch.maximum(highest, _ZERO64)  # NaN stays NaN, float64
    scale = (high - low).nan_to_num_(255.0, float("inf")).div_(_STEPS64).float()
    zero_neg = torch.div(low, scale).round_()
    centred = torch.div(x, scale).round_()
    # the constant first (``_STEPS32``)
    return torch.clamp(centred, zero_neg, torch.add(_STEPS32, zero_neg)).nan_to_num_(0.0), scale


def mat_mul_n_bits(A, B, scales, zero_points=None, g_idx=None, bias=None, *, K, N,  # noqa: N803
                   block_size, bits=4, accuracy_level=0, weight_prepacked=0):
    # The blocks dequantized, then a float32 product; CpuAcc's fusion (``fusion/contrib_quant``)
    # dequantizes a constant weight once at load instead of at every call.
    weight = n_bits_weight(B, scales, zero_points, K=K, N=N, block_size=block_size, bits=bits)
    y = torch.matmul(A.float(), weight.t())
    if bias is not None:
        y = y + bias
    return (y.to(A.dtype),)


def n_bits_weight(B, scales, zero_points=None, *, K, N, block_size, bits):  # noqa: N803
    """MatMulNBits' (N, K) float32 weight from its (N, k_blocks, blob) bytes (8 / bits values a
    byte, low bits first, along K), per block scales and zero points (packed like B, unpacked in
    A's type, or absent: 2^(bits - 1)), as CpuRef dequantizes it."""
    k_blocks = -(-K // block_size)
    q = _unpack(B.reshape(N, -1), bits)[:, :k_blocks * block_size].reshape(N, k_blocks, -1)
    if zero_points is None:
        zero = torch.tensor(2.0 ** (bits - 1), device=B.device)
    elif zero_points.dtype == torch.uint8:
        zero = _unpack(zero_points.reshape(N, -1), bits)[:, :k_blocks, None].float()
    else:
        zero = zero_points.reshape(N, k_blocks, 1).float()
    weight = (q.float() - zero) * scales.reshape(N, k_blocks, 1).float()
    return weight.reshape(N, -1)[:, :K]


def _unpack(packed, bits):
    """(rows, bytes) uint8 -> (rows, bytes * 8 / bits) values, the low bits of each byte first."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    values = torch.bitwise_and(packed[..., None] >> shifts, 2 ** bits - 1)
    return values.reshape(packed.shape[0], -1)


# -- checks ------------------------------------------------------------------------------------
def check_eight_bit(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    """The quantized tensors are uint8 or int8 (ONNX Runtime's kernels take no other)."""
    dtype = inputs[_QUANTIZED_INPUT.get(layer.op_type, 0)].dtype if inputs else None
    if dtype is not None and dtype not in EIGHT_BIT:
        return f"{layer.op_type} of {dtype} (takes uint8, int8)"
    return None


_QUANTIZED_INPUT = {"QLinearConcat": 2}  # the first tensor after Y's scale and zero point


def check_q_linear_average_pool(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("channels_last", 0):  # the window check reads (N, C, *spatial) shapes
        nchw = [TensorInfo(None, info.dtype) for info in inputs]
        return check_eight_bit(layer, inputs) or check_average_pool(layer, nchw)
    return check_eight_bit(layer, inputs) or check_average_pool(layer, inputs)


def check_dynamic_quantize_mat_mul(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    dtype = inputs[1].dtype if len(inputs) > 1 else None
    if dtype is not None and dtype not in EIGHT_BIT:
        return f"DynamicQuantizeMatMul of a {dtype} B (takes uint8, int8)"
    return None


KERNELS: KernelTable = {
    MS + "QLinearAdd": {1: q_linear_add},
    MS + "QLinearMul": {1: q_linear_mul},
    MS + "QLinearSigmoid": {1: q_linear_sigmoid},
    MS + "QLinearLeakyRelu": {1: q_linear_leaky_relu},
    MS + "QLinearConcat": {1: q_linear_concat},
    MS + "QLinearGlobalAveragePool": {1: q_linear_global_average_pool},
    MS + "QLinearAveragePool": {1: q_linear_average_pool},
    MS + "QLinearSoftmax": {1: q_linear_softmax},
    MS + "QGemm": {1: q_gemm},
    MS + "MatMulIntegerToFloat": {1: mat_mul_integer_to_float},
    MS + "DynamicQuantizeMatMul": {1: dynamic_quantize_mat_mul},
    MS + "MatMulNBits": {1: mat_mul_n_bits},
}

CHECKS = {
    **{key: check_eight_bit for key in KERNELS if key != MS + "MatMulNBits"},
    MS + "MatMulNBits": check_mat_mul_n_bits,
    MS + "QLinearAveragePool": check_q_linear_average_pool,
    MS + "DynamicQuantizeMatMul": check_dynamic_quantize_mat_mul,
}
