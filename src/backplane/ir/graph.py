"""The intermediate representation: small data with a readable printout.

A Graph is a list of Layers in topological order. Layers are joined by tensor names (ONNX style): a
layer's input slot ``i`` reads the tensor named ``layer.inputs[i]`` ("" for an absent optional input),
its output slot ``j`` writes ``layer.outputs[j]``. Every tensor has a TensorInfo; constant tensors
(initializers, folded values) live in ``graph.constants``.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Dim = int | str | None  # a static size, a symbolic name, or unknown


@dataclass(frozen=True)
class TensorInfo:
    """Shape and element type of one tensor. Symbolic dimensions are strings, unknown ones None."""

    shape: tuple[Dim, ...] | None  # None: rank unknown
    dtype: np.dtype | None  # None: not a plain tensor (sequence, optional) or unknown

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)

    @property
    def nbytes(self) -> int | None:
        if not self.is_static or self.dtype is None:
            return None
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize  # type: ignore[arg-type]

    def __str__(self) -> str:
        dtype = self.dtype.name if self.dtype is not None else "?"
        if self.shape is None:
            return f"{dtype}[?]"
        return f"{dtype}[{','.join('?' if d is None else str(d) for d in self.shape)}]"


UNKNOWN = TensorInfo(None, None)


@dataclass(eq=False)
class Layer:
    """One operation. ``attrs`` are Python values (ints, floats, str, lists, np.ndarray, Graph)."""

    name: str
    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    domain: str = ""
    opset: int = 0  # the model's opset for this layer's domain
    backend: str | None = None  # set by the optimizer

    def __repr__(self) -> str:
        attrs = ", ".join(f"{k}={_short(v)}" for k, v in self.attrs.items())
        on = f" @{self.backend}" if self.backend else ""
        ins = ", ".join(i or "_" for i in self.inputs)
        return f"{', '.join(self.outputs)} = {self.op_type}[{attrs}]({ins}){on}  # {self.name}"

    def describe(self) -> str:
        """How error messages name a layer: its name, op and opset, and for a delegate the
        model's nodes it runs (its debug handles), so that a failure inside one names them."""
        domain = f"{self.domain}::" if self.domain else ""
        nodes = self.model_nodes()
        shown = ", ".join(nodes[:SHOWN_NODES]) + (f" and {len(nodes) - SHOWN_NODES} more"
                                                  if len(nodes) > SHOWN_NODES else "")
        runs = f", running model nodes {shown}" if nodes else ""
        return f"layer '{self.name}' ({domain}{self.op_type}, opset {self.opset}{runs})"

    def model_nodes(self) -> list[str]:
        """The model's nodes a layer runs where it runs others: a delegate's, read back from the
        ``debug_handle_map`` its backend's ``preprocess`` gave (each handle inside the blob -> the
        nodes it holds), else its partition's layers; a substituted layer's, from the layers it
        holds (``attrs["layers"]``: names or layers, as OpenVINO's and CpuAcc's keep them).
        [] for any other layer (its name is the node's)."""
        handles = self.attrs.get("debug_handle_map")
        if handles:
            return list(dict.fromkeys(n for nodes in handles.values() for n in nodes))
        held = self.attrs.get("layers")
        part = self.attrs.get("graph")
        if handles is not None and isinstance(part, Graph):
            held = part.layers
        if not isinstance(held, list):
            return []
        names = [n for item in held for n in (
            [item] if isinstance(item, str) else
            (item.model_nodes() or [item.name]) if isinstance(item, Layer) else [])]
        return list(dict.fromkeys(names))


SHOWN_NODES = 12
"""The model nodes an error names for a delegate before "and N more"."""


def _short(value: Any) -> str:
    """An attribute as one short readable token: tensors by shape, graphs and layer lists by size,
    functions by name, objects by type and id; never a memory address."""
    if isinstance(value, np.ndarray):
        return f"tensor{list(value.shape)}" if value.size > 4 else repr(value.tolist())
    if isinstance(value, Graph):
        return f"<graph {value.name} of {len(value.layers)} layers>"
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, Layer) for v in value):
            return f"<{len(value)} layers>"
        items = [_short(v) for v in value[:SHOWN_ITEMS]]
        more = [f"... {len(value)} items"] if len(value) > SHOWN_ITEMS else []
        inner = ", ".join(items + more)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict) and len(value) > SHOWN_ITEMS:
        return f"<{len(value)} entries>"
    if callable(value) and hasattr(value, "__qualname__"):
        return value.__qualname__
    text = repr(value)
    if " at 0x" in text or len(text) > 120:  # a default repr, or a record holding functions
        name, kind = getattr(value, "id", None) or getattr(value, "name", None), type(value).__name__
        return f"{kind}({name!r})" if isinstance(name, str) else f"<{kind}>"
    return text


