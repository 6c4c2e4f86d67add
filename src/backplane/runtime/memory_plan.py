"""What a loaded network's memory is, from its plan: the report's figures and the constants' spans.

``LoadedNetwork`` asks this at load: the peak bytes of a run's intermediate tensors per backend and
the bytes of each backend's constants (``PlacementReport.peak_bytes``, ``constant_bytes``), the
partitions a run crosses (``partitions``), and the memory (address, bytes) of the constants that a
run's outputs must not alias (``ownership.Held``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from backplane.ir.graph import Graph, Layer
from backplane.optimizer.optimize import OptimizedNetwork
from backplane.runtime.fallback import FALLBACK_IMPORT
from backplane.runtime.steps import NONE_SLOT, Step

GLUE = ("MemCopy", "MemImport", FALLBACK_IMPORT)
"""The layers that move a tensor between backends' memories (their bytes are the target's)."""


def planned_memory(network: OptimizedNetwork, steps: Sequence[Step], layers: Sequence[Layer],
                   slots: dict[str, int], memory: Sequence[Sequence[tuple[int, int]]],
                   ) -> tuple[dict[str, int], dict[str, int]]:
    """Per backend: the peak bytes of the intermediate tensors of a run of the host plan, and
    the bytes of its constants (``PlacementReport.peak_bytes``, ``constant_bytes``), from the
    memory (address, bytes) of each layer's constants."""
    graph = network.graph
    copied_to = {c.layer: c.target for c in network.report.copies if c.strategy == "copy"}
    names = {slot: name for name, slot in slots.items()}
    live: dict[str, int] = {}
    peak: dict[str, int] = {}
    held: dict[int, tuple[str, int]] = {}  # slot -> (backend, bytes)
    for step, layer in zip(steps, layers):
        owner = copied_to.get(layer.name) if layer.op_type in GLUE else layer.backend
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
    for layer, spans in zip(layers, memory):
        backend = layer.backend or ""
        for address, nbytes in spans:
            # once per memory: a fused layer's weight may be a (transposed) view of a constant
            if (backend, address, nbytes) not in seen:
                seen.add((backend, address, nbytes))
                constants[backend] = constants.get(backend, 0) + nbytes
    return peak, constants


def partitions(layers: Sequence[Layer]) -> list[str]:
    """The backend of each run of consecutive layers of one backend (copy and import layers aside)."""
    found: list[str] = []
    for layer in layers:
        if layer.op_type in GLUE or not layer.backend:
            continue
        if not found or found[-1] != layer.backend:
            found.append(layer.backend)
    return found


def constant_memory(layer: Layer, graph: Graph) -> list[tuple[int, int]]:
    """The memory (address, bytes) of the constants a layer reads: its inputs' and the arrays its
    attributes hold."""
    held = [graph.constants[n] for n in layer.inputs if n in graph.constants]
    return [(value.__array_interface__["data"][0], int(value.nbytes))
            for value in [*held, *_attr_arrays(layer)]]


def body_constant_memory(layers: Sequence[Layer]) -> list[tuple[int, int]]:
    """The memory of the constants of the control-flow bodies ``layers`` hold, at any depth."""
    spans = []
    for layer in layers:
        for body in layer.attrs.values():
            if isinstance(body, OptimizedNetwork):
                graph = body.graph
                spans += [span for inner in graph.layers for span in constant_memory(inner, graph)]
                spans += body_constant_memory(graph.layers)
    return spans


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
