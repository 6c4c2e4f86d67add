"""Tensor-handle strategy per edge, and the compatibility layers it needs (the Ethos-N design's step 5-6).

Where a tensor crosses from one backend to another, ``edge_strategy`` decides, from the producer's
tensor-handle factory and the consumer's factories in its order of preference (Arm NN's
GetHandleFactoryPreferences), whether the consumer reads it as it is, imports it, reads it through
fallback memory (a FallbackImport), or needs a copy. Only ``choose`` decides;
``insert_compatibility_layers`` carries the decision out. The rule is the design's, in order:

1. DIRECT_COMPATIBILITY where a factory the consumer prefers is the producer's;
2. EXPORT_TO_TARGET on the first preferred factory that imports a kind the producer exports
   (``(factory->GetImportFlags() & srcFactory->GetExportFlags()) != 0``): a MemImport, or a
   FallbackImport "if the srcFactory requires fallback import memory";
3. COPY_TO_TARGET on the first preferred factory that maps, where the producer's maps too.

Where the design finds no strategy (a side that cannot map, nothing imported) it stops with
"Undefined memory strategy found"; here the edge is copied all the same, through the factories'
``copy_out`` and ``copy_in``, which every factory has (a CUDA factory's is a DMA), where Arm NN's
MemCopy maps both handles: the edges between CUDA memory and the host (GpuAcc <-> CpuAcc, CpuRef,
the user) are of that kind, and the design's own matrix runs GPU <-> CPU.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Sequence

from backplane.backends.api.memory import (
    HOST_FACTORY,
    MemorySource,
    TensorHandleFactory,
    fallback_kind,
)
from backplane.ir.graph import Graph, Layer
from backplane.optimizer.report import CopyRecord
from backplane.runtime.fallback import SYNC

BUILTIN = "builtin"
USER = "user"  # graph inputs come from, and graph outputs go to, the user's host memory

Preferences = TensorHandleFactory | Sequence[TensorHandleFactory]
"""A consumer's tensor-handle factories, preferred first (one factory: that one alone)."""


class EdgeStrategy(enum.Enum):
    DIRECT_COMPATIBILITY = "direct"  # both sides use the same tensor handles
    EXPORT_TO_TARGET = "import"  # a MemImport layer hands the source's memory over, zero-copy
    FALLBACK_IMPORT = "fallback_import"  # memory both import, written by the producer, shared
    COPY_TO_TARGET = "copy"  # a MemCopy layer moves the tensor


def choose(source: TensorHandleFactory, targets: Preferences, to_user: bool = False,
           ) -> tuple[EdgeStrategy, TensorHandleFactory]:
    """The strategy of an edge from ``source`` to a consumer that prefers ``targets``, and the
    consumer's factory it uses (the module's docstring gives the rule). A tensor that goes
    ``to_user`` outlives the run: where the rule says FallbackImport it is copied instead (the
    producer's memory cannot be handed over, and the next run writes the fallback memory again)."""
    prefs = _tuple(targets)
    if not prefs:
        raise ValueError(f"no tensor-handle factory to read {source.id}'s tensors with: a backend "
                         f"lists at least one in tensor_handle_factories()")
    for target in prefs:
        if target.id == source.id:
            return EdgeStrategy.DIRECT_COMPATIBILITY, target
    for target in prefs:
        if target.can_import_from(source):
            if fallback_kind(source, target) is None:
                return EdgeStrategy.EXPORT_TO_TARGET, target
            if not to_user:
                return EdgeStrategy.FALLBACK_IMPORT, target
            break  # the producer's memory cannot be handed over, and fallback memory is reused
    mapped = [t for t in prefs if t.supports_mapping]
    if source.supports_mapping and mapped:
        return EdgeStrategy.COPY_TO_TARGET, mapped[0]
    return EdgeStrategy.COPY_TO_TARGET, prefs[0]  # the design's Undefined: see the docstring


def edge_strategy(source: TensorHandleFactory, targets: Preferences,
                  to_user: bool = False) -> EdgeStrategy:
    """How a tensor of ``source`` reaches a consumer that prefers ``targets`` (``choose``)."""
    return choose(source, targets, to_user)[0]


