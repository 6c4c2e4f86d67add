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

The bytes and the descriptor come from a file, and oneDNN trusts both: it copies
``sizeof(memory_desc_t)`` bytes from the descriptor whatever its length
(``dnnl_memory_desc_create_with_blob``), and its kernels read wherever the descriptor's offset,
strides and blocks point. ``from_bytes`` therefore checks the descriptor first (``check``): its
length, the fields of oneDNN's ``memory_desc_t`` as torch serializes them (``parse``), a blocked
layout of this dtype and these sizes, every count and index in range, and the furthest byte it
reads inside ``data``; a descriptor that fails is an ``ArtifactError`` naming the field, never
handed to torch. The tensor made is checked once more by torch's own count of its bytes (which
includes any extra buffer the descriptor's flags ask for).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import math
import os
import struct
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from backplane.artifact.container import ArtifactError

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
    with _one_thread():
        tensor = make()
    made = MADE.get()
    if made is not None and getattr(tensor, "is_mkldnn", False):
        made[name] = weakref.ref(tensor)
    return tensor


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """The calling thread at one torch thread for the block. A reorder is a copy of a few KB to a
    few MB; on two threads beside busy neighbours each one waited for its preempted partner at
    the region's barrier: the demo model's 52 convolution weights took 0.71 s of its 1.3 s load
    at load average 8 (this 2-core AMD EPYC), 0.35-0.42 s for the whole load at one thread."""
    import torch

    before = torch.get_num_threads()
    if before > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before > 1:
            torch.set_num_threads(before)


class TraceInputs:
    """The packed weights a ``Traced`` layer's frozen graph takes as inputs (``TRACED``).

    A frozen TorchScript graph holds no oneDNN tensor as a constant ("Unsupported value kind"),
    so a trace's oneDNN products read the plain weight and reorder it each call; an input it may
    be. While ``TRACED`` is set, a traced Linear asks ``weight`` for its packed weight: on the
    layers' first run (untraced) it is packed and kept here, in the order made; the trace then
    takes ``packed`` as its last inputs, and the same calls during the trace hand those very
    tensors back (the tracer knows them as inputs). 32x1024x256 at 1 thread, this AMD EPYC:
    plain 401, packed 337 us (``fusion/linear.py``). A traced convolution's weight likewise
    (``conv_weight``, ``fusion/conv.py``)."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[Any, Any]] = {}  # id(weight) -> (weight, packed)

    def weight(self, weight: Any, rows: int) -> Any:
        """``weight``'s packed form for ``rows`` rows (made at the first call for it)."""
        import torch

        found = self._made.get(id(weight))
        if found is None or found[0] is not weight:
            found = (weight, torch.ops.mkldnn._reorder_linear_weight(weight, rows))
            self._made[id(weight)] = found
        return found[1]

    def conv_weight(self, weight: Any, padding: list[int], strides: list[int],
                    dilations: list[int], groups: int, input_shape: list[int]) -> Any:
        """A convolution's ``weight`` packed for its geometry and input shape (made at the first
        call for it), as ``weight`` packs a linear's."""
        import torch

        found = self._made.get(id(weight))
        if found is None or found[0] is not weight:
            found = (weight, torch.ops.mkldnn._reorder_convolution_weight(
                weight, padding, strides, dilations, groups, input_shape))
            self._made[id(weight)] = found
        return found[1]

    @property
    def packed(self) -> list[Any]:
        return [packed for _, packed in self._made.values()]


TRACED: contextvars.ContextVar[TraceInputs | None] = contextvars.ContextVar(
    "backplane_traced_packed_weights", default=None)
"""The packed weights of the ``Traced`` layer being traced, while set (``TraceInputs``)."""


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


class _Type(NamedTuple):
    dnnl: int  # oneDNN's dnnl_data_type_t
    size: int  # bytes per element
    shim: Callable[[Any], int]  # AOTInductor's code for it


DTYPES = {"float32": _Type(3, 4, lambda shim: shim.aoti_torch_dtype_float32()),
          "bfloat16": _Type(2, 2, lambda shim: shim.aoti_torch_dtype_bfloat16())}
"""The types a packed weight is kept in (CpuAcc's fp32, and bf16 with ``CpuAcc.precision``)."""


