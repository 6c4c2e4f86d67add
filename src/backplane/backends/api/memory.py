"""Tensor memory: which memory a backend's tensors live in, what it can import and export, and the
memory manager acquired around execution (Arm NN's ITensorHandleFactory, MemorySource, IMemoryManager).
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


class MemorySource(enum.Flag):
    """Kinds of memory a tensor handle can live in, import from or export to."""

    UNDEFINED = 0
    MALLOC = enum.auto()  # plain host memory (NumPy arrays, torch CPU tensors)
    PINNED = enum.auto()  # page-locked host memory
    CUDA = enum.auto()  # CUDA device memory
    DMA_BUF = enum.auto()  # a buffer shared between devices by the OS
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
    copy_in: Callable[[Any], Any] = _host_copy
    """Copy a host array into this memory (what a MemCopy into the backend runs)."""
    copy_out: Callable[[Any], Any] = _host_copy
    """Copy a tensor of this memory to a host array (what a MemCopy out of the backend runs)."""
    export: Callable[[Any], Any] = _same
    """This memory as a host array, without a copy (what a MemImport runs on the producer's side);
    used where ``export_flags`` meet the consumer's ``import_flags``."""
    import_: Callable[[Any], Any] = _same
    """A host array as a tensor of this memory, without a copy (a MemImport's consumer side)."""

    def can_import_from(self, source: TensorHandleFactory) -> bool:
        """Whether tensors of ``source`` can be read here zero-copy (Arm NN's import, Ethos-N's
        EXPORT_TO_TARGET): it exports host memory that this one imports, and both map it."""
        shared = source.export_flags & self.import_flags & MemorySource.MALLOC
        return bool(shared) and source.supports_mapping and self.supports_mapping


HOST_FACTORY = TensorHandleFactory("host", MemorySource.MALLOC, MemorySource.MALLOC,
                                   MemorySource.MALLOC)
"""Host memory as NumPy sees it: every host backend shares it, so edges between them need nothing."""


class MemoryManager:
    """Backend memory acquired before a network's runs and released after (IMemoryManager)."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


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
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes <= _UNCHECKED_BYTES and LIMIT_VARIABLE not in os.environ:
        return
    limit = allocation_limit()
    if nbytes > limit:
        raise AllocationError(f"{what} of shape {tuple(int(s) for s in shape)} and type "
                              f"{np.dtype(dtype).name} would take {_size(nbytes)}; the limit is "
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
