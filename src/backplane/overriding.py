"""A feed for a graph input that has an initializer: ONNX's default value, which a run may replace.

From IR version 4 an initializer whose name is also a graph input is that input's default (ONNX
Runtime's "overridable initializer"): ONNX Runtime takes a feed for it and computes with the feed.
The session's network holds the initializer as a constant (folded, packed into kernels: the common
case costs nothing); a run given such inputs runs a second network in which they are inputs, made
at the first such run and kept, one per set of inputs given. Before IR 4 every initializer had to
be listed as an input, and none is a default (ONNX Runtime treats them as constants too).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from typing import Any

import onnx

from backplane.ir.graph import Graph
from backplane.optimizer.optimize import OptimizedNetwork


def overridable(proto: onnx.ModelProto) -> frozenset[str]:
    """The graph inputs of ``proto`` that have an initializer, where they are defaults (IR 4 on)."""
    if proto.ir_version < 4:
        return frozenset()
    given = {vi.name for vi in proto.graph.input}
    return frozenset(init.name for init in proto.graph.initializer if init.name in given)


def with_inputs(graph: Graph, names: frozenset[str]) -> Graph:
    """``graph`` with the constants ``names`` as inputs after its own (in sorted order)."""
    return dataclasses.replace(graph, inputs=[*graph.inputs, *sorted(names)],
                               constants={k: v for k, v in graph.constants.items()
                                          if k not in names})


class Overrides:
    """The networks of a session that take some of its defaults as inputs, made when first fed."""

    def __init__(self, names: frozenset[str], graph: Graph,
                 make: Callable[[Graph], OptimizedNetwork]) -> None:
        self.names = names
        self._graph, self._make = graph, make
        self._networks: dict[frozenset[str], int] = {}
        self._lock = threading.Lock()

    def network_for(self, feed: Mapping[str, Any], runtime: Any) -> int:
        """The id of the network (loaded in ``runtime``) that reads the defaults ``feed`` gives."""
        given = self.names.intersection(feed)
        with self._lock:
            if given not in self._networks:
                self._networks[given] = runtime.load(self._make(with_inputs(self._graph, given)))
            return self._networks[given]

    def unload(self, runtime: Any) -> None:
        with self._lock:
            for network_id in self._networks.values():
                runtime.unload(network_id)
            self._networks.clear()
