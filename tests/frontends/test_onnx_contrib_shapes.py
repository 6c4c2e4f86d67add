"""The shapes the importer gives ONNX Runtime's ops' outputs (``onnx_contrib.OUTPUT_SHAPES``):
onnx's inference has none for them, and the layers after an unshaped output do not fuse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession
from backplane.frontends.onnx import import_onnx

pytest.importorskip("onnxruntime")
from tests.models.test_ort_tools import DATA, ort_run, ort_saved  # noqa: E402


def test_saved_mobilenets_fused_convolutions_are_shaped(tmp_path: Path) -> None:
    """ONNX Runtime's saved tiny MobileNet: each FusedConv's output has Conv's static shape, so
    the convolutions after it fuse on CpuAcc (none ran fused after the first FusedConv: 2.3x the
    plain file's time)."""
    path = ort_saved(DATA / "tiny_mobilenet_v3.onnx", tmp_path / "saved.onnx")
    graph = import_onnx(path)
    fused = [lay for lay in graph.layers if lay.op_type == "FusedConv"]
    assert len(fused) > 10
    for layer in fused:
        shape, x = graph.info(layer.outputs[0]).shape, graph.info(layer.inputs[0]).shape
        weight = graph.constants[layer.inputs[1]]
        assert shape is not None and all(isinstance(d, int) for d in shape), layer.name
        assert shape[:2] == (x[0], weight.shape[0])
        strides = layer.attrs.get("strides", [1, 1])
        assert shape[2] == -(-x[2] // strides[0])  # the model's pads keep the size (/ stride)
    pytest.importorskip("torch")
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    network = session.runtime.network(session.network_id)
    inner = [lay for outer in network.layers for lay in outer.attrs.get("layers", [outer])]
    assert not [lay for lay in inner if lay.op_type == "Conv" and not lay.domain]
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    (got,), (want,) = session.run(None, feeds), ort_run(path, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
