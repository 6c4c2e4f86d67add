"""CpuRef: readable NumPy kernels, the executable specification every other backend is tested against."""

from __future__ import annotations

from typing import Any

from backplane.backends.api.backend import Backend
from backplane.backends.api.memory import is_host_allocator
from backplane.backends.reference.kernels import ANY_DTYPE_OPS, CHECKS, KERNELS


class CpuRef(Backend):
    id = "CpuRef"
    version = "1.0.0"
    KERNELS = KERNELS
    CHECKS = CHECKS
    ANY_DTYPE_OPS = ANY_DTYPE_OPS

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "Reference": True, "HostThreads": "blas"}

    def use_custom_allocator(self, allocator: Any) -> bool:
        """A host allocator: NumPy arrays over its memory (the runtime allocates them)."""
        return is_host_allocator(allocator)
