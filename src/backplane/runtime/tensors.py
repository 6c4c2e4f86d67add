"""The tensors of each backend's partition of a loaded network, made at load and released at unload.

A backend's tensors come from one of two places, or none (the default, and the hot path's case:
each workload returns what its kernels allocate):

- the backend makes them itself: ``Backend.gen_tensors`` returns a ``TensorRegistry`` (onert's
  BackendContext::genTensors and ITensorRegistry);
- the runtime makes them from the backend's custom allocator (``RuntimeOptions.custom_allocators``,
  Arm NN's ICustomAllocator) where both are host memory (the backend's tensor-handle factory and
  the allocator's ``memory``): an ``AllocatedTensors``, one buffer per tensor the
  backend's layers read or write (constants included), allocated at load where the tensor's size is
  known then, at the first run that makes it otherwise (and again, larger, where a later run needs
  more), all freed at unload.

The backend's workload factory gets its registry before it makes any workload
(``WorkloadFactory.tensors``: onert's genKernels binds the kernels to them). Each of the backend's
workloads is then wrapped (``placed``): an input that another backend, a copy or the user made is
copied into the backend's tensor of it before the call, and each output the workload did not write
into its tensor is copied there after it. So every tensor the backend's layers read or write is in
its memory. The tensors are the network's, reused by every run: a network that has them runs one
run at a time, and a run's outputs that are such tensors are copied out (``detach``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Backend, Workload
from backplane.backends.api.memory import (MemorySource, TensorHandleFactory, TensorRegistry,
                                           allocate_with, host_view, is_host_allocator)
from backplane.ir.graph import Graph, Layer, TensorInfo


class AllocatedTensors(TensorRegistry):
    """A backend's tensors in memory from its custom allocator (see the module's docstring)."""

    def __init__(self, allocator: Any, backend_id: str, factory: TensorHandleFactory) -> None:
        super().__init__(write=factory.write_to)
        self.allocator, self.backend_id, self.factory = allocator, backend_id, factory
        self.buffers: dict[str, np.ndarray] = {}  # tensor -> its flat bytes
        self.given: dict[str, Any] = {}  # tensor -> what the allocator returned, for its free
        self.hosts: dict[str, np.ndarray] = {}  # tensor -> its typed host view (static sizes)

    def reserve(self, name: str, info: TensorInfo) -> None:
        """Allocate ``name``'s tensor now where its size is known (a plain, static tensor)."""
        nbytes = info.nbytes
        if nbytes is None or info.dtype is None or info.dtype.kind in "OSU" \
                or name in self.buffers:
            return
        host = self._allocated(name, nbytes, f"tensor '{name}' ({info})")
        host = host.view(info.dtype).reshape(info.shape)  # type: ignore[arg-type]
        self.hosts[name] = host
        self.tensors[name] = self.factory.import_(host)

    def constant(self, name: str, value: np.ndarray) -> Any:
        """A copy of the constant ``value`` in allocated memory, as the backend's tensor."""
        key = f"{name}@{self.backend_id}"
        host = self._allocated(key, int(value.nbytes), f"constant '{name}'")
        host = host.view(value.dtype).reshape(value.shape)
        np.copyto(host, value)
        self.tensors[key] = tensor = self.factory.import_(host)
        return tensor

    def place(self, name: str, value: Any) -> Any:
        tensor = self.tensors.get(name)
        if tensor is value or value is None or isinstance(value, (list, tuple)):
            return value
        host = self.hosts.get(name)
        if host is not None and tuple(getattr(value, "shape", ())) == host.shape:
            self.write(value, host)
            return tensor
        array = host_view(value)  # a size known only now: (re)allocated to fit
        if array.dtype.kind in "OSU":
            return value
        have = self.buffers.get(name)
        if have is None or have.nbytes < array.nbytes:
            self._free(name)
            self._allocated(name, int(array.nbytes), f"tensor '{name}' ({array.dtype}"
                                                     f"{list(array.shape)})")
        host = self.buffers[name][:array.nbytes].view(array.dtype).reshape(array.shape)
        np.copyto(host, array)
        return self.factory.import_(host)

    def owns(self, value: Any) -> bool:
        """Whether ``value`` is, or views, memory of this registry."""
        try:
            view = host_view(value)
        except (TypeError, ValueError, RuntimeError, BufferError):
            return False
        return view.dtype != object and any(np.may_share_memory(view, b)
                                            for b in self.buffers.values())

    def release(self) -> None:
        for name in list(self.buffers):
            self._free(name)
        self.hosts.clear()
        super().release()

    @property
    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self.buffers.values())

    def _allocated(self, name: str, nbytes: int, what: str) -> np.ndarray:
        given, flat = allocate_with(self.allocator, self.backend_id, what, nbytes,
                                    self.factory.alignment)
        self.buffers[name], self.given[name] = flat, given
        return flat

    def _free(self, name: str) -> None:
        if self.buffers.pop(name, None) is not None:
            self.allocator.free(self.given.pop(name))


