"""The default registry, with the built-in backends registered explicitly, in one place."""

from __future__ import annotations

from backplane.backends.registry.registry import BackendRegistry, Registration, UnknownBackendError


def _builtin_registry() -> BackendRegistry:
    from backplane.backends.openvino.backend import OpenVINO  # imports openvino only when created
    from backplane.backends.reference.backend import CpuRef
    from backplane.backends.torch.backend import CpuAcc, GpuAcc  # imports torch only when created

    registry = BackendRegistry()  # builtin is in every registry from the start
    registry.register(CpuRef.id, CpuRef, origin="built in")
    registry.register(CpuAcc.id, CpuAcc, origin="built in")
    registry.register(GpuAcc.id, GpuAcc, origin="built in")
    registry.register(OpenVINO.id, OpenVINO, origin="built in")
    return registry


registry = _builtin_registry()

__all__ = ["BackendRegistry", "Registration", "UnknownBackendError", "registry"]
