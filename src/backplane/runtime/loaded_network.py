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
from backplane.runtime import edge_checks, fallback, host_threads, ownership, tensors
from backplane.runtime.device_plans import placed_plan
from backplane.runtime.memory_plan import (body_constant_memory, constant_memory, partitions,
                                           planned_memory)
from backplane.runtime.steps import (NONE_SLOT, STOP, ExecutionError, Plan, RunTerminated, Step,
                                     StepFailure, handover, one_call, plan_steps, run_steps,
                                     straight_run)

__all__ = ["NONE_SLOT", "STOP", "ExecutionError", "LayerTiming", "LoadedNetwork", "Plan",
           "RunTerminated", "Step", "StepFailure", "WorkloadError", "run_steps"]

class WorkloadError(ExecutionError):
    """A backend could not create the workload of a layer it took, at load; names both."""

    def __init__(self, message: str, layer: Layer, backend: str) -> None:
        super().__init__(message)
        self.layer, self.backend = layer, backend


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
                memory.append(constant_memory(layer, graph))
                if release is not None:  # its workload holds what it reads: the layer holds nothing
                    self.layers[index] = graph.layers[index] = self._released(layer, release)
        except BaseException:
            _release([], None, self.tensors, [])
            raise
        for factory in factories.values():
            factory.constants = {}
        destroys = [w.destroy for w in workloads if getattr(w, "destroy", None) is not None]
        destroys += [body.close for w in workloads for body in getattr(w, "bodies", ())]
        created = list(workloads)  # before the runtime's wrappers: see steps.handover
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
        converts = [handover(layer, w, c) for layer, w, c in zip(self.layers, workloads, created)]
        self.steps = plan_steps(self.layers, workloads, self._slots, set(self.output_slots),
                                self._constant_slots, converts)
        self._layer_of = {id(step.workload): layer for step, layer in zip(self.steps, self.layers)}
        self.host_plan = Plan(tuple(self.steps), tuple(self.layers), self.output_slots,
                              self.input_slots)
        network.report.peak_bytes, network.report.constant_bytes = planned_memory(
            network, self.steps, self.layers, self._slots, memory)
        self.held = ownership.Held([*(span for spans in memory for span in spans),
                                    *body_constant_memory(self.layers)])
        if release is not None:
            graph.constants.let_go()  # type: ignore[attr-defined]
            network.released = True
        network.report.partitions = partitions(self.layers)
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
        else:  # one partition: one call between its handovers, no slots (steps.one_call)
            failure = functools.partial(_failure, self._layer_of)  # no cycle through self
            loop = functools.partial(_run, self._template, failure, self.host_plan)
            single = one_call(self.host_plan, self._template, loop, failure,
                              functools.partial(_owned, self.held)) \
                or straight_run(self.host_plan, self._template, failure)  # steps as code
            if single is not None:
                self.execute = single  # type: ignore[method-assign]
        if self.fallback_memory.buffers or self.tensors:
            self._detach_outputs()
        self.host_runs = whole_run(self) if debug.level() < 2 else None
        if self.host_runs is not None:  # before the lock: a whole run holds it too
            self.execute = self.host_runs  # type: ignore[method-assign]
            destroys.append(self.host_runs.kept.close)  # the graphs' holder: nothing of self
        if self.exclusive:
            self._lock = threading.RLock()  # the traced run holds it and calls the profiled one
            self.execute = self._one_at_a_time(self.execute)  # type: ignore[method-assign]
            self.execute_profiled = self._one_at_a_time(self.execute_profiled)  # type: ignore[method-assign]
            self.execute_plan = self._one_at_a_time(self.execute_plan)  # type: ignore[method-assign]
        owning = getattr(self.execute, "owned", None)  # None where the run was wrapped above
        if owning is not None:
            self.execute_owned = owning  # type: ignore[method-assign]
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

    def execute_owned(self, inputs: Sequence[Any]) -> list[Any]:
        """``execute``, its outputs the caller's alone (``ownership.owned``: each copied where
        anything else may hold its memory); ``inputs`` as ``execute`` takes them. A network that is
        one call (``steps.one_call``) decides it where the outputs are made
        (``steps.owning_call``)."""
        return ownership.owned(self.execute(inputs), inputs, self.held)

    def execute_plan(self, plan: Plan, inputs: Sequence[Any]) -> list[Any]:
        """``execute`` with another plan (user tensors in device memory or buffers: ``plan``);
        ``inputs`` are then followed by the buffers its outputs are written into."""
        return self._run(plan, inputs)

    def _run(self, plan: Plan, inputs: Sequence[Any]) -> list[Any]:
        return _run(self._template, self._failure, plan, inputs)

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
        return placed_plan(self, inputs_on, outputs_on)

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
        return _failure(self._layer_of, step, exc)


def whole_run(loaded: LoadedNetwork) -> Any:
    """A backend's whole run of ``loaded`` where one offers it (``Backend.host_run``: GpuAcc's
    one CUDA graph per input signature, its copies in and out captured, for a network of one
    GpuAcc partition between the user's NumPy inputs and outputs; ``torch/cuda_host.py``), else
    None. It is the network's ``execute``: any run it does not take (device tensors, a time
    limit) goes through the network's steps. Its ``kept.close`` is called at the network's
    close."""
    for backend in loaded.network.backends.values():
        make = getattr(backend, "host_run", None)
        run = make(loaded) if make is not None else None
        if run is not None:
            return run
    return None


def _run(template: list[Any], failure: Callable[[Step, Exception], ExecutionError], plan: Plan,
         inputs: Sequence[Any]) -> list[Any]:
    """One run of ``plan`` over a new list of slots (``template``'s copy), its inputs put in;
    a failed step's error is ``failure``'s, naming its layer."""
    env = list(template)
    for slot, value in zip(plan.input_slots, inputs):
        env[slot] = value
    try:
        run_steps(plan.steps, env, STOP.get())
    except StepFailure as failed:
        raise failure(failed.step, failed.error) from failed.error
    return [_array(env[i]) for i in plan.output_slots]


def _owned(held: ownership.Held, outputs: list[Any], inputs: Sequence[Any]) -> list[Any]:
    return ownership.owned(outputs, inputs, held)


def _failure(layer_of: dict[int, Layer], step: Step, exc: Exception) -> ExecutionError:
    layer = layer_of[id(step.workload)]
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


def _read_constants(graph: Graph) -> frozenset[str]:
    """The constants a layer reads as an input, or that are outputs: bound at load."""
    return frozenset(n for layer in graph.layers for n in layer.inputs if n in graph.constants) \
        | frozenset(n for n in graph.outputs if n in graph.constants)


def _nbytes(values: Any) -> int | None:
    if not isinstance(values, (tuple, list)):
        return None
    sizes = [getattr(value, "nbytes", None) for value in values]
    known = [int(size) for size in sizes if isinstance(size, (int, np.integer))]
    return sum(known) if known else None


def _array(value: Any) -> Any:
    """NumPy turns 0-d results into scalars (np.float32); outputs are always arrays."""
    return np.asarray(value) if isinstance(value, np.generic) else value
