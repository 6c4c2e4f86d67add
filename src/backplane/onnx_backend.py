"""backplane as an onnx.backend.base.Backend (prepare / run_model / supports_device)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx
from onnx.backend.base import Backend, BackendRep

from backplane.session import InferenceSession


class BackplaneRep(BackendRep):
    def __init__(self, session: InferenceSession) -> None:
        self.session = session

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        names = [arg.name for arg in self.session.get_inputs()]
        if isinstance(inputs, dict):
            feeds = inputs
        else:
            feeds = dict(zip(names, inputs if isinstance(inputs, (list, tuple)) else [inputs]))
        return tuple(self.session.run(None, feeds))


class BackplaneBackend(Backend):
    """``device`` is a comma-separated backend preference list (default CpuRef), or "CPU"."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> BackplaneRep:
        return BackplaneRep(InferenceSession(model, backends=_backends(device)))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> tuple[Any, ...]:
        return cls.prepare(model, device).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        from backplane.backends.registry import registry
        return device == "CPU" or all(b in registry.ids() for b in _backends(device))


REFERENCE = ("CpuRef",)
"""The "CPU" device: the reference backend (the node suite's known failures are CpuRef's); name
other backends as the device ("CpuAcc,CpuRef")."""


def _backends(device: str) -> Sequence[str]:
    return REFERENCE if device in ("CPU", "") else [d.strip() for d in device.split(",")]


prepare = BackplaneBackend.prepare
run_model = BackplaneBackend.run_model
supports_device = BackplaneBackend.supports_device
