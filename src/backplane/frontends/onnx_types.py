"""ONNX element types and attributes as Python values."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, numpy_helper


def onnx_to_numpy_dtype(elem_type: int) -> np.dtype | None:
    """The NumPy dtype of an ONNX element type (ml_dtypes for bfloat16, float8, int4); None if unknown."""
    if elem_type == TensorProto.UNDEFINED:
        return None
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, ValueError, TypeError):
        return None


def numpy_to_onnx_dtype(dtype: np.dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def tensor_to_array(tensor: TensorProto, base_dir: str | None = None) -> np.ndarray:
    """A TensorProto as an ndarray (strings as object arrays of str). Its dims must be sizes: NumPy
    would read a -1 as "whatever is left" and accept data of any length."""
    if any(d < 0 for d in tensor.dims):
        raise ValueError(f"its dims {list(tensor.dims)} include a negative size")
    array = numpy_helper.to_array(tensor, base_dir or "")
    if not array.flags.writeable:
        # A view of the proto's bytes, read-only: an array of its own instead (the bytes are freed),
        # which a backend over host memory can share (CpuAcc's torch.from_numpy cannot view
        # read-only memory, and would otherwise hold a second copy of every constant it reads).
        array = array.copy()
    if array.dtype.kind in "SO" and tensor.data_type == TensorProto.STRING:
        array = np.vectorize(lambda b: b.decode("utf-8") if isinstance(b, bytes) else b,
                             otypes=[object])(array) if array.size else array.astype(object)
    return array


def attribute_value(attr: AttributeProto, import_graph: Callable[[onnx.GraphProto], Any]) -> Any:
    """The Python value of one attribute: int, float, str, list, ndarray, or an imported sub-graph."""
    kind = attr.type
    if kind == AttributeProto.FLOAT:
        return float(attr.f)
    if kind == AttributeProto.INT:
        return int(attr.i)
    if kind == AttributeProto.STRING:
        return attr.s.decode("utf-8")
    if kind == AttributeProto.TENSOR:
        return tensor_to_array(attr.t)
    if kind == AttributeProto.GRAPH:
        return import_graph(attr.g)
    if kind == AttributeProto.SPARSE_TENSOR:
        return sparse_to_dense(attr.sparse_tensor)
    if kind == AttributeProto.TYPE_PROTO:
        return attr.tp
    if kind == AttributeProto.FLOATS:
        return [float(v) for v in attr.floats]
    if kind == AttributeProto.INTS:
        return [int(v) for v in attr.ints]
    if kind == AttributeProto.STRINGS:
        return [s.decode("utf-8") for s in attr.strings]
    if kind == AttributeProto.TENSORS:
        return [tensor_to_array(t) for t in attr.tensors]
    if kind == AttributeProto.GRAPHS:
        return [import_graph(g) for g in attr.graphs]
    if kind == AttributeProto.TYPE_PROTOS:
        return list(attr.type_protos)
    raise ValueError(f"attribute '{attr.name}' has unknown type {kind}")


MAX_SPARSE_DENSE_BYTES = 1 << 30  # a few bytes of sparse tensor must not become gigabytes at import


def sparse_to_dense(sparse: onnx.SparseTensorProto) -> np.ndarray:
    """The dense array of a SparseTensorProto; indices out of its dims, values and indices of
    different counts, or a dense form past MAX_SPARSE_DENSE_BYTES are ValueErrors."""
    dims = tuple(int(d) for d in sparse.dims)
    if any(d < 0 for d in dims):
        raise ValueError(f"the sparse tensor's dims {list(dims)} include a negative size")
    values = tensor_to_array(sparse.values).reshape(-1)
    indices = tensor_to_array(sparse.indices)
    if indices.dtype.kind not in "iu":
        raise ValueError(f"the sparse tensor's indices are {indices.dtype}, not integers")
    size = math.prod(dims)
    if size * values.dtype.itemsize > MAX_SPARSE_DENSE_BYTES:
        raise ValueError(f"the sparse tensor's dense form {list(dims)} would take "
                         f"{size * values.dtype.itemsize} bytes, more than {MAX_SPARSE_DENSE_BYTES}")
    dense = np.zeros(dims, dtype=values.dtype)
    if indices.ndim == 1:  # linearized indices
        bounds = np.array([size])
        rows = indices.reshape(-1, 1)
    elif indices.ndim == 2 and indices.shape[1] == len(dims):  # one row of coordinates per value
        bounds = np.array(dims)
        rows = indices
    else:
        raise ValueError(f"the sparse tensor's indices have shape {list(indices.shape)}; for dims "
                         f"{list(dims)} they are [n] or [n, {len(dims)}]")
    if len(rows) != len(values):
        raise ValueError(f"the sparse tensor has {len(values)} values and {len(rows)} indices")
    if len(rows) and ((rows < 0).any() or (rows >= bounds).any()):
        raise ValueError(f"the sparse tensor's indices fall outside its dims {list(dims)}")
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense
