"""CpuRef's kernels that write their output into memory they are given (a workload's
``write_into``): NumPy's ``out=`` on the ops whose kernel is one ufunc (or a few, in place), for the
element types where that computes what the kernel in KERNELS computes. The runtime gives them the
caller's buffer of an output (IOBinding, ``runtime/user_buffers.py``) or fallback memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.api.kernels import with_write_into
from backplane.ir.graph import Layer, TensorInfo

NUMBERS, FLOATS = "fiu", "f"


def _sigmoid(out: np.ndarray, X: np.ndarray) -> None:
    np.negative(X, out=out)  # the kernel's steps (elementwise.sigmoid), in ``out``
    np.exp(out, out=out)
    out += 1
    np.reciprocal(out, out=out)


OUT_KERNELS: dict[str, tuple[str, Callable[..., Any]]] = {
    "Relu": (NUMBERS, lambda out, X: np.maximum(X, 0, out=out)),
    "Add": (NUMBERS, lambda out, A, B: np.add(A, B, out=out)),
    "Sub": (NUMBERS, lambda out, A, B: np.subtract(A, B, out=out)),
    "Mul": (NUMBERS, lambda out, A, B: np.multiply(A, B, out=out)),
    "Div": (FLOATS, lambda out, A, B: np.divide(A, B, out=out)),  # integers truncate: not here
    "Abs": (NUMBERS, lambda out, X: np.abs(X, out=out)),
    "Neg": (NUMBERS, lambda out, X: np.negative(X, out=out)),
    "Sqrt": (FLOATS, lambda out, X: np.sqrt(X, out=out)),
    "Exp": (FLOATS, lambda out, X: np.exp(X, out=out)),
    "Tanh": (FLOATS, lambda out, X: np.tanh(X, out=out)),
    "Sigmoid": (FLOATS, _sigmoid),
    "MatMul": (FLOATS, lambda out, A, B: np.matmul(A, B, out=out)),
}
"""Op type -> (the element kinds it writes in place, ``kernel(out, *inputs)``)."""


def writing_into(workload: Workload, layer: Layer, inputs: Sequence[TensorInfo],
                 outputs: Sequence[TensorInfo]) -> Workload:
    """``workload`` with a ``write_into`` where OUT_KERNELS has its op and its tensors all have
    one NumPy element type of the kinds listed (MatMul: of rank 2 or more); else as it is."""
    found = OUT_KERNELS.get(layer.op_type)
    if found is None or layer.domain not in ("", "ai.onnx") or layer.attrs or len(outputs) != 1:
        return workload
    kinds, out_kernel = found
    dtypes = {info.dtype for info in (*inputs, *outputs)}
    dtype = next(iter(dtypes))
    if len(dtypes) != 1 or dtype is None or dtype.isbuiltin != 1 or dtype.kind not in kinds:
        return workload
    if layer.op_type == "MatMul" and any(info.shape is None or len(info.shape) < 2
                                         for info in inputs):
        return workload
    return with_write_into(workload, out_kernel)
