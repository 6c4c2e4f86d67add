"""LoadedNetwork: an OptimizedNetwork turned into a flat list of prepared calls over numbered slots.

Everything is decided at load: each layer's workload, which slot each tensor lives in, when a slot
can be dropped. A run is then: put the inputs in their slots, call each workload in order, drop what
is dead, read the outputs (onnx.reference's "step 1: inputs, step 2: execute nodes").

Concurrent runs: each run has its own slots (a list made per run), so runs of one network from
several threads are safe wherever the workloads are. A workload that keeps state across calls
(GpuAcc's captured CUDA graphs copy inputs into, and return, tensors of their own) says so with an
``exclusive`` attribute set to True; a network that holds one runs one run at a time, under a lock
taken for the whole run, so that no run overwrites another's tensors before it has copied them out.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from backplane import debug
from backplane.backends.api.backend import Backend, ProfilingContext, Workload
from backplane.backends.api.memory import HOST_FACTORY, MemoryManager
from backplane.ir.graph import Graph, Layer
from backplane.optimizer.optimize import OptimizedNetwork
from backplane.optimizer.release import FileWeights, ReleasedConstants, released_layer
from backplane.runtime import edge_checks, fallback, host_threads, ownership, tensors, user_buffers

NONE_SLOT = 0  # always holds None: absent optional inputs read it, absent outputs write it


class ExecutionError(RuntimeError):
    """A workload failed at run time; the message names its layer."""


class RunTerminated(ExecutionError):
    """A run stopped between two layers: ``RunOptions.terminate`` was set, or its time ran out."""


STOP: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "backplane_stop", default=None)
"""The running run's check, called before each layer (control-flow bodies' included): raises
``RunTerminated`` to stop it. None (the hot path's case): nothing is checked."""


class WorkloadError(ExecutionError):
    """A backend could not create the workload of a layer it took, at load; names both."""

    def __init__(self, message: str, layer: Layer, backend: str) -> None:
        super().__init__(message)
        self.layer, self.backend = layer, backend


@dataclass(frozen=True)
class Step:
    workload: Workload
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    frees: tuple[int, ...]  # slots read for the last time by this step


@dataclass(frozen=True)
class Plan:
    """What a run calls: the steps, the layers they run (for profiles and errors), the output slots
    and the slots a run's values go in (its inputs, then the buffers its outputs are written into).
    A network has its own plan for host inputs and outputs, and one per placement of the user's
    tensors in device memory or in buffers (``LoadedNetwork.plan``)."""

    steps: tuple[Step, ...]
    layers: tuple[Layer, ...]
    output_slots: tuple[int, ...]
    input_slots: tuple[int, ...]


@dataclass(frozen=True)
class LayerTiming:
    layer: str
    op_type: str
    backend: str
    seconds: float
    start: float = 0.0
    """``time.perf_counter()`` when the layer began; a workload's inner layers start one after the
    other from the workload's start (for traces: ``backplane.profiling``)."""
    nbytes: int | None = None
    """The bytes of the layer's outputs where they tell them (a MemCopy or MemImport: the bytes it
    moves); None for a workload's inner layers."""


class LoadedNetwork:
    def __init__(self, network: OptimizedNetwork, network_id: int,
                 profiling: dict[str, ProfilingContext] | None = None) -> None:
        self.network_id = network_id
        self.network = network
        graph = network.graph
        self.memory_managers: list[MemoryManager] = []
        factories = {}
        for backend_id, backend in network.backends.items():
            manager = backend.create_memory_manager()
            if manager is not None:
                self.memory_managers.append(manager)
            factories[backend_id] = backend.create_workload_factory(manager)
            factories[backend_id].network_id = network_id
        self._slots: dict[str, int] = {}
        self._template: list[Any] = [None]
        self._constant_slots: dict[tuple[int, str], str] = {}  # (layer, constant) -> its slot's key
        self.layers: list[Layer] = list(graph.layers)
        self.tensors = tensors.registries(network.backends, graph, self.layers)
        """Per backend that has them, the tensors of its partition (``runtime/tensors.py``)."""
        for backend_id, registry in self.tensors.items():
            factories[backend_id].tensors = registry
        release = network.weights
        if release is not None:  # what no layer reads as an input is left to the file already
            graph.constants = ReleasedConstants(  # type: ignore[assignment]
                graph.constants, release, holding=_read_constants(graph))
        workloads: list[Workload] = []
        memory: list[list[tuple[int, int]]] = []  # each layer's constants, for the report
        for factory in factories.values():  # for the load only: builtin folds those bodies read
            factory.constants = graph.constants
        try:
            for index, layer in enumerate(self.layers):
                workloads.append(self._create(factories, layer, graph, network.backends))
                memory.append(_constant_memory(layer, graph))
                if release is not None:  # its workload holds what it reads: the layer holds nothing
                    self.layers[index] = graph.layers[index] = self._released(layer, release)
        except BaseException:
            _release([], None, self.tensors, [])
            raise
        for factory in factories.values():
            factory.constants = {}
        destroys = [w.destroy for w in workloads if getattr(w, "destroy", None) is not None]
        destroys += [body.close for w in workloads for body in getattr(w, "bodies", ())]
        workloads = tensors.placed(self.layers, workloads, self.tensors, graph)
        self.fallback_memory = fallback.FallbackMemoryManager(
            {b: backend.custom_allocator for b, backend in network.backends.items()
             if backend.custom_allocator is not None})
        workloads, copied = fallback.bind(self.layers, workloads, graph, self.fallback_memory)
        workloads = host_threads.share(self.layers, workloads, network.backends)
        workloads = edge_checks.checked(self.layers, workloads, graph, network.backends)
        for record in network.report.copies:
            if record.layer in copied:
                record.copied_bytes = copied[record.layer]
        for layer in self.layers:
            for name in (*layer.inputs, *layer.outputs):
                self._slot(name)
        for name in graph.outputs:  # an output may be a constant that no layer reads
            if name in graph.constants:
                self._slot(name)
                self._template[self._slots[name]] = graph.constants[name]
        self.input_slots = tuple(self._slot(name) for name in network.input_names)
        self.output_slots = tuple(self._slot(name) for name in graph.outputs)
        self.steps = _plan(self.layers, workloads, self._slots, set(self.output_slots),
                           self._constant_slots)
        self._layer_of = {id(step.workload): layer for step, layer in zip(self.steps, self.layers)}
        self.host_plan = Plan(tuple(self.steps), tuple(self.layers), self.output_slots,
                              self.input_slots)
        network.report.peak_bytes, network.report.constant_bytes = self._planned_memory(memory)
        self.held = ownership.Held([*(span for spans in memory for span in spans),
                                    *_body_constant_memory(self.layers)])
        if release is not None:
            graph.constants.let_go()  # type: ignore[attr-defined]
            network.released = True
        network.report.partitions = _partitions(self.layers)
        network.report.fallback_bytes = self.fallback_memory.nbytes
        self._plans: dict[tuple[tuple[str, ...], tuple[str | None, ...]], Plan] = {}
        self._planning = threading.Lock()
        self.profiling = profiling or {}
        # Fallback memory and the backends' tensors are the network's, shared by its runs: one
        # run at a time, and no output of a run may alias them.
        self.exclusive = any(getattr(w, "exclusive", False) for w in workloads) \
            or bool(self.fallback_memory.buffers) or bool(self.tensors)
        if debug.level() >= 2:  # chosen once, at load: the plain loop stays free of checks
            self.execute = self._execute_traced  # type: ignore[method-assign]
        if self.fallback_memory.buffers or self.tensors:
            self._detach_outputs()
        if self.exclusive:
            self._lock = threading.RLock()  # the traced run holds it and calls the profiled one
            self.execute = self._one_at_a_time(self.execute)  # type: ignore[method-assign]
            self.execute_profiled = self._one_at_a_time(self.execute_profiled)  # type: ignore[method-assign]
            self.execute_plan = self._one_at_a_time(self.execute_plan)  # type: ignore[method-assign]
        for manager in self.memory_managers:  # held from here to the unload (Arm NN's rule)
            manager.acquire()
        self._finalizer = weakref.finalize(self, _release, self.memory_managers,
                                           self.fallback_memory, self.tensors, destroys)

    def close(self) -> None:
        """Release what the network holds (the runtime's unload; its finalizer where it is
        dropped without one): its memory managers, fallback memory and backends' tensors, what
        its delegates' ``init`` took, and its control-flow bodies' networks. Closing again does
        nothing."""
        self._finalizer()

    # -- load ----------------------------------------------------------------------------------------
    def _slot(self, name: str) -> int:
        if not name:
            return NONE_SLOT
        if name not in self._slots:
            self._slots[name] = len(self._template)
            self._template.append(None)
        return self._slots[name]

    def _create(self, factories: dict[str, Any], layer: Layer, graph: Graph,
                backends: dict[str, Backend]) -> Workload:
        infos_in = [graph.info(n) for n in layer.inputs]
        infos_out = [graph.info(n) for n in layer.outputs]
        for name in layer.inputs:
            if name in graph.constants:
                self._constant_slots[id(layer), name] = self._bind_constant(
                    name, graph.constants[name], backends[layer.backend or ""])
        try:
            if layer.op_type in (fallback.FALLBACK_IMPORT, fallback.SYNC):  # the source's: it syncs
                return factories[layer.attrs["source_backend"]].create_fallback_import(layer)
            return factories[layer.backend or ""].create_workload(layer, infos_in, infos_out)
        except Exception as exc:
            raise WorkloadError(f"{layer.backend} could not create a workload for "
                                f"{layer.describe()}: {exc}", layer, layer.backend or "") from exc

    def _bind_constant(self, name: str, value: np.ndarray, backend: Backend) -> str:
        """The key of the slot holding ``name`` in ``backend``'s memory: constants live in host
        memory, and each other kind of memory that reads one gets its own copy, made here once (a
        backend with a custom allocator: in memory from it)."""
        registry = self.tensors.get(backend.id)
        if isinstance(registry, tensors.AllocatedTensors) and isinstance(value, np.ndarray) \
                and value.dtype.kind not in "OSU":
            key = f"{name}@{backend.id}"
            slot = self._slot(key)
            if self._template[slot] is None:
                self._template[slot] = registry.constant(name, value)
            return key
        factory = backend.tensor_handle_factories()[0]
        host = factory.id == HOST_FACTORY.id
        key = name if host else f"{name}@{factory.id}"
        slot = self._slot(key)
        if self._template[slot] is None:
            self._template[slot] = value if host else factory.copy_in(value)
        return key

    def _released(self, layer: Layer, weights: FileWeights) -> Layer:
        """``layer``'s released copy (``optimizer/release.py``), its constants bound as before."""
        light = released_layer(layer, weights)
        for name in layer.inputs:
            bound = self._constant_slots.pop((id(layer), name), None)
            if bound is not None:
                self._constant_slots[id(light), name] = bound
        return light

    def _planned_memory(self, memory: Sequence[Sequence[tuple[int, int]]],
                        ) -> tuple[dict[str, int], dict[str, int]]:
        """Per backend: the peak bytes of the intermediate tensors of a run of the host plan, and
        the bytes of its constants (``PlacementReport.peak_bytes``, ``constant_bytes``), from the
        memory (address, bytes) of each layer's constants."""
        graph = self.network.graph
        copied_to = {c.layer: c.target for c in self.network.report.copies if c.strategy == "copy"}
        names = {slot: name for name, slot in self._slots.items()}
        live: dict[str, int] = {}
        peak: dict[str, int] = {}
        held: dict[int, tuple[str, int]] = {}  # slot -> (backend, bytes)
        for step, layer in zip(self.steps, self.layers):
            owner = copied_to.get(layer.name) if layer.op_type in _GLUE else layer.backend
            inner = _inner_peak(graph, layer)  # a compiled partition's own intermediates
            if owner and inner:
                peak[owner] = max(peak.get(owner, 0), live.get(owner, 0) + inner)
            for slot in step.outputs:
                nbytes = _bytes(graph, names.get(slot))
                if owner and nbytes and slot != NONE_SLOT:
                    held[slot] = (owner, nbytes)
                    live[owner] = live.get(owner, 0) + nbytes
                    peak[owner] = max(peak.get(owner, 0), live[owner])
            for slot in step.frees:
                if slot in held:
                    owner_of, nbytes = held.pop(slot)
                    live[owner_of] -= nbytes
        constants: dict[str, int] = {}
        seen: set[tuple[str, int, int]] = set()
        for layer, spans in zip(self.layers, memory):
            backend = layer.backend or ""
            for address, nbytes in spans:
                # once per memory: a fused layer's weight may be a (transposed) view of a constant
                if (backend, address, nbytes) not in seen:
                    seen.add((backend, address, nbytes))
                    constants[backend] = constants.get(backend, 0) + nbytes
        return peak, constants

    def _detach_outputs(self) -> None:
        fallback_detach, registries = self.fallback_memory.detach, self.tensors

        def detach(value: Any) -> Any:
            return tensors.detach(registries, fallback_detach(value))

        run, profiled = self.execute, self.execute_profiled
        planned = self.execute_plan

        def execute(inputs: Sequence[Any]) -> list[Any]:
            return [detach(value) for value in run(inputs)]

        def execute_plan(plan: Plan, inputs: Sequence[Any]) -> list[Any]:
            return [detach(value) for value in planned(plan, inputs)]

        def execute_profiled(inputs: Sequence[Any], plan: Plan | None = None,
                             ) -> tuple[list[Any], list[LayerTiming]]:
            outputs, timings = profiled(inputs, plan)
            return [detach(value) for value in outputs], timings

        self.execute = execute  # type: ignore[method-assign]
        self.execute_plan = execute_plan  # type: ignore[method-assign]
        self.execute_profiled = execute_profiled  # type: ignore[method-assign]

    def _one_at_a_time(self, run: Any) -> Any:
        def locked(*args: Any) -> Any:
            with self._lock:
                return run(*args)

        return locked

    # -- run -----------------------------------------------------------------------------------------
    def slots(self) -> list[Any]:
        """The slots a run starts from, a new list: constants bound, all else None (builtin's
        iterated bodies keep one over a call's iterations)."""
        return list(self._template)

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        """Run once; ``inputs`` in the order of the network's inputs, already checked."""
        return self._run(self.host_plan, inputs)

    def execute_plan(self, plan: Plan, inputs: Sequence[Any]) -> list[Any]:
        """``execute`` with another plan (user tensors in device memory or buffers: ``plan``);
        ``inputs`` are then followed by the buffers its outputs are written into."""
        return self._run(plan, inputs)

    def _run(self, plan: Plan, inputs: Sequence[Any]) -> list[Any]:
        env = list(self._template)
        for slot, value in zip(plan.input_slots, inputs):
            env[slot] = value
        try:
            run_steps(plan.steps, env, STOP.get())
        except StepFailure as failure:
            raise self._failure(failure.step, failure.error) from failure.error
        return [_array(env[i]) for i in plan.output_slots]

    def execute_profiled(self, inputs: Sequence[Any], plan: Plan | None = None,
                         ) -> tuple[list[Any], list[LayerTiming]]:
        """Like ``execute``, timing every layer (for the CLI and the debug knob, not the hot path)."""
        plan = plan or self.host_plan
        env = list(self._template)
        for slot, value in zip(plan.input_slots, inputs):
            env[slot] = value
        timings: list[LayerTiming] = []
        stop = STOP.get()
        for step, layer in zip(plan.steps, plan.layers):
            if stop is not None:
                stop()
            self._profile_step(step, layer, env, timings)
        return [_array(env[i]) for i in plan.output_slots], timings

    # -- the user's tensors in device memory ---------------------------------------------------------
    def plan(self, inputs_on: Sequence[str], outputs_on: Sequence[str | None]) -> Plan:
        """The plan for inputs in the memory of ``inputs_on`` (a device per input: "cpu",
        "cuda:0") and outputs wanted in ``outputs_on`` (a device per output; None: where the host
        plan puts it, host memory; ``user_buffers.INTO``: written into a host buffer given at each
        run, after the inputs). Made once per placement, at its first run.

        An input in device memory is imported (a MemImport, no copy) by each copy layer that would
        have moved it into that memory; every other reader gets one host copy of it. An output
        wanted in device memory skips the copy that would have brought it to the host when it is
        there already (cloned on the device where its producer overwrites it at the next run: a
        captured CUDA graph), and is moved there otherwise."""
        key = (tuple(inputs_on), tuple(outputs_on))
        if key == (("cpu",) * len(self.input_slots), (None,) * len(self.output_slots)):
            return self.host_plan
        plan = self._plans.get(key)
        if plan is None:
            with self._planning:  # slots are numbered as plans are made: one plan at a time
                plan = self._plans.get(key) or self._placed(*key)
                self._plans[key] = plan
        return plan

    def _placed(self, inputs_on: tuple[str, ...], outputs_on: tuple[str | None, ...]) -> Plan:
        from backplane.backends.api.memory import to_device, to_host

        graph = self.network.graph
        layers = list(self.layers)
        workloads = [step.workload for step in self.steps]
        front: list[tuple[Layer, Workload]] = []
        for name, device in zip(self.network.input_names, inputs_on):
            if device == "cpu":
                continue
            host_copy = ""
            for index, layer in enumerate(layers):
                if name not in layer.inputs:
                    continue
                target = layer.attrs.get("target")
                if layer.op_type in _GLUE and getattr(target, "device", None) == device:
                    layers[index] = Layer(f"MemImport[{name}](user {device}->{layer.outputs[0]})",
                                          "MemImport", [name], list(layer.outputs),
                                          {"source": device, "target": target}, backend="builtin")
                    workloads[index] = _importer(target)
                    continue
                if not host_copy:
                    host_copy = f"{name}@host"
                    copy = Layer(f"MemCopy[{name}](user {device}->host)", "MemCopy", [name],
                                 [host_copy], {"source": device, "target": HOST_FACTORY},
                                 backend="builtin")
                    front.append((copy, lambda x: (to_host(x),)))
                layers[index] = _renamed(layer, name, host_copy)
                for constant in layer.inputs:  # its constants stay bound where they were
                    bound = self._constant_slots.get((id(layer), constant))
                    if bound is not None:
                        self._constant_slots[id(layers[index]), constant] = bound
        outputs = list(graph.outputs)
        back: list[tuple[Layer, Workload]] = []
        producer = {o: i for i, layer in enumerate(layers) for o in layer.outputs}
        for position, (name, device) in enumerate(zip(graph.outputs, outputs_on)):
            if device is None or device == "cpu" or device == user_buffers.INTO:
                continue
            index = producer.get(name)
            layer = layers[index] if index is not None else None
            if layer is not None and layer.op_type in _GLUE \
                    and getattr(layer.attrs.get("source"), "device", None) == device:
                name = layer.inputs[0]  # the value before it was brought to the host
                made_by = producer.get(name)
                if not str(getattr(layer.attrs["source"], "id", "")).startswith("torch-"):
                    # another library's tensor handle: handed over as a torch tensor, no copy
                    copy = Layer(f"MemImport[{name}]({device}->user {device})", "MemImport",
                                 [name], [f"{name}@user {device}"],
                                 {"source": layer.attrs["source"], "target": device},
                                 backend="builtin")
                    back.append((copy, functools.partial(_moved, to_device, device)))
                    outputs[position] = copy.outputs[0]
                    continue
                if made_by is None or not getattr(workloads[made_by], "exclusive", False):
                    outputs[position] = name
                    continue
                copy = Layer(f"MemCopy[{name}]({device}->user {device})", "MemCopy", [name],
                             [f"{name}@user {device}"], {"source": device, "target": device},
                             backend="builtin")
                back.append((copy, lambda x: (x.clone(),)))
            else:
                copy = Layer(f"MemCopy[{name}](host->user {device})", "MemCopy", [name],
                             [f"{name}@user {device}"], {"source": HOST_FACTORY, "target": device},
                             backend="builtin")
                back.append((copy, functools.partial(_moved, to_device, device)))
            outputs[position] = copy.outputs[0]
        into = [i for i, device in enumerate(outputs_on) if device == user_buffers.INTO]
        buffers, copies = user_buffers.bind(layers, workloads, outputs, into,
                                            self.network.output_names, graph,
                                            self.network.backends, self._constant_slots)
        back += copies
        read = {n for layer in layers for n in layer.inputs} | {n for c, _ in back for n in c.inputs}
        kept = [(layer, w) for layer, w in zip(layers, workloads)
                if layer.op_type not in _GLUE or any(o in read or o in outputs for o in layer.outputs)]
        placed = [*front, *kept, *back]
        for layer, workload in placed:
            for value in (*layer.inputs, *layer.outputs):
                self._slot(value)
            self._layer_of.setdefault(id(workload), layer)
        output_slots = tuple(self._slot(name) for name in outputs)
        steps = _plan([layer for layer, _ in placed], [w for _, w in placed], self._slots,
                      set(output_slots), self._constant_slots)
        return Plan(tuple(steps), tuple(layer for layer, _ in placed), output_slots,
                    (*self.input_slots, *(self._slot(name) for name in buffers)))

    def _profile_step(self, step: Step, layer: Layer, env: list[Any],
                      timings: list[LayerTiming]) -> None:
        inner = getattr(step.workload, "profiled", None)  # a workload that times its own layers
        parts: list[tuple[str, str, float]] = []
        start = time.perf_counter()
        try:
            if inner is None:
                results = step.workload(*[env[i] for i in step.inputs])
            else:
                results, parts = inner(*[env[i] for i in step.inputs])
        except RunTerminated:
            raise
        except Exception as exc:
            raise self._failure(step, exc) from exc
        seconds = time.perf_counter() - start
        backend = layer.backend or ""
        context = self.profiling.get(backend)
        nbytes = None if parts else _nbytes(results)
        for name, op_type, spent, *size in parts or [(layer.name, layer.op_type, seconds)]:
            timings.append(LayerTiming(name, op_type, backend, spent, start,
                                       size[0] if size else nbytes))
            start += spent
            if context is not None:
                context.record(name, spent)
        for i, value in zip(step.outputs, results):
            env[i] = value
        for i in step.frees:
            env[i] = None

    def _execute_traced(self, inputs: Sequence[Any]) -> list[Any]:
        outputs, timings = self.execute_profiled(inputs)
        layers = {layer.name: layer for layer in self.layers}
        for t in timings:
            shown = repr(layers[t.layer]) if t.layer in layers else f"{t.layer} ({t.op_type})"
            debug.console().print(f"{t.seconds * 1e3:9.3f} ms  {t.backend:>10}  {shown}",
                                  markup=False, highlight=False)
        return outputs

    def _failure(self, step: Step, exc: Exception) -> ExecutionError:
        layer = self._layer_of[id(step.workload)]
        return ExecutionError(f"{layer.describe()} failed on {layer.backend}: "
                              f"{type(exc).__name__}: {exc}")


def _release(managers: Sequence[MemoryManager], fallback_memory: Any,
             registries: dict[str, Any], destroys: Sequence[Callable[[], Any]]) -> None:
    """What a network holds, let go (``LoadedNetwork.close``; no reference to the network, so
    that its finalizer may call it)."""
    for manager in managers:
        manager.release()
    if fallback_memory is not None:
        fallback_memory.release()
    for registry in registries.values():
        registry.release()
    for destroy in destroys:  # delegates' Backend.destroy, control-flow bodies' close
        destroy()


class StepFailure(Exception):
    """A step's workload raised ``error`` (``run_steps``): the caller names the step's layer."""

    def __init__(self, step: Step, error: Exception) -> None:
        super().__init__(step, error)
        self.step, self.error = step, error


def run_steps(steps: Sequence[Step], env: list[Any], stop: Any = None) -> None:
    """The run loop: each step's workload called on its slots of ``env``, its results written to
    its output slots, the slots it was the last reader of cleared; ``stop`` (a run's ``STOP``)
    asked before each step where given. A workload's error comes out as a ``StepFailure`` naming
    the step (``RunTerminated`` as it is)."""
    step = None
    try:
        if stop is None:
            for step in steps:
                results = step.workload(*[env[i] for i in step.inputs])
                for i, value in zip(step.outputs, results):
                    env[i] = value
                for i in step.frees:
                    env[i] = None
        else:  # the same loop, asking before each step whether to go on
            for step in steps:
                stop()
                results = step.workload(*[env[i] for i in step.inputs])
                for i, value in zip(step.outputs, results):
                    env[i] = value
                for i in step.frees:
                    env[i] = None
    except RunTerminated:
        raise
    except Exception as exc:
        raise StepFailure(step, exc) from exc  # type: ignore[arg-type]  # the loop named it


_GLUE = ("MemCopy", "MemImport", fallback.FALLBACK_IMPORT)


def _partitions(layers: Sequence[Layer]) -> list[str]:
    """The backend of each run of consecutive layers of one backend (copy and import layers aside)."""
    found: list[str] = []
    for layer in layers:
        if layer.op_type in _GLUE or not layer.backend:
            continue
        if not found or found[-1] != layer.backend:
            found.append(layer.backend)
    return found


def _constant_memory(layer: Layer, graph: Graph) -> list[tuple[int, int]]:
    """The memory (address, bytes) of the constants a layer reads: its inputs' and the arrays its
    attributes hold."""
    held = [graph.constants[n] for n in layer.inputs if n in graph.constants]
    return [(value.__array_interface__["data"][0], int(value.nbytes))
            for value in [*held, *_attr_arrays(layer)]]


def _body_constant_memory(layers: Sequence[Layer]) -> list[tuple[int, int]]:
    """The memory of the constants of the control-flow bodies ``layers`` hold, at any depth."""
    spans = []
    for layer in layers:
        for body in layer.attrs.values():
            if isinstance(body, OptimizedNetwork):
                graph = body.graph
                spans += [span for inner in graph.layers for span in _constant_memory(inner, graph)]
                spans += _body_constant_memory(graph.layers)
    return spans


def _read_constants(graph: Graph) -> frozenset[str]:
    """The constants a layer reads as an input, or that are outputs: bound at load."""
    return frozenset(n for layer in graph.layers for n in layer.inputs if n in graph.constants) \
        | frozenset(n for n in graph.outputs if n in graph.constants)


def _attr_arrays(layer: Layer) -> list[np.ndarray]:
    """The arrays a layer holds in its attributes: a fused layer's weights, a captured subgraph's
    constants (``attrs["constants"]``), and those of the layers it holds (``attrs["layers"]``)."""
    found = []
    for value in layer.attrs.values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list) \
            else [value]
        for item in items:
            if isinstance(item, np.ndarray):
                found.append(item)
            elif isinstance(item, Layer):
                found += _attr_arrays(item)
    return found


