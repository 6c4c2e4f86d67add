"""The tiny models on CpuAcc (CpuRef behind it) match ONNX Runtime within 1e-4, with CpuAcc's fused
layers in the plan; and with each convolution route forced."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.models.test_models import DATA, TINY, assert_close, ort_outputs  # noqa: E402

FUSED = {"tiny_mobilenet_v3": "FusedConv", "tiny_bert": "Linear", "tiny_gpt2": "Linear"}


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_match_onnx_runtime(name: str) -> None:
    path = DATA / f"{name}.onnx"
    feeds = dict(np.load(DATA / f"{name}.npz"))
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))
    placed = {layer.backend for layer in session.optimized.graph.layers if layer.op_type not in ("MemCopy", "MemImport")}
    assert placed == {"CpuAcc"}, f"layers left to {placed - {'CpuAcc'}}"
    assert any(layer.op_type == FUSED[name] for layer in session.optimized.graph.layers)


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
