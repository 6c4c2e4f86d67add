"""Weights packed into oneDNN's layouts, kept as their bytes in CpuAcc's artifact blob.

CpuAcc's oneDNN routes reorder each weight once at load into the layout oneDNN's kernel reads
(``torch.ops.mkldnn._reorder_linear_weight``, ``_reorder_convolution_weight``): for GPT-2's LM head
(50257 x 512) 65-88 ms on two cores, for BERT-base's 60 linears about 0.09 s; an artifact load that
packs again is that much slower than it need be. A packed tensor is an opaque oneDNN memory (its
layout depends on the processor's instruction sets and on oneDNN's version: the blob's machine
facts, ``delegate.FACT_NAMES``); torch gives its bytes (``torch.ops.mkldnn.data_ptr`` and
``_nbytes``) and its oneDNN memory descriptor (``_get_mkldnn_serialized_md``), and makes one again
from the two through AOTInductor's C interface (``aoti_torch_create_tensor_from_blob_v2`` with
the mkldnn layout, declared in torch's ``aoti_torch/c/shim.h``), as an AOTInductor package loads
its packed constants: the tensor made reads the bytes where they lie (the artifact's mapping), no
copy, no reorder.

``packed(name, make)`` is how a route gets its packed weight: the one kept for ``name`` (a layer's
name) while ``KEPT`` is set (``delegate.init``), else ``make()``, recorded while ``MADE`` is set
(``delegate.preprocess``). Where torch lacks the C interface (``available()`` False), a blob keeps
no packed weights and the routes pack at load as before.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import os
import weakref
from collections.abc import Callable
from typing import Any

KEPT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "backplane_kept_packed_weights", default=None)
"""Packed weights by layer name, made from a blob's bytes: used instead of packing while set."""
MADE: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "backplane_made_packed_weights", default=None)
"""Layer name -> a weak reference to the packed weight made for it, recorded while set: the ones
still alive once the workloads are built are those their routes kept."""


def packed(name: str, make: Callable[[], Any]) -> Any:
    """The packed weight of layer ``name``: kept (``KEPT``) or made now (and recorded, ``MADE``)."""
    kept = KEPT.get()
    if kept is not None and name in kept:
        return kept[name]
    tensor = make()
    made = MADE.get()
    if made is not None and getattr(tensor, "is_mkldnn", False):
        made[name] = weakref.ref(tensor)
    return tensor


def alive(made: dict[str, Any]) -> dict[str, Any]:
    """The packed weights of ``made`` (weak references) that something still holds."""
    import gc

    gc.collect()  # a route measured and not kept may sit in a reference cycle
    return {name: tensor for name, ref in made.items() if (tensor := ref()) is not None}


def to_bytes(tensor: Any) -> tuple[bytes, bytes, list[int], str]:
    """A packed tensor as (its oneDNN memory descriptor, its bytes, its sizes, its dtype name)."""
    import torch

    descriptor = torch.ops.mkldnn._get_mkldnn_serialized_md(tensor).numpy().tobytes()
    data = ctypes.string_at(torch.ops.mkldnn.data_ptr(tensor), torch.ops.mkldnn._nbytes(tensor))
    return descriptor, data, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")


def from_bytes(descriptor: bytes | memoryview, data: memoryview, sizes: list[int],
               dtype: str) -> Any:
    """The packed tensor ``to_bytes`` described, reading ``data`` where it lies (the caller keeps
    ``data``'s memory alive as long as the tensor: it is not copied)."""
    import torch

    shim = _shim()
    if shim is None:
        raise RuntimeError("this torch has no AOTInductor C interface to make a oneDNN tensor from "
                           "its bytes")
    dtype_code = {"float32": shim.aoti_torch_dtype_float32,
                  "bfloat16": shim.aoti_torch_dtype_bfloat16}[dtype]()
    if data.readonly:  # bytes: a copy, aligned as oneDNN wants it (a mapping's pages already are)
        import numpy as np

        room = np.empty(len(data) + 64, np.uint8)
        start = -room.ctypes.data % 64
        room[start:start + len(data)] = np.frombuffer(data, np.uint8)
        data = memoryview(room[start:start + len(data)])
    buffer = (ctypes.c_char * len(data)).from_buffer(data)  # the memory itself, not a copy
    count = len(sizes)
    strides = [1] * count
    for i in range(count - 2, -1, -1):
        strides[i] = strides[i + 1] * sizes[i + 1]
    handle = ctypes.c_void_p()
    descriptor = bytes(descriptor)
    error = shim.aoti_torch_create_tensor_from_blob_v2(
        ctypes.addressof(buffer), count, (ctypes.c_int64 * count)(*sizes),
        (ctypes.c_int64 * count)(*strides), 0, dtype_code, shim.aoti_torch_device_type_cpu(), 0,
        ctypes.byref(handle), shim.aoti_torch_layout__mkldnn(), descriptor, len(descriptor))
    if error or not handle.value:
        raise RuntimeError(f"torch could not make a oneDNN tensor of sizes {sizes} from its bytes "
                           f"(error {error})")
    tensor = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(_capsule(handle.value))
    tensor._backplane_memory = buffer  # the bytes it reads live as long as it does
    return tensor


def available() -> bool:
    """Whether this torch can make a packed tensor from its bytes (and give them)."""
    import torch

    return (_shim() is not None and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_get_mkldnn_serialized_md")
            and hasattr(torch._C, "_aoti"))


@functools.lru_cache(maxsize=1)
def _shim() -> Any:
    import torch

    try:
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        create = library.aoti_torch_create_tensor_from_blob_v2
    except (OSError, AttributeError):
        return None
    create.restype = ctypes.c_int32
    create.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64),
                       ctypes.POINTER(ctypes.c_int64), ctypes.c_int64, ctypes.c_int32,
                       ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.c_int32, ctypes.c_char_p, ctypes.c_int64]
    for name in ("aoti_torch_dtype_float32", "aoti_torch_dtype_bfloat16",
                 "aoti_torch_device_type_cpu", "aoti_torch_layout__mkldnn"):
        getattr(library, name).restype = ctypes.c_int32
    return library


def _capsule(pointer: int) -> Any:
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(pointer, None, None)
