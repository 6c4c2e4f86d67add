"""Ifs decided before their network runs: by a constant, or by the model's small inputs.

Why: builtin runs an If's branch as a nested network (``backends/builtin/control_flow.py``), which
cuts the network around it into partitions with handovers between them, and a compiled partition
never spans the If. A VAD whose front end is chosen by its sample-rate input (``sr == 16000``)
then ran three partitions and a nested one: 0.38 ms where its layers alone took 0.28.

Two cases are decided here, before placement:

- an If whose predicate is a constant (after constant folding) is replaced by the branch it takes;
- an If whose predicate is computed only from the network's inputs of a few elements and fixed
  sizes (``PREDICATE_ELEMENTS``) and constants (``sr``, a mode flag) makes the network two
  versions, each the network with one branch inlined, optimized whole like any network (one
  compiled CpuAcc partition for the VAD). The network becomes one builtin ``DecidedIf`` layer
  (``backends/builtin/decided.py``), which computes the predicate on the host from those inputs
  (once per value: remembered by their bytes) and runs the version it picks.

Each version may decide a further If, ``MAX_DECIDED`` deep (at most 2**3 versions). An If whose
predicate reads anything else (a tensor computed from data) stays a builtin If, run by its nested
branch networks. The report names the If's path and why (``LayerPlacement.note``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from backplane.backends.builtin.backend import DECIDED_IF
from backplane.ir.graph import Graph, Layer
from backplane.optimizer.passes import NONDETERMINISTIC
from backplane.optimizer.report import LayerPlacement, PlacementReport

MAX_DECIDED = 3
"""Ifs decided one inside another's version: each doubles the networks loaded."""
MAX_BYTES = 64 << 20
"""A network whose weights take more is not made versions (each version's backends hold its own
prepacked or copied weights)."""
PREDICATE_ELEMENTS = 64
"""The most elements an input that decides an If may have (``sr``: 1)."""
BRANCHES = ("then_branch", "else_branch")
WITH_BODIES = frozenset({"If", "Loop", "Scan", "SequenceMap"})


@dataclass(frozen=True)
class Decision:
    """An If decided by the network's inputs: the If, the layers computing its predicate (in the
    network's order) and the inputs they read."""

    layer: Layer
    predicate: tuple[Layer, ...]
    inputs: tuple[str, ...]

    def why(self) -> str:
        """The report's note on the If."""
        computed = ", ".join(lay.op_type for lay in self.predicate)
        return (f"decided by input {', '.join(self.inputs)} on the host ({computed}), once per "
                f"value: each value runs its own network, the branch taken inlined")


def why_nested(decide: int, graph: Graph) -> str:
    """The report's note on an If of ``graph`` left to its nested branch networks; ``decide``:
    how many Ifs deep the optimizer could still decide (0 inside a body)."""
    if decide <= 0:
        why = f"not decided inside a body or past {MAX_DECIDED} decided Ifs"
    elif too_large(graph):
        why = (f"the network's weights, {constant_bytes(graph) / 2**20:.0f} MiB, too large to "
               f"load a version per branch")
    else:
        why = "its predicate is not computed from small inputs and constants alone"
    return f"the branch taken runs as a nested network at each run ({why})"


def constant_bytes(graph: Graph) -> int:
    return sum(int(getattr(value, "nbytes", 0)) for value in graph.constants.values())


def too_large(graph: Graph) -> bool:
    """Whether ``graph``'s weights are too large to hold once per version (``MAX_BYTES``)."""
    return constant_bytes(graph) > MAX_BYTES


def inline_constant_ifs(graph: Graph) -> bool:
    """Replace each If of ``graph`` whose predicate is a constant by the branch it takes; whether
    any was."""
    inlined = False
    for layer in list(graph.layers):
        cond = layer.inputs[0] if layer.op_type == "If" and not layer.domain else ""
        if cond and cond in graph.constants:
            branch = BRANCHES[0] if _true(graph.constants[cond]) else BRANCHES[1]
            _inline_into(graph, layer, branch)
            inlined = True
    return inlined


def _true(value: np.ndarray) -> bool:
    return bool(np.asarray(value).reshape(-1)[0])


def find(graph: Graph, computable: Callable[[Layer], bool]) -> Decision | None:
    """The first If of ``graph`` whose predicate is computed from its small static inputs and
    constants only (see above), by layers ``computable`` on the host; None where there is none."""
    made = {out: layer for layer in graph.layers for out in layer.outputs if out}
    if len(set(graph.outputs)) != len(graph.outputs) or set(graph.outputs) & set(graph.inputs) \
            or too_large(graph):
        return None  # an output given twice or an input given back: a layer cannot write it
    for layer in graph.layers:
        if layer.op_type == "If" and not layer.domain and layer.inputs and layer.inputs[0]:
            found = _cone(layer.inputs[0], made, graph, computable)
            if found is not None and found[1]:
                order = {id(lay): i for i, lay in enumerate(graph.layers)}
                layers = sorted(found[0], key=lambda lay: order[id(lay)])
                return Decision(layer, tuple(layers), tuple(found[1]))
    return None


