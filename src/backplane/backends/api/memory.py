"""Tensor memory: which memory a backend's tensors live in, what it can import and export, the
memory manager held while a network is loaded, custom allocators and tensor registries (Arm NN's
ITensorHandleFactory, MemorySource, IMemoryManager, ICustomAllocator; onert's ITensorRegistry).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


def _host_copy(value: Any) -> Any:
    if value is None or isinstance(value, (list, tuple)):  # an empty optional, a sequence
        return value if value is None else [_host_copy(v) for v in value]
    return np.array(value, copy=True)


def _same(value: Any) -> Any:
    return value


def _write_host(value: Any, out: np.ndarray) -> None:
    np.copyto(out, host_view(value))


class MemorySource(enum.Flag):
    """Kinds of memory a tensor handle can live in, import from or export to."""

    UNDEFINED = 0
    MALLOC = enum.auto()  # plain host memory (NumPy arrays, torch CPU tensors)
    PINNED = enum.auto()  # page-locked host memory
    CUDA = enum.auto()  # CUDA device memory
    DMA_BUF = enum.auto()  # a buffer shared between devices by the OS (here: page-aligned, mmap'd)
    BACKEND = enum.auto()  # memory private to one backend


@dataclass(frozen=True)
class TensorHandleFactory:
    """Describes one kind of tensor handle a backend makes.

    Two backends whose preferred factories have the same ``id`` read each other's tensors directly;
    otherwise the optimizer decides per edge between import and copy from the flags.
    """

    id: str
    memory: MemorySource = MemorySource.MALLOC
    import_flags: MemorySource = MemorySource.UNDEFINED
    export_flags: MemorySource = MemorySource.UNDEFINED
    supports_mapping: bool = True
    device: str = "cpu"
    """Where the memory is, as DLPack and torch name devices: "cpu", "cuda:0", ... Device memory is
    imported only by a factory of the same device."""
    copy_in: Callable[[Any], Any] = _host_copy
    """Copy a host array into this memory (what a MemCopy into the backend runs)."""
    copy_out: Callable[[Any], Any] = _host_copy
    """Copy a tensor of this memory to a host array (what a MemCopy out of the backend runs)."""
    export: Callable[[Any], Any] = _same
    """This memory as a host array, without a copy (what a MemImport runs on the producer's side);
    used where ``export_flags`` meet the consumer's ``import_flags``."""
    import_: Callable[[Any], Any] = _same
    """A host array as a tensor of this memory, without a copy (a MemImport's consumer side; both
    sides of a FallbackImport, given the fallback memory as an array of the tensor's shape)."""
    alignment: int = 64
    """The bytes memory imported here must be aligned to (Arm NN's GetMemoryAlignment): fallback
    memory is aligned for both sides."""
    fallback_import: bool = False
    """FallbackImportMemoryRequired: where a consumer imports a kind this factory exports, the
    tensor is not handed over as it is (a MemImport) but through fallback memory of that kind, which
    both sides import and the runtime allocates (a FallbackImport layer; ``fallback_kind``)."""
    write_to: Callable[[Any, np.ndarray], None] = _write_host
    """Copy a tensor of this memory into a host array (a FallbackImport whose producer cannot write
    its output in place: the one copy left)."""

    def can_import_from(self, source: TensorHandleFactory) -> bool:
        """Whether tensors of ``source`` can be read here zero-copy: the Ethos-N design's
        ``(factory->GetImportFlags() & srcFactory->GetExportFlags()) != 0``, for every kind of
        memory. One addition: CUDA memory only between factories of the same device (DLPack hands
        another device's memory over as it is, where this factory's kernels cannot run on it)."""
        shared = source.export_flags & self.import_flags
        if shared & ~MemorySource.CUDA:
            return True
        return bool(shared) and source.device == self.device


FALLBACK_KINDS = (MemorySource.DMA_BUF, MemorySource.PINNED, MemorySource.MALLOC)
"""The kinds of memory a FallbackImport may hand over, the preferred first."""


def fallback_kind(source: TensorHandleFactory, target: TensorHandleFactory) -> MemorySource | None:
    """The kind of fallback memory a tensor of ``source`` reaches ``target`` through: where
    ``source`` says FallbackImportMemoryRequired (``fallback_import``), the first kind of
    FALLBACK_KINDS that ``source`` exports and ``target`` imports; None otherwise (CUDA memory is
    imported as it is: the fallback memory manager allocates host memory only)."""
    if not source.fallback_import:
        return None
    shared = source.export_flags & target.import_flags
    return next((kind for kind in FALLBACK_KINDS if shared & kind), None)


HOST_FACTORY = TensorHandleFactory("host", MemorySource.MALLOC, MemorySource.MALLOC,
                                   MemorySource.MALLOC)
"""Host memory as NumPy sees it: every host backend shares it, so edges between them need nothing."""


DLPACK_DEVICES = {1: "cpu", 2: "cuda", 3: "cpu", 13: "cpu"}
"""DLPack's device types (kDLCPU, kDLCUDA, kDLCUDAHost: pinned host memory, kDLCUDAManaged is left
out) as the names devices have here; a value of another device type is refused by name."""


def device_of(value: Any) -> str:
    """The device a value's memory is on: "cpu" for NumPy arrays and anything host-side, "cuda:N"
    for a CUDA tensor of any library that speaks DLPack (torch, CuPy, JAX)."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__dlpack_device__"):
        return "cpu"
    kind, index = value.__dlpack_device__()
    name = DLPACK_DEVICES.get(int(kind))
    if name is None:
        raise ValueError(f"a {type(value).__name__} on DLPack device type {int(kind)}: backplane "
                         f"takes host memory (types 1, 3, 13) and CUDA memory (type 2)")
    return name if name == "cpu" else f"{name}:{int(index)}"


def host_view(value: Any) -> Any:
    """A host value as a NumPy array, without a copy where the value's library allows it (torch CPU
    tensors, JAX and CuPy host arrays through DLPack; anything else through ``np.asarray``)."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__") and not hasattr(value, "__array__"):
        try:
            return np.from_dlpack(value)
        except (BufferError, TypeError, RuntimeError):
            pass
    return np.asarray(value)


