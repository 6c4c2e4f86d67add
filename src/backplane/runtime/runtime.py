"""Runtime: holds the backends' contexts, loads optimized networks under ids, runs them."""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from backplane.backends.api.backend import (Backend, BackendContext, BackendOptions, OptionError,
                                            ProfilingContext, check_options)
from backplane.backends.registry import BackendRegistry
from backplane.backends.registry import registry as default_registry
from backplane.backends.registry.dynamic import backend_paths
from backplane.backends.registry.registry import UnknownBackendError
from backplane.backends.api.memory import device_of, host_view
from backplane.ir.graph import TensorInfo
from backplane.install_hints import hint
from backplane.optimizer.optimize import OptimizedNetwork
from backplane.runtime.loaded_network import LayerTiming, LoadedNetwork, Plan, WorkloadError
from backplane.runtime.ownership import owned
from backplane.runtime.prepared_run import host_run, prepared_check  # noqa: F401  # its name
from backplane.runtime.user_buffers import INTO

log = logging.getLogger("backplane.runtime")


class InvalidInputError(ValueError):
    """The inputs given to a run do not match the model: a name, a dtype, a shape."""


@dataclass
class RuntimeOptions:
    """``backend_options`` go to every backend context, and to the backends of every network loaded
    here where the network's own (``optimize(backend_options=...)``) do not set them;
    ``custom_allocators`` maps a backend id to the allocator its tensors are allocated from (Arm
    NN's m_CustomAllocatorMap; a ``CustomAllocator``, ``runtime/tensors.py``); ``profiling``
    profiles every run: each backend's profiling context (a plain ``ProfilingContext`` where the
    backend makes none), in ``Runtime.profiling`` by backend id, records the time of each layer
    it ran."""

    backend_options: dict[str, Any] = field(default_factory=dict)
    custom_allocators: dict[str, Any] = field(default_factory=dict)
    profiling: bool = False
    dynamic_backends_path: str | None = None
    """One directory of dynamic backends that replaces BACKPLANE_DYNAMIC_BACKEND_PATHS entirely."""
    backends: list[str] | None = None
    """The backends this runtime will use (an InferenceSession names its list): their contexts
    are made when it is created. None: each backend's context is made at its first load (making
    every registered backend's would import torch and OpenVINO; see docs/architecture.md)."""


