"""Group the layers of each backend into subgraphs that keep the partition acyclic.

Every layer gets a depth: the largest, over its producers, of the producer's depth, plus one when the
producer runs on another backend. Layers of one backend at one depth form one subgraph. Along any
edge the depth never falls, and it rises when the backend changes, so a path that leaves a subgraph
cannot come back into it: the subgraphs form a DAG.

Each such subgraph is one delegation tag (ExecuTorch: "Each tag must represent a distinct submodule
that we intend on lowering and should be fully contained"): ``delegation_tags`` names them, the
placement report shows them, and the artifact compiler hands each to its backend's ``preprocess``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backplane.backends.api.backend import CompileSpec
from backplane.ir.graph import Graph, Layer, SubgraphView

BUILTIN = "builtin"


def partition(graph: Graph, skip: frozenset[str] = frozenset()) -> list[tuple[str, SubgraphView]]:
    """(backend id, view) pairs in execution order; layers of backends in ``skip`` are left out."""
    producers = graph.producers()
    depth: dict[int, int] = {}
    groups: dict[tuple[str, int], list[Layer]] = {}
    for layer in graph.layers:  # topological order
        level = 0
        for name in layer.inputs:
            dep = producers.get(name)
            if dep is not None:
                level = max(level, depth[id(dep)] + (dep.backend != layer.backend))
        depth[id(layer)] = level
        if layer.backend not in skip:
            groups.setdefault((layer.backend or "", level), []).append(layer)
    ordered = sorted(groups.items(), key=lambda item: item[0][1])
    return [(backend, SubgraphView.of(graph, layers)) for (backend, _), layers in ordered]


@dataclass(frozen=True)
class DelegationSpec:
    """What a delegation tag stands for (ExecuTorch's DelegationSpec): the backend its
    layers go to and the compile specs its partition is preprocessed with (``Backend.preprocess``:
    the backend's own options)."""

    backend_id: str
    compile_specs: tuple[CompileSpec, ...] = ()


def compile_specs(backend_id: str, options: Mapping[str, Any]) -> tuple[CompileSpec, ...]:
    """The options named after ``backend_id``, as the compile specs of its partitions."""
    return tuple(CompileSpec(key, value) for key, value in sorted(options.items())
                 if key.startswith(f"{backend_id}."))


def delegation_tags(graph: Graph, options: Mapping[str, Any] | None = None, prefix: str = "",
                    ) -> tuple[dict[str, str], dict[str, DelegationSpec]]:
    """ExecuTorch's tags over a placed graph: each of ``partition``'s subgraphs (builtin's layers
    aside: they stay with the runtime) gets a tag, ``{prefix}{backend}_{n}`` with ``n`` its place
    in execution order; returns the tag of each layer name and the spec of each tag."""
    tags: dict[str, str] = {}
    specs: dict[str, DelegationSpec] = {}
    for number, (backend_id, view) in enumerate(partition(graph, skip=frozenset({BUILTIN}))):
        tag = f"{prefix}{backend_id}_{number}"
        specs[tag] = DelegationSpec(backend_id, compile_specs(backend_id, options or {}))
        tags.update((layer.name, tag) for layer in view.layers)
    return tags, specs
