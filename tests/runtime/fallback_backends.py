"""Two host backends whose own memories neither can read, but that both export and import dma-buf
with FallbackImportMemoryRequired, as the Ethos-N design's NPU and GPU: the FallbackImport's test
bed, with no device.

- TestNpu is asynchronous: its kernels go into a command queue that runs when it is flushed (as
  OpenCL's does at clFinish), so that whoever reads its memory before it syncs reads stale bytes.
  Its tensors (``NpuTensor``) live in memory of its own; it imports dma-buf only (an anonymous
  shared mapping here), aligned to the page.
- TestGpu runs at once. Its tensors (``GpuTensor``) live in memory of its own too; it imports
  dma-buf aligned to two pages.

Both say they export dma-buf and import it, with ``fallback_import``: their own memory is not
dma-buf, so it cannot be handed over as it is ("no backend has support for memory export. Arm NN
needs to handle the memory for each backend"); by the design's rule the edge between them is a
FallbackImport: the producer writes into dma-buf memory that both import, nothing is copied.
Their kernels (Relu, Sigmoid, Tanh, Add, Sub, Mul, float32) write into given memory
(``write_into``); TestNpuCopying's do not, so that a FallbackImport from it copies instead.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest

from backplane.backends.api.backend import (
    SUPPORTED,
    Backend,
    Support,
    Workload,
    WorkloadFactory,
    unsupported,
)
from backplane.backends.api.memory import HOST_FACTORY, MemorySource, TensorHandleFactory
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import registry
from backplane.ir.graph import Layer, TensorInfo

UFUNCS: dict[str, Callable[..., Any]] = {
    "Relu": lambda x, out: np.maximum(x, 0, out=out),
    "Sigmoid": lambda x, out: np.divide(1, np.add(1, np.exp(-x), out=out), out=out),
    "Tanh": lambda x, out: np.tanh(x, out=out),
    "Add": lambda a, b, out: np.add(a, b, out=out), "Sub": lambda a, b, out: np.subtract(a, b, out=out),
    "Mul": lambda a, b, out: np.multiply(a, b, out=out),
}


@dataclass(eq=False)
class NpuTensor:
    array: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


@dataclass(eq=False)
class GpuTensor:
    array: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


class CommandQueue:
    """Work queued by TestNpu, run in order when flushed."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], Any]] = []
        self.flushes = 0

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for run in pending:
            run()
        self.flushes += 1


def is_dma_buf(array: np.ndarray) -> bool:
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(getattr(base, "obj", base), mmap.mmap)  # np.frombuffer keeps a memoryview


def _importer(kind: type, alignment: int, dma_buf_only: bool) -> Callable[[np.ndarray], Any]:
    def import_(array: np.ndarray) -> Any:
        if array.ctypes.data % alignment:
            raise ValueError(f"{kind.__name__} imports memory aligned to {alignment} bytes only")
        if dma_buf_only and not is_dma_buf(array):
            raise ValueError(f"{kind.__name__} imports dma-buf memory only")
        return kind(array)

    return import_


class FallbackTestBackend(Backend):
    version = "0.1.0"
    HANDLE: ClassVar[type]
    FACTORY: ClassVar[TensorHandleFactory]
    IN_PLACE: ClassVar[bool] = True

    def __init__(self) -> None:
        self.queue = CommandQueue()

    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        if layer.op_type not in UFUNCS or any(i.dtype != np.float32 for i in (*inputs, *outputs)):
            return unsupported(f"{self.id} runs float32 {', '.join(UFUNCS)} only")
        return SUPPORTED

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        return (self.FACTORY,)

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return FallbackTestFactory(self, memory_manager)

    def run(self, work: Callable[[], Any]) -> None:
        work()


class FallbackTestFactory(WorkloadFactory):
    backend: FallbackTestBackend

    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        backend, ufunc = self.backend, UFUNCS[layer.op_type]
        handle = backend.HANDLE

        def write_into(memory: Sequence[Any], *xs: Any) -> tuple[Any]:
            arrays = [x.array for x in xs]
            given = memory[0]
            out = given.array if given is not None else \
                np.empty(np.broadcast_shapes(*(a.shape for a in arrays)), np.float32)
            backend.run(lambda: ufunc(*arrays, out=out))
            return (given if given is not None else handle(out),)

        def run(*xs: Any) -> tuple[Any]:
            return write_into([None], *xs)

        if backend.IN_PLACE:
            run.write_into = write_into  # type: ignore[attr-defined]
        return run

    def create_fallback_import(self, layer: Layer) -> Workload:
        queue = self.backend.queue

        def synced(x: Any) -> tuple[Any]:
            queue.flush()  # the consumer reads the fallback memory next: the writes must be done
            return (x,)

        return synced