def _cone(name: str, made: dict[str, Layer], graph: Graph, computable: Callable[[Layer], bool],
          ) -> tuple[list[Layer], list[str]] | None:
    """The layers computing ``name`` and the inputs they read, or None where it reads anything
    but small static inputs and constants, or a layer of another domain, a body or a random draw."""
    layers: dict[int, Layer] = {}
    inputs: list[str] = []
    stack = [name]
    while stack:
        tensor = stack.pop()
        if not tensor or tensor in graph.constants or tensor in inputs:
            continue
        if tensor in graph.inputs:
            info = graph.info(tensor)
            if not info.is_static or info.shape is None \
                    or int(np.prod(info.shape)) > PREDICATE_ELEMENTS:
                return None
            inputs.append(tensor)
            continue
        layer = made.get(tensor)
        if layer is None or layer.domain or layer.op_type in NONDETERMINISTIC \
                or layer.op_type in WITH_BODIES or not computable(layer):
            return None
        if id(layer) not in layers:
            layers[id(layer)] = layer
            stack += layer.inputs
    return list(layers.values()), inputs


def versions(graph: Graph, decision: Decision) -> dict[str, Graph]:
    """Per branch, a copy of ``graph`` with ``decision``'s If replaced by that branch."""
    made = {}
    for branch in BRANCHES:
        version = graph.private_copy()
        layer = next(lay for lay in version.layers if lay.name == decision.layer.name)
        _inline_into(version, layer, branch)
        made[branch] = version
    return made


def predicate(graph: Graph, decision: Decision) -> Graph:
    """The layers computing ``decision``'s predicate as a graph of their own: its inputs the
    network's inputs they read, its output the predicate."""
    layers = [copy.copy(lay) for lay in decision.predicate]
    names = {n for lay in layers for n in (*lay.inputs, *lay.outputs) if n}
    cond = decision.layer.inputs[0]
    return Graph(f"{decision.layer.name} predicate", layers, list(decision.inputs), [cond],
                 {n: graph.info(n) for n in names | {cond}},
                 {n: graph.constants[n] for n in names if n in graph.constants},
                 dict(graph.opsets))


def decided_network(graph: Graph, decision: Decision, optimize: Callable[[Graph, str], object],
                    ) -> tuple[Graph, PlacementReport, dict[str, object]]:
    """``graph`` as one ``DecidedIf`` layer over its versions, each optimized by
    ``optimize(version, path)``; the report joins theirs, their layers under the version's path
    ("/If/then_branch/<layer>"), with a line for the If saying why."""
    nets = {branch: optimize(version, f"{decision.layer.name}/{branch}/")
            for branch, version in versions(graph, decision).items()}
    attrs = {**nets, "predicate": predicate(graph, decision), "why": decision.why()}
    layer = Layer(decision.layer.name, DECIDED_IF, list(graph.inputs), list(graph.outputs), attrs, "",
                  decision.layer.opset)
    names = [*graph.inputs, *graph.outputs]
    outer = Graph(graph.name, [layer], list(graph.inputs), list(graph.outputs),
                  {n: graph.info(n) for n in names}, {}, dict(graph.opsets))
    first = next(iter(nets.values()))
    report = PlacementReport(list(first.report.preferences))  # type: ignore[attr-defined]
    report.layers[layer.name] = LayerPlacement(layer.name, "If", "builtin", note=decision.why())
    for branch, net in nets.items():
        _join(report, net.report, f"{layer.name}/{branch}/")  # type: ignore[attr-defined]
        report.versions[f"{layer.name}/{branch}"] = net.report  # type: ignore[attr-defined]
    return outer, report, nets


def _join(report: PlacementReport, inner: PlacementReport, path: str) -> None:
    for name, placement in inner.layers.items():
        report.layers[f"{path}{name}"] = dataclasses.replace(
            placement, name=f"{path}{placement.name}",
            tag=placement.tag and f"{path}{placement.tag}")
    report.delegations.update((f"{path}{t}", d) for t, d in inner.delegations.items())
    report.copies += inner.copies
    report.subgraphs += inner.subgraphs
    report.unavailable.update(inner.unavailable)
    report.warnings += [w for w in inner.warnings if w not in report.warnings]
    report.measurements += inner.measurements


# -- inlining --------------------------------------------------------------------------------------
def _inline_into(graph: Graph, layer: Layer, branch: str) -> None:
    """``layer`` (an If of ``graph``) replaced in place by the layers of its ``branch``: each
    branch output the If's output of the same position (an Identity where the branch gives a
    tensor it does not make, or one tensor twice). Layer names the network has already get the
    branch's path."""
    body: Graph = layer.attrs[branch]
    made = {out for lay in body.layers for out in lay.outputs if out}
    rename: dict[str, str] = {}
    for given, mine in zip(body.outputs, layer.outputs):
        if mine and given in made and given not in rename:
            rename[given] = mine
    taken = {lay.name for lay in graph.layers}
    inlined = []
    for lay in body.layers:
        new = copy.copy(lay)
        new.name = lay.name if lay.name not in taken else f"{layer.name}/{branch}/{lay.name}"
        new.inputs = [rename.get(n, n) for n in lay.inputs]
        new.outputs = [rename.get(n, n) for n in lay.outputs]
        new.backend = None
        inlined.append(new)
    for given, mine in zip(body.outputs, layer.outputs):
        if mine and rename.get(given) != mine:
            inlined.append(Layer(f"{layer.name}/{branch}/{mine}", "Identity",
                                 [rename.get(given, given)], [mine], {}, "",
                                 graph.opsets.get("", layer.opset)))
    for name, info in body.tensors.items():
        graph.tensors.setdefault(rename.get(name, name), info)
    for given, mine in zip(body.outputs, layer.outputs):
        info = body.tensors.get(given)
        if mine and info is not None and info.shape is not None and info.dtype is not None:
            graph.tensors[mine] = info
    graph.constants.update(body.constants)
    position = next(i for i, lay in enumerate(graph.layers) if lay is layer)
    graph.layers[position:position + 1] = inlined
    graph.toposort()
