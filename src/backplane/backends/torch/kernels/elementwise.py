"""Elementwise torch kernels: arithmetic, math, comparisons, logic, Where, Cast, Clip, activations.

ONNX broadcasting is NumPy's, which is torch's. ONNX keeps the input dtype where torch might promote
(Pow of an int by a float, integer Div), so those kernels cast back or pick the rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from backplane.backends.api.kernels import KernelTable
from backplane.backends.torch.kernels.common import (
    FLOATS,
    NUMPY_TO_TORCH,
    NUMBERS,
    SIGNED,
    TORCH_DTYPES,
    in_range,
    scalar,
    torch_dtype,
)
from backplane.backends.torch.kernels import common
from backplane.frontends.onnx_types import onnx_to_numpy_dtype
from backplane.ir.graph import Layer, TensorInfo


def _unary(fn):
    def kernel(X):
        return (fn(X),)
    kernel.__name__ = fn.__name__
    return kernel


_TRACING = torch._C._is_tracing  # one C call (torch.jit.is_tracing wraps it)


def _traced_scalar(A, B):
    """``B`` as a 1-d constant of one value where it is a 0-d float constant of ``A``'s type that
    a trace without oneDNN Graph's fuser (a ``Traced`` layer) reads after ``A``, a tensor of some
    rank, in an Add, Sub, Mul or Div: TorchScript's interpreter copies such a 0-d constant at every
    call (aten::to: a detector's ``sigmoid * 2 - 0.5``), and reads a 1-d one as it is (the frozen
    trace folds the reshape into a constant of shape (1,)). The same values and the same result
    shape, as ``A`` has a rank; any other ``B`` (a computed 0-d value: no copy) as it is."""
    if B.dim() or not A.dim() or B.dtype != A.dtype or not A.dtype.is_floating_point \
            or A.device.type != "cpu" or B.device.type != "cpu" \
            or torch.jit.onednn_fusion_enabled():
        return B
    try:
        constant = torch._C._get_value_trace(B).node().kind() == "prim::Constant"
    except Exception:  # noqa: BLE001  # not a traced value: left as it is
        return B
    return B.reshape(1) if constant else B


def add(A, B):
    if _TRACING():
        B = _traced_scalar(A, B)
    return (torch.add(A, B),)


def sub(A, B):
    if _TRACING():
        B = _traced_scalar(A, B)
    return (torch.sub(A, B),)


def mul(A, B):
    if _TRACING():
        B = _traced_scalar(A, B)
    return (torch.mul(A, B),)


def div(A, B):
    if A.dtype.is_floating_point:
        if _TRACING():
            B = _traced_scalar(A, B)
        return (torch.div(A, B),)
    # ONNX integer division truncates. By zero it is 0, as in CpuRef (NumPy), where torch's CPU
    # kernel would raise ZeroDivisionError and fail the whole run; no data-dependent branch, so
    # that the kernel stays capturable in a CUDA graph.
    # The most negative integer by -1 overflows: x86 traps (SIGFPE kills the process) where NumPy
    # wraps to the same most negative integer; -A wraps the same way.
    zero = B == 0
    if not A.dtype.is_signed:  # (uint8's 255 == -1 in torch's comparison)
        quotient = torch.div(A, B.masked_fill(zero, 1), rounding_mode="trunc")
        return (quotient.masked_fill_(zero, 0),)
    minus_one = B == -1
    quotient = torch.div(A, B.masked_fill(zero | minus_one, 1), rounding_mode="trunc")
    quotient = torch.where(minus_one, torch.neg(A), quotient)
    return (quotient.masked_fill_(zero, 0),)


_NUMPY_PROMOTED = {(NUMPY_TO_TORCH[a], NUMPY_TO_TORCH[b]): NUMPY_TO_TORCH[np.result_type(a, b)]
                   for a in NUMBERS for b in NUMBERS if np.result_type(a, b) in NUMPY_TO_TORCH}
"""(X's type, Y's type) -> the type NumPy computes X ** Y in."""


def pow_(X, Y):
    if not X.dtype.is_floating_point:
        # NumPy (CpuRef) computes an integer to a float power in the type both promote to
        # (int32 ** float32 in float64) and truncates back; integer powers wrap alike in both
        wide = _NUMPY_PROMOTED.get((X.dtype, Y.dtype), X.dtype)
        return (torch.pow(X.to(wide), Y.to(wide)).to(X.dtype),)
    if Y.dtype.is_floating_point and Y.dtype != X.dtype:
        # In torch a 0-d tensor does not widen the other's type (a 0-d float32 X to a float16 Y
        # is computed in float16: 4 ** 8 overflows); CpuRef computes in the wider type.
        wide = torch.promote_types(X.dtype, Y.dtype)
        return (torch.pow(X.to(wide), Y.to(wide)).to(X.dtype),)
    return (torch.pow(X, Y).to(X.dtype),)


def sign(input):  # noqa: A002
    if input.dtype.is_floating_point:  # torch's sign of NaN is 0; NumPy's (and the spec's) is NaN
        return (torch.where(torch.isnan(input), input, torch.sign(input)),)
    return (torch.sign(input),)


def erf(input):  # noqa: A002
    return (torch.erf(input),)


def sum_(*data_0):
    return (functools.reduce(torch.add, data_0),)


def mean(*data_0):
    return (functools.reduce(torch.add, data_0) / len(data_0),)


def max_(*data_0):
    return (functools.reduce(torch.maximum, data_0),)


def min_(*data_0):
    return (functools.reduce(torch.minimum, data_0),)


def clip_v6(input, max=3.4028234663852886e38, min=-3.4028234663852886e38):  # noqa: A002
    # The default bounds (float32's largest) overflow float16, which torch.clamp refuses: bounds
    # are rounded to the input's type first, as NumPy does (past its range: an infinity).
    return (common.clamp(input, in_range(min, input.dtype), in_range(max, input.dtype)),)


def clip(input, min=None, max=None):  # noqa: A002
    low = None if min is None else scalar(min)
    high = None if max is None else scalar(max)
    if low is None and high is None:
        return (input.clone(),)
    return (common.clamp(input, low, high),)


def equal(A, B):
    return (torch.eq(A, B),)


def less(A, B):
    return (torch.lt(A, B),)


def less_or_equal(A, B):
    return (torch.le(A, B),)


def greater(A, B):
    return (torch.gt(A, B),)


def greater_or_equal(A, B):
    return (torch.ge(A, B),)


def not_(X):
    return (torch.logical_not(X),)


def and_(A, B):
    return (torch.logical_and(A, B),)


def or_(A, B):
    return (torch.logical_or(A, B),)


def xor(A, B):
    return (torch.logical_xor(A, B),)


def where(condition, X, Y):
    return (torch.where(condition, X, Y),)


def cast(input, to, saturate=1):  # noqa: A002
    return (input.to(torch_dtype(to)),)


def relu(X):
    return (common.relu(X),)


def leaky_relu(X, alpha=0.01):
    # alpha 0 is ReLU, and oneDNN Graph computes it as one (relu keeps NaN there)
    return (common.relu(X) if alpha == 0 else F.leaky_relu(X, alpha),)


def prelu(X, slope):
    return (torch.where(X < 0, X * slope, X),)


def elu(X, alpha=1.0):
    return (F.elu(X, alpha),)


def selu(X, alpha=1.6732632423543772, gamma=1.0507009873554805):
    return (gamma * torch.where(X > 0, X, alpha * torch.expm1(X)),)


def sigmoid(X):
    return (torch.sigmoid(X),)


def hard_sigmoid(X, alpha=0.2, beta=0.5):
    # torch's own (one kernel instead of three) where its 1/6 for ONNX's float32 alpha is below the
    # type's precision: not for float64 (alpha differs by 3e-8, and CUDA's kernel computes in float)
    if abs(alpha - 1 / 6) < 1e-7 and beta == 0.5 and X.dtype != torch.float64:
        return (F.hardsigmoid(X),)
    return (common.clamp(X * alpha + beta, 0.0, 1.0),)


def hard_swish(X):
    if X.dtype == torch.float64:  # torch's CUDA hardswish loses float64's precision (3e-8 off at 1)
        return (X * torch.clamp(X / 6 + 0.5, 0.0, 1.0),)
    return (F.hardswish(X),)


def softplus(X):
    # log(1 + exp(x)); torch's softplus returns x itself past 20, where exp would overflow (to an
    # infinity from 88.7 in float32, 11.1 in float16) and log1p(exp(x)) rounds to x anyway.
    return (F.softplus(X),)


def softsign(X):
    return (X / (1 + torch.abs(X)),)


def mish(X):
    return (F.mish(X),)


def gelu(X, approximate="none"):
    return (common.gelu(X, approximate),)


def thresholded_relu(X, alpha=1.0):
    return (torch.where(X > alpha, X, torch.zeros_like(X)),)


def check_cast(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    to = layer.attrs.get("to")
    dtype = onnx_to_numpy_dtype(to) if isinstance(to, int) else None
    if dtype is None or dtype not in TORCH_DTYPES:
        name = dtype.name if dtype is not None else f"ONNX type {to}"
        return f"Cast to {name} (no torch type for it)"
    return None


def check_gelu(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    approximate = layer.attrs.get("approximate", "none")
    return None if approximate in ("none", "tanh") else f"Gelu approximate={approximate!r} not known"


KERNELS: KernelTable = {
    "Add": {7: add},
    "Sub": {7: sub},
    "Mul": {7: mul},
    "Div": {7: div},
    "Pow": {7: pow_},
    "Neg": {6: _unary(torch.neg)},
    "Abs": {6: _unary(torch.abs)},
    "Reciprocal": {6: _unary(torch.reciprocal)},
    "Sqrt": {6: _unary(torch.sqrt)},
    "Exp": {6: _unary(torch.exp)},
    "Log": {6: _unary(torch.log)},
    "Floor": {6: _unary(torch.floor)},
    "Ceil": {6: _unary(torch.ceil)},
    "Round": {11: _unary(torch.round)},  # both round half to even
    "Sign": {9: sign},
    "Erf": {9: erf},
    "Sin": {7: _unary(torch.sin)},
    "Cos": {7: _unary(torch.cos)},
    "Tan": {7: _unary(torch.tan)},
    "Asin": {7: _unary(torch.asin)},
    "Acos": {7: _unary(torch.acos)},
    "Atan": {7: _unary(torch.atan)},
    "Sinh": {9: _unary(torch.sinh)},
    "Cosh": {9: _unary(torch.cosh)},
    "Tanh": {6: _unary(torch.tanh)},
    "Asinh": {9: _unary(torch.asinh)},
    "Acosh": {9: _unary(torch.acosh)},
    "Atanh": {9: _unary(torch.atanh)},
    "Sum": {6: sum_},
    "Mean": {6: mean},
    "Max": {6: max_},
    "Min": {6: min_},
    "Clip": {6: clip_v6, 11: clip},
    "Equal": {7: equal},
    "Less": {7: less},
    "LessOrEqual": {12: less_or_equal},
    "Greater": {7: greater},
    "GreaterOrEqual": {12: greater_or_equal},
    "Not": {1: not_},
    "And": {7: and_},
    "Or": {7: or_},
    "Xor": {7: xor},
    "Where": {9: where},
    "Cast": {6: cast},
    "Relu": {6: relu},
    "LeakyRelu": {6: leaky_relu},
    "PRelu": {7: prelu},
    "Elu": {6: elu},
    "Selu": {6: selu},
    "Sigmoid": {6: sigmoid},
    "HardSigmoid": {6: hard_sigmoid},
    "HardSwish": {14: hard_swish},
    "Softplus": {1: softplus},
    "Softsign": {1: softsign},
    "Mish": {18: mish},
    "Gelu": {20: gelu},
    "ThresholdedRelu": {10: thresholded_relu},
}

_FLOAT_OPS = ("Reciprocal", "Sqrt", "Exp", "Log", "Floor", "Ceil", "Round", "Erf", "Sin", "Cos",
              "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Tanh", "Asinh", "Acosh", "Atanh",
              "Mean", "LeakyRelu", "PRelu", "Elu", "Selu", "Sigmoid", "HardSigmoid", "HardSwish",
              "Softplus", "Softsign", "Mish", "Gelu", "ThresholdedRelu")
INPUT_DTYPES = {
    **{op: FLOATS for op in _FLOAT_OPS},
    **{op: NUMBERS for op in ("Add", "Sub", "Mul", "Div", "Abs", "Sum", "Max", "Min", "Clip",
                              "Relu", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")},
    "Neg": FLOATS | SIGNED,
    "Sign": FLOATS | SIGNED,
    "Pow": NUMBERS,
}
"""Per op, the element types its first input may have (other inputs follow ONNX's type rules)."""

CHECKS = {"Cast": check_cast, "Gelu": check_gelu}
"""Refusals the attributes decide (the output's type may not be known to the support check)."""