class Runtime:
    """Loads networks and runs them (Arm NN's IRuntime). Backend contexts live as long as it does.

    Created, it registers the dynamic backends on its paths and makes the contexts of the backends
    it will use (``RuntimeOptions.backends``, and those dynamic ones); it holds each backend it
    uses in the registry until it goes (``close``, or its finalizer): the last Runtime to go calls
    a backend's ``destroy`` hook and unregisters a dynamic backend it loaded."""

    def __init__(self, options: RuntimeOptions | None = None,
                 registry: BackendRegistry | None = None) -> None:
        self.options = options or RuntimeOptions()
        self.registry = registry or default_registry
        self.contexts: dict[str, BackendContext] = {}
        self.profiling: dict[str, ProfilingContext] = {}
        self._networks: dict[int, LoadedNetwork] = {}
        self._host_runs: dict[int, Callable[[Any], list[Any] | None]] = {}  # see host_run
        self._ids = itertools.count(1)
        self._held: set[str] = set()  # the backend ids this runtime holds in the registry
        self._asked: set[str] = set()  # those whose context was made (or is None)
        self._finalizer = weakref.finalize(self, self.registry.let_go, self._held)
        paths = backend_paths(self.options.dynamic_backends_path)
        dynamic = self.registry.hold_dynamic_backends(paths) if paths else []
        self._held.update(dynamic)
        for backend_id in ["builtin", *(self.options.backends or ()), *dynamic]:
            self._context_at_creation(backend_id, named=backend_id not in dynamic)

    def _context_at_creation(self, backend_id: str, named: bool) -> None:
        """Make ``backend_id``'s context now, where it is registered and available here; a
        failure is raised for a backend the options name, logged for a dynamic one (its first
        load raises it again)."""
        if backend_id in self._asked:
            return
        try:
            backend = self.registry.create(backend_id)
        except UnknownBackendError:
            return  # optimize names it, with the known ones
        if not backend.availability():
            return
        try:
            self._context_for(backend)
        except Exception as exc:
            if named:
                raise
            log.warning("backend %s: no context at the runtime's creation: %s: %s", backend_id,
                        type(exc).__name__, exc)

    def _context_for(self, backend: Backend) -> BackendContext | None:
        """The backend's context in this runtime, made at the runtime's creation or by the first
        backend of its id to load; the runtime holds the backend from then on."""
        if backend.id not in self._held:
            self._held.add(backend.id)
            self.registry.hold(backend.id)
        if backend.id not in self._asked:  # once per id, None (no context) included
            options = BackendOptions(self.options.backend_options)
            context = backend.create_backend_context(options)
            if context is not None:
                self.contexts[backend.id] = context
            if self.options.profiling:
                self.profiling[backend.id] = backend.create_profiling_context(options) \
                    or ProfilingContext()
            self._asked.add(backend.id)
        return self.contexts.get(backend.id)

    def _configure(self, network: OptimizedNetwork) -> list[str]:
        """Give the backends of ``network`` and of its bodies their options and allocators; returns
        their ids, each once (a backend used only inside a body gets its context too)."""
        ids: list[str] = []
        for net in within(network):
            options = BackendOptions({**self.options.backend_options, **net.backend_options})
            for backend_id, backend in net.backends.items():
                check_options(backend, options.values)
                backend.options = options
                allocator = self.options.custom_allocators.get(backend_id)
                if allocator is not None:
                    if not callable(getattr(allocator, "allocate", None)):
                        raise TypeError(f"the custom allocator {allocator!r} given for backend "
                                        f"{backend_id} has no allocate(nbytes, alignment) "
                                        f"(see backplane.backends.api.memory.CustomAllocator)")
                    if not backend.use_custom_allocator(allocator):
                        raise ValueError(f"backend {backend_id} does not accept the custom "
                                         f"allocator {allocator!r} given for it in "
                                         f"RuntimeOptions.custom_allocators")
                    backend.custom_allocator = allocator
                if backend_id not in ids:
                    ids.append(backend_id)
                    self._context_for(backend)
        return ids

    def prepare(self, network: OptimizedNetwork) -> None:
        """Give the network's backends their options, allocators and contexts without loading it:
        what compiling an artifact does before the backends preprocess their partitions."""
        self._configure(network)

    def load(self, network: OptimizedNetwork) -> int:
        """Create every workload of the network once; returns the id to run it by.

        A backend that cannot create the workload of a layer it took gives the layer up (Arm NN's
        failed subgraph, found at load): the network is optimized again without that backend for
        the model's layers behind it, which go to the next backend that supports them, with the
        reason in the report. The load fails when no backend is left, or in strict mode. A network
        whose weights a load released (``optimizer/release.py``) is made again to load."""
        if network.released:
            if network.remake is None:
                raise ValueError("this network's weights were released after its load, and it has "
                                 "no model file to be made again from: load the model again "
                                 "(SessionOptions.keep_initializers keeps them)")
            network = network.remake(dict(network.exclusions))  # released as it loads
        if not self._finalizer.alive:
            raise RuntimeError("this Runtime is closed: create another to load networks")
        network_id = next(self._ids)
        told: list[BackendContext] = []
        while True:  # each retry keeps one more backend from a layer: it ends
            for backend_id in self._configure(network):
                context = self.contexts.get(backend_id)
                if context is not None and context not in told:
                    context.before_load_network(network_id)
                    told.append(context)
            try:
                loaded = LoadedNetwork(network, network_id, self.profiling)
                break
            except WorkloadError as exc:
                network = _without(network, exc)
        self._networks[network_id] = loaded
        if not self.options.profiling:
            self._host_runs[network_id] = host_run(loaded, _input_specs(loaded))
        for context in told:
            context.after_load_network(network_id)
        return network_id

    def unload(self, network_id: int) -> None:
        loaded = self._loaded(network_id)
        used = {b for net in within(loaded.network) for b in net.backends}
        contexts = [context for b, context in self.contexts.items() if b in used]
        for context in contexts:
            context.before_unload_network(network_id)
        del self._networks[network_id]
        self._host_runs.pop(network_id, None)
        loaded.close()  # memory managers, fallback memory, tensors, delegates' handles
        for context in contexts:
            context.after_unload_network(network_id)

    def close(self) -> None:
        """Unload every network still loaded and let go of the backends this runtime holds (the
        last Runtime to go calls a backend's ``destroy`` hook and unregisters the dynamic backends
        it loaded). Loading after is an error; closing again does nothing. A runtime dropped
        without ``close`` lets go of its backends when it is collected."""
        for network_id in list(self._networks):
            self.unload(network_id)
        self._finalizer()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def network(self, network_id: int) -> LoadedNetwork:
        return self._loaded(network_id)

    def run(self, network_id: int, inputs: Mapping[str, Any] | Sequence[Any],
            outputs_on: Sequence[str | None] | None = None,
            into: Sequence[np.ndarray | None] | None = None) -> list[Any]:
        """Run a loaded network; inputs by name (or in the model's order), outputs in the model's order.

        Inputs may be NumPy arrays or anything that speaks DLPack (torch, CuPy, JAX), on the host or
        a CUDA device: each is read where it is, without a copy where its first readers can import
        that memory. ``outputs_on`` names a device per output (None: host memory, as NumPy).
        ``into`` gives per output a host array to write it into, or None: the
        layer that makes the output writes it there where it can (``user_buffers``), and the
        array itself is that output's result."""
        if outputs_on is None and into is None and not self.options.profiling:
            fast = self._host_runs.get(network_id)
            outputs = None if fast is None else fast(inputs)
            if outputs is not None:
                return outputs
        if self.options.profiling:
            return self.run_profiled(network_id, inputs, outputs_on, into)[0]
        loaded = self._loaded(network_id)
        values = check_inputs(_input_specs(loaded), inputs)
        if outputs_on is None and into is None and not any(_on_device(v) for v in values):
            return owned(loaded.execute(values), values, loaded.held)
        if into is not None:
            plan, given = _placement(loaded, values, outputs_on, into), _given(into)
            return _owned_into(loaded.execute_plan(plan, [*values, *given]), into, values,
                               loaded.held)
        return owned(loaded.execute_plan(_placement(loaded, values, outputs_on), values), values,
                     loaded.held)

    def host_run(self, network_id: int) -> Callable[[Any], list[Any] | None]:
        """The network's run of a dict of NumPy feeds prepared at its load (``prepared_run``):
        the outputs, the caller's, or None where ``run`` must take the feeds (any other kind, a
        wrong one, all of them on a profiling runtime). A session calls it without ``run``'s
        frame; it must not outlive the network's unload."""
        return self._host_runs.get(network_id, _not_prepared)

    def run_profiled(self, network_id: int, inputs: Mapping[str, Any] | Sequence[Any],
                     outputs_on: Sequence[str | None] | None = None,
                     into: Sequence[np.ndarray | None] | None = None,
                     ) -> tuple[list[Any], list[LayerTiming]]:
        loaded = self._loaded(network_id)
        values = check_inputs(_input_specs(loaded), inputs)
        plan = _placement(loaded, values, outputs_on, into)
        outputs, timings = loaded.execute_profiled([*values, *_given(into)], plan)
        return _owned_into(outputs, into, values, loaded.held), timings

    def _loaded(self, network_id: int) -> LoadedNetwork:
        try:
            return self._networks[network_id]
        except KeyError:
            raise KeyError(f"no network loaded under id {network_id}; loaded ids are "
                           f"{sorted(self._networks)}") from None