SHOWN_ITEMS = 4
"""Items of a list attribute shown in a layer's printout (the rest are counted)."""


@dataclass(eq=False)
class Graph:
    """A model: layers in topological order, named inputs and outputs, tensor infos, constants."""

    name: str
    layers: list[Layer]
    inputs: list[str]
    outputs: list[str]
    tensors: dict[str, TensorInfo]
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=dict)

    def info(self, name: str) -> TensorInfo:
        return self.tensors.get(name, UNKNOWN)

    def producers(self) -> dict[str, Layer]:
        return {out: layer for layer in self.layers for out in layer.outputs if out}

    def consumers(self) -> dict[str, list[Layer]]:
        users: dict[str, list[Layer]] = {}
        for layer in self.layers:
            for name in layer.inputs:
                if name:
                    users.setdefault(name, []).append(layer)
        return users

    def private_copy(self) -> Graph:
        """A copy whose layers (and their input and output lists) and dicts are its own, so that
        a pass may rewrite it; the constants' arrays and the layers' attributes are shared."""
        layers = [copy.copy(layer) for layer in self.layers]
        for layer in layers:
            layer.inputs, layer.outputs = list(layer.inputs), list(layer.outputs)
        return Graph(self.name, layers, list(self.inputs), list(self.outputs), dict(self.tensors),
                     dict(self.constants), dict(self.opsets))

    def toposort(self, reads: Callable[[Layer], Iterable[str]] | None = None) -> None:
        """Reorder ``layers`` so that every layer comes after the producers of its inputs (of the
        names ``reads`` gives, where given: a control-flow layer's captures, say)."""
        self.layers = topological_order(self.layers, self.producers(), reads)

    def __repr__(self) -> str:
        lines = [f"graph {self.name}({', '.join(f'{n}: {self.info(n)}' for n in self.inputs)}) {{"]
        lines += [f"  {layer!r}" for layer in self.layers]
        lines.append(f"  return {', '.join(self.outputs)}")
        lines.append("}")
        return "\n".join(lines)


def topological_order(layers: Iterable[Layer], producers: dict[str, Layer],
                      reads: Callable[[Layer], Iterable[str]] | None = None) -> list[Layer]:
    """Depth-first topological order that keeps the given order where it can; a layer depends on
    the producers of ``reads(layer)`` (its inputs by default). A cycle is a ValueError."""
    reads = reads or (lambda layer: layer.inputs)
    layers = list(layers)
    members = set(map(id, layers))
    done: set[int] = set()
    order: list[Layer] = []
    for root in layers:
        stack: list[tuple[Layer, Iterator[str]]] = [(root, iter(reads(root)))]
        if id(root) in done:
            continue
        on_stack = {id(root)}
        while stack:
            layer, pending = stack[-1]
            for name in pending:
                dep = producers.get(name)
                if dep is None or id(dep) in done or id(dep) not in members:
                    continue
                if id(dep) in on_stack:
                    raise ValueError(f"the graph has a cycle through {dep.describe()}")
                stack.append((dep, iter(reads(dep))))
                on_stack.add(id(dep))
                break
            else:
                stack.pop()
                on_stack.discard(id(layer))
                done.add(id(layer))
                order.append(layer)
    return order


@dataclass(eq=False)
class SubgraphView:
    """A connected piece of a Graph: some of its layers, with the tensors that cross the boundary.

    ``inputs`` are tensors the layers read but do not produce (constants excluded); ``outputs`` are
    tensors the layers produce that something outside the view (or the graph's output) reads.
    """

    layers: list[Layer]
    inputs: list[str]
    outputs: list[str]
    graph: Graph | None = None

    @classmethod
    def of(cls, graph: Graph, layers: Iterable[Layer]) -> SubgraphView:
        layers = list(layers)
        inside = set(map(id, layers))
        produced = {out for layer in layers for out in layer.outputs if out}
        inputs: list[str] = []
        for layer in layers:
            for name in layer.inputs:
                if name and name not in produced and name not in graph.constants and name not in inputs:
                    inputs.append(name)
        read_outside = {n for lay in graph.layers if id(lay) not in inside for n in lay.inputs}
        read_outside |= set(graph.outputs)
        outputs = [o for layer in layers for o in layer.outputs if o and o in read_outside]
        return cls(layers, inputs, outputs, graph)

    def __repr__(self) -> str:
        body = "\n".join(f"  {layer!r}" for layer in self.layers)
        return f"subgraph({', '.join(self.inputs)}) -> ({', '.join(self.outputs)}) {{\n{body}\n}}"
