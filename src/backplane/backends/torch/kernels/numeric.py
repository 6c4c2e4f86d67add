"""Math torch kernels beyond elementwise arithmetic: IsNaN / IsInf, Mod, BitShift and the bitwise
ops, Celu / Shrink / Swish / SwiGLU, CumSum / CumProd, Einsum, Det, NegativeLogLikelihoodLoss and
SoftmaxCrossEntropyLoss, ArgMax / ArgMin / Hardmax, the reductions torch lacks elsewhere, window
functions, DFT / STFT, CastLike / BitCast. (The linear quantization ops: ``quantization.py``.)

Where NumPy (CpuRef, the spec) widens a computation, these kernels widen it the same way, so that
the results are the same values and not merely close ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.torch.kernels.common import (
    FLOATS,
    NUMBERS,
    SIGNED,
    TORCH_DTYPES,
    ints,
    torch_dtype,
)
from backplane.backends.torch.kernels.shape import _reduce, _reduce_v1
from backplane.frontends.onnx_types import onnx_to_numpy_dtype
from backplane.ir.graph import Layer, TensorInfo

UINT8 = np.dtype(np.uint8)
INTEGERS = SIGNED | {UINT8}


# -- tests of values, Mod, bits --------------------------------------------------------------------
def is_nan(X):
    return (torch.isnan(X),)


def is_inf(X, detect_negative=1, detect_positive=1):
    if detect_negative and detect_positive:
        return (torch.isinf(X),)
    if detect_positive:
        return (torch.isposinf(X),)
    if detect_negative:
        return (torch.isneginf(X),)
    return (torch.zeros_like(X, dtype=torch.bool),)


def mod(A, B, fmod=0):
    if A.dtype.is_floating_point:
        return (torch.fmod(A, B) if fmod else _float_mod(A, B),)
    # By 0 the result is 0, as in CpuRef (NumPy), where torch's CPU kernel raises; and x % -1 is 0,
    # where x86's division traps on INT_MIN % -1 (SIGFPE: the whole process dies). Masked, not
    # branched on, so that the kernel stays capturable in a CUDA graph.
    trivial = (B == 0) | (B == -1) if A.dtype.is_signed else B == 0
    divisor = B.masked_fill(trivial, 1)
    result = torch.fmod(A, divisor) if fmod else torch.remainder(A, divisor)
    return (result.masked_fill(trivial, 0),)


def _float_mod(a, b):
    """NumPy's float remainder (npy_divmod): C's fmod moved into the divisor's sign, and a zero
    result signed as the divisor (torch's remainder signs it as the dividend)."""
    m = torch.fmod(a, b)
    m = torch.where((m != 0) & ((b < 0) != (m < 0)), m + b, m)
    return torch.where(m == 0, torch.copysign(torch.zeros_like(m), b), m)


def bit_shift(X, Y, direction):
    # a shift by the type's width or more gives 0 in both torch and NumPy
    shift = torch.bitwise_left_shift if direction == "LEFT" else torch.bitwise_right_shift
    return (shift(X, Y),)


def bitwise_and(A, B):
    return (torch.bitwise_and(A, B),)


def bitwise_or(A, B):
    return (torch.bitwise_or(A, B),)


def bitwise_xor(A, B):
    return (torch.bitwise_xor(A, B),)


def bitwise_not(X):
    return (torch.bitwise_not(X),)


# -- activations CpuAcc's elementwise table lacks --------------------------------------------------
def celu(X, alpha=1.0):
    return (torch.clamp_min(X, 0) + torch.clamp_max(alpha * torch.expm1(X / alpha), 0),)


def shrink(input, bias=0.0, lambd=0.5):  # noqa: A002
    zero = torch.zeros_like(input)
    return (torch.where(input < -lambd, input + bias,
                        torch.where(input > lambd, input - bias, zero)),)


def swish(X, alpha=1.0):
    return (X / (1 + torch.exp(-alpha * X)),)


def swi_glu(A, B, alpha=1.0):
    gate = 1 / (1 + torch.exp(-alpha * A))  # rounded to A's type, as in CpuRef
    return (A * gate * B,)


# -- cumulative, Einsum, Det -----------------------------------------------------------------------
def cum_sum(x, axis, exclusive=0, reverse=0):
    return (_cumulative(torch.cumsum, 0, x, axis, exclusive, reverse),)


def cum_prod(x, axis, exclusive=0, reverse=0):
    return (_cumulative(torch.cumprod, 1, x, axis, exclusive, reverse),)


def _cumulative(scan, identity, x, axis, exclusive, reverse):
    axis = ints(axis)[0] % x.dim()
    data = x.flip(axis) if reverse else x
    result = scan(data, axis, dtype=x.dtype)  # torch would widen integers to int64
    size = x.shape[axis]
    if exclusive and size:  # shifted by one along the axis, starting from the identity
        first = torch.full_like(result.narrow(axis, 0, 1), identity)
        result = torch.cat([first, result.narrow(axis, 0, size - 1)], axis)
    return result.flip(axis) if reverse else result


def einsum(*Inputs, equation):  # noqa: N803
    return (torch.einsum(equation.replace(" ", ""), *Inputs),)


def det(X):
    # CUDA's LU lost a NaN column (a determinant of -0.0 on an H100, where LAPACK's is NaN): a
    # matrix holding NaN has a NaN determinant, said here on every device (n^2 reads for n^3 work)
    return (torch.linalg.det(X).masked_fill_(torch.isnan(X).any(-1).any(-1), math.nan),)


# -- losses ----------------------------------------------------------------------------------------
def negative_log_likelihood_loss(input, target, weight=None, ignore_index=None,  # noqa: A002
                                 reduction="mean"):
    return (_nll(input, target, weight, ignore_index, reduction),)


def softmax_cross_entropy_loss(scores, labels, weights=None, ignore_index=None, reduction="mean",
                               *, n_outputs=1):
    # log(softmax) along the classes, as exp / sum then log (not log-sum-exp), like CpuRef
    exp = torch.exp(scores - torch.amax(scores, 1, keepdim=True))
    log_prob = torch.log(exp / torch.sum(exp, 1, keepdim=True))
    return (_nll(log_prob, labels, weights, ignore_index, reduction), log_prob)[:n_outputs]


def _nll(log_prob, target, weight, ignore_index, reduction):
    # (N, C, d1, ..., dk) scores, (N, d1, ..., dk) classes; an ignored target weighs 0
    target = target.long()
    ignored = target == ignore_index if ignore_index is not None else \
        torch.zeros_like(target, dtype=torch.bool)
    target = torch.where(ignored, 0, target)
    target = torch.where(target < 0, target + log_prob.shape[1], target)  # NumPy's from the end
    picked = torch.gather(log_prob, 1, target.unsqueeze(1)).squeeze(1)
    weights = torch.ones_like(picked) if weight is None else weight[target]
    weights = torch.where(ignored, 0, weights).to(log_prob.dtype)
    loss = -picked * weights
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / weights.sum()  # "mean": weighted by the weights


# -- ArgMax, ArgMin, Hardmax -----------------------------------------------------------------------
def arg_max(data, axis=0, keepdims=1, select_last_index=0):
    return (_arg(torch.argmax, data, axis, keepdims, select_last_index),)


def arg_min(data, axis=0, keepdims=1, select_last_index=0):
    return (_arg(torch.argmin, data, axis, keepdims, select_last_index),)


def _arg(fn, data, axis, keepdims, select_last_index):
    if select_last_index:  # search the reversed axis, then count back from the end
        return data.shape[axis] - 1 - fn(data.flip(axis), axis, bool(keepdims))
    return fn(data, axis, bool(keepdims))


def hardmax(input, axis=-1):  # noqa: A002
    # one-hot of the first maximum along the axis (torch's argmax, like NumPy's, takes the first)
    first = torch.argmax(input, axis, keepdim=True)
    return (torch.zeros_like(input).scatter_(axis, first, 1),)


def hardmax_v1(input, axis=1):  # noqa: A002
    flat = input.reshape(math.prod(input.shape[:axis]), -1)  # before opset 13: over the 2-D view
    return (hardmax(flat, -1)[0].reshape(input.shape),)


# -- reductions ------------------------------------------------------------------------------------
def _prod(x, dims, keep):
    for dim in sorted((d % max(x.dim(), 1) for d in dims), reverse=True):
        x = torch.prod(x, dim, keep, dtype=x.dtype) if x.dim() else x
    return x


def _sum_square(x, dims, keep):
    return torch.sum(x * x, dims, keep, dtype=x.dtype)


def _l1(x, dims, keep):
    return torch.sum(torch.abs(x), dims, keep, dtype=x.dtype)


def _l2(x, dims, keep):
    return torch.sqrt(torch.sum(x * x, dims, keep))


def _log_sum(x, dims, keep):
    return torch.log(torch.sum(x, dims, keep))


def _log_sum_exp(x, dims, keep):
    # shifted by the maximum so that exp cannot overflow; an all -inf (or empty) slice gives -inf
    if x.numel() == 0:
        return torch.log(torch.sum(torch.exp(x), dims, keep))
    peak = torch.amax(x, dims, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    total = torch.log(torch.sum(torch.exp(x - peak), dims, keepdim=True)) + peak
    return total if keep or not dims else total.squeeze(tuple(d % x.dim() for d in dims))


def _reductions(fn):
    """The axes-attribute (before opset 18) and axes-input forms of one reduction."""
    return {1: _reduce_v1(fn), 18: _reduce(fn)}


# -- window functions, DFT, STFT -------------------------------------------------------------------
def _cosine_sum(size, coefficients, output_datatype, periodic):
    # w[n] = sum_k (-1)^k a_k cos(2 pi k n / N), N = size when periodic, size - 1 when symmetric;
    # in float64 as in CpuRef, rounded once to the output type
    n = ints(size)[0]
    device = size.device if isinstance(size, torch.Tensor) else None
    phase = 2 * math.pi * torch.arange(n, dtype=torch.float64, device=device) / \
        (n if periodic else n - 1)
    window = sum((-1) ** k * a * torch.cos(k * phase) for k, a in enumerate(coefficients))
    return (window.to(torch_dtype(output_datatype)),)


def hann_window(size, output_datatype=1, periodic=1):
    return _cosine_sum(size, (0.5, 0.5), output_datatype, periodic)


def hamming_window(size, output_datatype=1, periodic=1):
    return _cosine_sum(size, (25 / 46, 21 / 46), output_datatype, periodic)


def blackman_window(size, output_datatype=1, periodic=1):
    return _cosine_sum(size, (0.42, 0.5, 0.08), output_datatype, periodic)


def _complex(x):
    """(..., 1 or 2) real or (real, imaginary) pairs as a real or complex tensor, in float64: the
    transforms are computed there and rounded once at the end. In float32, torch's FFT and
    NumPy's differ by rounding noise (1e-7 where the exact value is 0, the node suite's atol)."""
    x = x.double()
    return x[..., 0] if x.shape[-1] == 1 else torch.complex(x[..., 0], x[..., 1])


def _pairs(z, dtype):
    return torch.view_as_real(z.resolve_conj()).to(dtype)


def dft(input, dft_length=None, axis=None, inverse=0, onesided=0):  # noqa: A002
    axis = (-2 if axis is None else ints(axis)[0]) % input.dim()  # counts the (re, im) axis
    signal = _complex(input)
    if dft_length is not None:
        n = ints(dft_length)[0]
    else:  # a one-sided spectrum of n // 2 + 1 bins comes from n = 2 (bins - 1) samples
        n = 2 * (signal.shape[axis] - 1) if inverse and onesided else signal.shape[axis]
    if inverse and onesided:  # the real signal of a one-sided spectrum
        return (torch.fft.irfft(signal, n, axis)[..., None].to(input.dtype),)
    if inverse:
        return (_pairs(torch.fft.ifft(signal, n, axis), input.dtype),)
    spectrum = torch.fft.fft(signal, n, axis)
    if onesided:
        spectrum = spectrum.narrow(axis, 0, n // 2 + 1)
    return (_pairs(spectrum, input.dtype),)


def dft_v17(input, dft_length=None, axis=1, inverse=0, onesided=0):  # noqa: A002
    return dft(input, dft_length, [axis], inverse, onesided)


def stft(signal, frame_step, window=None, frame_length=None, onesided=1):
    # (B, L, 1 or 2) -> (B, frames, bins, 2): the spectrum of each windowed frame
    x = _complex(signal)  # (B, L)
    if frame_length is not None:
        length = ints(frame_length)[0]
    else:
        length = window.shape[0] if window is not None else x.shape[-1]
    frames = x.unfold(-1, length, ints(frame_step)[0])  # (B, frames, length)
    if window is not None:
        frames = frames * window
    spectrum = torch.fft.fft(frames, dim=-1)
    if onesided:
        spectrum = spectrum[..., :length // 2 + 1]
    return (_pairs(spectrum, signal.dtype),)


# -- casts -----------------------------------------------------------------------------------------
def cast_like(input, target_type, saturate=1, round_mode="up"):  # noqa: A002
    # saturate and round_mode concern float8 alone, which torch kernels do not claim
    return (input.to(target_type.dtype),)


def bit_cast(input, to):  # noqa: A002
    return (input.view(torch_dtype(to)),)


# -- support checks --------------------------------------------------------------------------------
def check_bit_shift(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    direction = layer.attrs.get("direction")
    return None if direction in ("LEFT", "RIGHT") else \
        f"BitShift direction {direction!r} not known (known: 'LEFT', 'RIGHT')"


def check_loss(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    reduction = layer.attrs.get("reduction", "mean")
    known = ("none", "sum", "mean")
    return None if reduction in known else \
        f"{layer.op_type} reduction {reduction!r} not known (known: {', '.join(known)})"


def check_einsum(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if any(info.dtype is not None and info.dtype != inputs[0].dtype for info in inputs):
        return "Einsum of inputs of different types"
    return None


def check_arg(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    shape = inputs[0].shape if inputs else None
    if shape is not None and 0 in shape:
        return f"{layer.op_type} of an empty tensor (torch's argmax / argmin refuse it)"
    return None


def check_cast_like(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if len(inputs) > 1 and inputs[1].dtype is None:
        return "CastLike to an unknown type"
    return None


def check_bit_cast(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    target = onnx_to_numpy_dtype(layer.attrs.get("to", 0))
    source = inputs[0].dtype if inputs else None
    if target is None or target not in TORCH_DTYPES or source is None:
        return f"BitCast from {source} to {target} (no torch type for it)"
    if target == np.dtype(np.bool_):  # any byte but 0 and 1 would be no boolean at all
        return "BitCast to bool"
    if target.itemsize != source.itemsize:
        return f"BitCast from {source} to {target}: the bit widths differ"
    return None


def check_window(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    dtype = onnx_to_numpy_dtype(layer.attrs.get("output_datatype", 1))
    if dtype not in TORCH_DTYPES:
        return f"{layer.op_type} of {dtype} (no torch type for it)"
    return None


def check_spectrum(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    shape = inputs[0].shape if inputs else None
    if shape is not None and isinstance(shape[-1], int) and shape[-1] not in (1, 2):
        return f"{layer.op_type} of a signal whose last axis is {shape[-1]} (1 or 2: real, complex)"
    single = inputs and inputs[0].dtype in (np.dtype(np.float16), np.dtype(np.float32))
    if layer.attrs.get("inverse", 0) and not layer.attrs.get("onesided", 0) and single:
        # NumPy's float32 inverse FFT leaves rounding noise (2e-7 on the node suite's
        # test_dft_inverse, where the exact value is 0 and the suite's atol is 1e-7) that
        # torch's FFT (or this kernel's float64) does not reproduce
        return "inverse DFT of float16 / float32 (NumPy's rounding noise is not reproducible)"
    return None


KERNELS: KernelTable = {
    "IsNaN": {9: is_nan},
    "IsInf": {10: is_inf},
    "Mod": {10: mod},
    "BitShift": {11: bit_shift},
    "BitwiseAnd": {18: bitwise_and},
    "BitwiseOr": {18: bitwise_or},
    "BitwiseXor": {18: bitwise_xor},
    "BitwiseNot": {18: bitwise_not},
    "Celu": {12: celu},
    "Shrink": {9: shrink},
    "Swish": {24: swish},
    "SwiGLU": {28: swi_glu},
    "CumSum": {11: cum_sum},
    "CumProd": {26: cum_prod},
    "Einsum": {12: einsum},
    "Det": {11: det},
    "NegativeLogLikelihoodLoss": {12: negative_log_likelihood_loss},
    "SoftmaxCrossEntropyLoss": {12: softmax_cross_entropy_loss},
    "ArgMax": {1: arg_max},  # select_last_index (opset 12) has a neutral default
    "ArgMin": {1: arg_min},
    "Hardmax": {1: hardmax_v1, 13: hardmax},
    "ReduceProd": _reductions(_prod),
    "ReduceSumSquare": _reductions(_sum_square),
    "ReduceL1": _reductions(_l1),
    "ReduceL2": _reductions(_l2),
    "ReduceLogSum": _reductions(_log_sum),
    "ReduceLogSumExp": _reductions(_log_sum_exp),
    "HannWindow": {17: hann_window},
    "HammingWindow": {17: hamming_window},
    "BlackmanWindow": {17: blackman_window},
    "DFT": {17: dft_v17, 20: dft},
    "STFT": {17: stft},
    "CastLike": {15: cast_like},
    "BitCast": {26: bit_cast},
}

CHECKS = {
    "BitShift": check_bit_shift,
    "Einsum": check_einsum,
    "NegativeLogLikelihoodLoss": check_loss,
    "SoftmaxCrossEntropyLoss": check_loss,
    "ArgMax": check_arg,
    "ArgMin": check_arg,
    "Hardmax": check_arg,
    "CastLike": check_cast_like,
    "BitCast": check_bit_cast,
    "HannWindow": check_window,
    "HammingWindow": check_window,
    "BlackmanWindow": check_window,
    "DFT": check_spectrum,
    "STFT": check_spectrum,
}

_FLOAT_OPS = ("IsNaN", "IsInf", "Celu", "Shrink", "Swish", "SwiGLU", "Einsum", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "Hardmax", "DFT", "STFT",
              "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss")
INPUT_DTYPES = {
    **{op: FLOATS for op in _FLOAT_OPS},
    **{op: INTEGERS for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot")},
    **{op: NUMBERS for op in ("Mod", "CumSum", "CumProd", "ArgMax", "ArgMin", "ReduceProd",
                              "ReduceSumSquare", "ReduceL1")},
    "BitShift": INTEGERS,  # signed since opset 28; NumPy and torch agree on every shift
    "Det": frozenset(np.dtype(t) for t in (np.float32, np.float64)),  # torch.linalg: no float16
}
"""Per op, the element types its first input may have (other inputs follow ONNX's type rules)."""
