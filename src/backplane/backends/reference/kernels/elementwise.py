"""Elementwise ops: unary and binary math, comparisons, logic, Where, Clip and activations.

NumPy 2 keeps an array's dtype when it meets a Python scalar, so constants here are Python floats
(``math.pi``, not ``np.pi``) and attribute values arrive as Python floats: float32 stays float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo


def _unary(fn: Any) -> Any:
    """A kernel applying a NumPy ufunc that keeps the dtype (Abs, Exp, Sin, ...)."""
    def kernel(X):
        return (fn(X),)
    kernel.__name__ = fn.__name__
    return kernel


# -- arithmetic --------------------------------------------------------------------------------
def add(A, B):
    return (np.add(A, B),)


def sub(A, B):
    return (np.subtract(A, B),)


def mul(A, B):
    return (np.multiply(A, B),)


def div(A, B):
    if np.issubdtype(np.result_type(A, B), np.integer):
        return (_truncated_divide(A, B),)
    return (np.divide(A, B),)


def _truncated_divide(a, b):
    # ONNX integer division truncates toward zero (C semantics); floor_divide rounds down.
    quotient = np.floor_divide(a, b)
    inexact = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return (quotient + inexact).astype(quotient.dtype)


def pow_(X, Y):
    return (np.power(X, Y).astype(X.dtype),)


def mod(A, B, fmod=0):
    # fmod=0 takes the sign of the divisor (Python's %), fmod=1 the sign of the dividend (C fmod).
    return (np.fmod(A, B) if fmod else np.mod(A, B),)


def neg(X):
    return (np.negative(X),)


def reciprocal(X):
    return (np.reciprocal(X),)


def erf(input):
    if input.dtype == np.float64:  # math.erf per element: slow, exact to the last bit
        return (np.frompyfunc(math.erf, 1, 1)(input).astype(input.dtype),)
    return (_erf_float32(input.astype(np.float32)).astype(input.dtype),)


# erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2), z >= 0: Numerical Recipes' Chebyshev fit, relative
# error below 1.2e-7 everywhere (two float32 ulps). Near 0, where erf is small and that bound is not
# relative to it, the Maclaurin series is used instead.
_ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
                -1.13520398, 1.48851587, -0.82215223, 0.17087277)
_ERF_SERIES = tuple((-1) ** n / (math.factorial(n) * (2 * n + 1)) for n in range(8))


def _horner(x: np.ndarray, coeffs: Sequence[float]) -> np.ndarray:
    result = np.full_like(x, coeffs[-1])
    for c in coeffs[-2::-1]:
        result *= x
        result += np.float32(c)
    return result


def _erf_float32(x: np.ndarray) -> np.ndarray:
    z = np.abs(x)
    t = np.float32(1) / (np.float32(1) + np.float32(0.5) * z)
    exponent = _horner(t, _ERFC_COEFFS)
    exponent -= z * z
    result = np.float32(1) - t * np.exp(exponent)
    np.copysign(result, x, out=result)
    series = _horner(x * x, _ERF_SERIES)
    series *= x
    series *= np.float32(2 / math.sqrt(math.pi))
    np.copyto(result, series, where=z < 0.5)
    return result


def sum_(*data_0):
    return (functools.reduce(np.add, data_0),)


def mean(*data_0):
    return ((functools.reduce(np.add, data_0) / len(data_0)).astype(data_0[0].dtype),)


def max_(*data_0):
    return (functools.reduce(np.maximum, data_0),)


def min_(*data_0):
    return (functools.reduce(np.minimum, data_0),)


def clip_v6(input, max=3.4028234663852886e38, min=-3.4028234663852886e38):  # noqa: A002
    return (np.clip(input, min, max).astype(input.dtype),)


def clip(input, min=None, max=None):  # noqa: A002
    output = input if min is None else np.maximum(input, min)
    output = output if max is None else np.minimum(output, max)
    return (output.astype(input.dtype),)


def bit_shift(X, Y, direction):
    return (np.left_shift(X, Y) if direction == "LEFT" else np.right_shift(X, Y),)


def bitwise_and(A, B):
    return (np.bitwise_and(A, B),)


def bitwise_or(A, B):
    return (np.bitwise_or(A, B),)


def bitwise_xor(A, B):
    return (np.bitwise_xor(A, B),)


def is_nan(X):
    return (np.isnan(X),)


def is_inf(X, detect_negative=1, detect_positive=1):
    return ((np.isneginf(X) & bool(detect_negative)) | (np.isposinf(X) & bool(detect_positive)),)


# -- comparisons and logic ---------------------------------------------------------------------
def equal(A, B):
    return (np.asarray(A == B, dtype=bool),)


def less(A, B):
    return (np.less(A, B),)


def less_or_equal(A, B):
    return (np.less_equal(A, B),)


def greater(A, B):
    return (np.greater(A, B),)


def greater_or_equal(A, B):
    return (np.greater_equal(A, B),)


def not_(X):
    return (np.logical_not(X),)


def and_(A, B):
    return (np.logical_and(A, B),)


def or_(A, B):
    return (np.logical_or(A, B),)


def xor(A, B):
    return (np.logical_xor(A, B),)


def string_concat(X, Y):
    return (np.asarray(X + Y, dtype=object),)  # object arrays of str add elementwise


def where(condition, X, Y):
    return (np.where(condition, X, Y),)


# -- activations -------------------------------------------------------------------------------
def relu(X):
    return (np.maximum(X, 0).astype(X.dtype),)


def leaky_relu(X, alpha=0.01):
    return (np.where(X < 0, X * alpha, X).astype(X.dtype),)


def prelu(X, slope):
    return (np.where(X < 0, X * slope, X).astype(X.dtype),)


def thresholded_relu(X, alpha=1.0):
    return (np.where(X > alpha, X, 0).astype(X.dtype),)


def elu(X, alpha=1.0):
    return (np.where(X < 0, alpha * np.expm1(X), X).astype(X.dtype),)


def selu(X, alpha=1.6732632423543772, gamma=1.0507009873554805):
    return ((gamma * np.where(X <= 0, alpha * np.expm1(X), X)).astype(X.dtype),)


def celu(X, alpha=1.0):
    return ((np.maximum(X, 0) + np.minimum(0, alpha * np.expm1(X / alpha))).astype(X.dtype),)


def sigmoid(X):
    result = np.negative(X)
    np.exp(result, out=result)
    result += 1
    return (np.reciprocal(result, out=result),)


def hard_sigmoid(X, alpha=0.2, beta=0.5):
    return (np.clip(X * alpha + beta, 0, 1).astype(X.dtype),)


def hard_swish(X):
    return (X * np.clip(X / 6 + 0.5, 0, 1).astype(X.dtype),)


def swish(X, alpha=1.0):
    return (X / (1 + np.exp(-alpha * X)),)


def softplus(X):
    return (np.logaddexp(0, X).astype(X.dtype),)


def softsign(X):
    return (X / (1 + np.abs(X)),)


def mish(X):
    return ((X * np.tanh(np.logaddexp(0, X))).astype(X.dtype),)


def gelu(X, approximate="none"):
    if approximate == "tanh":
        inner = math.sqrt(2 / math.pi) * (X + 0.044715 * X**3)
        return ((0.5 * X * (1 + np.tanh(inner))).astype(X.dtype),)
    return ((0.5 * X * (1 + erf(X / math.sqrt(2))[0])).astype(X.dtype),)


def swi_glu(A, B, alpha=1.0):
    # Swish(A) = A * sigmoid(alpha * A), the sigmoid rounded to A's type first, gates B.
    gate = (1 / (1 + np.exp(-alpha * A))).astype(A.dtype)
    return ((A * gate * B).astype(A.dtype),)


def shrink(input, bias=0.0, lambd=0.5):  # noqa: A002
    output = np.where(input < -lambd, input + bias, np.where(input > lambd, input - bias, 0))
    return (output.astype(input.dtype),)


def check_gelu(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    approximate = layer.attrs.get("approximate", "none")
    return None if approximate in ("none", "tanh") else f"Gelu approximate={approximate!r} not known"


KERNELS: KernelTable = {
    # arithmetic
    "Add": {7: add},
    "Sub": {7: sub},
    "Mul": {7: mul},
    "Div": {7: div},
    "Pow": {7: pow_},
    "Mod": {10: mod},
    "Neg": {6: neg},
    "Abs": {6: _unary(np.abs)},
    "Reciprocal": {6: reciprocal},
    "Sqrt": {6: _unary(np.sqrt)},
    "Exp": {6: _unary(np.exp)},
    "Log": {6: _unary(np.log)},
    "Floor": {6: _unary(np.floor)},
    "Ceil": {6: _unary(np.ceil)},
    "Round": {11: _unary(np.round)},  # both round half to even
    "Sign": {9: _unary(np.sign)},
    "Erf": {9: erf},
    "Sin": {7: _unary(np.sin)},
    "Cos": {7: _unary(np.cos)},
    "Tan": {7: _unary(np.tan)},
    "Asin": {7: _unary(np.arcsin)},
    "Acos": {7: _unary(np.arccos)},
    "Atan": {7: _unary(np.arctan)},
    "Sinh": {9: _unary(np.sinh)},
    "Cosh": {9: _unary(np.cosh)},
    "Tanh": {6: _unary(np.tanh)},
    "Asinh": {9: _unary(np.arcsinh)},
    "Acosh": {9: _unary(np.arccosh)},
    "Atanh": {9: _unary(np.arctanh)},
    "Sum": {6: sum_},  # opset 6-7 do not broadcast; NumPy's broadcasting is a superset
    "Mean": {6: mean},
    "Max": {6: max_},
    "Min": {6: min_},
    "Clip": {6: clip_v6, 11: clip},
    "BitShift": {11: bit_shift},
    "BitwiseAnd": {18: bitwise_and},
    "BitwiseOr": {18: bitwise_or},
    "BitwiseXor": {18: bitwise_xor},
    "BitwiseNot": {18: _unary(np.bitwise_not)},
    "IsNaN": {9: is_nan},
    "IsInf": {10: is_inf},
    # comparisons and logic
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
    "StringConcat": {20: string_concat},
    # activations
    "Relu": {6: relu},
    "LeakyRelu": {6: leaky_relu},
    "PRelu": {7: prelu},
    "ThresholdedRelu": {10: thresholded_relu},
    "Elu": {6: elu},
    "Selu": {6: selu},
    "Celu": {12: celu},
    "Sigmoid": {6: sigmoid},
    "HardSigmoid": {6: hard_sigmoid},
    "HardSwish": {14: hard_swish},
    "Swish": {24: swish},
    "Softplus": {1: softplus},
    "Softsign": {1: softsign},
    "Mish": {18: mish},
    "Gelu": {20: gelu},
    "Shrink": {9: shrink},
    "SwiGLU": {28: swi_glu},
}

CHECKS = {"Gelu": check_gelu}

# ml_dtypes' bfloat16 computes like NumPy's float16: each ufunc works in float32 and rounds its
# result to the type, as the spec's reference does. These kernels are such ufuncs (or selections)
# and are right for every type their schema allows; the others keep to NumPy's types.
ANY_DTYPE = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Sqrt", "Exp", "Where", "Equal",
                       "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Elu", "Celu"})
