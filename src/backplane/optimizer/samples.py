"""What measured placement (``measured.place``) and the CPU rules (``against_cpu``) feed a
partition or a network they time, and what a partition's timing is keyed on.

Graph inputs are seeded (floats normal, integers 0 or 1, booleans random; free dimensions at 1),
so that two loads of one model time the same values; a partition's signature hashes what its time
depends on and never its layers' or tensors' names, so one timed partition serves every copy of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.ir.graph import Graph


def seeded_inputs(graph: Graph) -> dict[str, np.ndarray]:
    """Seeded values of the graph's inputs: floats normal, integers 0 or 1, booleans random; free
    dimensions at 1; inputs of unknown type or rank left out (what reads them is not timed)."""
    rng = np.random.default_rng(0)
    values: dict[str, np.ndarray] = {}
    for name in graph.inputs:
        info = graph.info(name)
        if info.shape is None or info.dtype is None:
            continue
        shape = tuple(d if isinstance(d, int) else 1 for d in info.shape)
        values[name] = seeded(rng, shape, info.dtype)
    return values


def seeded(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    return np.zeros(shape, dtype)



def signature(alone: Graph, inputs: Sequence[np.ndarray]) -> str:
    """A hash of what a partition's time depends on: ops, attributes, wiring, shapes, element
    types, constants (their bytes) and the inputs' shapes; never its layers' or tensors' names."""
    local: dict[str, int] = {}

    def number(name: str) -> int:
        return local.setdefault(name, len(local)) if name else -1

    text = [repr([(tuple(v.shape), v.dtype.str) for v in inputs])]
    for name in alone.inputs:
        number(name)
    for layer in alone.layers:
        attrs = sorted((k, _attr(v)) for k, v in layer.attrs.items())
        text.append(repr((layer.domain, layer.op_type, layer.opset, attrs,
                          [number(n) for n in layer.inputs], [number(n) for n in layer.outputs])))
    for name, index in local.items():
        constant = alone.constants.get(name)
        digest = "" if constant is None else hashlib.sha256(
            np.ascontiguousarray(constant).tobytes()).hexdigest()
        text.append(f"{index}: {alone.info(name)} {digest}")
    text.append(repr([number(n) for n in alone.outputs]))
    return hashlib.sha256("\n".join(text).encode()).hexdigest()


def _attr(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array{value.shape}{value.dtype.str}:{hashlib.sha256(value.tobytes()).hexdigest()}"
    return repr(value)

