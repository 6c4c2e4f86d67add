"""The backend contract (Arm NN's IBackendInternal, onert's Backend), with a default for everything.

A minimal backend is an id, a support check and a table of kernels::

    class MyBackend(Backend):
        id = "MyBackend"
        KERNELS = {"Relu": {6: lambda x: (np.maximum(x, 0),)}}

Everything else (workload factory, memory manager, backend context, profiling context, capabilities,
tensor-handle factories, custom allocator, ``optimize_subgraph``) has a default that a backend
overrides when it does more.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from backplane.backends.api.kernels import Kernel, UnsupportedError, bind_kernel, select_kernel
from backplane.backends.api.memory import HOST_FACTORY, MemoryManager, TensorHandleFactory
from backplane.backends.api.optimization import OptimizationViews
from backplane.ir.graph import Layer, SubgraphView, TensorInfo

BACKEND_API_VERSION = (1, 0)
"""The version of this contract: a backend written against (major, minor) loads when the major is
equal and its minor is not above ours (seed 000, "Dynamic backend versioning")."""

Workload = Callable[..., tuple[Any, ...]]
"""A prepared call: inputs positional, a tuple of outputs back. Created once at load, run many times.

A workload that runs several layers of its own may also have ``profiled(*inputs) -> (outputs,
[(layer name, op type, seconds), ...])``: a profiled run then times its layers one by one (CpuAcc's
OneDnnGraph when it runs its layers one by one)."""



def is_numpy_native(dtype: np.dtype | None) -> bool:
    """NumPy's own element types; ml_dtypes' bfloat16, float8 and int4 are not claimed by default.

    float8_e5m2 reports kind "f" like float32, so the test is whether NumPy built the type in.
    """
    return dtype is not None and (dtype.isbuiltin == 1 or dtype.kind in "OSU")


@dataclass(frozen=True)
class Support:
    """A support decision and, when refused, the reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


SUPPORTED = Support(True)


def unsupported(reason: str) -> Support:
    return Support(False, reason)


class BackendContext:
    """Lives as long as the Runtime; told before and after every network load and unload."""

    def before_load_network(self, network_id: int) -> None: ...
    def after_load_network(self, network_id: int) -> None: ...
    def before_unload_network(self, network_id: int) -> None: ...
    def after_unload_network(self, network_id: int) -> None: ...


class ProfilingContext:
    """Receives the time each of the backend's workloads took when a run is profiled."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def record(self, layer_name: str, seconds: float) -> None:
        self.events.append((layer_name, seconds))


@dataclass
class WorkloadFactory:
    """Creates a workload per layer, once, at load time. The default binds the backend's kernels."""

    backend: Backend
    memory_manager: MemoryManager | None = None
    network_id: int = 0
    """The id of the network being loaded (set by the runtime; builtin loads bodies under it)."""

    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        kernel = self.backend.kernel_for(layer)
        if kernel is None:
            raise UnsupportedError(f"{self.backend.id} has no kernel for {layer.describe()}")
        return bind_kernel(kernel, layer.attrs, len(layer.outputs))


class OptionError(ValueError):
    """A backend option with a value the backend does not take: the user's to fix, never a reason
    to fall back to another backend (the message lists the values it takes)."""


