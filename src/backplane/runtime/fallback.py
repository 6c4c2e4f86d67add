"""Fallback memory (the Ethos-N design's FallbackImport layer and fallback memory manager).

Where the consumer imports a kind of memory the producer exports and the producer's factory says
FallbackImportMemoryRequired (``fallback_kind``), the optimizer puts a FallbackImport layer on the
edge instead of a MemImport. At load, ``bind`` carries it out:

- the network's ``FallbackMemoryManager`` allocates one buffer of that kind per such tensor, once,
  aligned for both sides (the least common multiple of their ``alignment``);
- the producer's backend imports the buffer as its output, and the producer's workload writes its
  output there (``write_into``); the consumer's backend imports it as its input;
- the FallbackImport's workload, which the source backend's workload factory creates
  (``create_fallback_import``), runs between the two: an asynchronous source waits there for its
  writes, then the consumer's handle of the buffer is handed over. No byte is copied.

A producer whose workload cannot write into given memory (or whose factory does not import that
kind) writes where it always does, and the FallbackImport copies its output into the buffer
(``TensorHandleFactory.write_to``): the one copy left, counted in the report
(``CopyRecord.copied_bytes``). So is a tensor that is also an output of the network, which must
outlive the run.

Buffers live as long as the network and every run reuses them: a network that holds one runs one
run at a time (``exclusive``), and a run's outputs never alias one (``detach``).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.api.memory import MemorySource, allocate_with, host_view
from backplane.ir.graph import Graph, Layer, TensorInfo

FALLBACK_IMPORT = "FallbackImport"
SYNC = "Sync"
"""A layer between an asynchronous backend's output and any other reader: its workload is the
source backend's ``create_fallback_import`` (a FallbackImport's without the fallback memory)."""


def allocate(kind: MemorySource, nbytes: int, alignment: int) -> np.ndarray:
    """``nbytes`` of memory of ``kind`` aligned to ``alignment``, as bytes (the seed's
    DmabufFallbackMemoryAllocator and MallocFallbackMemoryAllocator, and pinned memory for CUDA)."""
    size = nbytes + alignment
    if kind is MemorySource.DMA_BUF:
        # An anonymous shared mapping: page-aligned memory the OS can hand to devices, as the
        # seed's dma-buf is (a real dma-buf heap needs a device driver this machine may lack).
        raw = np.frombuffer(mmap.mmap(-1, size), np.uint8)
    elif kind is MemorySource.PINNED:
        import torch  # page-locked by the CUDA driver: CUDA copies it by DMA and maps it

        raw = torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
    elif kind is MemorySource.MALLOC:
        raw = np.empty(size, np.uint8)
    else:
        raise ValueError(f"no fallback memory of kind {kind.name}: fallback memory is one of "
                         f"DMA_BUF, PINNED, MALLOC")
    offset = -raw.ctypes.data % alignment
    return raw[offset:offset + nbytes]


class FallbackMemoryManager:
    """The fallback memory of one network (the seed's FallbackMemoryManager, per network id): one
    buffer per tensor and kind, allocated at load, reused by every run, freed at unload. Where the
    source backend (which owns the fallback memory: the seed registers the manager with it) has a
    custom allocator of that kind of memory (``allocators``, by backend id), its buffers come
    from that allocator, and go back to it."""

    def __init__(self, allocators: Mapping[str, Any] | None = None) -> None:
        self.buffers: dict[tuple[str, MemorySource], np.ndarray] = {}
        self.allocators = dict(allocators or {})
        self._given: list[tuple[Any, Any]] = []  # (allocator, what it returned), for its free

    def buffer(self, tensor: str, kind: MemorySource, info: TensorInfo, alignment: int,
               owner: str = "") -> tuple[np.ndarray, bool]:
        """The buffer of ``tensor`` in memory of ``kind``, typed and shaped as ``info`` says, and
        whether it was allocated by this call (from ``owner``'s allocator where it has one)."""
        if info.shape is None or info.dtype is None or info.nbytes is None:
            raise ValueError(f"fallback memory for {tensor} ({info}): its size must be known at "
                             f"load")
        key = (tensor, kind)
        fresh = key not in self.buffers
        if fresh:
            allocator = self.allocators.get(owner)
            if allocator is not None and getattr(allocator, "memory", MemorySource.MALLOC) & kind:
                given, self.buffers[key] = allocate_with(
                    allocator, owner, f"the fallback memory of '{tensor}'", info.nbytes, alignment)
                self._given.append((allocator, given))
            else:
                self.buffers[key] = allocate(kind, info.nbytes, alignment)
        return self.buffers[key].view(info.dtype).reshape(info.shape), fresh

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers.values())

    def detach(self, value: Any) -> Any:
        """``value``, copied where it shares memory with a buffer (a run's output outlives the run;
        the next run writes the buffer again)."""
        if value is None or isinstance(value, (list, tuple)):
            return value
        try:
            view = host_view(value)
        except (TypeError, ValueError, RuntimeError, BufferError):
            return value  # not host memory
        if view.dtype == object:
            return value
        if any(np.may_share_memory(view, b) for b in self.buffers.values()):
            return np.array(view, copy=True)
        return value

    def release(self) -> None:
        self.buffers.clear()
        for allocator, given in self._given:
            allocator.free(given)
        self._given.clear()


def bind(layers: Sequence[Layer], workloads: Sequence[Workload], graph: Graph,
         manager: FallbackMemoryManager) -> tuple[list[Workload], dict[str, int]]:
    """The workloads with every FallbackImport carried out in ``manager``'s memory (see the module's
    docstring): producers that write into it wrapped, each FallbackImport handing it over; and per
    FallbackImport layer, the bytes it copies a run (0 where its producer writes in place)."""
    made = {out: (i, k) for i, layer in enumerate(layers) for k, out in enumerate(layer.outputs)}
    imports = [i for i, layer in enumerate(layers) if layer.op_type == FALLBACK_IMPORT]
    alignment: dict[str, int] = {}
    for i in imports:
        name, attrs = layers[i].inputs[0], layers[i].attrs
        alignment[name] = math.lcm(alignment.get(name, 1), attrs["source"].alignment,
                                   attrs["target"].alignment)
    bound = list(workloads)
    into: dict[int, list[Any]] = {}  # producer -> the memory each of its outputs is written into
    in_place: dict[tuple[str, MemorySource], bool] = {}
    copied: dict[str, int] = {}
    for i in imports:
        layer = layers[i]
        name, source, target = layer.inputs[0], layer.attrs["source"], layer.attrs["target"]
        kind = MemorySource[layer.attrs["memory"]]
        info = graph.info(name)
        buffer, fresh = manager.buffer(name, kind, info, alignment[name],
                                       layer.attrs.get("source_backend", ""))
        producer, position = made[name]
        if fresh:
            writes = (getattr(workloads[producer], "write_into", None) is not None
                      and bool(source.import_flags & kind))  # its output imported from the buffer
            free = into.get(producer, [None] * len(layers[producer].outputs))[position] is None
            in_place[name, kind] = writes and free and name not in graph.outputs
            if in_place[name, kind]:
                into.setdefault(producer, [None] * len(layers[producer].outputs))
                into[producer][position] = source.import_(buffer)
        consumer = target.import_(buffer)
        if in_place[name, kind]:
            bound[i] = _handing_over(workloads[i], consumer)
            copied[layer.name] = 0
        else:
            bound[i] = _copying_over(workloads[i], consumer, buffer, source.write_to)
            copied[layer.name] = int(buffer.nbytes)
    for producer, memory in into.items():
        bound[producer] = _writing_into(workloads[producer], memory)
    return bound, copied


def _writing_into(workload: Workload, memory: list[Any]) -> Workload:
    """``workload`` writing its outputs into ``memory`` (one per output; None: where it likes)."""
    write_into = workload.write_into  # type: ignore[attr-defined]

    def writing_into(*inputs: Any) -> tuple[Any, ...]:
        return write_into(memory, *inputs)

    return writing_into


def _handing_over(sync: Workload, consumer: Any) -> Workload:
    """A FallbackImport whose producer wrote in place: the source's sync, then the consumer's view."""
    def fallback_import(x: Any) -> tuple[Any]:
        sync(x)
        return (consumer,)

    return fallback_import


def _copying_over(sync: Workload, consumer: Any, buffer: np.ndarray, write_to: Any) -> Workload:
    """A FallbackImport whose producer wrote elsewhere: the source's sync, one copy into the
    buffer, then the consumer's view of it."""
    def fallback_import(x: Any) -> tuple[Any]:
        (synced,) = sync(x)
        write_to(synced, buffer)
        return (consumer,)

    return fallback_import
