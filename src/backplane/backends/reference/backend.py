"""CpuRef: readable NumPy kernels, the executable specification every other backend is tested against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backplane.backends.api.backend import Backend, Workload, WorkloadFactory
from backplane.backends.api.memory import is_host_allocator
from backplane.backends.reference.kernels import ANY_DTYPE_OPS, CHECKS, KERNELS
from backplane.backends.reference.write_into import writing_into
from backplane.ir.graph import Layer, TensorInfo


class RefWorkloadFactory(WorkloadFactory):
    """The kernels bound, those that can write into given memory with a ``write_into``."""

    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        workload = super().create_workload(layer, inputs, outputs)
        return writing_into(workload, layer, inputs, outputs)


class CpuRef(Backend):
    id = "CpuRef"
    version = "1.0.0"
    KERNELS = KERNELS
    CHECKS = CHECKS
    ANY_DTYPE_OPS = ANY_DTYPE_OPS

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "Reference": True, "HostThreads": "blas"}

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return RefWorkloadFactory(self, memory_manager)

    def use_custom_allocator(self, allocator: Any) -> bool:
        """A host allocator: NumPy arrays over its memory (the runtime allocates them)."""
        return is_host_allocator(allocator)
