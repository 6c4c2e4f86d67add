"""builtin: always registered; owns the glue between backends (MemCopy) and, later, control flow.

Like onert's builtin backend, its kernels are never taken from other backends, and the optimizer
places its layers itself rather than by preference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backplane.backends.api.backend import Backend, Workload, WorkloadFactory
from backplane.backends.api.memory import TensorHandleFactory
from backplane.ir.graph import Layer, TensorInfo

BUILTIN_OPS = ("MemCopy",)


def make_mem_copy(source: TensorHandleFactory, target: TensorHandleFactory) -> Workload:
    """Copy a tensor out of ``source`` memory into ``target`` memory."""
    copy_out, copy_in = source.copy_out, target.copy_in

    def mem_copy(x: Any) -> tuple[Any]:
        return (copy_in(copy_out(x)),)

    return mem_copy


class BuiltinWorkloadFactory(WorkloadFactory):
    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        if layer.op_type == "MemCopy":
            return make_mem_copy(layer.attrs["source"], layer.attrs["target"])
        return super().create_workload(layer, inputs, outputs)


class Builtin(Backend):
    id = "builtin"
    version = "1.0.0"

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return BuiltinWorkloadFactory(self, memory_manager)
