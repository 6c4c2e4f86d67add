"""The backend contract (Arm NN's IBackendInternal, onert's Backend), with a default for everything.

A minimal backend is an id, a support check and a table of kernels::

    class MyBackend(Backend):
        id = "MyBackend"
        KERNELS = {"Relu": {6: lambda x: (np.maximum(x, 0),)}}

Everything else (workload factory, memory manager, backend context, profiling context, capabilities,
tensor-handle factories, custom allocator, ``optimize_subgraph``) has a default that a backend
overrides when it does more.

Ahead of time (ExecuTorch's delegates, ``docs/artifact.md``): a backend may also turn each of its
partitions into a blob at compile time (``preprocess``) and that blob into a runnable handle when
the artifact loads (``init``, ``execute``, ``destroy``). A backend without them keeps its layers as
plain layers in the artifact, bound to its kernels at load.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from backplane.backends.api.kernels import (Kernel, UnsupportedError, bind_kernel, parameters,
                                            select_kernel)
from backplane.backends.api.memory import (HOST_FACTORY, MemoryManager, TensorHandleFactory,
                                           TensorRegistry)
from backplane.backends.api.optimization import OptimizationViews
from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo

BACKEND_API_VERSION = (1, 0)
"""The version of this contract: a backend written against (major, minor) loads when the major is
equal and its minor is not above ours (Arm NN's dynamic backends documentation, "Dynamic backend
versioning")."""

DELEGATE_DOMAIN = "backplane.delegate"
"""The domain of a ``Delegate`` layer: one partition preprocessed into a blob, run by its backend's
``init`` / ``execute`` (see ``CompileSpec``, ``PreprocessResult``, ``InitContext``)."""

Workload = Callable[..., tuple[Any, ...]]
"""A prepared call: inputs positional, a tuple of outputs back. Created once at load, run many times.

A workload that runs several layers of its own may also have ``profiled(*inputs) -> (outputs,
[(layer name, op type, seconds[, output bytes]), ...])``: a profiled run then times its layers one by
one (CpuAcc's OneDnnGraph when it runs its layers one by one).

A workload that can write its outputs into memory it is given may have ``write_into(memory,
*inputs) -> outputs``, ``memory`` holding per output a tensor of its backend's memory to write that
output into, or None: where an output crosses to another backend through fallback memory, the
producer then writes it there and nothing is copied (``runtime/fallback.py``)."""



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


def support_of(backend: Any, layer: Any, inputs: Sequence[Any], outputs: Sequence[Any]) -> Support:
    """``backend``'s answer for ``layer``, held to the contract: a ``Support``. An answer of
    another type, or an exception from the query, is a refusal whose reason names the backend's
    mistake (the layer goes to the next backend; the report keeps the reason)."""
    try:
        answer = backend.is_layer_supported(layer, inputs, outputs)
    except OptionError:
        raise  # the user's option, not the backend's mistake: ``check_options`` names it
    except Exception as exc:  # noqa: BLE001  # a plugin's bug: refused, with its reason
        return unsupported(f"{backend.id}.is_layer_supported raised {type(exc).__name__}: {exc}")
    if not isinstance(answer, Support):
        return unsupported(f"{backend.id}.is_layer_supported returned {answer!r} "
                           f"({type(answer).__name__}); it must return a backplane.Support "
                           f"(SUPPORTED, or unsupported(reason))")
    return answer


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
    tensors: TensorRegistry | None = None
    """The tensors of the backend's partition, where it has its own (``Backend.gen_tensors``) or
    a custom allocator's: set by the runtime before any workload is made, so that a workload may
    write its outputs into them (the runtime copies an output there where it did not)."""

    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        if layer.domain == DELEGATE_DOMAIN:
            return delegate_workload(self.backend, layer, self.network_id)
        kernel = self.backend.kernel_for(layer)
        if kernel is None:
            raise UnsupportedError(f"{self.backend.id} has no kernel for {layer.describe()}")
        return bind_kernel(kernel, layer.attrs, len(layer.outputs))

    def create_fallback_import(self, layer: Layer) -> Workload:
        """The workload of a FallbackImport layer whose source is this backend (the Ethos-N design
        creates it from the source backend, not the layer's): it runs after the producer wrote the
        fallback memory and before the consumer reads it, and returns its input once the source's
        writes are done. Default: a backend that runs synchronously has nothing to wait for; an
        asynchronous one waits for its queue (Arm NN's ClFallbackImportWorkload: a CL sync)."""
        return _written


def _written(x: Any) -> tuple[Any]:
    return (x,)


@dataclass(frozen=True)
class CompileSpec:
    """One setting a partition was preprocessed with (ExecuTorch's CompileSpec): a name and a
    JSON value; the artifact stores them beside the blob and hands them back to ``init``."""

    key: str
    value: Any


@dataclass
class PreprocessResult:
    """What ``Backend.preprocess`` makes of one partition (ExecuTorch's PreprocessResult).

    ``debug_handle_map`` maps what runs inside the blob (a fused layer, a compiled partition) to
    the model's node names it holds, so that errors and profiles inside a delegate name them."""

    processed_bytes: bytes
    debug_handle_map: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class InitContext:
    """What ``Backend.init`` gets besides its blob (ExecuTorch's BackendInitContext).

    ``graph`` is the partition's portable subgraph, stored beside the blob: its layers, its input
    and output names and infos, and the constants it reads, mapped from the artifact (stored once
    for all partitions, never copied into a blob). ``network_id`` is the network being loaded."""

    graph: Graph
    network_id: int = 0


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
    custom_allocator: Any = None
    """The allocator of ``RuntimeOptions.custom_allocators`` this backend accepted (set by the
    runtime at load): its tensors are allocated from it."""
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
        """Whether the backend accepts ``allocator`` (a ``CustomAllocator``) for its tensors; where
        it does, the runtime sets ``custom_allocator`` and allocates the backend's tensors from it
        (``runtime/tensors.py``). Default: no (CpuRef and CpuAcc take a host allocator)."""
        return False

    def gen_tensors(self, tensors: Mapping[str, TensorInfo]) -> TensorRegistry | None:
        """Make the tensors of this backend's partition of a network being loaded (onert's
        BackendContext::genTensors): given every tensor its layers read or write but the constants,
        by name, return those it makes, owned by it until the network is unloaded (the registry's
        ``release``). The runtime hands them to the workload factory, copies each foreign input
        into its tensor before a layer reads it and each output its workload did not write there
        into it. Default: None, the backend's kernels allocate their outputs (or the runtime
        allocates them from ``custom_allocator``)."""
        return None

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

    # -- ahead of time (the delegate contract) ---------------------------------------------------
    def machine_facts(self) -> dict[str, str]:
        """What this backend's blobs depend on here (instruction sets, GPU architecture, library
        versions): stored in the artifact, compared at load. Default: nothing."""
        return {}

    def preprocess(self, graph: Graph, compile_specs: Sequence[CompileSpec],
                   ) -> PreprocessResult | None:
        """Compile one of this backend's partitions (``graph``: its layers, as optimized) into a
        blob, at compile time. Default: None, the layers stay plain and bind at load."""
        return None

    def init(self, processed: bytes | memoryview, compile_specs: Sequence[CompileSpec],
             context: InitContext) -> Any:
        """Turn a blob made by ``preprocess`` into a handle for ``execute``, when the artifact
        loads: the only code an artifact runs on load."""
        raise NotImplementedError(f"backend {self.id} made a blob but has no init")

    def execute(self, handle: Any, *inputs: Any) -> tuple[Any, ...]:
        """Run a handle made by ``init``: inputs positional, a tuple of outputs back."""
        raise NotImplementedError(f"backend {self.id} made a blob but has no execute")

    def destroy(self, handle: Any) -> None:
        """Release what ``init`` took (the network is unloaded). Default: nothing."""


def delegate_workload(backend: Backend, layer: Layer, network_id: int) -> Workload:
    """The workload of a Delegate layer: its blob through ``backend.init`` once, here, at load;
    ``execute`` at every run; ``destroy`` when the network is unloaded (or the workload dropped)."""
    attrs = layer.attrs
    specs = [CompileSpec(key, value) for key, value in attrs["compile_specs"]]
    handle = backend.init(attrs["blob"], specs, InitContext(attrs["graph"], network_id))
    execute = backend.execute

    def run(*inputs: Any) -> tuple[Any, ...]:
        return execute(handle, *inputs)

    profiled = getattr(handle, "profiled", None)
    if profiled is not None:  # a handle that times its own layers, named after the model's nodes
        run.profiled = profiled  # type: ignore[attr-defined]
    run.destroy = weakref.finalize(run, backend.destroy, handle)  # type: ignore[attr-defined]
    from backplane.runtime import host_route

    host_route.forward(run, handle)  # a handle with NumPy runs: CpuAcc's, which execute calls
    return run


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
        params = parameters(kernel)
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    return [name for name in attrs if name not in params]
