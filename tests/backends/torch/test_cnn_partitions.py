"""The corpus's CNN partitions compiled by oneDNN Graph (issue 27): a U-Net's Resize and
ConvTranspose and a dynamo-exported MobileNet's ReduceMean kept every such partition out of a
OneDnnGraph, and the Resize kernel could not be traced at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion.traced import native_half  # noqa: E402
from backplane.backends.torch.kernels.vision import resize  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_traced import _inner_layers  # noqa: E402
from tests.models.test_corpus import tolerance  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"


def _decoder() -> bytes:
    """Conv+Relu, ConvTranspose x2, Resize (bilinear x2, taps path at this size), Concat with a
    skip, Conv, ReduceMean over the map (opset 18: axes an input) and Sigmoid: one static CNN."""
    rng = np.random.default_rng(0)

    def const(name: str, shape: tuple[int, ...]) -> object:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    inits = [const("w1", (8, 3, 3, 3)), const("b1", (8,)), const("wt", (8, 4, 2, 2)),
             const("w2", (4, 12, 3, 3)),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "axes")]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("ConvTranspose", ["r1", "wt"], ["up"], strides=[2, 2]),
        helper.make_node("Resize", ["r1", "", "scales"], ["rs"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Concat", ["up", "rs"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "w2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("ReduceMean", ["c2", "axes"], ["m"], keepdims=1),
        helper.make_node("Sigmoid", ["m"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "decoder",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 1, 1])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return model.SerializeToString()


def _session(model: bytes | str, mode: str) -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options={"CpuAcc.compile": mode})))


def _graphs(session: InferenceSession) -> list:
    """The routes of the OneDnnGraph layers that run (a static model's, or its signatures')."""
    found = []
    for layer, work in _inner_layers(session):
        while hasattr(work, "work"):
            work = work.work
        if layer.op_type == "OneDnnGraph":
            found.append(work.route)
    return found


def test_the_resize_kernel_traces_to_what_it_computes() -> None:
    """A trace's sizes are tensors: the taps' host code compared them with NumPy arrays (TypeError),
    and every partition holding a Resize ran layer by layer."""
    x = torch.randn(1, 4, 6, 6)

    def run(value):
        return resize(value, None, np.array([1, 1, 2, 2], np.float32), mode="linear")[0]

    with torch.no_grad():
        traced = torch.jit.trace(run, (x,), check_trace=False)
        other = torch.randn(1, 4, 6, 6)
        torch.testing.assert_close(traced(other), run(other), rtol=0, atol=1e-6)


def test_resize_conv_transpose_and_reduce_mean_compile_in_one_graph() -> None:
    model = _decoder()
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    session = _session(model, "onednn_graph")
    assert _graphs(session) == ["onednn_graph"]
    (got,) = session.run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_nan_through_the_compiled_resize_stays_where_cpuref_puts_it() -> None:
    model = _decoder()
    x = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)
    x[0, 1, 3, 4] = np.nan
    session = _session(model, "onednn_graph")
    (got,) = session.run(None, {"x": x})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("name", ["unet_resize_ts13", "unet_resize_dyn20", "mobilenet_dw_dyn18",
                                  "mobilenet_fp16_ts17"])
def test_the_corpus_cnns_compile_and_match_cpuref(name: str) -> None:
    """Each signature's build of these free-size CNNs is one OneDnnGraph, compiled (the float16
    MobileNet's in float32, its unfused Conv and Gemm layers inside, as Traced ones compute)."""
    path = str(CORPUS / f"{name}.onnx")
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    session = _session(path, "onednn_graph")
    got = session.run(None, feeds)
    if not (name == "mobilenet_fp16_ts17" and native_half()):  # a CPU computing float16 itself
        assert _graphs(session) == ["onednn_graph"]  # (the GPU machine's Xeon) keeps it float16
    want = InferenceSession(path, backends=["CpuRef"]).run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=0, atol=tolerance(w))


def test_a_graph_onednn_cannot_compile_is_traced_instead(monkeypatch) -> None:
    """Where the fuser fails (as it did on the Resize's in-place sum), the layers are traced
    without it rather than run one by one."""
    from backplane.backends.torch.fusion import onednn_graph

    monkeypatch.setattr(onednn_graph, "_compiled", lambda *args: None)
    model = _decoder()
    feeds = {"x": np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)}
    session = _session(model, "onednn_graph")
    (got,) = session.run(None, feeds)  # compiled (here: traced) at the first run
    assert _graphs(session) == ["traced"]
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attrs", [{"transB": 1}, {"transB": 1, "alpha": 0.5}, {"transA": 1},
                                   {"transB": 1, "beta": 2.0}, {}])
def test_the_traced_gemm_computes_what_cpuacc_gemm_does(attrs: dict) -> None:
    from backplane.backends.torch.fusion.onednn_graph import TRACEABLE_KERNELS
    from backplane.backends.torch.kernels.nn import gemm

    rng = np.random.default_rng(4)
    a = torch.from_numpy(rng.standard_normal((3, 5) if not attrs.get("transA") else (5, 3)))
    b = torch.from_numpy(rng.standard_normal((4, 5) if attrs.get("transB") else (5, 4)))
    c = torch.from_numpy(rng.standard_normal(4))
    a[0, 1] = np.nan
    (got,) = TRACEABLE_KERNELS["Gemm"](a, b, c, **attrs)
    (want,) = gemm(a, b, c, **attrs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