def insert_compatibility_layers(graph: Graph, factories: Mapping[str, Preferences],
                                asynchronous: Collection[str] = (),
                                protected: Collection[str] = ()) -> list[CopyRecord]:
    """Insert a MemCopy (MemImport, FallbackImport) layer on every edge whose strategy is a copy
    (an import, a fallback import); returns what was inserted. A fallback import needs the tensor's
    size at load, where its memory is allocated: a tensor of free dimensions is copied instead.

    ``factories`` maps a backend id to its tensor-handle factories, preferred first (the user is
    host memory): a producer's tensors are of its first, a consumer reads through the one that
    ``choose`` picks.

    A tensor of an ``asynchronous`` backend (AsyncExecution) that another backend or the user
    reads goes through a Sync layer first, whose workload the source backend makes
    (``create_fallback_import``: the design's FallbackImportWorkload, "created to be sync after
    execution of the subgraph in case the source backend has asynchronous execution"); a
    FallbackImport syncs itself, and so does a tensor in CUDA memory (``_host_sync``). A tensor
    of a ``protected`` backend (ProtectedContentAllocation) that a backend without it or the user
    would read is refused: that copy or import would put protected memory in unprotected memory.
    """
    prefs = {USER: (HOST_FACTORY,), **{b: _tuple(f) for b, f in factories.items()}}
    producers = graph.producers()
    copies: dict[tuple[str, str], Layer] = {}
    synced: dict[str, Layer] = {}
    records: list[CopyRecord] = []
    layers: list[Layer] = []

    def reader(name: str, target: str) -> str:
        dep = producers.get(name)
        source = dep.backend if dep is not None else USER
        if name in graph.constants or source == target or source is None:
            return name
        if source in protected and target not in protected:
            _refuse_protected(name, source, target, protected)
        made_by = prefs[source][0]
        strategy, factory = choose(made_by, prefs[target], target == USER)
        info = graph.info(name)
        if strategy is EdgeStrategy.FALLBACK_IMPORT and info.nbytes is None:
            # copied as an edge to the user is: what the rule gives when fallback memory is out
            strategy, factory = choose(made_by, prefs[target], to_user=True)
        read = name
        if source in asynchronous and _host_sync(strategy, made_by):
            if name not in synced:
                synced[name] = _sync(graph, name, source)
                layers.append(synced[name])
            read = synced[name].outputs[0]
        if strategy is EdgeStrategy.DIRECT_COMPATIBILITY:
            return read
        key = (name, factory.id)
        if key not in copies:
            copies[key] = _mem_copy(graph, read, (source, made_by), (target, factory), strategy)
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


def _tuple(factories: Preferences) -> tuple[TensorHandleFactory, ...]:
    return (factories,) if isinstance(factories, TensorHandleFactory) else tuple(factories)


def _mem_copy(graph: Graph, name: str, source: tuple[str, TensorHandleFactory],
              target: tuple[str, TensorHandleFactory], strategy: EdgeStrategy) -> Layer:
    """The compatibility layer of one edge: ``source`` and ``target`` are (backend, factory)."""
    (source_id, made_by), (target_id, read_by) = source, target
    out = f"{name}@{target_id}"
    graph.tensors[out] = graph.info(name)
    attrs: dict[str, object] = {"source": made_by, "target": read_by}
    op = "MemImport" if strategy is EdgeStrategy.EXPORT_TO_TARGET else "MemCopy"
    if strategy is EdgeStrategy.FALLBACK_IMPORT:
        # On builtin like the other glue; its workload is the source backend's (which can sync
        # it), the memory the runtime's fallback memory manager allocates once per network.
        kind = fallback_kind(made_by, read_by)
        op = "FallbackImport"
        attrs.update(source_backend=source_id, memory=kind.name if kind else "")
    return Layer(f"{op}[{name}]({source_id}->{target_id})", op, [name], [out], attrs, opset=0,
                 backend=BUILTIN)


def _host_sync(strategy: EdgeStrategy, made_by: TensorHandleFactory) -> bool:
    """Whether an edge out of an asynchronous backend needs a Sync layer: not a FallbackImport,
    which syncs itself, nor an edge out of CUDA memory, where the copy-out waits on the producer's
    stream and DLPack orders an import on the importer's (a host-wide sync would only cost)."""
    return strategy is not EdgeStrategy.FALLBACK_IMPORT and not made_by.memory & MemorySource.CUDA


def _sync(graph: Graph, name: str, source: str) -> Layer:
    """A Sync layer: ``name`` once ``source``'s writes are done (its workload is the source's)."""
    out = f"{name}@synced"
    graph.tensors[out] = graph.info(name)
    return Layer(f"{SYNC}[{name}]({source})", SYNC, [name], [out], {"source_backend": source},
                 opset=0, backend=BUILTIN)


def _refuse_protected(name: str, source: str, target: str, protected: Collection[str]) -> None:
    from backplane.optimizer.optimize import OptimizationError  # optimize imports this module

    reader = "the user (an output of the network)" if target == USER else target
    allowed = ", ".join(sorted(protected))
    raise OptimizationError(
        f"{name} is in protected memory of {source} (ProtectedContentAllocation) and {reader} "
        f"would read it through unprotected memory; its readers must run on a backend that "
        f"allocates protected content ({allowed}), and it cannot be an output")