def _inner_peak(graph: Graph, layer: Layer) -> int:
    """The peak bytes of the tensors made inside a layer that holds its layers (a OneDnnGraph:
    ``attrs["layers"]``), as its layers one by one hold them (each dropped after its last reader
    inside, its outputs kept): its memory while it runs, on top of what the plan holds. A compiled
    partition that fuses layers may hold less; 0 for any other layer."""
    inner = layer.attrs.get("layers")
    if not isinstance(inner, list) or not all(isinstance(lay, Layer) for lay in inner):
        return 0
    made = {name: index for index, lay in enumerate(inner) for name in lay.outputs if name}
    last = dict(made)  # each made tensor's last reader inside (its maker where none reads it)
    for index, lay in enumerate(inner):
        last.update((name, index) for name in lay.inputs if name in made)
    freed: dict[int, list[str]] = {}
    for name, index in last.items():
        if name not in layer.outputs:
            freed.setdefault(index, []).append(name)
    live = peak = 0
    for index, lay in enumerate(inner):
        live += sum(_bytes(graph, name) for name in lay.outputs)
        peak = max(peak, live)
        live -= sum(_bytes(graph, name) for name in freed.get(index, ()))
    return peak


def _bytes(graph: Graph, name: str | None) -> int:
    if not name:
        return 0
    try:
        return graph.info(name).nbytes or 0
    except (KeyError, TypeError, ValueError):
        return 0


