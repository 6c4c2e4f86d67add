"""Group the layers of each backend into subgraphs that keep the partition acyclic.

Every layer gets a depth: the largest, over its producers, of the producer's depth, plus one when the
producer runs on another backend. Layers of one backend at one depth form one subgraph. Along any
edge the depth never falls, and it rises when the backend changes, so a path that leaves a subgraph
cannot come back into it: the subgraphs form a DAG.
"""

from __future__ import annotations

from backplane.ir.graph import Graph, Layer, SubgraphView


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
