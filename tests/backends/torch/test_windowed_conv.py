"""A small 1-d Conv of a transposed (N, L, C) tensor, with its siblings of the same windows, is
one WindowedConv (``fusion/windowed.py``): the product of the windows, a strided view of the
(N, L, C) memory, by the stacked weights; CpuRef's and ONNX Runtime's values, NaN where a window
holds one; left alone where its windows are not rows of that memory, or where it is large."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion import windowed  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
RNG = np.random.default_rng(27)
C, L, O, K, S = 6, 40, 5, 4, 3  # channels, length, outputs, kernel, stride: 13 windows


def _gated(batch: int = 1, pads=(0, 0), transposed: bool = True) -> onnx.ModelProto:
    """x (N, L, C) -> Transpose -> Conv a, Conv b (kernel 4, stride 3) -> a * Sigmoid(b) -> y,
    and a's output read by a Relu -> z (a second reader: the product's columns, a view)."""
    rows = (L + sum(pads) - K) // S + 1
    shape = [batch, L, C] if transposed else [batch, C, L]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]) if transposed else
             helper.make_node("Identity", ["x"], ["t"]),
             helper.make_node("Conv", ["t", "wa", "ba"], ["a"], kernel_shape=[K], strides=[S],
                              pads=list(pads)),
             helper.make_node("Conv", ["t", "wb", "bb"], ["b"], kernel_shape=[K], strides=[S],
                              pads=list(pads)),
             helper.make_node("Sigmoid", ["b"], ["g"]), helper.make_node("Mul", ["a", "g"], ["y"]),
             helper.make_node("Relu", ["a"], ["z"])]
    inits = [numpy_helper.from_array((RNG.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("wa", (O, C, K)), ("ba", (O,)), ("wb", (O, C, K)), ("bb", (O,)))]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, O, rows]) for n in "yz"]
    graph = helper.make_graph(nodes, "gated", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, shape)], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _session(model, mode: str, monkeypatch) -> InferenceSession:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    data = model if isinstance(model, (str, Path)) else model.SerializeToString()
    return InferenceSession(data, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.route_cache": False, "CpuAcc.compile": mode})))


def _placed(session) -> list:
    return [lay for top in session.optimized.graph.layers
            for lay in (top.attrs.get("layers", []) if top.op_type in ("Traced", "OneDnnGraph")
                        else [top]) if lay.op_type not in ("MemCopy", "MemImport")]


def _against_references(session, model, feeds) -> None:
    data = model.SerializeToString()
    got = session.run(None, feeds)
    for want in (InferenceSession(data, backends=["CpuRef"]).run(None, feeds),
                 ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)):
        for g, w in zip(got, want):
            assert np.array_equal(np.isnan(g), np.isnan(w))
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mode", ["layers", "onednn_graph"])
def test_sibling_convolutions_of_one_transpose_are_one_product(batch: int, mode: str,
                                                               monkeypatch) -> None:
    model = _gated(batch)
    session = _session(model, mode, monkeypatch)
    fused = [lay for lay in _placed(session) if lay.op_type == "WindowedConv"]
    assert len(fused) == 1 and fused[0].attrs["splits"] == [O, O]
    assert not [lay for lay in _placed(session) if lay.op_type in ("Conv", "FusedConv")]
    x = RNG.standard_normal((batch, L, C)).astype(np.float32)
    x[0, 6, 2] = np.nan  # in windows 1 and 2 (rows 3-6 and 6-9)
    (y, z) = session.run(None, {"x": x})
    assert np.isnan(y[0, :, 1:3]).all() and not np.isnan(y[0, :, 3:]).any()
    _against_references(session, model, {"x": x})


@pytest.mark.parametrize("model", [_gated(pads=(1, 1)), _gated(transposed=False)],
                         ids=["padded", "not-a-transpose"])
def test_other_windows_are_left_to_the_convolution(model, monkeypatch) -> None:
    session = _session(model, "layers", monkeypatch)
    assert not [lay for lay in _placed(session) if lay.op_type == "WindowedConv"]
    _against_references(session, model, {"x": RNG.standard_normal(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)})


def test_a_large_one_is_left_to_the_convolution(monkeypatch) -> None:
    monkeypatch.setattr(windowed, "PRODUCT_MACS", 13 * O * K * C - 1)  # one is over
    session = _session(_gated(), "layers", monkeypatch)
    assert not [lay for lay in _placed(session) if lay.op_type == "WindowedConv"]


def test_the_corpus_byte_classifier(monkeypatch) -> None:
    """Its gated Conv1d over the embedded bytes (free length: each signature's build)."""
    from tests.backends.torch.test_half_fusion import _built

    path = CORPUS / "bytes_int32_dyn20.onnx"
    session = _session(path, "onednn_graph", monkeypatch)
    feeds = dict(np.load(CORPUS / "bytes_int32_dyn20.s0.npz"))
    (got,) = session.run(None, feeds)
    assert _built(session, "WindowedConv") == 1
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
