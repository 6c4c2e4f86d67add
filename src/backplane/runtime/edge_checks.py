"""A plugin backend's workloads checked at their edge: what a kernel returns against its layer.

A kernel of a backend from outside backplane (registered by the user, a dynamic backend, an entry
point) may return the wrong number of outputs, or an output of another dtype, rank or size than the
model says; unchecked, the next layer fails with a message about itself, or worse computes on it.
Each such workload is wrapped at load with what its layer's outputs must be (known from the
graph: dtype, rank, each dimension known as a number) and the first disagreement fails the run
with a message naming the backend, the layer, the output and both values. backplane's own backends
are not wrapped: the test suite holds each of them to CpuRef op by op, and their hot path stays
free of checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Backend, Workload
from backplane.ir.graph import Graph, Layer


class KernelContractError(RuntimeError):
    """A backend's workload returned something its layer cannot have made."""


def is_plugin(backend: Backend) -> bool:
    """Whether ``backend`` comes from outside backplane (its class defined elsewhere)."""
    return not type(backend).__module__.startswith("backplane.")


def checked(layers: Sequence[Layer], workloads: Sequence[Workload], graph: Graph,
            backends: dict[str, Backend]) -> list[Workload]:
    """``workloads`` with those of plugin backends wrapped by ``_checker``."""
    plugins = {b for b, backend in backends.items() if is_plugin(backend)}
    return [_checker(w, layer, graph) if layer.backend in plugins else w
            for layer, w in zip(layers, workloads)]


def _checker(workload: Workload, layer: Layer, graph: Graph) -> Workload:
    expected = [(name, graph.info(name)) for name in layer.outputs]

    def run(*inputs: Any) -> Any:
        results = workload(*inputs)
        if not isinstance(results, (tuple, list)) or len(results) != len(expected):
            count = len(results) if isinstance(results, (tuple, list)) else type(results).__name__
            _fail(layer, f"returned {count} outputs where the layer has {len(expected)} "
                         f"({', '.join(n for n, _ in expected)}): a kernel returns a tuple of "
                         f"its outputs")
        for (name, info), value in zip(expected, results):
            if name and value is not None:
                problem = _disagreement(value, info)
                if problem:
                    _fail(layer, f"returned output '{name}' {problem}")
        return results

    run.__dict__.update(getattr(workload, "__dict__", {}))  # exclusive, profiled, ...: kept
    return run


def _disagreement(value: Any, info: Any) -> str:
    """What is wrong with ``value`` as a tensor of ``info`` ("" where nothing is)."""
    if isinstance(value, (list, tuple)) or not hasattr(value, "shape"):
        return ""  # a sequence or an optional: not a plain tensor
    if isinstance(value, np.ndarray) and info.dtype is not None and value.dtype != info.dtype:
        return f"of dtype {value.dtype}; the model says {info.dtype}"
    if info.shape is None:
        return ""
    shape = tuple(value.shape)
    if len(shape) != len(info.shape):
        return f"of shape {list(shape)} (rank {len(shape)}); the model says {info} (rank " \
               f"{len(info.shape)})"
    for axis, (got, want) in enumerate(zip(shape, info.shape)):
        if isinstance(want, int) and got != want:
            return f"of shape {list(shape)}; the model says {info} (axis {axis})"
    return ""


def _fail(layer: Layer, problem: str) -> None:
    raise KernelContractError(f"backend {layer.backend}'s workload for {layer.describe()} "
                              f"{problem}")
