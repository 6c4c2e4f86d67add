"""Tensor-handle strategy per edge, and the compatibility layers it needs (the Ethos-N design's step 5-6).

Where a tensor crosses from one backend to another, ``edge_strategy`` decides, from the two backends'
tensor-handle factories, whether the consumer reads it as it is, imports it, or needs a copy. Only
that one function decides; ``insert_compatibility_layers`` carries the decision out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from backplane.backends.api.memory import HOST_FACTORY, TensorHandleFactory
from backplane.ir.graph import Graph, Layer
from backplane.optimizer.report import CopyRecord

BUILTIN = "builtin"
USER = "user"  # graph inputs come from, and graph outputs go to, the user's host memory


class EdgeStrategy(enum.Enum):
    DIRECT_COMPATIBILITY = "direct"  # both sides use the same tensor handles
    EXPORT_TO_TARGET = "import"  # a MemImport layer hands the source's memory over, zero-copy
    COPY_TO_TARGET = "copy"  # a MemCopy layer moves the tensor


def edge_strategy(source: TensorHandleFactory, target: TensorHandleFactory) -> EdgeStrategy:
    if source.id == target.id:
        return EdgeStrategy.DIRECT_COMPATIBILITY
    if target.can_import_from(source):
        return EdgeStrategy.EXPORT_TO_TARGET
    return EdgeStrategy.COPY_TO_TARGET


def insert_compatibility_layers(graph: Graph, factories: Mapping[str, TensorHandleFactory],
                                ) -> list[CopyRecord]:
    """Insert a MemCopy (or MemImport) layer on every edge whose strategy is a copy (or an import);
    returns what was inserted.

    ``factories`` maps a backend id to its preferred tensor-handle factory (the user is host memory).
    """
    factories = {USER: HOST_FACTORY, **factories}
    producers = graph.producers()
    copies: dict[tuple[str, str], Layer] = {}
    records: list[CopyRecord] = []
    layers: list[Layer] = []

    def reader(name: str, target: str) -> str:
        dep = producers.get(name)
        source = dep.backend if dep is not None else USER
        if name in graph.constants or source == target or source is None:
            return name
        strategy = edge_strategy(factories[source], factories[target])
        if strategy is EdgeStrategy.DIRECT_COMPATIBILITY:
            return name
        key = (name, factories[target].id)
        if key not in copies:
            copies[key] = _mem_copy(graph, name, source, target, factories, strategy)
            layers.append(copies[key])
            info = graph.info(name)
            records.append(CopyRecord(name, source, target, strategy.value, info.nbytes,
                                      copies[key].name))
        return copies[key].outputs[0]

    for layer in graph.layers:
        layer.inputs = [reader(n, layer.backend or USER) if n else n for n in layer.inputs]
        layers.append(layer)
    graph.outputs = [reader(n, USER) for n in graph.outputs]
    graph.layers = layers
    return records


def _mem_copy(graph: Graph, name: str, source: str, target: str,
              factories: Mapping[str, TensorHandleFactory], strategy: EdgeStrategy) -> Layer:
    out = f"{name}@{target}"
    graph.tensors[out] = graph.info(name)
    attrs = {"source": factories[source], "target": factories[target]}
    op = "MemImport" if strategy is EdgeStrategy.EXPORT_TO_TARGET else "MemCopy"
    return Layer(f"{op}[{name}]({source}->{target})", op, [name], [out], attrs, opset=0,
                 backend=BUILTIN)
