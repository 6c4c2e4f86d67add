"""TritonGpu: an out-of-tree GPU backend over Triton kernels, with its own CUDA stream and its own
tensor handles, that shares CUDA memory with GpuAcc (and any other DLPack library) without copies.

It is the second device backend of the Ethos-N design's test matrix (the NPU beside the GPU): where a
network's layers alternate between GpuAcc and TritonGpu, each hand-over is a MemImport, not a copy,
and each side waits for the other's writes on the device, not on the host:

- its tensors are ``TritonTensor``: a CUDA tensor and the event recorded after the kernel that wrote
  it, on TritonGpu's stream. A reader imports one through DLPack, ``__dlpack__(stream=its stream)``,
  and that makes the reader's stream wait for the event (GpuAcc's import is ``torch.from_dlpack``);
- it imports GpuAcc's tensors by asking them for DLPack on its own stream, which makes its stream
  wait for GpuAcc's (torch records the event on the producer's current stream);
- memory read on another stream is marked as such (``record_stream``), so that torch's caching
  allocator does not reuse it before that stream is done.

Kernels: float32 Relu, Sigmoid, Tanh, Add, Sub, Mul, Div (broadcasting like NumPy), one Triton
kernel each, launched on its stream. Everything else is left to the next backend.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane import Backend
from backplane.backends.api.backend import SUPPORTED, Support, unsupported
from backplane.backends.api.memory import MemorySource, TensorHandleFactory
from backplane.ir.graph import Layer, TensorInfo

UNARY = {"Relu": 0, "Sigmoid": 1, "Tanh": 2}
BINARY = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3}
BLOCK = 1024


def missing() -> str | None:
    """Why TritonGpu cannot run here, or None."""
    for module in ("torch", "triton"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


@functools.lru_cache(maxsize=None)
def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def unary(x_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        if OP == 0:
            y = tl.maximum(x, 0.0)
        elif OP == 1:
            y = 1.0 / (1.0 + tl.exp(-x))
        else:
            e = tl.exp(-2.0 * tl.abs(x))  # tanh without overflow: sign(x) (1 - e) / (1 + e)
            t = (1.0 - e) / (1.0 + e)
            y = tl.where(x < 0, -t, t)
        tl.store(y_ptr + offsets, y, mask=mask)

    @triton.jit
    def binary(a_ptr, b_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        a = tl.load(a_ptr + offsets, mask=mask)
        b = tl.load(b_ptr + offsets, mask=mask)
        if OP == 0:
            y = a + b
        elif OP == 1:
            y = a - b
        elif OP == 2:
            y = a * b
        else:
            y = a / b
        tl.store(y_ptr + offsets, y, mask=mask)

    return unary, binary


class TritonTensor:
    """A CUDA tensor written on TritonGpu's stream, with the event recorded after its last write.
    It speaks DLPack: a reader that names its stream gets that stream made to wait for the event."""

    __slots__ = ("tensor", "event")

    def __init__(self, tensor: Any, stream: Any) -> None:
        import torch

        self.tensor = tensor
        self.event = torch.cuda.Event()
        self.event.record(stream)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> Any:
        return self.tensor.dtype

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, stream: int | None = None, **kwargs: Any) -> Any:
        import torch

        if stream is not None and stream != -1:
            device = self.tensor.device
            reader = torch.cuda.default_stream(device) if stream in (1, 2) \
                else torch.cuda.ExternalStream(stream, device=device)
            reader.wait_event(self.event)  # on the device: the host does not wait
            self.tensor.record_stream(reader)
        try:
            return self.tensor.__dlpack__(**kwargs)  # no stream: the wait is done
        except TypeError:  # a torch that takes no max_version / copy
            return self.tensor.__dlpack__()


class TritonGpu(Backend):
    id = "TritonGpu"
    version = "0.1.0"

    def __init__(self) -> None:
        self.missing = missing()
        self._stream: Any = None

    # -- what it is ------------------------------------------------------------------------------
    def availability(self) -> Support:
        return unsupported(self.missing) if self.missing else SUPPORTED

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "AsyncExecution": True}

    @property
    def stream(self) -> Any:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()  # its own, not the one GpuAcc runs on
        return self._stream

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        import torch

        device = f"cuda:{torch.cuda.current_device()}"
        return (TensorHandleFactory(f"triton-{device}", MemorySource.CUDA, MemorySource.CUDA,
                                    MemorySource.CUDA, supports_mapping=False, device=device,
                                    copy_in=self._copy_in, copy_out=self._copy_out,
                                    import_=self._import),)

    # -- support ---------------------------------------------------------------------------------
    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        if self.missing:
            return unsupported(self.missing)
        if layer.domain or layer.op_type not in (*UNARY, *BINARY):
            return unsupported(f"TritonGpu runs {', '.join((*UNARY, *BINARY))} only")
        if any(info.dtype != np.float32 for info in (*inputs, *outputs)):
            return unsupported("TritonGpu runs float32 only")
        return SUPPORTED

    def kernel_for(self, layer: Layer) -> Any:
        unary, binary = _kernels()
        stream = self.stream
        if layer.op_type in UNARY:
            op = UNARY[layer.op_type]

            def run_unary(x: TritonTensor) -> tuple[TritonTensor]:
                import torch

                with torch.cuda.stream(stream):
                    source = x.tensor.contiguous()
                    out = torch.empty_like(source)
                    n = source.numel()
                    unary[((n + BLOCK - 1) // BLOCK,)](source, out, n, OP=op, BLOCK=BLOCK)
                return (TritonTensor(out, stream),)

            return run_unary
        op = BINARY[layer.op_type]

        def run_binary(a: TritonTensor, b: TritonTensor) -> tuple[TritonTensor]:
            import torch

            with torch.cuda.stream(stream):
                left, right = (t.contiguous() for t in torch.broadcast_tensors(a.tensor, b.tensor))
                out = torch.empty_like(left)
                n = left.numel()
                binary[((n + BLOCK - 1) // BLOCK,)](left, right, out, n, OP=op, BLOCK=BLOCK)
            return (TritonTensor(out, stream),)

        return run_binary

    # -- memory ----------------------------------------------------------------------------------
    def _copy_in(self, value: Any) -> TritonTensor:
        import torch

        with torch.cuda.stream(self.stream):
            tensor = torch.from_numpy(np.ascontiguousarray(value)).to("cuda")
        return TritonTensor(tensor, self.stream)

    def _copy_out(self, value: TritonTensor) -> np.ndarray:
        import torch

        with torch.cuda.stream(self.stream):  # waits for this stream only
            return value.tensor.cpu().numpy()

    def _import(self, value: Any) -> TritonTensor:
        """Another library's CUDA tensor, read on this stream once its producer's writes are done."""
        import torch

        capsule = value.__dlpack__(stream=self.stream.cuda_stream)  # makes this stream wait
        tensor = torch.from_dlpack(capsule)
        tensor.record_stream(self.stream)
        return TritonTensor(tensor, self.stream)


def get_backend_id() -> str:
    return TritonGpu.id


def get_version() -> tuple[int, int]:
    return (1, 0)


def backend_factory() -> TritonGpu:
    return TritonGpu()
