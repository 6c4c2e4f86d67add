"""What a loaded network keeps of its weights: each once.

Once a network is loaded, its workloads hold what they read: the constants bound to their slots
(CpuRef's kernels read the model's arrays themselves, CpuAcc views them as torch tensors) or a layout
of their own (oneDNN's packed weights, channels-last kernels, a device's copy). The graph the model
was imported as, the optimized graph's constants and the fused layers' attributes (views of those
constants) would otherwise keep every weight alive a second time beside each own layout: ONNX
Runtime, likewise, removes the initializers from its graph once its session state holds them.

A session that read its model from a file gives the weights up: it keeps ``released_graph``'s copy
of the graph it imported, and sets ``OptimizedNetwork.weights`` (a ``FileWeights``) on the network
it loads; the load then replaces each layer, once its workload is made, by ``released_layer``'s
copy, and holds the graph's constants as ``ReleasedConstants`` (``runtime/loaded_network.py``).
In the copies,

- each array in a layer's attributes is a ``Released`` placeholder (its shape and dtype), but for
  small ones (``KEPT_BYTES``), which a printout or a check may read;
- a constant the model file holds is held weakly (``FileWeights``): reading it gives the very array
  a backend still holds, or, where none does, the weight read from the file again; any other
  constant (folded, made by a fusion, small) is kept.

Loading a released network loads its ``remake`` (the file imported and optimized again);
``SessionOptions.keep_initializers`` keeps everything instead.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from backplane.ir.graph import Graph, Layer
from backplane.optimizer.optimize import OptimizedNetwork

KEPT_BYTES = 1 << 16
"""An array of at most this many bytes (and not a view of a larger one) stays where it is."""


class Weights(Protocol):
    """Where a model's weights can be read again by name (``frontends.onnx_file.WeightFile``)."""

    def __contains__(self, name: object) -> bool: ...

    def read(self, name: str) -> np.ndarray: ...


class FileWeights:
    """The weights a model file holds, each held weakly by name: the array imported from the file
    while a backend holds it, or the one read from it again while the reader holds it. The
    released graphs of one load share it, so that they give one array for one name."""

    def __init__(self, weights: Weights, imported: Mapping[str, np.ndarray]) -> None:
        self._weights = weights
        self._refs = {name: weakref.ref(value) for name, value in imported.items()
                      if name in weights and isinstance(value, np.ndarray) and not _small(value)}

    def holds(self, name: str, value: Any) -> bool:
        """Whether ``value`` is the array imported from the file as ``name`` (it can be read again)."""
        ref = self._refs.get(name)
        return ref is not None and ref() is value

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._refs[name]()
        if value is None:  # no backend holds it: read from the file again
            value = self._weights.read(name)
            self._refs[name] = weakref.ref(value)
        return value

    def held(self) -> list[str]:
        """The names of the weights something still holds (the rest would be read again)."""
        return [name for name, ref in self._refs.items() if ref() is not None]


@dataclasses.dataclass(frozen=True)
class Released:
    """An array a loaded network no longer holds (its backend keeps the values in a layout of its
    own, or nothing reads them)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def __repr__(self) -> str:  # as a layer's printout shows an array
        return f"tensor{list(self.shape)}"


class ReleasedConstants(Mapping[str, np.ndarray]):
    """A released graph's constants by name: those the model file holds come from ``weights``
    (held weakly there), any other is kept; so are those in ``holding`` until ``let_go``."""

    def __init__(self, constants: Mapping[str, np.ndarray], weights: FileWeights | None,
                 holding: frozenset[str] = frozenset()) -> None:
        self._kept: dict[str, Any] = {}
        self._released: list[str] = []
        self._weights = weights
        for name, value in _items(constants):
            if value is _LEFT or (name not in holding and weights is not None
                                  and weights.holds(name, value)):
                self._released.append(name)
            else:
                self._kept[name] = value

    def let_go(self) -> None:
        """Hold weakly the constants ``holding`` kept that the file holds."""
        for name, value in list(self._kept.items()):
            if self._weights is not None and self._weights.holds(name, value):
                del self._kept[name]
                self._released.append(name)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self._kept:
            return self._kept[name]
        if name not in self._released:
            raise KeyError(name)
        assert self._weights is not None
        return self._weights[name]

    def __iter__(self) -> Iterator[str]:
        yield from self._kept
        yield from self._released

    def __len__(self) -> int:
        return len(self._kept) + len(self._released)

    def __contains__(self, name: object) -> bool:
        return name in self._kept or name in self._released

    def held(self) -> list[str]:
        """The names of the released weights a backend still holds (the rest would be read
        again from the file)."""
        held = set(self._weights.held()) if self._weights is not None else set()
        return [name for name in self._released if name in held]

    def __repr__(self) -> str:
        return f"<{len(self)} constants, {len(self._released)} of them left to the model file>"


def released_graph(graph: Graph, weights: FileWeights | None) -> Graph:
    layers = [released_layer(layer, weights) for layer in graph.layers]
    return Graph(graph.name, layers, list(graph.inputs), list(graph.outputs), dict(graph.tensors),
                 ReleasedConstants(graph.constants, weights),  # type: ignore[arg-type]
                 dict(graph.opsets))


def released_layer(layer: Layer, weights: FileWeights | None) -> Layer:
    attrs = {key: _released(value, weights) for key, value in layer.attrs.items()}
    return dataclasses.replace(layer, attrs=attrs)


def _released(value: Any, weights: FileWeights | None) -> Any:
    if isinstance(value, np.ndarray):
        return value if _small(value) else Released(tuple(value.shape), value.dtype)
    if isinstance(value, Layer):
        return released_layer(value, weights)
    if isinstance(value, Graph):
        return released_graph(value, weights)
    if isinstance(value, OptimizedNetwork):  # a control-flow body: its own loaded network holds it
        return dataclasses.replace(value, graph=released_graph(value.graph, weights), remake=None,
                                   weights=None, released=True)
    if type(value) in (list, tuple):
        return type(value)(_released(v, weights) for v in value)
    if type(value) is dict:
        return {k: _released(v, weights) for k, v in value.items()}
    return value


_LEFT = object()  # a constant a released graph left to the file, not read again to be copied


def _items(constants: Mapping[str, np.ndarray]) -> list[tuple[str, Any]]:
    if isinstance(constants, ReleasedConstants):
        return [*constants._kept.items(), *((name, _LEFT) for name in constants._released)]
    return list(constants.items())


def _small(value: Any) -> bool:
    """Whether an array and the memory it views are at most KEPT_BYTES (a scalar or object: kept)."""
    while isinstance(value, np.ndarray):
        if value.nbytes > KEPT_BYTES:
            return False
        value = value.base
    return True