def from_bytes(descriptor: bytes | memoryview, data: memoryview, sizes: Sequence[int],
               dtype: str) -> Any:
    """The packed tensor ``to_bytes`` described, reading ``data`` where it lies (the caller keeps
    ``data``'s memory alive as long as the tensor: it is not copied). ``ArtifactError`` where the
    descriptor is not one of a packed weight of ``sizes`` and ``dtype`` inside ``data``
    (``check``), before torch sees it."""
    import torch

    shim = _shim()
    if shim is None:
        raise RuntimeError("this torch has no AOTInductor C interface to make a oneDNN tensor from "
                           "its bytes")
    descriptor = bytes(descriptor)
    check(descriptor, len(data), sizes, dtype)
    if data.readonly or _address(data) % 64:  # a copy, aligned as oneDNN wants it (a mapping's
        data = _aligned_copy(data)            # pages and the blob's 64-byte offsets already are)
    buffer = (ctypes.c_char * len(data)).from_buffer(data)  # the memory itself, not a copy
    count = len(sizes)
    strides = [math.prod(sizes[i + 1:]) for i in range(count)]
    handle = ctypes.c_void_p()
    error = shim.aoti_torch_create_tensor_from_blob_v2(
        ctypes.addressof(buffer), count, (ctypes.c_int64 * count)(*sizes),
        (ctypes.c_int64 * count)(*strides), 0, DTYPES[dtype].shim(shim),
        shim.aoti_torch_device_type_cpu(), 0, ctypes.byref(handle), shim.aoti_torch_layout__mkldnn(),
        descriptor, len(descriptor))
    if error or not handle.value:
        raise RuntimeError(f"torch could not make a oneDNN tensor of sizes {list(sizes)} from its "
                           f"bytes (error {error})")
    tensor = torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(_capsule(handle.value))
    tensor._backplane_memory = buffer  # the bytes it reads live as long as it does
    nbytes = torch.ops.mkldnn._nbytes(tensor)
    if nbytes > len(data) or list(tensor.shape) != list(sizes):  # what check said, as torch says it
        raise ArtifactError(f"a packed weight of sizes {list(sizes)} became a oneDNN tensor of "
                            f"sizes {list(tensor.shape)} and {nbytes} bytes, from {len(data)}")
    return tensor


# -- the descriptor: oneDNN's memory_desc_t as torch serializes it, checked field by field --------
class Descriptor(NamedTuple):
    """The fields of a serialized oneDNN memory descriptor that say what a packed weight reads
    (element counts and strides in elements). The rest is unused for a blocked layout (the union's
    other members, padding: not always zero) or extra data (compensation flags), which torch's own
    size of the tensor counts (``from_bytes``)."""

    head: int  # torch's serialization header (1)
    dims: list[int]  # its logical dims: the weight's sizes, a grouped weight's with groups first
    dtype: int  # dnnl_data_type_t
    padded: list[int]  # the dims the layout holds, each a multiple of its blocks
    padded_offsets: list[int]
    offset0: int  # the first element's offset
    format: int  # dnnl_format_kind_t: 2, blocked
    strides: list[int]  # of each dim's outer blocks
    blocks: list[int]  # the inner blocks, outermost first
    block_dims: list[int]  # the dim each inner block divides
    groups: int  # ideep's, after the struct


MAX_DIMS = 12  # DNNL_MAX_NDIMS
_BLOCKED = 2
_ARRAYS = {"dims": 8, "padded": 112, "padded_offsets": 208, "strides": 320, "blocks": 424,
           "block_dims": 520}
"""Where each int64[12] array lies in the descriptor; ndims is the int32 at 4, the data type at
104, offset0 (int64) at 304, the format at 312, the number of inner blocks at 416, ideep's groups in
the last 4 bytes."""


def parse(descriptor: bytes) -> Descriptor:
    """The fields of a descriptor of this torch's length (``ArtifactError`` on a count out of
    range: no array is read past its twelve entries)."""
    def i32(at: int) -> int:
        return int(struct.unpack_from("<i", descriptor, at)[0])

    def array(name: str, count: int) -> list[int]:
        return list(struct.unpack_from(f"<{count}q", descriptor, _ARRAYS[name]))

    ndims, nblocks = i32(4), i32(416)
    if not 1 <= ndims <= MAX_DIMS or not 0 <= nblocks <= MAX_DIMS:
        raise ArtifactError(f"a packed weight's descriptor has {ndims} dims and {nblocks} inner "
                            f"blocks; oneDNN allows 1 to {MAX_DIMS} and 0 to {MAX_DIMS}")
    return Descriptor(i32(0), array("dims", ndims), i32(104), array("padded", ndims),
                      array("padded_offsets", ndims), struct.unpack_from("<q", descriptor, 304)[0],
                      i32(312), array("strides", ndims), array("blocks", nblocks),
                      array("block_dims", nblocks), i32(len(descriptor) - 4))