def _without(network: OptimizedNetwork, failure: WorkloadError) -> OptimizedNetwork:
    """``network`` optimized again with ``failure``'s backend kept from its layer's model layers,
    or ``failure`` raised where that cannot be (strict mode, a builtin layer, nothing to remake)."""
    failure = _innermost(failure)
    path = getattr(failure, "body_path", "")  # a layer of a control-flow body, at any depth
    inner = getattr(failure, "body_network", network)
    names = [f"{path}{name}" for name in inner.layers_behind(failure.layer)]
    known = [name for name in names if failure.backend in network.exclusions.get(name, {})]
    if network.options.strict or network.remake is None or not names or known \
            or failure.backend == "builtin" or isinstance(failure.__cause__, OptionError):
        raise failure
    reason = f"could not create its workload: {failure.__cause__ or failure}"
    exclusions = {name: dict(reasons) for name, reasons in network.exclusions.items()}
    for name in names:
        exclusions.setdefault(name, {})[failure.backend] = reason
    message = (f"{failure.backend} could not create a workload for {failure.layer.name}; "
               f"{', '.join(names)} fall back to the next backend ({failure.__cause__})")
    log.warning(message)
    remade = network.remake(exclusions)
    remade.report.warnings.append(message)
    return remade


def _innermost(failure: WorkloadError) -> WorkloadError:
    """The failure of a body's layer where ``failure`` is its control-flow layer's (builtin's,
    raised from loading the body), else ``failure``."""
    while failure.backend == "builtin" and isinstance(failure.__cause__, WorkloadError) \
            and hasattr(failure.__cause__, "body_path"):
        failure = failure.__cause__
    return failure