def registries(network_backends: Mapping[str, Backend], graph: Graph,
               layers: Sequence[Layer]) -> dict[str, TensorRegistry]:
    """Per backend that has them, the tensors of its partition: the backend's own
    (``gen_tensors``, given the infos of every tensor its layers read or write but the constants),
    else its custom allocator's (host memory only: an allocator of another kind allocates the
    fallback memory the backend owns, ``runtime/fallback.py``), else none."""
    found: dict[str, TensorRegistry] = {}
    for backend_id, backend in network_backends.items():
        names = {name for layer in layers if layer.backend == backend_id
                 for name in (*layer.inputs, *layer.outputs)
                 if name and name not in graph.constants}
        if not names:
            continue
        infos = {name: graph.info(name) for name in sorted(names)}
        made = backend.gen_tensors(infos)
        allocator, factory = backend.custom_allocator, backend.tensor_handle_factories()[0]
        if made is None and allocator is not None and factory.memory & MemorySource.MALLOC \
                and is_host_allocator(allocator):  # host memory the runtime can make tensors of
            made = AllocatedTensors(allocator, backend_id, factory)
            for name, info in infos.items():
                made.reserve(name, info)
        if made is not None:
            found[backend_id] = made
    return found


def placed(layers: Sequence[Layer], workloads: Sequence[Workload],
           found: Mapping[str, TensorRegistry], graph: Graph) -> list[Workload]:
    """``workloads``, those of backends with tensors of their own wrapped to read and write them."""
    if not found:
        return list(workloads)
    made_by = {name: layer.backend for layer in layers for name in layer.outputs if name}
    wrapped = []
    for layer, workload in zip(layers, workloads):
        registry = found.get(layer.backend or "")
        if registry is None:
            wrapped.append(workload)
            continue
        foreign = [name if name and name not in graph.constants
                   and made_by.get(name) != layer.backend else "" for name in layer.inputs]
        wrapped.append(_placing(workload, registry, foreign, list(layer.outputs)))
    return wrapped


def _placing(workload: Workload, registry: TensorRegistry, foreign: list[str],
             outputs: list[str]) -> Workload:
    place = registry.place
    reads = any(foreign)

    def placing(*values: Any) -> tuple[Any, ...]:
        if reads:
            values = tuple(place(name, v) if name else v for name, v in zip(foreign, values))
        results = workload(*values)
        return tuple(place(name, v) if name else v for name, v in zip(outputs, results))

    kept = {k: v for k, v in getattr(workload, "__dict__", {}).items()
            if k not in ("profiled", "write_into")}  # those would bypass the tensors
    placing.__dict__.update(kept)  # exclusive, destroy, ...
    return placing


def detach(found: Mapping[str, TensorRegistry], value: Any) -> Any:
    """``value``, copied where it is one of the registries' tensors or views their memory (a run's
    output outlives the run; the next run writes the tensor again)."""
    for registry in found.values():
        if isinstance(registry, AllocatedTensors):
            if registry.owns(value):
                return np.array(host_view(value), copy=True)
        elif any(value is tensor for tensor in registry.tensors.values()):
            return np.array(host_view(value), copy=True)
    return value
