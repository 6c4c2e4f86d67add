"""SupportRegistry: layer-support objects by backend id (Arm NN's LayerSupportRegistry).

"When ArmNN needs to decide if a layer is supported on a backend, it looks up the factory function
through the registry. Then it creates an ILayerSupport object for the given backend and calls the
corresponding API function to check if the layer is supported." A support query therefore needs no
backend: no options, no context, no memory, no device. ``partition()`` asks only this registry.

A layer-support object has the backend's ``id`` and ``is_layer_supported(layer, inputs, outputs)
-> Support``. The bundled backends register theirs below, in one place. A plugin registers its own
(``supports.register("MyNpu", MyNpuSupport)``); an id with none registered is answered by its
backend, made once from the BackendRegistry and kept (a backend is its own layer support).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from backplane.backends.api.backend import Backend, BackendOptions, Support, support_of
from backplane.backends.registry.registry import BackendRegistry
from backplane.ir.graph import Layer, TensorInfo


class LayerSupport(Protocol):
    """Arm NN's ILayerSupport: whether one backend takes a layer, and why not."""

    id: str

    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support: ...


SupportFactory = Callable[[], LayerSupport]


class ClassSupport:
    """A bundled backend's layer support, made without the backend: its class's own
    ``is_layer_supported`` (the one check, never a copy of it), run on this object, which holds
    only what that check reads: the kernel tables and the reason the backend cannot run here."""

    options = BackendOptions()
    kernel_for = Backend.kernel_for  # the default check's helpers, on this object's tables
    _no_kernel_reason = Backend._no_kernel_reason

    def __init__(self, backend_class: type[Backend], missing: str | None = None) -> None:
        self.id = backend_class.id
        self.missing = missing
        self.KERNELS: Any = backend_class.KERNELS
        self.CHECKS: Any = backend_class.CHECKS
        self.ANY_DTYPE_OPS = backend_class.ANY_DTYPE_OPS
        self.OPTIONS = backend_class.OPTIONS  # the options its partitions' specs may name
        self._check = backend_class.is_layer_supported

    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        return self._check(self, layer, inputs, outputs)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<layer support {self.id}>"


class SupportRegistry:
    """Layer-support factories by backend id; each factory is called once, at the first query."""

    def __init__(self, backends: BackendRegistry | None = None) -> None:
        self._factories: dict[str, SupportFactory] = {}
        self._made: dict[str, LayerSupport] = {}
        self._backends = backends

    def register(self, backend_id: str, factory: SupportFactory) -> None:
        if backend_id in self._factories:
            raise ValueError(f"a layer support for backend id '{backend_id}' is already "
                             f"registered; deregister it first")
        self._factories[backend_id] = factory

    def deregister(self, backend_id: str) -> None:
        if backend_id not in self._factories:
            raise KeyError(f"no layer support registered for backend id '{backend_id}'; "
                           f"registered: {', '.join(self._factories) or '(none)'}")
        del self._factories[backend_id]
        self._made.pop(backend_id, None)

    def ids(self) -> list[str]:
        return list(self._factories)

    def support(self, backend_id: str) -> LayerSupport:
        """The layer support of ``backend_id``: its registered one, else its backend (made once
        from the backend registry: an unknown id is its UnknownBackendError, naming the known)."""
        made = self._made.get(backend_id)
        if made is None:
            factory = self._factories.get(backend_id)
            made = factory() if factory is not None else self._backend(backend_id)
            self._made[backend_id] = made
        return made

    def is_layer_supported(self, backend_id: str, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        """``backend_id``'s answer for ``layer``, held to the contract as the optimizer holds a
        backend's (``support_of``: an exception or a non-Support answer is a refusal)."""
        return support_of(self.support(backend_id), layer, inputs, outputs)

    def _backend(self, backend_id: str) -> Backend:
        if self._backends is None:
            from backplane.backends.registry import registry

            self._backends = registry
        return self._backends.create(backend_id)


# -- the bundled backends' layer supports ----------------------------------------------------------
def _cpuref() -> LayerSupport:
    from backplane.backends.reference.backend import CpuRef

    return ClassSupport(CpuRef)


def _builtin() -> LayerSupport:
    from backplane.backends.builtin.backend import Builtin

    return Builtin()  # always made by every optimization: it is its own layer support


def _torch(gpu: bool) -> LayerSupport:
    from backplane.backends.torch.backend import CpuAcc, GpuAcc

    backend_class = GpuAcc if gpu else CpuAcc
    support = ClassSupport(backend_class)
    support.missing = backend_class._missing(support)  # type: ignore[arg-type]  # torch, CUDA
    if support.missing is None:  # the tables CpuAcc's and GpuAcc's __init__ take from torch
        from backplane.backends.torch import kernels

        support.KERNELS, support.CHECKS = kernels.KERNELS, kernels.CHECKS
        support.input_dtypes = kernels.INPUT_DTYPES  # type: ignore[attr-defined]
    return support


def _openvino() -> LayerSupport:
    from backplane.backends.openvino.backend import OpenVINO, openvino_missing

    return ClassSupport(OpenVINO, openvino_missing())


def bundled(backends: BackendRegistry | None = None) -> SupportRegistry:
    """A support registry with the bundled backends' layer supports; other ids are answered by
    their backend from ``backends`` (default: ``backplane.registry``)."""
    found = SupportRegistry(backends)
    found.register("builtin", _builtin)
    found.register("CpuRef", _cpuref)
    found.register("CpuAcc", lambda: _torch(gpu=False))
    found.register("GpuAcc", lambda: _torch(gpu=True))
    found.register("OpenVINO", _openvino)
    return found


supports = bundled()
"""The default support registry, beside ``backplane.registry`` (the backends)."""
