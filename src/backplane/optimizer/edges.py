"""Tensor-handle strategy per edge, and the compatibility layers it needs (the Ethos-N design's step 5-6).

Where a tensor crosses from one backend to another, ``edge_strategy`` decides, from the two backends'
tensor-handle factories, whether the consumer reads it as it is, imports it, reads it through memory
of a third kind that both import (a FallbackImport), or needs a copy. Only that one function decides;
``insert_compatibility_layers`` carries the decision out.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from backplane.backends.api.memory import HOST_FACTORY, TensorHandleFactory, fallback_kind
from backplane.ir.graph import Graph, Layer
from backplane.optimizer.report import CopyRecord

BUILTIN = "builtin"
USER = "user"  # graph inputs come from, and graph outputs go to, the user's host memory


class EdgeStrategy(enum.Enum):
    DIRECT_COMPATIBILITY = "direct"  # both sides use the same tensor handles
    EXPORT_TO_TARGET = "import"  # a MemImport layer hands the source's memory over, zero-copy
    FALLBACK_IMPORT = "fallback_import"  # memory both import, written by the producer, shared
    COPY_TO_TARGET = "copy"  # a MemCopy layer moves the tensor


def edge_strategy(source: TensorHandleFactory, target: TensorHandleFactory,
                  to_user: bool = False) -> EdgeStrategy:
    """How a tensor of ``source`` reaches ``target``. A tensor that goes ``to_user`` outlives the
    run: it never goes through fallback memory, which the next run writes again."""
    if source.id == target.id:
        return EdgeStrategy.DIRECT_COMPATIBILITY
    if target.can_import_from(source):
        return EdgeStrategy.EXPORT_TO_TARGET
    if not to_user and fallback_kind(source, target) is not None:
        return EdgeStrategy.FALLBACK_IMPORT
    return EdgeStrategy.COPY_TO_TARGET


def insert_compatibility_layers(graph: Graph, factories: Mapping[str, TensorHandleFactory],
                                ) -> list[CopyRecord]:
    """Insert a MemCopy (MemImport, FallbackImport) layer on every edge whose strategy is a copy
    (an import, a fallback import); returns what was inserted. A fallback import needs the tensor's
    size at load, where its memory is allocated: a tensor of free dimensions is copied instead.

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
        strategy = edge_strategy(factories[source], factories[target], target == USER)
        if strategy is EdgeStrategy.DIRECT_COMPATIBILITY:
            return name
        info = graph.info(name)
        if strategy is EdgeStrategy.FALLBACK_IMPORT and info.nbytes is None:
            strategy = EdgeStrategy.COPY_TO_TARGET
        key = (name, factories[target].id)
        if key not in copies:
            copies[key] = _mem_copy(graph, name, source, target, factories, strategy)
            layers.append(copies[key])
            copied = {EdgeStrategy.COPY_TO_TARGET: info.nbytes, EdgeStrategy.EXPORT_TO_TARGET: 0
                      }.get(strategy)  # a fallback import's: known at load (in place or not)
            records.append(CopyRecord(name, source, target, strategy.value, info.nbytes,
                                      copies[key].name, copied))
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
    attrs: dict[str, object] = {"source": factories[source], "target": factories[target]}
    op = "MemImport" if strategy is EdgeStrategy.EXPORT_TO_TARGET else "MemCopy"
    if strategy is EdgeStrategy.FALLBACK_IMPORT:
        # On builtin like the other glue; its workload is the source backend's (which can sync
        # it), the memory the runtime's fallback memory manager allocates once per network.
        kind = fallback_kind(factories[source], factories[target])
        op = "FallbackImport"
        attrs.update(source_backend=source, memory=kind.name if kind else "")
    return Layer(f"{op}[{name}]({source}->{target})", op, [name], [out], attrs, opset=0,
                 backend=BUILTIN)
