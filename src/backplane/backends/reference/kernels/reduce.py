"""Reductions: Reduce*, ArgMax / ArgMin, Softmax / LogSoftmax / Hardmax, CumSum / CumProd.

The Reduce* ops took their axes as an attribute until opset 13 (ReduceSum) or 18 (the others), and
as an optional second input after; each gets one kernel per form, built from one NumPy reducer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from backplane.backends.api.kernels import Kernel, KernelTable
from backplane.backends.reference.kernels.cast import is_integer

Reducer = Callable[[np.ndarray, tuple[int, ...]], np.ndarray]  # keepdims=True result


def _reduce(reducer: Reducer, data, axes, keepdims, noop_with_empty_axes=0):
    if axes is None or len(axes) == 0:
        if noop_with_empty_axes:
            return data
        axes = tuple(range(data.ndim))  # all of them, in order (np.ravel of a range: an array)
    else:
        axes = tuple(sorted(int(a) % data.ndim for a in np.ravel(axes))) if data.ndim else ()
    result = reducer(data, axes)
    return result if keepdims else result.squeeze(axis=axes)


def _reduce_kernels(reducer: Reducer, name: str) -> tuple[Kernel, Kernel]:
    """The attribute-axes and input-axes kernels of one Reduce op."""
    def with_axes_attribute(data, axes=None, keepdims=1):
        return (_reduce(reducer, data, axes, keepdims),)

    def with_axes_input(data, axes=None, keepdims=1, noop_with_empty_axes=0):
        return (_reduce(reducer, data, axes, keepdims, noop_with_empty_axes),)

    with_axes_attribute.__name__ = f"{name}_v1"
    with_axes_input.__name__ = name
    return with_axes_attribute, with_axes_input


def _identity_of_max(dtype: np.dtype):  # the value an empty ReduceMax gives
    return False if dtype.kind == "b" else (np.iinfo(dtype).min if is_integer(dtype) else -np.inf)


def _identity_of_min(dtype: np.dtype):
    return True if dtype.kind == "b" else (np.iinfo(dtype).max if is_integer(dtype) else np.inf)


def _max(x, axes):
    if x.size:  # the ufunc's reduction itself: np.max's wrapper and initial cost 3x on 16 values
        return np.maximum.reduce(x, axis=axes, keepdims=True)
    return np.max(x, axis=axes, keepdims=True, initial=_identity_of_max(x.dtype))


def _min(x, axes):
    if x.size:
        return np.minimum.reduce(x, axis=axes, keepdims=True)
    return np.min(x, axis=axes, keepdims=True, initial=_identity_of_min(x.dtype))


def _sum(x, axes):
    return np.sum(x, axis=axes, keepdims=True, dtype=x.dtype)


def _mean(x, axes):
    count = math.prod(map(x.shape.__getitem__, axes))  # no generator's frames (per call)
    if x.dtype.kind != "f" or not count:  # integers truncate; empty: NaN
        return np.mean(x, axis=axes, keepdims=True, dtype=x.dtype)
    # np.mean's own arithmetic for floats (a sum in the type, divided by the count) without its
    # Python wrapper, which cost as much again on a few values (7.6 against 4.1 us on 2 x 16)
    return np.add.reduce(x, axis=axes, keepdims=True, dtype=x.dtype) / count


def _prod(x, axes):
    return np.prod(x, axis=axes, keepdims=True, dtype=x.dtype)


def _sum_square(x, axes):
    return _sum(x * x, axes)


def _l1(x, axes):
    return _sum(np.abs(x), axes)


def _l2(x, axes):
    return np.sqrt(_sum(x * x, axes)).astype(x.dtype)


def _log_sum(x, axes):
    return np.log(_sum(x, axes))


def _log_sum_exp(x, axes):
    # Shift by the maximum so exp cannot overflow; an all -inf (or empty) slice gives -inf.
    peak = _max(x, axes)
    peak = np.where(np.isfinite(peak), peak, 0)
    return (np.log(_sum(np.exp(x - peak), axes)) + peak).astype(x.dtype)


reduce_sum_v1, reduce_sum = _reduce_kernels(_sum, "reduce_sum")
reduce_mean_v1, reduce_mean = _reduce_kernels(_mean, "reduce_mean")
reduce_max_v1, reduce_max = _reduce_kernels(_max, "reduce_max")
reduce_min_v1, reduce_min = _reduce_kernels(_min, "reduce_min")
reduce_prod_v1, reduce_prod = _reduce_kernels(_prod, "reduce_prod")
reduce_sum_square_v1, reduce_sum_square = _reduce_kernels(_sum_square, "reduce_sum_square")
reduce_l1_v1, reduce_l1 = _reduce_kernels(_l1, "reduce_l1")
reduce_l2_v1, reduce_l2 = _reduce_kernels(_l2, "reduce_l2")
reduce_log_sum_v1, reduce_log_sum = _reduce_kernels(_log_sum, "reduce_log_sum")
reduce_log_sum_exp_v1, reduce_log_sum_exp = _reduce_kernels(_log_sum_exp, "reduce_log_sum_exp")


# -- ArgMax / ArgMin ---------------------------------------------------------------------------
def arg_max(data, axis=0, keepdims=1, select_last_index=0):
    return (_arg(np.argmax, data, axis, keepdims, select_last_index),)


def arg_min(data, axis=0, keepdims=1, select_last_index=0):
    return (_arg(np.argmin, data, axis, keepdims, select_last_index),)


def _arg(fn, data, axis, keepdims, select_last_index):
    if select_last_index:  # search the reversed axis, then count back from the end
        flipped = fn(np.flip(data, axis), axis=axis, keepdims=bool(keepdims))
        return (data.shape[axis] - 1 - flipped).astype(np.int64)
    return fn(data, axis=axis, keepdims=bool(keepdims)).astype(np.int64)


# -- Softmax family ----------------------------------------------------------------------------
# An empty input has nothing to normalize: its empty result, as ONNX Runtime gives (np.max of an
# empty axis raises).
def softmax(input, axis=-1):  # noqa: A002
    if input.size == 0:
        return (np.empty_like(input),)
    shifted = input - np.max(input, axis=axis, keepdims=True)
    np.exp(shifted, out=shifted)
    shifted /= np.sum(shifted, axis=axis, keepdims=True)
    return (shifted,)


def log_softmax(input, axis=-1):  # noqa: A002
    if input.size == 0:
        return (np.empty_like(input),)
    shifted = input - np.max(input, axis=axis, keepdims=True)
    return (shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True)),)


def hardmax(input, axis=-1):  # noqa: A002
    # One-hot of the first maximum along the axis.
    if input.size == 0:
        return (np.empty_like(input),)
    first = np.argmax(input, axis=axis, keepdims=True)
    index = np.arange(input.shape[axis]).reshape([-1 if d == axis % input.ndim else 1
                                                  for d in range(input.ndim)])
    return ((index == first).astype(input.dtype),)


def _as_2d(op: Kernel, name: str) -> Kernel:
    """Opsets 1-12: the input is coerced to 2-D at ``axis`` and the op runs on the last axis."""
    def kernel(input, axis=1):  # noqa: A002
        flat = input.reshape(int(np.prod(input.shape[:axis])), -1)
        return (op(flat, axis=-1)[0].reshape(input.shape),)
    kernel.__name__ = name
    return kernel


softmax_v1 = _as_2d(softmax, "softmax_v1")
log_softmax_v1 = _as_2d(log_softmax, "log_softmax_v1")
hardmax_v1 = _as_2d(hardmax, "hardmax_v1")


# -- cumulative --------------------------------------------------------------------------------
def cum_sum(x, axis, exclusive=0, reverse=0):
    return (_cumulative(np.cumsum, np.add, x, axis, exclusive, reverse),)


def cum_prod(x, axis, exclusive=0, reverse=0):
    return (_cumulative(np.cumprod, np.multiply, x, axis, exclusive, reverse),)


def _cumulative(scan, ufunc, x, axis, exclusive, reverse):
    axis = int(np.ravel(axis)[0])
    data = np.flip(x, axis) if reverse else x
    result = scan(data, axis=axis, dtype=x.dtype)
    if exclusive:  # shift by one along the axis, starting from the ufunc's identity
        result = np.roll(result, 1, axis=axis)
        first = [slice(None)] * x.ndim
        first[axis] = slice(0, 1)
        result[tuple(first)] = ufunc.identity
    return np.flip(result, axis) if reverse else result


KERNELS: KernelTable = {
    "ReduceSum": {1: reduce_sum_v1, 13: reduce_sum},
    "ReduceMean": {1: reduce_mean_v1, 18: reduce_mean},
    "ReduceMax": {1: reduce_max_v1, 18: reduce_max},
    "ReduceMin": {1: reduce_min_v1, 18: reduce_min},
    "ReduceProd": {1: reduce_prod_v1, 18: reduce_prod},
    "ReduceSumSquare": {1: reduce_sum_square_v1, 18: reduce_sum_square},
    "ReduceL1": {1: reduce_l1_v1, 18: reduce_l1},
    "ReduceL2": {1: reduce_l2_v1, 18: reduce_l2},
    "ReduceLogSum": {1: reduce_log_sum_v1, 18: reduce_log_sum},
    "ReduceLogSumExp": {1: reduce_log_sum_exp_v1, 18: reduce_log_sum_exp},
    "ArgMax": {1: arg_max},  # select_last_index (opset 12) is an attribute with a neutral default
    "ArgMin": {1: arg_min},
    "Softmax": {1: softmax_v1, 13: softmax},
    "LogSoftmax": {1: log_softmax_v1, 13: log_softmax},
    "Hardmax": {1: hardmax_v1, 13: hardmax},
    "CumSum": {11: cum_sum},
    "CumProd": {26: cum_prod},
}

# Extrema select; Softmax is ufuncs, where bfloat16 rounds at each step as float16 does.
ANY_DTYPE = frozenset({"ReduceMax", "ReduceMin", "Softmax"})
