"""Control-flow bodies as flat call lists: an If branch or a Loop/Scan body costs its kernels.

A body is loaded as a network of its own (``LoadedNetwork``); a layer of it that its backend can
also run as plain kernel calls (CpuAcc's Specialized layers, whose build per input signature and
nested network cost more than their few small layers: ``CpuAcc.flat_layers``) is expanded here, at
load, into those calls, over slots of the body's slot list. The body then runs as one flat list of
steps (``FlatBody``), through the runtime's own run loop: no nested network per call or iteration,
whatever the shapes of an iteration.

Nothing is expanded in a body that runs one run at a time (``exclusive``) or under the debug
trace: those run their loaded network as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backplane import debug
from backplane.backends.builtin.bodies import with_frees
from backplane.ir.graph import Layer
from backplane.runtime.loaded_network import (
    NONE_SLOT,
    STOP,
    ExecutionError,
    LoadedNetwork,
    Step,
    StepFailure,
    run_steps,
)
from backplane.runtime.steps import RunTerminated
from backplane.runtime.steps import compiled


class FlatBody:
    """A loaded body with its expandable layers expanded: what ``IteratedBody`` and builtin's If
    read of a loaded network (``host_plan``, ``slots``, ``input_slots``, ``output_slots``,
    ``exclusive``, ``execute``), over a longer slot list holding the folded constants too."""

    exclusive = False

    def __init__(self, net: LoadedNetwork, steps: Sequence[Step], layers: Sequence[Layer],
                 template: list[Any]) -> None:
        self.net, self.input_slots, self.output_slots = net, net.input_slots, net.output_slots
        keep = set(self.output_slots)
        self.host_plan = dataclasses.replace(net.host_plan, steps=with_frees(steps, keep),
                                             layers=tuple(layers))
        self.template = template
        self.layer_of = {id(step.workload): layer for step, layer in zip(steps, layers)}
        self.call = compiled(self.host_plan.steps)  # where no stop is asked
        self.direct = _direct(self.host_plan.steps, self.input_slots, self.output_slots, template)

    def slots(self) -> list[Any]:
        """The slots a call starts from: constants bound, all else None."""
        return list(self.template)

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        """One call; ``inputs`` in the order of the body's inputs."""
        env = list(self.template)
        for slot, value in zip(self.input_slots, inputs):
            env[slot] = value
        stop = STOP.get()
        try:
            if stop is None:
                self.call(env)
            else:
                run_steps(self.host_plan.steps, env, stop)
        except StepFailure as failure:
            raise self.failure(failure) from failure.error
        outputs = []
        for slot in self.output_slots:  # in line, no frame per output: an If runs it at each call
            value = env[slot]  # NumPy turns 0-d results into scalars (np.float32): arrays out
            outputs.append(np.asarray(value) if type(value) is not np.ndarray
                           and isinstance(value, np.generic) else value)
        return outputs

    def failure(self, failure: StepFailure) -> ExecutionError:
        """The error of a failed step, naming its layer as a loaded network does."""
        exc, step = failure.error, failure.step
        layer = self.layer_of.get(id(step.workload)) if step is not None else None
        where = f"{layer.describe()} failed on {layer.backend}" if layer else "a body failed"
        return ExecutionError(f"{where}: {type(exc).__name__}: {exc}")


def _direct(steps: Sequence[Step], inputs: Sequence[int], outputs: Sequence[int],
            template: list[Any]) -> Any:
    """``execute`` where no stop is asked, as one function of straight code of the inputs (a
    sequence in the body's order): each input and each slot of ``template`` it reads a local
    variable, a line per step, the outputs a tuple of arrays. builtin's If calls it for its branch:
    no slot list copied, no second frame (``FlatBody.execute`` and ``call``). A failed step raises
    ``StepFailure`` naming it. Nothing of the model is in the code: slot numbers only."""
    from backplane.runtime.steps import SlotReader, _outputs, _step_at, step_line

    namespace: dict[str, Any] = {"StepFailure": StepFailure, "RunTerminated": RunTerminated,
                                 "_outputs": _outputs, "T": template, "_ndarray": np.ndarray,
                                 "_generic": np.generic, "_asarray": np.asarray}
    read = SlotReader("T", inputs)
    loads, made = read.loads, read.made

    lines: list[str] = []
    steps_at: dict[int, Step] = {}
    for index, step in enumerate(steps):
        steps_at[len(lines)] = step
        lines.append("        " + step_line(step, str(index), read, namespace))
        made.update(slot for slot in step.outputs if slot != NONE_SLOT)
        lines.extend(f"        v{slot} = None" for slot in step.frees if slot in made)
    given = [f"    v{slot} = inputs[{k}]" for k, slot in enumerate(inputs)]
    results = [read(slot) for slot in outputs]
    header = ["def run(inputs):", *given, *loads.values(), "    try:"]
    footer = ["    except RunTerminated:", "        raise", "    except Exception as exc:",
              "        raise StepFailure(_failed_step(exc), exc) from exc"]
    for k, value in enumerate(results):  # NumPy turns 0-d results into scalars: arrays out
        footer += [f"    o{k} = {value}",
                   f"    if type(o{k}) is not _ndarray and isinstance(o{k}, _generic):",
                   f"        o{k} = _asarray(o{k})"]
    footer.append(f"    return ({''.join(f'o{k}, ' for k in range(len(results)))})")
    source = "\n".join([*header, *(lines or ["        pass"]), *footer])
    first = len(header) + 1
    at = {first + offset: step for offset, step in steps_at.items()}
    namespace["_failed_step"] = lambda exc: _step_at(exc, at)
    exec(compile(source, "<backplane steps>", "exec"), namespace)  # noqa: S102  # slot numbers only
    return namespace.pop("run")  # no cycle through its globals: its workloads go at the unload


