"""IR: topological order, cycles, subgraph boundaries, the printout."""

from __future__ import annotations

import numpy as np
import pytest

from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo


def chain() -> Graph:
    a = Layer("a", "Relu", ["x"], ["t1"])
    b = Layer("b", "Add", ["t1", "w"], ["t2"])
    c = Layer("c", "Neg", ["t2"], ["y"])
    tensors = {"x": TensorInfo((2, "n"), np.dtype(np.float32))}
    return Graph("g", [c, a, b], ["x"], ["y"], tensors, {"w": np.ones(2, np.float32)})


def test_toposort_puts_producers_first() -> None:
    graph = chain()
    graph.toposort()
    assert [layer.name for layer in graph.layers] == ["a", "b", "c"]


def test_a_cycle_is_reported_with_a_layer_on_it() -> None:
    graph = chain()
    graph.layers[1].inputs = ["y"]  # a reads c's output
    with pytest.raises(ValueError, match="cycle through layer"):
        graph.toposort()


def test_subgraph_view_boundaries_exclude_constants() -> None:
    graph = chain()
    graph.toposort()
    view = SubgraphView.of(graph, graph.layers[1:])
    assert view.inputs == ["t1"] and view.outputs == ["y"]
    view = SubgraphView.of(graph, graph.layers[:1])
    assert view.inputs == ["x"] and view.outputs == ["t1"]


def test_tensor_info_printout_and_size() -> None:
    info = TensorInfo((2, "n", None), np.dtype(np.float16))
    assert str(info) == "float16[2,n,?]" and not info.is_static and info.nbytes is None
    assert TensorInfo((2, 3), np.dtype(np.float32)).nbytes == 24


def test_layer_printout_names_attributes_and_backend() -> None:
    layer = Layer("conv", "Conv", ["x", "w", ""], ["y"], {"pads": [1, 1, 1, 1]}, opset=17,
                  backend="CpuRef")
    assert repr(layer) == "y = Conv[pads=[1, 1, 1, 1]](x, w, _) @CpuRef  # conv"
    assert layer.describe() == "layer 'conv' (Conv, opset 17)"
