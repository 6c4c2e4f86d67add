"""A run's steps over numbered slots, and the loop that calls them (onnx.reference's "step 2").

A loaded network (``loaded_network.py``) decides everything at load: each layer's workload, the
slot each tensor lives in, when a slot can be dropped. What it hands a run is a ``Plan``: a tuple
of ``Step``s, each a workload with the slots it reads and writes and the slots it was the last
reader of. ``run_steps`` is then the whole hot path: call each step on its slots, write its
results, clear what is dead.

A MemImport between two kinds of host memory (the user's NumPy arrays and CpuAcc's torch tensors:
``torch.from_numpy`` one way, ``.numpy()`` the other) hands one value over without a copy. Its step
carries that handover as a plain function (``Step.convert``: value in, value out), prepared at
load, which the loop calls in place of the workload: no argument list, no result tuple. The step
keeps its workload for profiles and error messages.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy import ndarray

from backplane.backends.api.backend import Workload
from backplane.backends.api.memory import HOST_FACTORY, TensorHandleFactory
from backplane.ir.graph import Layer

NONE_SLOT = 0  # always holds None: absent optional inputs read it, absent outputs write it


class ExecutionError(RuntimeError):
    """A workload failed at run time; the message names its layer."""


class RunTerminated(ExecutionError):
    """A run stopped between two layers: ``RunOptions.terminate`` was set, or its time ran out."""


STOP: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "backplane_stop", default=None)
"""The running run's check, called before each layer (control-flow bodies' included): raises
``RunTerminated`` to stop it. None (the hot path's case): nothing is checked."""


@dataclass(frozen=True, slots=True)
class Step:
    workload: Workload
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    frees: tuple[int, ...]  # slots read for the last time by this step
    convert: Callable[[Any], Any] | None = None
    """A MemImport's handover as one function of its one input (``handover``), which the loop
    calls instead of ``workload``; None for every other step."""


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


class StepFailure(Exception):
    """A step's workload raised ``error`` (``run_steps``): the caller names the step's layer."""

    def __init__(self, step: Step, error: Exception) -> None:
        super().__init__(step, error)
        self.step, self.error = step, error


def run_steps(steps: Sequence[Step], env: list[Any], stop: Any = None) -> None:
    """The run loop: each step's workload called on its slots of ``env``, its results written to
    its output slots, the slots it was the last reader of cleared; ``stop`` (a run's ``STOP``)
    asked before each step where given. A workload's error comes out as a ``StepFailure`` naming
    the step (``RunTerminated``, which ``stop`` raises, as it is)."""
    step = None
    try:
        for step in steps:
            if stop is not None:
                stop()
            convert = step.convert
            if convert is not None:
                env[step.outputs[0]] = convert(env[step.inputs[0]])
            else:
                reads = step.inputs
                # one input read as it is: a list built per call costs more than the branch
                results = step.workload(env[reads[0]]) if len(reads) == 1 \
                    else step.workload(*[env[i] for i in reads])
                for i, value in zip(step.outputs, results):
                    env[i] = value
            for i in step.frees:
                env[i] = None
    except RunTerminated:
        raise
    except Exception as exc:
        raise StepFailure(step, exc) from exc  # type: ignore[arg-type]  # the loop named it


def handover(layer: Layer, workload: Workload, created: Workload) -> Callable[[Any], Any] | None:
    """The function a MemImport step runs (``Step.convert``): ``layer``'s source's ``export``
    then its target's ``import_`` (what builtin's MemImport workload calls), with the host's
    identity left out; None where ``layer`` is not a MemImport of builtin's or where the runtime
    wrapped its workload (``created`` is the workload before: a wrapper must run)."""
    if layer.op_type != "MemImport" or layer.backend != "builtin" or workload is not created:
        return None
    source, target = layer.attrs.get("source"), layer.attrs.get("target")
    if not isinstance(source, TensorHandleFactory) or not isinstance(target, TensorHandleFactory):
        return None
    export, import_ = source.export, target.import_
    if export is HOST_FACTORY.export:
        return import_
    if import_ is HOST_FACTORY.import_:
        return export

    def both(value: Any) -> Any:
        return import_(export(value))

    return both


def plan_steps(layers: Sequence[Layer], workloads: Sequence[Workload], slots: dict[str, int],
               keep: set[int], constant_slots: dict[tuple[int, str], str],
               converts: Sequence[Callable[[Any], Any] | None] = ()) -> list[Step]:
    """The steps, with every slot freed after its last reader (graph outputs and constants kept);
    ``converts``, where given, the MemImport handovers of the layers (``handover``)."""
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
        convert = converts[index] if index < len(converts) else None
        if convert is not None and (len(ins) != 1 or len(outs) != 1):
            convert = None
        steps.append(Step(workload, ins, outs, tuple(frees.get(index, ())), convert))
    return steps


def one_call(plan: Plan, template: Sequence[Any], loop: Callable[[Sequence[Any]], list[Any]],
             failure: Callable[[Step, Exception], Exception],
             owned: Callable[[list[Any], Sequence[Any]], list[Any]] | None = None,
             ) -> Callable[[Sequence[Any]], list[Any]] | None:
    """The plan of a network that is one partition (one step between the handovers of its inputs
    and of its outputs: CpuAcc's compiled partition between ``torch.from_numpy`` and ``.numpy()``)
    as one function of the run's inputs: each handover called on its value, the step on those,
    the outputs' handovers on its results; no slots. None for any other plan. Under a stop
    (``STOP`` set) it runs ``loop`` (the slots' loop, which asks before each step); a failure is
    ``failure(step, error)``, as the loop's.

    Given ``owned`` (the runtime's ``ownership.owned`` of a run's outputs and inputs), the function
    has an ``owned`` attribute too: the same run, its outputs the caller's alone (see
    ``owning_call``)."""
    work = [step for step in plan.steps if step.convert is None]
    if len(work) != 1 or not plan.input_slots:
        return None
    (step,) = work
    made = {slot: (k, s) for s in plan.steps if s.convert is not None for k, slot in
            enumerate(s.outputs)}
    position = {slot: p for p, slot in enumerate(plan.input_slots)}
    reads = []  # per argument of the step: (input position or -1, handover, its step, constant)
    for slot in step.inputs:
        _, before = made.get(slot, (0, None))
        source = before.inputs[0] if before is not None else slot
        if source in position:
            reads.append((position[source], before.convert if before else None, before or step,
                          None))
        elif before is None and slot not in position and template[slot] is not None \
                or slot == NONE_SLOT:
            reads.append((-1, None, step, template[slot]))
        else:
            return None
    outs = []  # per output: (the step's output index, handover or None, its step)
    for slot in plan.output_slots:
        _, after = made.get(slot, (0, None))
        source = after.inputs[0] if after is not None else slot
        if source not in step.outputs or slot in position:
            return None
        outs.append((step.outputs.index(source), after.convert if after else None, after or step))
    used = {id(step)} | {id(s) for _, _, s, _ in reads} | {id(s) for _, _, s in outs}
    if any(id(s) not in used for s in plan.steps):  # a handover of something else: the loop
        return None
    workload = step.workload

    def call(values: Sequence[Any]) -> list[Any]:
        if STOP.get() is not None:
            return loop(values)
        at = step
        try:
            args = []
            for index, convert, at, constant in reads:
                args.append(constant if index < 0 else values[index] if convert is None
                            else convert(values[index]))
            at = step
            results = workload(*args)
            outputs = []
            for index, convert, at in outs:
                value = results[index]
                outputs.append(convert(value) if convert is not None else
                               np.asarray(value) if isinstance(value, np.generic) else value)
            return outputs
        except RunTerminated:
            raise
        except Exception as exc:
            raise failure(at, exc) from exc

    if owned is not None:
        call.owned = owning_call(call, reads, workload, step, outs,  # type: ignore[attr-defined]
                                 owned, failure, len(plan.input_slots))
    return call


def owning_call(call: Callable[[Sequence[Any]], list[Any]], reads: Sequence[tuple[Any, ...]],
                workload: Workload, step: Step,
                outs: Sequence[tuple[int, Callable[[Any], Any] | None, Step]],
                owned: Callable[[list[Any], Sequence[Any]], list[Any]],
                failure: Callable[[Step, Exception], Exception], inputs: int = 0,
                ) -> Callable[[Sequence[Any]], list[Any]]:
    """``one_call``'s ``call`` (of ``reads``, ``workload`` and ``outs``, as it has them) with its
    outputs the caller's alone, decided where they are made: where every output has a handover,
    each result is looked at before its handover (``fresh_outputs.fresh``: a tensor no one else
    holds, in memory torch's allocator made) and handed over as it is, ``owned`` deciding for all
    only where one is not; where none has one and the workload offers such a run of its own (an
    ``owned`` attribute, a function of its inputs' sequence that asks the stop as its run does:
    builtin's DecidedIf, whose versions do), that run, itself where the step reads the network's
    ``inputs`` as they are; else ``owned`` after ``call``. Under a stop: ``owned`` after ``call``."""
    from backplane.runtime.fresh_outputs import Made, fresh, made

    inner = getattr(workload, "owned", None)
    plain = all(convert is None for _, convert, _, _ in reads) \
        and all(convert is None for _, convert, _ in outs)
    if inner is not None and plain and [i for i, _, _ in outs] == list(range(len(outs))):
        if [index for index, _, _, _ in reads] == list(range(inputs)):
            return inner  # type: ignore[no-any-return]  # its errors name their layers
        return lambda values: inner([constant if index < 0 else values[index]
                                     for index, _, _, constant in reads])
    if any(convert is None for _, convert, _ in outs):
        return lambda values: owned(call(values), values)

    kept, positions, taken = _hosted(reads, workload, outs)

    def handed(values: Sequence[Any]) -> list[Any]:
        if STOP.get() is not None:
            return owned(call(values), values)
        if kept:  # a native plan's NumPy run kept for these shapes: called in line, no frame
            arrays, shapes = [], []
            for index in positions:
                value = values[index]
                arrays.append(value)
                shapes.append(value.shape if type(value) is ndarray else None)
            host = kept.get(tuple(shapes))
            if host is not None:
                try:
                    results = host(*arrays)
                except Exception:  # noqa: BLE001  # again through the step: its error names it
                    results = None
                if results is not None:
                    outputs = []
                    for index in taken:
                        outputs.append(results[index])
                    return outputs
        at = step
        try:
            args = []
            for index, convert, at, constant in reads:
                args.append(constant if index < 0 else values[index] if convert is None
                            else convert(values[index]))
            at = step
            results = workload(*args)
            outputs = []
            mine = True
            own = made if type(results) is Made else fresh  # Made: proven at its build
            for index, convert, at in outs:
                value = results[index]
                mine = mine and own(value)
                outputs.append(convert(value))  # type: ignore[misc]  # each has one (above)
        except RunTerminated:
            raise
        except Exception as exc:
            raise failure(at, exc) from exc
        if mine:
            return outputs
        results = value = None  # ``owned`` counts references: the outputs' must be theirs alone
        return owned(outputs, values)

    handed.parts = (reads, workload, outs, owned)  # type: ignore[attr-defined]  # direct_run's
    return handed


def _hosted(reads: Sequence[tuple[Any, ...]], workload: Workload,
            outs: Sequence[tuple[int, Any, Step]]) -> tuple[Any, list[int], list[int]]:
    """For ``owning_call``'s ``handed``: the ``host_route.Hosted`` runs ``workload`` holds (a
    Specialized layer's native plan; None where it holds none, where the step reads a constant
    or two outputs are one result), the inputs' positions it reads and the results the outputs
    take. ``handed`` calls the run kept for its NumPy inputs' shapes on them, fresh NumPy
    outputs the caller's: a version of builtin's DecidedIf, which the session's direct run does
    not reach (``prepared_run._hosted`` is the same for a network's one call)."""
    from backplane.runtime.host_route import hosted

    found = hosted(workload)
    positions = [index for index, _, _, _ in reads]
    taken = [index for index, _, _ in outs]
    if min(positions, default=-1) < 0 or len(set(taken)) != len(taken):
        found = None
    return found, positions, taken


# -- steps as straight code ------------------------------------------------------------------------
def compiled(steps: Sequence[Step], moves: Sequence[tuple[int, Sequence[int]]] = (),
             returns: Sequence[int] = ()) -> Callable[[list[Any]], list[Any]]:
    """``steps`` as one function of the slots doing what ``run_steps(steps, env)`` does (no stop
    asked): each step one line of straight code over local variables, no loop over the steps, no
    tuple of inputs, no slot written and cleared between two steps (``run_steps`` costs about
    0.7 us a step on this 2-core AMD EPYC, the line about 0.1). What the steps read and did not
    make is read from ``env`` first; what they make and no later step frees is written back. A
    workload's error comes out as ``run_steps``'s, a ``StepFailure`` naming its step (found by the
    line it failed on). Then, where given, ``moves``: each ``(slot, targets)`` writes the value of
    ``slot`` into ``targets`` (all read before any is written: a Loop's carried values); the
    function returns the values of ``returns``' slots, a list. For control-flow bodies, whose few
    small kernels run per iteration: the code is made at load from slot numbers only, nothing of
    the model's."""
    read = SlotReader("env")
    loads, made = read.loads, read.made
    body: list[str] = []
    live: dict[int, None] = {}  # made and not freed since, in order
    namespace: dict[str, Any] = {"StepFailure": StepFailure, "RunTerminated": RunTerminated,
                                 "_outputs": _outputs}
    line_of_step: dict[int, Step] = {}

    for index, step in enumerate(steps):
        line = step_line(step, str(index), read, namespace)
        line_of_step[len(body)] = step
        body.append("        " + line)
        for slot in step.outputs:
            if slot != NONE_SLOT:
                made.add(slot)
                live.pop(slot, None)
                live[slot] = None
        for slot in step.frees:
            if slot in made:
                body.append(f"        v{slot} = None")
                live.pop(slot, None)
    writes = [f"    env[{slot}] = v{slot}" for slot in live]
    moved = [f"    m{k} = {read(slot)}" for k, (slot, _) in enumerate(moves)]
    moved += [f"    env[{target}] = m{k}" for k, (_, targets) in enumerate(moves) for target in targets]
    writes += [*moved, f"    return [{', '.join(map(read, returns))}]"]
    header = ["def run(env):", *loads.values(), "    try:"]
    source = "\n".join([*header, *(body or ["        pass"]),
                        "    except RunTerminated:", "        raise",
                        "    except Exception as exc:",
                        "        raise StepFailure(_failed_step(exc), exc) from exc", *writes])
    first = len(header) + 1  # the line number of the first step's line
    steps_at = {first + offset: step for offset, step in line_of_step.items()}
    namespace["_failed_step"] = lambda exc: _step_at(exc, steps_at)
    exec(compile(source, "<backplane steps>", "exec"), namespace)  # noqa: S102  # slot numbers only
    return namespace.pop("run")  # type: ignore[no-any-return]  # no cycle through its globals


class SlotReader:
    """``step_line``'s ``read`` for code over ``v<slot>`` variables: a slot's name, and for a slot
    read before the code makes it (one of ``made`` at the start: its inputs) one line that loads
    it from ``source`` (``loads``, in the order first read). Shared by the straight code of a
    step list, of an If's branch (builtin/flat.py) and of a whole Loop (builtin/looped.py)."""

    def __init__(self, source: str, made: Iterable[int] = ()) -> None:
        self.source = source
        self.made: set[int] = set(made)
        self.loads: dict[int, str] = {}

    def __call__(self, slot: int) -> str:
        if slot == NONE_SLOT:
            return "None"
        if slot not in self.made:
            self.loads.setdefault(slot, f"    v{slot} = {self.source}[{slot}]")
        return f"v{slot}"


def step_line(step: Step, key: str, read: Callable[[int], str], namespace: dict[str, Any]) -> str:
    """``step`` as one line of straight code over ``v<slot>`` variables (``read`` names an input),
    its workload or handover put in ``namespace`` under a name made of ``key``."""
    args = ", ".join(map(read, step.inputs))
    names = [f"v{slot}" if slot != NONE_SLOT else "_" for slot in step.outputs]
    if step.convert is not None:
        namespace[f"c{key}"] = step.convert
        return f"{names[0]} = c{key}({args})"
    namespace[f"w{key}"] = step.workload
    call = f"w{key}({args})"
    return (call if not names else f"{names[0]} = {call}[0]" if len(names) == 1
            else f"{', '.join(names)} = _outputs({call}, {len(names)})")


def _outputs(results: Sequence[Any], count: int) -> tuple[Any, ...]:
    """A workload's first ``count`` results, None for those it did not give (``run_steps`` leaves
    them unwritten)."""
    return (*results[:count], *(None,) * (count - len(results)))


def _step_at(exc: BaseException, steps_at: dict[int, Step]) -> Step | None:
    """The step whose line of the compiled code raised ``exc``."""
    trace = exc.__traceback__
    while trace is not None:
        if trace.tb_frame.f_code.co_filename == "<backplane steps>":
            return steps_at.get(trace.tb_lineno)
        trace = trace.tb_next
    return None


STRAIGHT_STEPS = 256
"""The most steps a network's plan may have to run as straight code (``straight_run``): the code
costs about 1 ms to make per 100 steps at load; a plan of more runs by ``run_steps``."""


def straight_run(plan: Plan, template: Sequence[Any],
                 failure: Callable[[Step, Exception], Exception],
                 ) -> Callable[[Sequence[Any]], list[Any]] | None:
    """A network's run of ``plan`` (what ``loaded_network._run`` does: a new list of slots from
    ``template``, the inputs put in, the steps, the outputs as arrays) with its steps as straight
    code (``compiled``); ``run_steps`` under a stop (``STOP`` set). None for a plan of more than
    ``STRAIGHT_STEPS`` steps."""
    if len(plan.steps) > STRAIGHT_STEPS:
        return None
    steps, inputs_at, outputs_at = plan.steps, plan.input_slots, plan.output_slots
    call = compiled(steps, returns=outputs_at)
    native = native_network(plan, template)

    def run(inputs: Sequence[Any]) -> list[Any]:
        if native is not None and STOP.get() is None:
            made = native(inputs)
            if made is not None:
                return made  # type: ignore[no-any-return]  # fresh arrays, the caller's
        env = list(template)
        for slot, value in zip(inputs_at, inputs):
            env[slot] = value
        stop = STOP.get()
        try:
            if stop is None:
                outputs = call(env)
            else:
                run_steps(steps, env, stop)
                outputs = [env[slot] for slot in outputs_at]
        except StepFailure as failed:
            raise failure(failed.step, failed.error) from failed.error
        return [np.asarray(v) if isinstance(v, np.generic) else v for v in outputs]

    run.straight = (call, template, inputs_at, len(outputs_at), failure)  # type: ignore[attr-defined]
    run.native = native  # type: ignore[attr-defined]  # read by prepared_run's direct run
    return run


def native_network(plan: Plan, template: Sequence[Any]) -> Any:
    """The whole network as one native call, where a step's workload offers to plan it
    (``plans_network``: builtin's If, ``builtin/native_net.py``) and it takes the network: an
    object called on a run's inputs that returns its outputs, fresh, or None (then the steps run),
    with ``hosted`` (``host_route.Hosted``: its runs by the inputs' shapes) and ``make(shapes,
    inputs)`` for the direct run. None where no step offers or the offer refuses."""
    for step in plan.steps:
        offer = getattr(step.workload, "plans_network", None)
        if offer is not None:
            return offer(plan.steps, plan.layers, template, plan.input_slots, plan.output_slots)
    return None
