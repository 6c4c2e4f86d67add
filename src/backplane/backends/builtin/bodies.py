"""Control-flow bodies prepared once at load, so that running one costs its kernels, not a network.

Two things are decided here, before any run:

- ``fold_outer_constants``: an outer constant a body reads (a weight of the model read inside an
  If branch or a Loop body) becomes a constant of the body, bound in the memory of each backend that
  reads it once at load, where it was an input imported into that memory at every call.
- ``IteratedBody``: a Loop, Scan or SequenceMap body as two lists of calls (the first iteration's,
  the others') over one list of slots that lives across the iterations of a call: the steps that
  read only what the enclosing scope gives (captured values) and constants run in the first
  iteration only (``_invariant``: the imports of captured values, a Slice of one by constant
  bounds), and those of constants alone once, at load (``_fold``); a carried value whose body
  leaves it in a backend's memory and whose next iteration would import it back there stays there
  (the two copies or imports are skipped; the one to the host runs once, after the last
  iteration); and the per-run setup of a loaded network (a slot list, output conversion) happens
  once per call.

A body whose runs share memory (fallback memory, a host backend's exclusive workload) or under the
debug trace runs as before, through its loaded network's ``execute`` per iteration; a GPU body with
captured CUDA graphs iterates like the others, its carried values kept on the GPU copied at each
iteration (a graph's outputs are overwritten at its next replay).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backplane import debug
from backplane.ir.graph import Layer
from backplane.optimizer.optimize import OptimizedNetwork
from backplane.optimizer.passes import NONDETERMINISTIC
from backplane.runtime.loaded_network import (
    NONE_SLOT,
    STOP,
    ExecutionError,
    LoadedNetwork,
    Step,
    StepFailure,
    run_steps,
)
from backplane.runtime.steps import compiled

VARYING = NONDETERMINISTIC | {"If", "Loop", "Scan", "SequenceMap"}
"""Ops whose calls on the same inputs may differ (random draws) or hold a body that may."""
GLUE = ("MemCopy", "MemImport")
"""The layers that only move a tensor between memories (a FallbackImport or Sync is not one: it
waits for its source backend, and its network runs the plain way)."""


# -- outer constants -------------------------------------------------------------------------------
def fold_outer_constants(net: OptimizedNetwork, known: Mapping[str, np.ndarray]) -> OptimizedNetwork:
    """``net`` (a body) with the outer constants ``known`` among its inputs made constants of its
    own: the copy or import layers that brought such an input into a backend's memory are dropped
    and their readers read the constant, which the loaded body binds in their memory once. The
    body's inputs stay as they are (the enclosing layer still passes the values). ``net`` itself is
    untouched."""
    graph = net.graph
    known = {name: value for name, value in known.items() if name in graph.inputs}
    if not known:
        return net
    renamed: dict[str, str] = {}
    kept: list[Layer] = []
    for layer in graph.layers:
        if _moves_constant(layer, known) and layer.outputs[0] not in graph.outputs:
            renamed[layer.outputs[0]] = layer.inputs[0]
            continue
        kept.append(layer)
    layers = [dataclasses.replace(layer, inputs=[renamed.get(n, n) for n in layer.inputs])
              if any(n in renamed for n in layer.inputs) else layer for layer in kept]
    layers = [_own_constants(layer, known, net.backends) for layer in layers]
    body = dataclasses.replace(graph, layers=layers, constants={**graph.constants, **known})
    return dataclasses.replace(net, graph=body)


def _own_constants(layer: Layer, known: Mapping[str, np.ndarray],
                   backends: Mapping[str, Any]) -> Layer:
    """``layer`` with the outer constants it reads made its own, where its backend folds them
    into a layer (``constant_inputs``: GpuAcc's Specialized layers, so that a body is captured)."""
    fold = getattr(backends.get(layer.backend or ""), "constant_inputs", None)
    reads = {name: known[name] for name in layer.inputs if name in known}
    return fold(layer, reads) if fold is not None and reads else layer


def _moves_constant(layer: Layer, known: Mapping[str, np.ndarray]) -> bool:
    return layer.op_type in GLUE and len(layer.inputs) == 1 and layer.inputs[0] in known \
        and len(layer.outputs) == 1 and bool(layer.outputs[0])


# -- iterated bodies -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Carried:
    """Where one carried value is read after an iteration and written before the next: the body
    output's slot (``source``) and the input's (``targets``); or, kept in a backend's memory, the
    slot the output glue reads and the slots its next iteration's import glue would fill, with the
    output glue (``to_host``) run once after the last iteration."""

    source: int
    targets: tuple[int, ...]
    to_host: Step | None = None
    host_read: bool = False
    """Whether the body itself reads the output glue's host value (then it runs every iteration)."""
    final: Step | None = None
    """``to_host`` reading and writing slot 1 of a list of its own (after the last iteration)."""


class IteratedBody:
    """A body run many times in one call: formal inputs (``n_formal``; ``carried`` pairs them with
    the outputs that feed them back), then the captured values. ``watched``: the output positions
    read after each iteration (a Loop's condition, scan outputs)."""

    def __init__(self, net: LoadedNetwork, n_formal: int, carried: Sequence[tuple[int, int]],
                 watched: Sequence[int]) -> None:
        self.net, self.n_formal = net, n_formal
        self.carried_inputs = tuple(position for position, _ in carried)
        self.carried_outputs = tuple(position for _, position in carried)
        self.varying = tuple(p for p in range(n_formal) if p not in self.carried_inputs)
        self.watched = tuple(watched)
        self.plain = not iterable(net) or debug.level() >= 2
        self.renew = net.exclusive  # carried GPU values copied: a graph changes its outputs
        slots, outs = net.input_slots, net.output_slots
        self.varying_slots = tuple(slots[p] for p in self.varying)
        self.carried_slots = tuple(slots[p] for p in self.carried_inputs)
        self.captured_slots = tuple(slots[n_formal:])
        self.watched_slots = tuple(outs[p] for p in self.watched)
        steps, layers = list(net.host_plan.steps), list(net.host_plan.layers)
        self.template = template = net.slots()  # a call's slots: constants, folded values
        constant = {slot for slot, value in enumerate(template) if value is not None}
        hoisted = _invariant(steps, layers, {*self.captured_slots, NONE_SLOT, *constant})
        folded = set() if self.plain or self.renew else \
            _fold(steps, hoisted, constant, template, set(outs))
        self.state = [_carried(steps, layers, slots[i], outs[o], set(hoisted), outs)
                      for i, o in carried]
        bridged_out = {i for c in self.state for i, step in enumerate(steps)
                       if step is c.to_host and not c.host_read}
        bridged_in = {i for c, (p, _) in zip(self.state, carried) if c.to_host is not None
                      for i, step in enumerate(steps) if slots[p] in step.inputs}
        keep = {*outs, *(c.source for c in self.state),
                *(slot for i in hoisted for slot in steps[i].outputs)}
        self.hoisted = tuple(steps[i] for i in hoisted if i not in folded)  # first iteration only
        self.folded = tuple(steps[i] for i in sorted(folded))  # run once, at load
        self.first = with_frees([s for i, s in enumerate(steps)
                                 if i not in bridged_out and i not in folded], keep)
        self.rest = with_frees([s for i, s in enumerate(steps)
                                 if i not in {*hoisted, *bridged_out, *bridged_in}], keep)
        # each as straight code, run where no stop is asked (``steps.compiled``): the iteration's
        # steps, its carried values handed to the next, its watched outputs returned
        moves = [(c.source, c.targets) for c in self.state]
        returns = [*self.watched_slots, *(c.source for c in self.state)]
        self.first_call = compiled(self.first, moves, returns)
        self.rest_call = compiled(self.rest, moves, returns)
        self.layer_of = {id(step.workload): layer for step, layer in zip(steps, layers)}

    def slots(self, carried: Sequence[Any], captured: Sequence[Any]) -> list[Any]:
        """A call's slot list: the template, the captured values and the carried ones put in."""
        env = list(self.template)
        for slot, value in zip(self.captured_slots, captured):
            env[slot] = value
        for slot, value in zip(self.carried_slots, carried):
            env[slot] = value
        return env

    def finished(self, values: Sequence[Any], stop: Any = None) -> list[Any]:
        """The carried ``values`` after the last iteration, each in host memory as the body gives
        it (a value kept in a backend's memory brought to the host by its output glue)."""
        final = []
        for carried, value in zip(self.state, values):
            if carried.final is not None:
                value = self.to_host(carried, value, stop)
            final.append(np.asarray(value) if isinstance(value, np.generic) else value)
        return final

    def start(self, carried: Sequence[Any], captured: Sequence[Any]) -> Iterations:
        """The iterations of one call, from the carried values' initial values."""
        if self.plain:
            return PlainIterations(self, carried, captured)
        return Iterations(self, carried, captured)

    def reads(self, position: int) -> bool:
        """Whether an iteration reads formal input ``position`` (a Loop's iteration number or
        condition often is not read: the driver need not make it)."""
        slot = self.net.input_slots[position]
        return slot in self.net.output_slots or any(slot in step.inputs for step in self.first)

    def execute(self, steps: Sequence[Step], env: list[Any], stop: Any = None) -> None:
        """Call ``steps`` over ``env`` (a loaded network's run loop, its errors named the same way);
        ``stop``: the run's check before each step, if any (``STOP``)."""
        try:
            run_steps(steps, env, stop)
        except StepFailure as failure:
            raise self.failure(failure) from failure.error

    def failure(self, failure: StepFailure) -> ExecutionError:
        """The error of a failed step, naming its layer as a loaded network does."""
        exc, step = failure.error, failure.step
        layer = self.layer_of.get(id(step.workload)) if step is not None else None
        where = f"{layer.describe()} failed on {layer.backend}" if layer else "a body failed"
        return ExecutionError(f"{where}: {type(exc).__name__}: {exc}")

    def to_host(self, carried: Carried, value: Any, stop: Any) -> Any:
        """A kept carried value brought to the host by its output glue (after the last iteration)."""
        if carried.final is None:
            return value
        env = [None, value]
        self.execute((carried.final,), env, stop)
        return env[1]


class Iterations:
    """One call's iterations over one list of slots (see ``IteratedBody``); a context manager
    around them (the body's memory managers are held from its load to its unload, not per call)."""

    def __init__(self, body: IteratedBody, carried: Sequence[Any], captured: Sequence[Any]) -> None:
        self.body, self.count, self.stop = body, 0, STOP.get()
        self.values = list(carried)  # the carried values after the last iteration
        self.env = body.slots(carried, captured)

    def __enter__(self) -> Iterations:
        # the body's memory managers are held from its load to its unload (LoadedNetwork)
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def run(self, varying: Sequence[Any]) -> list[Any]:
        """One iteration on the formal inputs that are not carried; the watched outputs."""
        body, env = self.body, self.env
        env[NONE_SLOT] = None  # an absent output of the last iteration may have written it
        for slot, value in zip(body.varying_slots, varying):
            env[slot] = value
        if self.stop is None and not body.renew:  # straight code: steps, handover, watched
            try:
                values = (body.rest_call if self.count else body.first_call)(env)
            except StepFailure as failure:
                raise body.failure(failure) from failure.error
            self.count += 1
            watching = len(body.watched_slots)
            self.values = values[watching:]
            return values[:watching]
        body.execute(body.rest if self.count else body.first, env, self.stop)
        watched = [env[slot] for slot in body.watched_slots]
        self.values = [env[c.source] for c in body.state]  # all read before any is written
        if body.renew:  # a value kept on the GPU may be a captured graph's output: copied
            self.values = [v if c.to_host is None else v.clone()
                           for c, v in zip(body.state, self.values)]
        for carried, value in zip(body.state, self.values):
            for slot in carried.targets:
                env[slot] = value
        self.count += 1
        return watched

    def carried(self) -> list[Any]:
        """The carried values after the last iteration, each in host memory as the body gives it."""
        if not self.count:
            return self.values
        return self.body.finished(self.values, self.stop)


class PlainIterations(Iterations):
    """The same iterations through the loaded network's ``execute`` (an exclusive or traced body)."""

    def __init__(self, body: IteratedBody, carried: Sequence[Any], captured: Sequence[Any]) -> None:
        self.body, self.count = body, 0
        self.values, self.captured = list(carried), list(captured)

    def __enter__(self) -> Iterations:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def run(self, varying: Sequence[Any]) -> list[Any]:
        body = self.body
        inputs: list[Any] = [None] * body.n_formal
        for position, value in zip(body.varying, varying):
            inputs[position] = value
        for position, value in zip(body.carried_inputs, self.values):
            inputs[position] = value
        outputs = body.net.execute([*inputs, *self.captured])
        self.values = [outputs[p] for p in body.carried_outputs]
        self.count += 1
        return [outputs[p] for p in body.watched]

    def carried(self) -> list[Any]:
        return self.values


def iterable(net: Any) -> bool:
    """Whether ``net`` (a loaded body) can run its iterations over one slot list (``Iterations``):
    not where a run writes memory every run shares (fallback memory, a backend's tensors) or a
    host backend's workload runs one run at a time; a GPU partition's captured CUDA graphs may
    (``exclusive``: the values they give are overwritten at their next replay, so a carried value
    kept on the GPU is copied at each iteration, and the others reach the host through glue)."""
    fallback = getattr(net, "fallback_memory", None)
    if getattr(fallback, "buffers", None) or getattr(net, "tensors", None):
        return False
    if not net.exclusive:
        return True
    from backplane.backends.builtin.device import keeps_on_device

    for step, layer in zip(net.host_plan.steps, net.host_plan.layers):
        if not getattr(step.workload, "exclusive", False) or keeps_on_device(layer.backend):
            continue
        bodies = getattr(step.workload, "bodies", None)  # nested control flow: its bodies decide
        if layer.backend != "builtin" or not bodies or not all(map(iterable, bodies)):
            return False
    return True


def _invariant(steps: Sequence[Step], layers: Sequence[Layer], given: set[int]) -> list[int]:
    """The steps whose inputs are the same at every iteration of a call: those reading only
    ``given`` slots (captured values, constants) or what such steps make. They run in the first
    iteration only (an import of a captured value; a Slice of one by constant bounds), but for a
    draw of random numbers and nested control flow, which may hold one."""
    known, found = set(given), []
    for index, (step, layer) in enumerate(zip(steps, layers)):
        if layer.op_type in VARYING:
            continue
        if all(slot in known for slot in step.inputs):
            found.append(index)
            known.update(step.outputs)
    return found


def _fold(steps: Sequence[Step], hoisted: Sequence[int], constant: set[int], template: list[Any],
          outputs: set[int]) -> set[int]:
    """The hoisted steps that read only constants (an Unsqueeze of an outer constant by a constant
    axis: the body's constants are the model's only once ``fold_outer_constants`` made them so,
    after the optimizer's folding), run here, once, their results written into ``template``;
    their indices. Not a step that writes a body output (each call's outputs are its own) nor
    one that fails here (it fails, or not, at each call, as before)."""
    known, folded = {*constant, NONE_SLOT}, set()
    for index in hoisted:
        step = steps[index]
        if not all(slot in known for slot in step.inputs) or outputs.intersection(step.outputs):
            continue
        try:
            args = [template[slot] for slot in step.inputs]
            results = (step.convert(*args),) if step.convert is not None else step.workload(*args)
        except Exception:  # noqa: BLE001  # left to the calls, whose errors name the layer
            continue
        if len(results) < len(step.outputs):
            continue
        for slot, value in zip(step.outputs, results):
            if slot != NONE_SLOT:
                template[slot] = value
                known.add(slot)
        folded.add(index)
    return folded


def _is_glue(step: Step, layer: Layer) -> bool:
    return layer.op_type in GLUE and len(step.inputs) == 1 and len(step.outputs) == 1


def _factory_id(layer: Layer, side: str) -> Any:
    return getattr(layer.attrs.get(side), "id", None)


def _carried(steps: Sequence[Step], layers: Sequence[Layer], given: int, made: int,
             hoisted: set[int], outputs: Sequence[int]) -> Carried:
    """How a carried value goes from the body output in slot ``made`` to the input slot ``given``:
    kept in its backend's memory where the body's last glue brings it to the host and only glue
    back into the same memory reads the input; otherwise through the host, as the body gives it."""
    plain = Carried(made, (given,))
    producers = [i for i, step in enumerate(steps) if made in step.outputs]
    if made == given or given in outputs or outputs.count(made) != 1 or len(producers) != 1 \
            or producers[0] in hoisted:
        return plain  # the body gives the input back, or the output twice, or not from a layer
    out, out_layer = steps[producers[0]], layers[producers[0]]
    readers = [i for i, step in enumerate(steps) if given in step.inputs]
    if not _is_glue(out, out_layer) or not readers:
        return plain
    memory = _factory_id(out_layer, "source")
    if memory is None or any(not _is_glue(steps[i], layers[i])
                             or _factory_id(layers[i], "target") != memory for i in readers):
        return plain
    return Carried(out.inputs[0], tuple(steps[i].outputs[0] for i in readers), out,
                   any(made in step.inputs for step in steps),
                   dataclasses.replace(out, inputs=(1,), outputs=(1,), frees=()))


def with_frees(steps: Sequence[Step], keep: set[int]) -> tuple[Step, ...]:
    """``steps`` with each slot they make freed after its last reader among them, but ``keep``
    (what they do not make, inputs and constants, is never freed: the slots may live across
    iterations)."""
    made = {slot for step in steps for slot in step.outputs if slot != NONE_SLOT}
    last: dict[int, int] = {}
    for index, step in enumerate(steps):
        for slot in step.inputs:
            last[slot] = index
    frees: dict[int, list[int]] = {}
    for slot, index in last.items():
        if slot in made and slot not in keep:
            frees.setdefault(index, []).append(slot)
    return tuple(dataclasses.replace(step, frees=tuple(frees.get(i, ())))
                 for i, step in enumerate(steps))
