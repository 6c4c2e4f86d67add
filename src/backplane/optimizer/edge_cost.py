"""The price of an edge of measured placement (``measured.place``): moving a tensor of a given
size from one backend's memory to another's as the network would, timed once per process.

Each tensor that crosses to a neighbouring partition (or from / to the user) is moved by the copy
or import that ``edge_strategy`` picks for the two backends' tensor-handle factories, run here by
builtin's MemCopy / MemImport workload on a tensor of that size; a FallbackImport is priced as one
copy into fallback memory, the most it costs (whether the producer writes in place is known only
at load).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from backplane.backends.api.memory import HOST_FACTORY, TensorHandleFactory, fallback_kind
from backplane.backends.builtin.backend import make_mem_copy, make_mem_import
from backplane.ir.graph import TensorInfo
from backplane.optimizer.edges import EdgeStrategy, edge_strategy
from backplane.runtime.fallback import FallbackMemoryManager

EDGE_RUNS, EDGE_BUDGET_S = 7, 0.3
"""Timed runs of an edge's copy at most, and seconds of them (one run at least)."""

_EDGES: dict[tuple[str, str, tuple[int, ...], str, bool], float] = {}
"""(source factory id, target factory id, shape, element type, to the user) -> median ms of that
move."""


def edge_ms(value: np.ndarray | None, source: TensorHandleFactory,
             target: TensorHandleFactory, to_user: bool = False) -> float:
    """Median ms of moving ``value`` from ``source``'s memory to ``target``'s as the network would
    (nothing, an import, a fallback import or a copy); 0 where the value is unknown."""
    strategy = edge_strategy(source, target, to_user)
    if strategy is EdgeStrategy.DIRECT_COMPATIBILITY or value is None:
        return 0.0
    key = (source.id, target.id, tuple(value.shape), value.dtype.str, to_user)
    if key not in _EDGES:
        if strategy is EdgeStrategy.FALLBACK_IMPORT:
            glue = _fallback_import(value, source, target)
        else:
            make = make_mem_import if strategy is EdgeStrategy.EXPORT_TO_TARGET else make_mem_copy
            glue = make(source, target)
        held = value if source.id == HOST_FACTORY.id else source.copy_in(value)
        _EDGES[key] = _median_ms(lambda: glue(held), 1)
    return _EDGES[key]


def _fallback_import(value: np.ndarray, source: TensorHandleFactory,
                     target: TensorHandleFactory) -> Callable[[Any], Any]:
    """A FallbackImport of ``value``'s size as it runs when the producer cannot write in place: one
    copy into fallback memory. Which producers write in place is known only at load, so an edge is
    priced at the most it costs: a placement is never slower than measured."""
    kind = fallback_kind(source, target)
    assert kind is not None  # edge_strategy chose FALLBACK_IMPORT
    info = TensorInfo(tuple(value.shape), value.dtype)
    buffer, _ = FallbackMemoryManager().buffer("edge", kind, info, math.lcm(source.alignment,
                                                                             target.alignment))
    consumer = target.import_(buffer)

    def fallback_import(x: Any) -> tuple[Any]:
        source.write_to(x, buffer)
        return (consumer,)

    return fallback_import



def _median_ms(run: Callable[[], Any], warmup: int) -> float:
    """Median ms of EDGE_RUNS runs of ``run`` (EDGE_BUDGET_S of them at most, one at least) after
    ``warmup`` untimed ones: an edge's copy or import."""
    for _ in range(warmup):
        run()
    times: list[float] = []
    spent = 0.0
    while len(times) < EDGE_RUNS and (not times or spent < EDGE_BUDGET_S):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times) * 1e3