def flatten(net: LoadedNetwork) -> LoadedNetwork | FlatBody:
    """``net`` (a loaded body) with each layer its backend can run flat expanded into its calls,
    run as straight code (``FlatBody``); ``net`` itself where it runs one run at a time or traced."""
    if net.exclusive or debug.level() >= 2:
        return net
    template, constants = net.slots(), net.network.graph.constants
    steps: list[Step] = []
    layers: list[Layer] = []
    for step, layer in zip(net.host_plan.steps, net.host_plan.layers):
        backend = net.network.backends.get(layer.backend or "")
        flat_layers = getattr(backend, "flat_layers", None)
        inner, at, known = undelegated(layer, step, template, backend, constants)
        flat = None if flat_layers is None else flat_layers(inner, at.workload, known)
        if flat is None:
            steps.append(step)
            layers.append(layer)
            continue
        for call in _calls(at, flat, template):
            steps.append(call)
        layers += [inner for _, _, _, inner in flat.calls]
    steps, layers = direct_predicates(steps, layers, set(net.output_slots))
    return FlatBody(net, steps, layers, template)  # straight code, expanded or not


def undelegated(layer: Layer, step: Step, template: list[Any], backend: Any,
                constants: Mapping[str, Any]) -> tuple[Layer, Step, Mapping[str, Any]]:
    """The layer a Delegate layer of one layer stands for (a session loaded from its compile
    cache holds a body's Specialized layer as a Delegate of its backend's blob), with a step over
    the Delegate's slots in that layer's order, its constants (the partition's own, put in new
    slots of ``template`` in the backend's memory) known; ``layer``, ``step`` and ``constants`` as
    they are for any other layer, or where that layer reads or makes a value the Delegate does
    not have."""
    part = layer.attrs.get("graph") if layer.op_type == "Delegate" else None
    if part is None or len(part.layers) != 1 or backend is None:
        return layer, step, constants
    (inner,) = part.layers
    slots = {**dict(zip(layer.inputs, step.inputs)), **dict(zip(layer.outputs, step.outputs))}
    suffix = f"@{layer.backend}"  # a constant in the backend's memory: its name, so marked
    slots.update({name: slots[name.removesuffix(suffix)] for name in inner.inputs
                  if name.endswith(suffix) and name.removesuffix(suffix) in slots})
    if any(name and name not in slots and name not in part.constants for name in inner.inputs):
        return layer, step, constants
    copy_in = backend.tensor_handle_factories()[0].copy_in
    for name in inner.inputs:
        if name and name not in slots:
            slots[name] = len(template)
            template.append(copy_in(part.constants[name]))
    reads = tuple(slots[name] if name else NONE_SLOT for name in inner.inputs)
    writes = tuple(slots.get(name, NONE_SLOT) if name else NONE_SLOT for name in inner.outputs)
    known = {**constants, **part.constants,
             **{name: constants[name.removesuffix(suffix)] for name in inner.inputs
                if name.endswith(suffix) and name.removesuffix(suffix) in constants}}
    return inner, Step(step.workload, reads, writes, ()), known


def direct_predicates(steps: Sequence[Step], layers: Sequence[Layer], keep: set[int],
                      ) -> tuple[list[Step], list[Layer]]:
    """``steps`` with each If reading its predicate where it was made: the host handover
    (MemImport: CpuAcc's ``.numpy()``) that brought it to builtin, read by that If alone, is left
    out; the If reads the value once on the host (``control_flow._bool``: one ``.item()``)."""
    readers: dict[int, int] = {}
    for step in steps:
        for slot in step.inputs:
            readers[slot] = readers.get(slot, 0) + 1
    producer = {slot: i for i, step in enumerate(steps) for slot in step.outputs}
    dropped: dict[int, int] = {}  # a handover's index -> the slot it read
    for step, layer in zip(steps, layers):
        if layer.op_type != "If" or layer.backend != "builtin" or not step.inputs:
            continue
        made = producer.get(step.inputs[0])
        if made is None or step.inputs[0] in keep or readers.get(step.inputs[0]) != 1:
            continue
        before, glue = steps[made], layers[made]
        if glue.op_type == "MemImport" and before.convert is not None:
            dropped[made] = before.inputs[0]
    if not dropped:
        return list(steps), list(layers)
    renamed = {steps[i].outputs[0]: slot for i, slot in dropped.items()}
    kept = [i for i in range(len(steps)) if i not in dropped]
    return ([dataclasses.replace(steps[i], inputs=tuple(renamed.get(s, s) for s in steps[i].inputs))
             for i in kept], [layers[i] for i in kept])


def _calls(step: Step, flat: Any, template: list[Any]) -> list[Step]:
    """``flat``'s calls as steps: the layer's inputs and outputs in ``step``'s slots, its folded
    constants and inner tensors in new slots at the end of ``template``."""
    slots = dict(zip(flat.inputs, step.inputs))
    slots.update(zip(flat.outputs, step.outputs))

    def slot(name: str) -> int:
        if not name:
            return NONE_SLOT
        if name not in slots:
            slots[name] = len(template)
            template.append(flat.constants.get(name))
        return slots[name]

    return [Step(call, tuple(map(slot, reads)), tuple(map(slot, writes)), ())
            for call, reads, writes, _ in flat.calls]