def within(network: OptimizedNetwork) -> list[OptimizedNetwork]:
    """``network`` and the networks of its control-flow bodies, at any depth."""
    found = [network]
    for layer in network.graph.layers:
        found += [n for value in layer.attrs.values() if isinstance(value, OptimizedNetwork)
                  for n in within(value)]
    return found


def _on_device(value: Any) -> bool:
    """Whether a checked input is in device memory (host values are NumPy arrays by then)."""
    return not isinstance(value, np.ndarray) and hasattr(value, "__dlpack_device__")


def _placement(loaded: LoadedNetwork, values: Sequence[Any],
               outputs_on: Sequence[str | None] | None,
               into: Sequence[np.ndarray | None] | None = None) -> Plan:
    count = len(loaded.output_slots)
    if outputs_on is None:
        outputs_on = (None,) * count
    for what, given in (("output devices", outputs_on), ("output buffers", into or ())):
        if given and len(given) != count:
            raise InvalidInputError(f"{len(given)} {what} given; the model has {count} outputs")
    if into is not None:
        outputs_on = [INTO if b is not None else d for d, b in zip(outputs_on, into)]
    return loaded.plan([device_of(v) if _on_device(v) else "cpu" for v in values], outputs_on)


def _given(into: Sequence[np.ndarray | None] | None) -> list[np.ndarray]:
    """The buffers of ``into``, in the order of the outputs: the run's values after its inputs."""
    return [b for b in into if b is not None] if into else []


def _owned_into(outputs: list[Any], into: Sequence[np.ndarray | None] | None,
                inputs: Sequence[Any], held: Any) -> list[Any]:
    """``owned`` for a run whose outputs may be written into the caller's buffers (``into``): those
    are the caller's results as they are; any other output that views a buffer is copied."""
    if not into:
        return owned(outputs, inputs, held)
    mine = owned([None if b is not None else o for o, b in zip(outputs, into)],
                 [*inputs, *_given(into)], held)
    return [o if b is None else b for o, b in zip(mine, into)]


def _not_prepared(feeds: Any) -> None:
    return None


def _input_specs(loaded: LoadedNetwork) -> list[tuple[str, TensorInfo]]:
    graph = loaded.network.graph
    return [(name, graph.info(name)) for name in loaded.network.input_names]