@dataclass(frozen=True)
class BackendOptions:
    """Backend options ("CpuAcc.compile": "layers", "GpuAcc.device": "cuda:1", ...): those of a
    network reach its own backends (``Backend.options``), a Runtime's reach its backend contexts."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)


class Backend:
    """Base class of every backend: one screen for a trivial one, overrides for the rest."""

    id: ClassVar[str] = ""
    version: ClassVar[str] = "0.0.0"
    api_version: ClassVar[tuple[int, int]] = BACKEND_API_VERSION
    KERNELS: ClassVar[Mapping[str, Mapping[int, Kernel]]] = {}
    CHECKS: ClassVar[Mapping[str, Callable[[Layer, Sequence[TensorInfo]], str | None]]] = {}
    """Optional per-op checks: given a layer and its input infos, a reason it is refused, or None."""
    ANY_DTYPE_OPS: ClassVar[frozenset[str]] = frozenset()
    """Ops whose kernels are right for every element type their ONNX schema allows, ml_dtypes'
    bfloat16, float8 and int4 included (data movement, casts): the NumPy-dtype check skips them."""
    OPTIONS: ClassVar[Mapping[str, str]] = {}
    """The options this backend takes ("<id>.<name>" -> what it does): any other option named
    after the backend's id is an error that lists these (``check_options``)."""
    options: BackendOptions = BackendOptions()
    """The options of the network this backend belongs to: ``optimize`` creates a backend for each
    network and sets them before asking it anything; ``Runtime.load`` adds the runtime's options
    that the network does not set. Read them from here, never from a context."""

    def __repr__(self) -> str:
        return f"<backend {self.id} {self.version}>"

    # -- support --------------------------------------------------------------------------------
    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        """Default: a kernel for the op at the model's opset, known attributes, NumPy dtypes."""
        kernel = self.kernel_for(layer)
        if kernel is None:
            return unsupported(self._no_kernel_reason(layer))
        unknown = _unknown_attributes(kernel, layer.attrs)
        if unknown:
            return unsupported(f"attribute(s) {', '.join(unknown)} not implemented")
        key = kernel_key(layer)
        for info in (*inputs, *outputs):
            if info.dtype is not None and not is_numpy_native(info.dtype) \
                    and key not in self.ANY_DTYPE_OPS:
                return unsupported(f"data type {info.dtype.name} not supported")
        check = self.CHECKS.get(key)
        reason = check(layer, inputs) if check else None
        return unsupported(reason) if reason else SUPPORTED

    def kernel_for(self, layer: Layer) -> Kernel | None:
        return select_kernel(self.KERNELS, kernel_key(layer), layer.opset)

    def _no_kernel_reason(self, layer: Layer) -> str:
        key = kernel_key(layer)
        versions = self.KERNELS.get(key)
        if not versions:
            return f"no kernel for {key}"
        return f"no kernel for {key} at opset {layer.opset} (kernels from opset {min(versions)})"

    # -- factories ------------------------------------------------------------------------------
    def create_memory_manager(self) -> MemoryManager | None:
        return None

    def create_workload_factory(self, memory_manager: MemoryManager | None = None) -> WorkloadFactory:
        return WorkloadFactory(self, memory_manager)

    def create_backend_context(self, options: BackendOptions) -> BackendContext | None:
        return None

    def create_profiling_context(self, options: BackendOptions) -> ProfilingContext | None:
        return None

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        """Where this backend's tensors live, preferred first. Default: host memory, shared by all."""
        return (HOST_FACTORY,)

    def use_custom_allocator(self, allocator: Any) -> bool:
        """Whether the backend accepts a custom allocator for its tensors. Default: no."""
        return False

    # -- description ----------------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        """Name / value pairs (Arm NN's BackendCapabilities)."""
        return {"AsyncExecution": False, "ProtectedContentAllocation": False}

    def availability(self) -> Support:
        """Whether the backend can run on this machine (a device present, a library installed)."""
        return SUPPORTED

    # -- optimization ---------------------------------------------------------------------------
    def optimize_subgraph(self, view: SubgraphView) -> OptimizationViews:
        """Rewrite or compile a subgraph assigned to this backend. Default: leave it untouched."""
        return OptimizationViews(untouched=[view])


def check_options(backend: Backend, options: Mapping[str, Any]) -> None:
    """OptionError for an option named after ``backend``'s id that it does not take (a misspelled
    one would otherwise do nothing, unseen)."""
    prefix = f"{backend.id}."
    unknown = sorted(k for k in options if k.startswith(prefix) and k not in backend.OPTIONS)
    if unknown:
        takes = ", ".join(backend.OPTIONS) or "none"
        raise OptionError(f"{', '.join(map(repr, unknown))}: not an option of {backend.id}; its "
                          f"options are: {takes}")


def kernel_key(layer: Layer) -> str:
    """A layer's key in KERNELS, CHECKS and ANY_DTYPE_OPS: its op type, prefixed with its domain
    outside the default one ("ai.onnx.ml::LabelEncoder"); ``layer.opset`` is that domain's."""
    return layer.op_type if layer.domain in ("", "ai.onnx") else f"{layer.domain}::{layer.op_type}"


def _unknown_attributes(kernel: Kernel, attrs: Mapping[str, Any]) -> list[str]:
    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [name for name in attrs if name not in params]
