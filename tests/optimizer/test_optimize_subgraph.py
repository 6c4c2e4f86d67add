"""optimize_subgraph: substitutions replace layers, failed parts move to the next backend, and the
views a backend returns must cover its subgraph exactly."""

from __future__ import annotations

import numpy as np
import pytest

from backplane import InferenceSession
from backplane.backends.api.optimization import OptimizationViews, Substitution
from backplane.backends.registry import registry
from backplane.ir.graph import Layer, SubgraphView
from tests.conftest import PartialBackend, small_cnn_model

X = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)


def fused_add_relu(a, b):
    return (np.maximum(a + b, 0).astype(a.dtype),)


class Fusing(PartialBackend):
    """Fuses Add followed by Relu into one layer of its own op type."""

    id = "TestFusing"
    KERNELS = {**PartialBackend.KERNELS, "AddRelu": {1: fused_add_relu}}

    def optimize_subgraph(self, view: SubgraphView) -> OptimizationViews:
        views = OptimizationViews()
        layers = list(view.layers)
        for add, relu in zip(layers, layers[1:]):
            if add.op_type == "Add" and relu.op_type == "Relu" and relu.inputs == add.outputs:
                fused = Layer(f"{add.name}+{relu.name}", "AddRelu", add.inputs, relu.outputs,
                              opset=1)
                part = SubgraphView.of(view.graph, [add, relu])
                views.substitutions.append(Substitution(part, [fused]))
                rest = [lay for lay in layers if lay not in (add, relu)]
                views.untouched.append(SubgraphView.of(view.graph, rest))
                return views
        views.untouched.append(view)
        return views


class FailsConvs(PartialBackend):
    """Accepts Conv at support time, then reports it failed in optimize_subgraph."""

    id = "TestFailsConvs"

    def optimize_subgraph(self, view: SubgraphView) -> OptimizationViews:
        convs = [lay for lay in view.layers if lay.op_type == "Conv"]
        rest = [lay for lay in view.layers if lay.op_type != "Conv"]
        views = OptimizationViews()
        if convs:
            views.failed.append(SubgraphView.of(view.graph, convs))
        if rest:
            views.untouched.append(SubgraphView.of(view.graph, rest))
        return views


class Sloppy(PartialBackend):
    id = "TestSloppy"

    def optimize_subgraph(self, view: SubgraphView) -> OptimizationViews:
        return OptimizationViews(untouched=[SubgraphView.of(view.graph, view.layers[1:])])


def reference_output() -> np.ndarray:
    return InferenceSession(small_cnn_model(), backends=["CpuRef"]).run(None, {"x": X})[0]


def test_a_substitution_replaces_layers_and_is_reported() -> None:
    with registry.temporarily(Fusing.id, Fusing):
        session = InferenceSession(small_cnn_model(), backends=["TestFusing", "CpuRef"])
    ops = [layer.op_type for layer in session.optimized.graph.layers]
    assert "AddRelu" in ops and "Add" not in ops
    assert session.report.layers["skip"].substituted_by == "skip+relu2"
    assert any(s.outcome == "substituted" for s in session.report.subgraphs)
    np.testing.assert_allclose(session.run(None, {"x": X})[0], reference_output(), rtol=1e-6)


def test_failed_subgraphs_are_reassigned_to_the_next_backend() -> None:
    with registry.temporarily(FailsConvs.id, FailsConvs):
        session = InferenceSession(small_cnn_model(), backends=["TestFailsConvs", "CpuRef"])
    report = session.report
    assert report.backend_of("conv1") == report.backend_of("conv2") == "CpuRef"
    assert report.backend_of("relu1") == "TestFailsConvs"
    assert ("TestFailsConvs", "optimize_subgraph reported it failed") in report.layers["conv1"].refusals
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], reference_output())


def test_views_that_do_not_cover_the_subgraph_are_an_error() -> None:
    with registry.temporarily(Sloppy.id, Sloppy):
        with pytest.raises(ValueError, match="TestSloppy.optimize_subgraph returned views that do "
                                             "not cover its subgraph exactly once: missing"):
            InferenceSession(small_cnn_model(), backends=["TestSloppy", "CpuRef"])