def check_inputs(specs: Sequence[tuple[str, TensorInfo]],
                 inputs: Mapping[str, Any] | Sequence[Any]) -> list[Any]:
    """Inputs in the model's order, each checked for name, dtype, rank and sizes."""
    if isinstance(inputs, Mapping):
        if len(inputs) != len(specs) or any(name not in inputs for name, _ in specs):
            _raise_names(specs, inputs)
        values = [inputs[name] for name, _ in specs]
    else:
        values = list(inputs)
        if len(values) != len(specs):
            raise InvalidInputError(f"{len(values)} inputs given; the model has {len(specs)}: "
                                    f"{_expected(specs)}")
    bound: dict[str, tuple[int, str]] = {}
    return [_check_one(name, info, value, bound) for (name, info), value in zip(specs, values)]


def _expected(specs: Sequence[tuple[str, TensorInfo]]) -> str:
    return ", ".join(f"{name}: {info}" for name, info in specs)


def _raise_names(specs: Sequence[tuple[str, TensorInfo]], inputs: Mapping[str, Any]) -> None:
    """The error for feeds whose names are not the model's (built only when they are not)."""
    names = {name for name, _ in specs}
    unknown = [name for name in inputs if name not in names]
    if unknown:
        raise InvalidInputError(f"{unknown} {'is not an input' if len(unknown) == 1 else 'are not inputs'}"
                                f" of the model; its inputs are: {_expected(specs)}")
    missing = [name for name, _ in specs if name not in inputs]
    raise InvalidInputError(f"input(s) {missing} missing; the model's inputs are: {_expected(specs)}")


def _check_one(name: str, info: TensorInfo, value: Any, bound: dict[str, tuple[int, str]]) -> Any:
    if type(value) is np.ndarray and value.dtype == info.dtype and value.shape == info.shape:
        return value  # the common case, checked at once: the declared type and static shape
    if info.dtype is None:  # sequences, optionals: passed as they are
        return value
    dtype: Any
    if isinstance(value, np.ndarray):
        dtype = value.dtype
    elif hasattr(value, "__dlpack_device__") and device_of(value) != "cpu":
        value, dtype = _device_tensor(name, value)  # stays where it is
    else:
        value = host_view(value)
        dtype = value.dtype
    if dtype != info.dtype and not (info.dtype == object and dtype.kind in "OU"):
        raise InvalidInputError(f"input '{name}' has dtype {dtype}; the model expects "
                                f"{info.dtype} ({name}: {info})")
    if info.shape is None:
        return value
    shape = tuple(int(size) for size in value.shape)
    if len(shape) != len(info.shape):
        raise InvalidInputError(f"input '{name}' has shape {shape} (rank {len(shape)}); "
                                f"the model expects rank {len(info.shape)} ({name}: {info})")
    for axis, (want, got) in enumerate(zip(info.shape, shape)):
        if isinstance(want, int) and want != got:
            raise InvalidInputError(f"input '{name}' has size {got} in dimension {axis}; the model "
                                    f"expects {want} ({name}: {info}, given shape {shape})")
        if isinstance(want, str):
            size, where = bound.setdefault(want, (got, name))
            if size != got:
                raise InvalidInputError(f"dimension '{want}' is {size} in input '{where}' but {got} "
                                        f"in input '{name}'")
    return value


def _device_tensor(name: str, value: Any) -> tuple[Any, np.dtype]:
    """A CUDA input as a torch tensor (imported through DLPack, no copy) and its NumPy dtype."""
    try:
        import torch

        from backplane.backends.torch.kernels.common import NUMPY_TO_TORCH
    except ImportError:
        raise InvalidInputError(f"input '{name}' is in {device_of(value)} memory; reading device "
                                f"memory takes torch ({hint('torch')})") from None
    tensor = value if isinstance(value, torch.Tensor) else torch.from_dlpack(value)
    for dtype, torch_dtype in NUMPY_TO_TORCH.items():
        if torch_dtype == tensor.dtype:
            return tensor, np.dtype(dtype)
    raise InvalidInputError(f"input '{name}' has torch dtype {tensor.dtype}, which has no ONNX "
                            f"element type here")