def _importer(target: Any) -> Workload:
    import_ = target.import_

    def mem_import(x: Any) -> tuple[Any]:
        return (import_(x),)

    return mem_import


def _moved(to_device: Any, device: str, x: Any) -> tuple[Any]:
    return (to_device(x, device),)


def _renamed(layer: Layer, old: str, new: str) -> Layer:
    return dataclasses.replace(layer, inputs=[new if n == old else n for n in layer.inputs])


def _nbytes(values: Any) -> int | None:
    if not isinstance(values, (tuple, list)):
        return None
    sizes = [getattr(value, "nbytes", None) for value in values]
    known = [int(size) for size in sizes if isinstance(size, (int, np.integer))]
    return sum(known) if known else None


def _array(value: Any) -> Any:
    """NumPy turns 0-d results into scalars (np.float32); outputs are always arrays."""
    return np.asarray(value) if isinstance(value, np.generic) else value


def _plan(layers: Sequence[Layer], workloads: Sequence[Workload], slots: dict[str, int],
          keep: set[int], constant_slots: dict[tuple[int, str], str]) -> list[Step]:
    """The steps, with every slot freed after its last reader (graph outputs and constants kept)."""
    last_read: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for name in layer.inputs:
            if name:
                last_read[slots[name]] = index
    produced = {slots[o] for layer in layers for o in layer.outputs if o}
    frees: dict[int, list[int]] = {}
    for slot, index in last_read.items():
        if slot in produced and slot not in keep:
            frees.setdefault(index, []).append(slot)
    steps = []
    for index, (layer, workload) in enumerate(zip(layers, workloads)):
        ins = tuple(slots[constant_slots.get((id(layer), n), n)] if n else NONE_SLOT
                    for n in layer.inputs)
        outs = tuple(slots[o] if o else NONE_SLOT for o in layer.outputs)
        steps.append(Step(workload, ins, outs, tuple(frees.get(index, ()))))
    return steps