class NpuBackend(FallbackTestBackend):
    id = "TestNpu"
    HANDLE = NpuTensor

    def run(self, work: Callable[[], Any]) -> None:
        self.queue.pending.append(work)

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        queue = self.queue

        def copy_out(x: NpuTensor) -> np.ndarray:
            queue.flush()
            return np.array(x.array, copy=True)

        def write_to(x: NpuTensor, out: np.ndarray) -> None:
            queue.flush()
            np.copyto(out, x.array)

        return (TensorHandleFactory(
            "test-npu", MemorySource.BACKEND, MemorySource.DMA_BUF, MemorySource.DMA_BUF,
            alignment=mmap.PAGESIZE,
            fallback_import=True, copy_in=lambda a: NpuTensor(np.array(a, np.float32)),
            copy_out=copy_out, import_=_importer(NpuTensor, mmap.PAGESIZE, True),
            write_to=write_to),)


GPU_ALIGNMENT = 2 * mmap.PAGESIZE  # more than a mapping's: fallback memory is aligned for both
GPU_FACTORY = TensorHandleFactory(
    "test-gpu", MemorySource.BACKEND, MemorySource.DMA_BUF, MemorySource.DMA_BUF,
    alignment=GPU_ALIGNMENT,
    fallback_import=True, copy_in=lambda a: GpuTensor(np.array(a, np.float32)),
    copy_out=lambda x: np.array(x.array, copy=True),
    import_=_importer(GpuTensor, GPU_ALIGNMENT, False), write_to=lambda x, out: np.copyto(out, x.array))


class GpuBackend(FallbackTestBackend):
    id = "TestGpu"
    HANDLE = GpuTensor
    FACTORY = GPU_FACTORY


class NpuCopyingBackend(NpuBackend):
    """TestNpu whose workloads cannot write into given memory."""

    id = "TestNpuCopying"
    IN_PLACE = False


BACKENDS = (NpuBackend, GpuBackend, NpuCopyingBackend)


@pytest.fixture
def fallback_backends() -> Iterator[None]:
    with registry.temporarily(NpuBackend.id, NpuBackend), \
            registry.temporarily(GpuBackend.id, GpuBackend), \
            registry.temporarily(NpuCopyingBackend.id, NpuCopyingBackend):
        yield


# -- an asynchronous backend in host memory: only the runtime's sync makes its outputs whole ---
UNWRITTEN = 777.0  # what an output of TestAsyncHost holds until its queue is flushed


class AsyncHostBackend(CpuRef):
    """CpuRef's kernels, run later: a workload queues its kernel and returns host arrays that hold
    UNWRITTEN until the queue is flushed, which only its sync (``create_fallback_import``) does, as
    a GPU's queue runs at clFinish. Its tensors are host memory (``FACTORY``), so a host reader
    reads them directly, or imports them: no copy-out that would wait."""

    id = "TestAsyncHost"
    FACTORY: ClassVar[TensorHandleFactory] = HOST_FACTORY

    def __init__(self) -> None:
        super().__init__()
        self.queue = CommandQueue()

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "AsyncExecution": True}

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        return (self.FACTORY,)

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return AsyncHostFactory(self, memory_manager)


class AsyncHostExporting(AsyncHostBackend):
    """The same, in host memory of its own that it exports: its readers import it (a MemImport)."""

    id = "TestAsyncHostExporting"
    FACTORY = TensorHandleFactory("test-async-host", MemorySource.MALLOC, MemorySource.MALLOC,
                                  MemorySource.MALLOC)


class AsyncHostFactory(WorkloadFactory):
    backend: AsyncHostBackend

    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        kernel, queue = super().create_workload(layer, inputs, outputs), self.backend.queue

        def queued(*xs: Any) -> tuple[Any, ...]:
            out = [np.full(o.shape, UNWRITTEN, o.dtype) for o in outputs]

            def later() -> None:
                for memory, value in zip(out, kernel(*xs)):
                    np.copyto(memory, value)

            queue.pending.append(later)
            return tuple(out)

        return queued

    def create_fallback_import(self, layer: Layer) -> Workload:
        queue = self.backend.queue

        def synced(x: Any) -> tuple[Any]:
            queue.flush()
            return (x,)

        return synced


@pytest.fixture
def async_backends() -> Iterator[None]:
    with registry.temporarily(AsyncHostBackend.id, AsyncHostBackend), \
            registry.temporarily(AsyncHostExporting.id, AsyncHostExporting):
        yield
