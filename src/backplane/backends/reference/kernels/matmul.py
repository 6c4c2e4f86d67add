"""Matrix products (MatMul, Gemm, MatMulInteger, QLinearMatMul, Einsum) through BLAS, and Det."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from backplane.backends.api.kernels import KernelTable

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def mat_mul(A, B):
    # 1-D @ 1-D gives a NumPy scalar; ml_dtypes' bfloat16 gives float32.
    return (np.asarray(np.matmul(A, B)).astype(A.dtype, copy=False),)


def gemm(A, B, C=None, alpha=1.0, beta=1.0, transA=0, transB=0):  # noqa: N803
    a = A.T if transA else A
    b = B.T if transB else B
    y = np.matmul(a, b)
    if y.dtype.kind == "f" and y.dtype == A.dtype and (C is None or C.dtype == y.dtype):
        # a new array of A's type: scaled and added to in place, where two more arrays were made
        # (y + C, then astype's copy; a Loop body's Gemms run per iteration)
        if alpha != 1.0:
            y *= alpha
        if C is not None:
            y += beta * C if beta != 1.0 else C
        return (y,)
    y = alpha * y if alpha != 1.0 else y  # integers: alpha and beta in floats, as before
    if C is not None:
        y = y + (beta * C if beta != 1.0 else C)
    return (y.astype(A.dtype),)


def mat_mul_integer(A, B, a_zero_point=None, b_zero_point=None):
    # A's zero point is per row (M), B's per column (N): rows broadcast down, columns across.
    a = A.astype(np.int32) - _zero(a_zero_point).reshape(-1, 1)
    b = B.astype(np.int32) - _zero(b_zero_point)
    return (np.matmul(a, b).astype(np.int32),)


def _zero(zero_point):
    return np.zeros(1, np.int32) if zero_point is None else np.asarray(zero_point, np.int32)


def q_linear_mat_mul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point):
    # Integer product of the centred operands, rescaled, rounded half to even and saturated.
    product = np.matmul(a.astype(np.int32) - a_zero_point.astype(np.int32).reshape(-1, 1),
                        b.astype(np.int32) - b_zero_point.astype(np.int32))
    scaled = product * (a_scale.astype(np.float32) * b_scale.astype(np.float32)
                        / y_scale.astype(np.float32))
    rounded = np.rint(scaled) + y_zero_point.astype(np.int32)
    info = np.iinfo(y_zero_point.dtype)
    return (np.clip(rounded, info.min, info.max).astype(y_zero_point.dtype),)


def det(X):
    return (np.asarray(np.linalg.det(X)).astype(X.dtype),)


def einsum(*Inputs, equation):  # noqa: N803
    dtype = Inputs[0].dtype
    if dtype == BFLOAT16:  # np.einsum has no bfloat16 loops: accumulate in float32, round once
        return (np.asarray(np.einsum(equation, *(x.astype(np.float32) for x in Inputs))).astype(dtype),)
    return (np.asarray(np.einsum(equation, *Inputs)),)


KERNELS: KernelTable = {
    "MatMul": {1: mat_mul},
    "Gemm": {7: gemm},  # opsets 1-6 carry a legacy broadcast attribute
    "MatMulInteger": {10: mat_mul_integer},
    "QLinearMatMul": {10: q_linear_mat_mul},
    "Einsum": {12: einsum},
    "Det": {11: det},
}

# BLAS has no bfloat16: MatMul's product comes back in float32 and is rounded once, as Einsum's.
ANY_DTYPE = frozenset({"MatMul", "Einsum"})
