"""The tiny models on CpuAcc (CpuRef behind it) match ONNX Runtime within 1e-4, with CpuAcc's fused
layers in the plan; and with each convolution route forced."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from backplane import InferenceSession, OptimizerOptions  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_fusion import placed  # noqa: E402
from tests.models.test_models import DATA, TINY, assert_close, ort_outputs  # noqa: E402

FUSED = {"tiny_mobilenet_v3": "FusedConv", "tiny_bert": "Linear", "tiny_gpt2": "Linear"}


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_match_onnx_runtime(name: str) -> None:
    path = DATA / f"{name}.onnx"
    feeds = dict(np.load(DATA / f"{name}.npz"))
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))
    backends = {layer.backend for layer in session.optimized.graph.layers
                if layer.op_type not in ("MemCopy", "MemImport")}
    assert backends == {"CpuAcc"}, f"layers left to {backends - {'CpuAcc'}}"
    assert any(layer.op_type == FUSED[name] for layer in placed(session))


@pytest.mark.parametrize("route", ["onednn", "torch"])
@pytest.mark.parametrize("linear", ["mkl", "onednn"])
def test_each_route_matches_onnx_runtime(route: str, linear: str) -> None:
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    options = RuntimeOptions(backend_options={"CpuAcc.conv_route": route,
                                              "CpuAcc.linear_route": linear})
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"], runtime=Runtime(options))
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))


def test_cpuacc_and_cpuref_mixed_by_pins() -> None:
    """Every Add on CpuRef: tensors cross between torch and NumPy memory both ways."""
    path = DATA / "tiny_bert.onnx"
    feeds = dict(np.load(DATA / "tiny_bert.npz"))
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"], pins={"LayerNormalization": "CpuRef"})
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))
    assert session.report.copies, "crossing between torch-cpu and host memory copies"


def test_a_constant_read_on_two_backends_reaches_each_in_its_memory() -> None:
    """One constant, read by a CpuAcc layer (Add) and a CpuRef layer (CumSum's input here): each
    backend gets it in its own memory (a torch tensor, a NumPy array), whichever layer comes first."""
    from onnx import helper, numpy_helper

    from tests.conftest import float_input, make_model

    c = numpy_helper.from_array(np.arange(4, dtype=np.float32), "c")
    axis = numpy_helper.from_array(np.array(0, np.int64), "axis")
    nodes = [helper.make_node("Add", ["x", "c"], ["a"], name="add"),  # CpuAcc
             helper.make_node("CumSum", ["c", "axis"], ["s"], name="cumsum"),  # pinned to CpuRef
             helper.make_node("Mul", ["a", "s"], ["y"], name="mul")]
    model = make_model(nodes, [float_input("x", [4])], [float_input("y", [4])], [c, axis])
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"], pins={"cumsum": "CpuRef"},
                               optimizer_options=OptimizerOptions(fold_constants=False))
    assert session.report.backend_of("add") == "CpuAcc"
    assert session.report.backend_of("cumsum") == "CpuRef"
    x = np.ones(4, np.float32)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, (x + np.arange(4)) * np.cumsum(np.arange(4)))
