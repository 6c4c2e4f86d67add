"""GpuAcc's memory: CUDA tensors, and the copies between them and the host (``factory``; out of
``cuda.py``, which imports it from here).

``copy_in`` uploads a host array: past ``STAGED_BYTES`` from pageable memory (the driver stages it and
returns once it has read the array; it may wait for the stream first), smaller ones through a
page-locked block of torch's caching host allocator. ``copy_out`` downloads into page-locked memory,
which waits for the GPU work queued before it: that is the sync before another backend or the user
reads a GpuAcc output.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from backplane.backends.api.memory import MemorySource, TensorHandleFactory, device_of, to_device
from backplane.backends.torch.backend import _numpy_to_torch

STAGED_BYTES = 4 << 20
"""Host arrays up to this size reach the GPU through a page-locked staging block."""


@functools.lru_cache(maxsize=None)
def factory(device: str) -> TensorHandleFactory:
    import torch

    target = torch.device(device)
    if target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    name = str(target)

    def copy_in(value: Any) -> Any:
        if not isinstance(value, np.ndarray) and device_of(value) != "cpu":
            return to_device(value, name)  # a user's CUDA tensor, of this device or another
        source = _numpy_to_torch(value)
        if source.nbytes > STAGED_BYTES:
            # From pageable memory the copy returns once the driver has read the array: it may
            # be freed right after, so no staging buffer has to outlive the call.
            return source.to(target, non_blocking=True)
        # Small arrays go through page-locked memory from torch's caching host allocator: a
        # pageable copy costs 20-40 us of driver staging and a fresh device block (a GpuAcc run of
        # a small CNN on the H100 machine: 62 us in aten::_to_copy). The block is not reused
        # before the copy is done: torch records the copy's event on it.
        staged = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        staged.copy_(source)
        return staged.to(target, non_blocking=True)

    def import_(value: Any) -> Any:
        # Another library's (or backend's) CUDA memory through DLPack: torch asks the producer
        # for it on the current stream, and the producer makes that stream wait for its writes.
        return value if isinstance(value, torch.Tensor) else torch.from_dlpack(value)

    def copy_out(tensor: Any) -> np.ndarray:
        # Into page-locked memory (torch's caching host allocator reuses it once the array dies):
        # the DMA runs at full speed, where a pageable download is staged through the driver.
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor).numpy()

    return TensorHandleFactory(f"torch-{name}", MemorySource.CUDA, MemorySource.CUDA,
                               MemorySource.CUDA, supports_mapping=False, device=name,
                               copy_in=copy_in, copy_out=copy_out, import_=import_)
