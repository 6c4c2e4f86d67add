"""A backend that cannot create the workload of a layer it took gives it up at load (Arm NN's failed
subgraph): the layer falls back to the next backend, with the reason in the report; strict mode, or
no backend left, makes it an error."""

from __future__ import annotations

import numpy as np
import pytest

from backplane import (InferenceSession, OptimizationError, OptimizerOptions, Runtime,
                       import_onnx, optimize)
from backplane.backends.api.backend import WorkloadFactory
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import registry
from backplane.runtime.loaded_network import ExecutionError
from tests.conftest import small_cnn_model

X = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)


class Brittle(CpuRef):
    """CpuRef's kernels, but no workload for the first convolution (as CpuAcc's oneDNN could not
    build a memory descriptor for a layer it had claimed)."""

    id = "TestBrittle"
    breaks = ("conv1",)

    def create_workload_factory(self, memory_manager=None) -> WorkloadFactory:
        factory = super().create_workload_factory(memory_manager)
        create, breaks = factory.create_workload, self.breaks

        def create_workload(layer, inputs, outputs):
            if layer.name in breaks:
                raise RuntimeError("could not construct a memory descriptor using a format tag")
            return create(layer, inputs, outputs)

        factory.create_workload = create_workload  # type: ignore[method-assign]
        return factory


def test_the_layer_falls_back_to_the_next_backend_with_the_reason() -> None:
    """000, of the sub-graphs a backend fails: "Arm NN will try to re-allocate these parts on
    other backends if available." Here also a layer whose workload its backend cannot create at
    load."""
    with registry.temporarily(Brittle.id, Brittle):
        session = InferenceSession(small_cnn_model(), backends=["TestBrittle", "CpuRef"])
    report = session.report
    conv = next(p for p in report.layers.values() if p.name == "conv1")
    assert conv.backend == "CpuRef"
    assert conv.refusals == [("TestBrittle", "could not create its workload: could not construct "
                                             "a memory descriptor using a format tag")]
    assert {p.backend for p in report.layers.values() if p.name != "conv1"} == {"TestBrittle"}
    assert any("conv1 fall back to the next backend" in w for w in report.warnings)
    want = InferenceSession(small_cnn_model(), backends=["CpuRef"]).run(None, {"x": X})[0]
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], want)


def test_strict_mode_or_no_backend_left_makes_it_an_error() -> None:
    with registry.temporarily(Brittle.id, Brittle):
        with pytest.raises(ExecutionError, match="TestBrittle could not create a workload for "
                                                 "layer 'conv1'"):
            InferenceSession(small_cnn_model(), backends=["TestBrittle", "CpuRef"],
                             optimizer_options=OptimizerOptions(strict=True))
        with pytest.raises(OptimizationError, match="no backend can run layer 'conv1' .*: "
                                                    "TestBrittle: could not create its workload: "
                                                    "could not construct a memory descriptor"):
            InferenceSession(small_cnn_model(), backends=["TestBrittle"])


def test_a_fused_layer_gives_up_every_model_layer_inside_it() -> None:
    """CpuAcc fuses conv1 with its Relu: a FusedConv that fails to build sends both to CpuRef."""
    pytest.importorskip("torch")
    from backplane.backends.torch.backend import CpuAcc

    class BrittleAcc(CpuAcc):
        id = "TestBrittleAcc"

        def create_workload_factory(self, memory_manager=None) -> WorkloadFactory:
            factory = super().create_workload_factory(memory_manager)
            create = factory.create_workload

            def create_workload(layer, inputs, outputs):
                if layer.op_type in ("FusedConv", "OneDnnGraph") and "conv1" in layer.name:
                    raise RuntimeError("oneDNN refused")
                return create(layer, inputs, outputs)

            factory.create_workload = create_workload  # type: ignore[method-assign]
            return factory

    with registry.temporarily(BrittleAcc.id, BrittleAcc):
        network = optimize(import_onnx(small_cnn_model()), ["TestBrittleAcc", "CpuRef"])
        fused = [p.name for p in network.report.layers.values() if p.substituted_by]
        runtime = Runtime()
        loaded = runtime.network(runtime.load(network)).network
    assert "conv1" in fused
    moved = {p.name for p in loaded.report.layers.values() if p.backend == "CpuRef"}
    assert "conv1" in moved and moved <= set(fused)
    want = InferenceSession(small_cnn_model(), backends=["CpuRef"]).run(None, {"x": X})[0]
    got = runtime.run(runtime.network(1).network_id, {"x": X})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def _loop_model(inner: str = "body_relu"):
    """y = Loop(3 times) { v = Relu(v + 1) } over x, the body's Relu named ``inner``."""
    from onnx import TensorProto, helper

    body = helper.make_graph(
        [helper.make_node("Add", ["v_in", "one"], ["s"], name="body_add"),
         helper.make_node("Relu", ["s"], ["v_out"], name=inner),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="body_cond")],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)], "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor("n", TensorProto.INT64, [], [3])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class BrittleInBodies(Brittle):
    id = "TestBrittleBody"
    breaks = ("body_relu",)


def test_a_layer_inside_a_loop_body_falls_back_too() -> None:
    """000: "Arm NN will try to re-allocate these parts on other backends if available." A layer
    of a Loop's body whose workload its backend cannot create goes to the next backend, and the
    report names it by its path."""
    x = np.array([[-5.0, -1.5, 0.5, 2.0]], np.float32)
    with registry.temporarily(BrittleInBodies.id, BrittleInBodies):
        session = InferenceSession(_loop_model(), backends=["TestBrittleBody", "CpuRef"])
    placed = session.report.layers["loop/body/body_relu"]
    assert placed.backend == "CpuRef"
    assert placed.refusals[0][0] == "TestBrittleBody"
    assert session.report.layers["loop/body/body_add"].backend == "TestBrittleBody"
    want = InferenceSession(_loop_model(), backends=["CpuRef"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], want)