def to_host(value: Any) -> np.ndarray:
    """A copy in host memory of a device value (through torch, which imports any CUDA DLPack
    producer); host values as they are."""
    if device_of(value) == "cpu":
        return host_view(value)
    import torch

    tensor = value if isinstance(value, torch.Tensor) else torch.from_dlpack(value)
    return tensor.cpu().numpy()


def to_device(value: Any, device: str) -> Any:
    """``value`` as a torch tensor on ``device``: imported without a copy where it is there already
    (any DLPack producer), copied otherwise."""
    import torch

    if device_of(value) == device:
        return value if isinstance(value, torch.Tensor) else torch.from_dlpack(value)
    if device_of(value) == "cpu":
        return torch.from_numpy(np.ascontiguousarray(host_view(value))).to(device)
    return torch.from_dlpack(value).to(device)


class MemoryManager:
    """A backend's memory for one loaded network (IMemoryManager): acquired when the network is
    loaded, before its first run, and released when it is unloaded (``LoadedNetwork.close``, or
    its finalizer), as Arm NN's backend guide has it ("Acquire() ... before it starts executing
    the network and ... Release() in its destructor")."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


class CustomAllocator:
    """Memory for one backend's tensors (Arm NN's ICustomAllocator), registered for it by id in
    ``RuntimeOptions.custom_allocators``: where the backend accepts it (``use_custom_allocator``),
    the runtime allocates that backend's tensors from it at load (its inputs, outputs,
    intermediates and constants, and the fallback memory it owns) and frees them at unload.

    ``allocate`` returns writable memory of at least ``nbytes`` bytes aligned to ``alignment``:
    anything with the buffer protocol (a NumPy array, a bytearray, an mmap)."""

    memory: MemorySource = MemorySource.MALLOC
    """The kind of memory it allocates (Arm NN's GetMemorySourceType)."""

    def allocate(self, nbytes: int, alignment: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no allocate(nbytes, alignment)")

    def free(self, buffer: Any) -> None:
        """Give back what ``allocate`` returned. Default: nothing (the garbage collector)."""


def is_host_allocator(allocator: Any) -> bool:
    """Whether ``allocator`` allocates host memory: an ``allocate`` method and a ``memory`` kind
    (MALLOC where it says none) that holds MALLOC."""
    memory = getattr(allocator, "memory", MemorySource.MALLOC)
    return callable(getattr(allocator, "allocate", None)) and isinstance(memory, MemorySource) \
        and bool(memory & MemorySource.MALLOC)


class AllocatorError(ValueError):
    """A custom allocator returned memory its backend cannot hold a tensor in."""


def allocate_with(allocator: Any, backend_id: str, what: str, nbytes: int,
                  alignment: int = 64) -> tuple[Any, np.ndarray]:
    """``nbytes`` bytes from ``backend_id``'s custom allocator: what it returned (for its
    ``free``) and a flat uint8 array over that memory; AllocatorError, naming the backend, the
    tensor and the sizes, where it returns too little, read-only, scattered or misaligned memory,
    or something that is not memory."""
    buffer = allocator.allocate(nbytes, alignment)
    given = f"the custom allocator of backend {backend_id} ({type(allocator).__name__})"
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise AllocatorError(f"{given} returned a {type(buffer).__name__} for {what}, not memory: "
                             f"allocate must return a writable buffer (a NumPy array, a "
                             f"bytearray, an mmap)") from exc
    if view.readonly or not view.c_contiguous:
        state = "read-only" if view.readonly else "not contiguous"
        raise AllocatorError(f"{given} returned {state} memory ({type(buffer).__name__}) for "
                             f"{what}: allocate must return writable, contiguous memory")
    if view.nbytes < nbytes:
        raise AllocatorError(f"{given} returned {view.nbytes} bytes for {what}, which takes "
                             f"{nbytes} bytes")
    flat = np.frombuffer(view.cast("B"), np.uint8)[:nbytes]
    if alignment > 1 and flat.ctypes.data % alignment:
        raise AllocatorError(f"{given} returned memory at address {flat.ctypes.data:#x} for "
                             f"{what}, not aligned to {alignment} bytes")
    return buffer, flat


class TensorRegistry:
    """The tensors of one backend's partition of a network, by tensor name (onert's
    ITensorRegistry, filled by BackendContext::genTensors): made at load, before the workloads,
    and released at unload. ``Backend.gen_tensors`` makes one where the backend owns its tensors;
    the runtime makes one from a custom allocator otherwise (``runtime/tensors.py``).

    ``write`` copies a value of the backend's memory into one of its tensors (default: host
    memory, ``np.copyto``); a tensor the backend does not make is None and its workload's result
    is taken as it is."""

    def __init__(self, tensors: dict[str, Any] | None = None,
                 write: Callable[[Any, Any], None] | None = None) -> None:
        self.tensors: dict[str, Any] = dict(tensors or {})
        self.write = write or _copy_host

    def get(self, name: str) -> Any | None:
        return self.tensors.get(name)

    def place(self, name: str, value: Any) -> Any:
        """``value`` as this registry's tensor of ``name``: ``value`` itself where it is that
        tensor or there is none (or it is not a tensor: None, a sequence), else the tensor, with
        ``value`` copied into it."""
        tensor = self.tensors.get(name)
        if tensor is None or tensor is value or value is None or isinstance(value, (list, tuple)):
            return value
        self.write(value, tensor)
        return tensor

    def release(self) -> None:
        """Let go of every tensor (the network is unloaded)."""
        self.tensors.clear()


def _copy_host(value: Any, tensor: Any) -> None:
    np.copyto(host_view(tensor), host_view(value))


LIMIT_VARIABLE = "BACKPLANE_MAX_TENSOR_BYTES"
"""The most bytes one tensor whose size comes from data may take; default: the memory available."""
_UNCHECKED_BYTES = 64 << 20  # below this no limit is looked up


class AllocationError(MemoryError):
    """A tensor whose size comes from data (ConstantOfShape, Expand, Tile, ...) would pass the limit."""


def check_allocation(shape: Any, dtype: Any, what: str = "a tensor") -> None:
    """Raise AllocationError, naming the size, before ``shape`` of ``dtype`` is allocated past the
    limit: ``$BACKPLANE_MAX_TENSOR_BYTES``, else the memory available now (a size past it would end
    in the kernel's OOM killer, or a NumPy MemoryError that says nothing of the layer)."""
    count = 1
    for size in shape:
        count *= max(int(size), 0)
    itemsize = getattr(dtype, "itemsize", None)  # a torch dtype's too
    if not isinstance(itemsize, int):
        dtype = np.dtype(dtype)
        itemsize = dtype.itemsize
    nbytes = count * itemsize
    if nbytes <= _UNCHECKED_BYTES and LIMIT_VARIABLE not in os.environ:
        return
    limit = allocation_limit()
    if nbytes > limit:
        name = str(dtype).removeprefix("torch.")
        raise AllocationError(f"{what} of shape {tuple(int(s) for s in shape)} and type "
                              f"{name} would take {_size(nbytes)}; the limit is "
                              f"{_size(limit)} (the memory available, or ${LIMIT_VARIABLE})")


def allocation_limit() -> int:
    """``$BACKPLANE_MAX_TENSOR_BYTES`` if set, else the memory available (Linux's MemAvailable)."""
    if LIMIT_VARIABLE in os.environ:
        return int(os.environ[LIMIT_VARIABLE])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _size(nbytes: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.4g} {unit}" if unit != "bytes" else f"{nbytes} bytes"
        nbytes /= 1024  # type: ignore[assignment]
    return ""