def check(descriptor: bytes, available: int, sizes: Sequence[int], dtype: str) -> int:
    """The bytes a packed weight of ``descriptor`` reads; ``ArtifactError`` unless the descriptor
    is one torch writes for a packed weight of ``sizes`` and ``dtype`` (this torch's length and
    header, a blocked layout of those dims in that type, every count and index in range) and those
    bytes lie within the ``available`` ones."""
    if dtype not in DTYPES:
        raise ArtifactError(f"a packed weight of type {dtype!r}; the types kept are "
                            f"{', '.join(DTYPES)}")
    known = _serialized()
    if known is None or len(descriptor) != known[0]:
        raise ArtifactError(f"a packed weight's descriptor of {len(descriptor)} bytes; this "
                            f"torch's are {known[0] if known else 'unknown'} bytes")
    fields = parse(descriptor)
    if fields.head != known[1]:
        raise ArtifactError(f"a packed weight's descriptor starts with {fields.head}; this torch's "
                            f"with {known[1]}")
    _check_fields(fields, list(sizes), DTYPES[dtype].dnnl)
    reads = _elements(fields) * DTYPES[dtype].size
    if reads > available:
        raise ArtifactError(f"a packed weight's descriptor reads {reads} bytes (offset "
                            f"{fields.offset0}, strides {fields.strides}, blocks {fields.blocks}); "
                            f"its data has {available}")
    return reads


def _check_fields(fields: Descriptor, sizes: list[int], dnnl_type: int) -> None:
    dims, groups = fields.dims, fields.groups
    grouped = (groups > 1 and len(sizes) > 0 and len(dims) == len(sizes) + 1
               and dims[0] == groups and dims[0] * dims[1] == sizes[0] and dims[2:] == sizes[1:])
    problems = [
        (fields.dtype != dnnl_type, f"data type {fields.dtype}, not {dnnl_type}"),
        (fields.format != _BLOCKED, f"format kind {fields.format}, not {_BLOCKED} (blocked)"),
        (not (grouped or (groups == 1 and dims == sizes)),
         f"dims {dims} in {groups} group(s), not the weight's sizes {sizes}"),
        (any(d < 1 or p < d for d, p in zip(dims, fields.padded)),
         f"dims {dims} padded to {fields.padded}"),
        (any(fields.padded_offsets) or fields.offset0 < 0 or min(fields.strides) < 0,
         f"padded offsets {fields.padded_offsets}, offset {fields.offset0}, strides "
         f"{fields.strides}"),
        (any(b < 1 for b in fields.blocks) or any(not 0 <= i < len(dims) for i in fields.block_dims),
         f"inner blocks {fields.blocks} of dims {fields.block_dims}")]
    for failed, what in problems:
        if failed:
            raise ArtifactError(f"a packed weight's descriptor has {what}")
    for dim, padded in enumerate(fields.padded):
        if padded % _block(fields, dim):
            raise ArtifactError(f"a packed weight's descriptor pads dim {dim} to {padded}, not a "
                                f"multiple of its blocks {_block(fields, dim)}")


def _block(fields: Descriptor, dim: int) -> int:
    return math.prod(b for b, d in zip(fields.blocks, fields.block_dims) if d == dim)


def _elements(fields: Descriptor) -> int:
    """One past the furthest element the layout reaches: its offset, each dim's last outer block at
    its stride, then one inner block (dense, the product of the inner blocks)."""
    last = sum((padded // _block(fields, dim) - 1) * stride
               for dim, (padded, stride) in enumerate(zip(fields.padded, fields.strides)))
    return fields.offset0 + last + math.prod(fields.blocks)


@functools.lru_cache(maxsize=1)
def _serialized() -> tuple[int, int] | None:
    """(length, header) of this torch's serialized descriptors, where a packed weight's parses as
    ``parse`` expects (checked on one made here), else None: then nothing is made from bytes."""
    import torch

    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(96, 40), 8)
        data = torch.ops.mkldnn._get_mkldnn_serialized_md(weight).numpy().tobytes()
        fields = parse(data)
        nbytes = torch.ops.mkldnn._nbytes(weight)
    except (RuntimeError, AttributeError, ArtifactError, struct.error):
        return None
    if (len(data) < 620 or fields.dims != [96, 40] or fields.dtype != DTYPES["float32"].dnnl or fields.format != _BLOCKED
            or fields.groups != 1 or _elements(fields) * 4 != nbytes):
        return None
    return len(data), fields.head


def _address(data: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(data, np.uint8).ctypes.data) if len(data) else 0


def _aligned_copy(data: memoryview) -> memoryview:
    import numpy as np

    room = np.empty(len(data) + 64, np.uint8)
    start = -room.ctypes.data % 64
    room[start:start + len(data)] = np.frombuffer(data, np.uint8)
    return memoryview(room[start:start + len(data)])


def available() -> bool:
    """Whether this torch can make a packed tensor from its bytes (and give them), with
    descriptors of the layout ``check`` reads."""
    import torch

    return (_shim() is not None and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_get_mkldnn_serialized_md")
            and hasattr(torch._C, "_aoti") and _serialized() is not None)


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
