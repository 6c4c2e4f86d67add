"""An If whose branches run on the GPU hands their results on in GPU memory.

builtin keeps its tensors in host memory, so a branch loaded as a network of its own ends with
glue that waits for the GPU and copies each result to the host (a Sync, then a MemCopy), and the
GpuAcc layer after the If copies it back: a VAD's If (Unsqueeze, Conv1d, Relu per branch, then an
encoder on GpuAcc) paid a wait and two copies a run for it, on top of the one that reads the
predicate. Two decisions remove them:

- at optimization (``mark_device_outputs``, builtin's ``optimize_subgraph``), an If whose every
  output is read by layers of a backend whose copy into its memory takes a torch CUDA tensor as it
  is (GpuAcc: ``cuda.factory``'s ``copy_in``) and by nothing else (no graph output, no host layer)
  is marked ``device_outputs``;
- at load (``on_device``), each branch of a marked If drops the glue that brings a GPU result to
  the host (the Sync and the copy), and gives the GPU tensor itself; the copy in front of the
  reader passes it through.

The predicate is still read once on the host (the one wait of the If), and only the branch it
picks runs: each branch is the chosen one's own captured CUDA graph (a GpuAcc partition), one per
predicate value, called without a nested network's run.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.ir.graph import Graph, Layer, SubgraphView

DEVICE_OUTPUTS = "device_outputs"
"""The attribute of an If layer marked to give its branches' GPU results as they are."""
GLUE = ("MemCopy", "MemImport")
SYNC = "Sync"
DEVICE_FACTORY = "torch-cuda"
"""The id prefix of the tensor-handle factories whose tensors stay on the device here (GpuAcc's):
their ``copy_in`` takes a CUDA tensor as it is."""


def mark_device_outputs(view: SubgraphView) -> OptimizationViews:
    """builtin's layers of ``view``, each If read only on the GPU marked ``device_outputs``."""
    graph = view.graph
    assert graph is not None, "the optimizer always gives views of a graph"
    marked, rest = [], []
    for layer in view.layers:
        if layer.op_type == "If" and not layer.domain and read_on_device(graph, layer):
            copy = dataclasses.replace(layer, attrs={**layer.attrs, DEVICE_OUTPUTS: True})
            marked.append(Substitution(SubgraphView.of(graph, [layer]), [copy]))
        else:
            rest.append(layer)
    if not marked:
        return OptimizationViews(untouched=[view])
    return OptimizationViews(substitutions=marked,
                             untouched=[SubgraphView.of(graph, rest)] if rest else [])


def read_on_device(graph: Graph, layer: Layer) -> bool:
    """Whether every output of ``layer`` is read, and only by layers of backends whose tensors
    are torch CUDA tensors (not a graph output, not a host layer)."""
    for name in layer.outputs:
        if not name:
            continue
        readers = [other.backend for other in graph.layers if name in other.inputs]
        if name in graph.outputs or not readers or not all(map(keeps_on_device, readers)):
            return False
    return True


@functools.lru_cache(maxsize=None)
def keeps_on_device(backend_id: str | None) -> bool:
    """Whether ``backend_id``'s tensors are torch CUDA tensors (its first tensor-handle factory's
    id begins with ``DEVICE_FACTORY``)."""
    from backplane.backends.registry import registry

    try:
        factories = registry.create(backend_id).tensor_handle_factories()
    except Exception:  # noqa: BLE001  # an unknown or broken backend: its readers stay on the host
        return False
    return bool(factories) and str(factories[0].id).startswith(DEVICE_FACTORY)


def on_device(body: Any) -> Any:
    """``body`` (a loaded branch, flat or not) giving its GPU results as they are
    (``DeviceBranch``), or ``body`` itself where none of its outputs comes to the host through
    glue from GPU memory."""
    plan = body.host_plan
    steps, layers = list(plan.steps), list(plan.layers)
    producer = {slot: i for i, step in enumerate(steps) for slot in step.outputs}
    reads: dict[int, int] = {}
    for step in steps:
        for slot in step.inputs:
            reads[slot] = reads.get(slot, 0) + 1
    outputs, dropped = [], set()
    for slot in body.output_slots:
        chain = _to_host_chain(slot, steps, layers, producer, reads, body.output_slots)
        if chain:
            dropped.update(chain)
            slot = steps[chain[-1]].inputs[0]
        outputs.append(slot)
    if not dropped:
        return body
    kept = [i for i in range(len(steps)) if i not in dropped]
    return DeviceBranch(body, [steps[i] for i in kept], [layers[i] for i in kept], outputs)


def _to_host_chain(slot: int, steps: Sequence[Any], layers: Sequence[Layer],
                   producer: dict[int, int], reads: dict[int, int],
                   outputs: Sequence[int]) -> list[int]:
    """The steps that bring the GPU value of output ``slot`` to the host: its glue from a torch
    CUDA factory, and the Sync before it, each read by nothing else; [] where it has none."""
    index = producer.get(slot)
    if index is None or outputs.count(slot) != 1 or reads.get(slot):
        return []
    glue = layers[index]
    source = glue.attrs.get("source")
    if glue.op_type not in GLUE or not str(getattr(source, "id", "")).startswith(DEVICE_FACTORY):
        return []
    chain = [index]
    before = producer.get(steps[index].inputs[0])
    if before is not None and layers[before].op_type == SYNC \
            and reads.get(steps[index].inputs[0]) == 1:
        chain.append(before)
    return chain


class DeviceBranch:
    """A loaded branch without the glue that brought its GPU results to the host: its other
    steps, run over its slots by the runtime's run loop (no nested network's run), its outputs
    read where the GPU left them."""

    def __init__(self, body: Any, steps: Sequence[Any], layers: Sequence[Layer],
                 outputs: Sequence[int]) -> None:
        from backplane.backends.builtin.bodies import with_frees

        self.body, self.input_slots, self.output_slots = body, body.input_slots, tuple(outputs)
        self.steps = with_frees(steps, set(outputs))
        self.layer_of = {id(step.workload): layer for step, layer in zip(steps, layers)}
        self.exclusive = body.exclusive

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        """One call; ``inputs`` in the order of the branch's inputs."""
        from backplane.runtime.loaded_network import STOP, ExecutionError, StepFailure, run_steps

        env = self.body.slots()
        for slot, value in zip(self.input_slots, inputs):
            env[slot] = value
        try:
            run_steps(self.steps, env, STOP.get())
        except StepFailure as failure:
            exc, layer = failure.error, self.layer_of.get(id(failure.step.workload))
            where = f"{layer.describe()} failed on {layer.backend}" if layer else "a branch failed"
            raise ExecutionError(f"{where}: {type(exc).__name__}: {exc}") from exc
        return [env[slot] for slot in self.output_slots]
