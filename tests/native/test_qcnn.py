"""The native int8 route (native/qcnn.c, fusion/int8_native.py): a whole static int8 CNN subgraph
in one C call, against ONNX Runtime's outputs bit for bit (its QLinearConv and QuantizeLinear
arithmetic) on the corpus's QOperator and QDQ ResNets and on hypothesis' QLinearConv /
QLinearMatMul cases, and within one quantization step of CpuRef's (which requantizes in float64);
pinned by option (CpuAcc.native), never by a measurement."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.ort_int8 import ort_int8_exact  # noqa: E402

CORPUS = "tests/data/corpus"
RESNETS = ["resnet_qlinear_ort15", "resnet_qdq_ort17"]
"""ONNX Runtime's quantizer's (its QDQ fusions: the same integer convolutions), bit for bit."""
needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


def _session(model, native: str = "auto", **options) -> InferenceSession:
    shapes = options.pop("input_shapes", None)
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"], input_shapes=shapes,
                            provider_options=[{"CpuAcc.native": native, **options}, {}])


def _ops(session: InferenceSession) -> list[str]:
    loaded = session.runtime.network(session.network_id)
    return [layer.op_type for layer in loaded.layers if layer.backend == "CpuAcc"]


def _ort(model, feeds):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None,
                                                                                          feeds)


def _corpus(name: str):
    feeds = dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    return f"{CORPUS}/{name}.onnx", feeds, {k: list(v.shape) for k, v in feeds.items()}


@needs_compiler
@pytest.mark.parametrize("name", RESNETS)
def test_the_corpus_int8_resnets_run_natively_as_onnx_runtime_does(name):
    path, feeds, shapes = _corpus(name)
    session = _session(path, input_shapes=shapes)
    assert _ops(session) == ["NativeInt8"]
    got = session.run(None, feeds)
    for g, w in zip(got, _ort(path, feeds)):
        np.testing.assert_array_equal(g, w)  # bit for bit
    for g, w in zip(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds)):
        step = np.abs(np.diff(np.unique(w))).min(initial=1.0)  # the output's quantization step
        assert np.abs(g - w).max() <= step * 1.0001
    nan = {k: v.copy() for k, v in feeds.items()}
    next(iter(nan.values())).reshape(-1)[7] = np.nan  # quantized as ONNX Runtime does: 0
    for g, w in zip(session.run(None, nan), _ort(path, nan)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("act", ["Relu", "Clip"])
def test_a_qdq_conv_with_its_activation_then_a_float_head(act):
    """DQ -> Conv -> Relu / Clip -> Q (the bounds in the requantization; ONNX Runtime's fusion
    drops the Relu or Clip the step makes redundant) -> DQ -> ReduceMean -> Gemm in float32."""
    if build.compiler() is None:
        pytest.skip("no C compiler")
    rng = np.random.default_rng(5)
    x_scale, y_scale = np.float32(0.02), np.float32(0.05)
    w_scale = rng.uniform(0.002, 0.01, 12).astype(np.float32)
    ints = rng.integers(-63, 64, (12, 6, 3, 3))
    inits = [numpy_helper.from_array(x_scale, "xs"), numpy_helper.from_array(np.uint8(128), "xz"),
             numpy_helper.from_array(ints.astype(np.int8), "wq"),
             numpy_helper.from_array(w_scale, "ws"),
             numpy_helper.from_array(np.zeros(12, np.int8), "wz"),
             numpy_helper.from_array(rng.integers(-500, 500, 12).astype(np.int32), "bq"),
             numpy_helper.from_array(x_scale * w_scale, "bs"),
             numpy_helper.from_array(np.zeros(12, np.int32), "bz"),
             numpy_helper.from_array(y_scale, "ys"), numpy_helper.from_array(np.uint8(0), "yz"),
             numpy_helper.from_array(np.float32(0), "lo"),
             numpy_helper.from_array(np.float32(255 * y_scale), "hi"),
             numpy_helper.from_array(rng.standard_normal((5, 12)).astype(np.float32), "fc"),
             numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "fb")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"], axis=0),
             helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["b"], axis=0),
             helper.make_node("Conv", ["xd", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node(act, ["c"] + (["lo", "hi"] if act == "Clip" else []), ["a"]),
             helper.make_node("QuantizeLinear", ["a", "ys", "yz"], ["aq"]),
             helper.make_node("DequantizeLinear", ["aq", "ys", "yz"], ["ad"]),
             helper.make_node("ReduceMean", ["ad"], ["m"], axes=[2, 3], keepdims=0),
             helper.make_node("Gemm", ["m", "fc", "fb"], ["out"], transB=1)]
    model = make_model(nodes, [float_input("x", [2, 6, 9, 7])], [float_input("out", [2, 5])],
                       inits, opset=13)
    feeds = {"x": (rng.standard_normal((2, 6, 9, 7)) * 1.5).astype(np.float32)}
    session = _session(model)
    assert _ops(session) == ["NativeInt8"]
    (got,) = session.run(None, feeds)
    for (want,) in (_ort(model, feeds), InferenceSession(model, backends=["CpuRef"]).run(
            None, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_a_free_batch_is_planned_per_signature():
    path, feeds, _ = _corpus("resnet_qdq_ort17")
    session = _session(path)
    batch = {k: np.concatenate([v, v[:, :, ::-1]]) for k, v in feeds.items()}
    for g, w in zip(session.run(None, batch), _ort(path, batch)):
        np.testing.assert_array_equal(g, w)


@needs_compiler
@pytest.mark.parametrize("options", [{"native": "off"}, {"CpuAcc.compile": "layers"},
                                     {"CpuAcc.int8": "exact"}])
def test_off_or_a_pinned_route_keeps_todays_path(options):
    path, feeds, shapes = _corpus("resnet_qlinear_ort15")
    session = _session(path, input_shapes=shapes, **options)
    assert "NativeInt8" not in _ops(session)
    got = session.run(None, feeds)
    for g, w in zip(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds)):
        np.testing.assert_allclose(g, w, atol=0.02)


def test_without_a_compiler_the_subgraph_keeps_its_torch_route(tmp_path, monkeypatch):
    monkeypatch.setenv("BACKPLANE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    path, feeds, shapes = _corpus("resnet_qdq_ort17")
    session = _session(path, input_shapes=shapes)
    assert "NativeInt8" not in _ops(session)
    got = session.run(None, feeds)
    for g, w in zip(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds)):
        np.testing.assert_allclose(g, w, atol=0.02)


@needs_compiler
def test_outputs_are_the_callers_and_threads_at_once_get_their_own_arena():
    path, feeds, shapes = _corpus("resnet_qlinear_ort15")
    session = _session(path, input_shapes=shapes)
    first = session.run(None, feeds)
    kept = [o.copy() for o in first]
    other = {k: (v * 2).astype(np.float32) for k, v in feeds.items()}
    session.run(None, other)
    for a, b in zip(first, kept):
        np.testing.assert_array_equal(a, b)
    want = _ort(path, other)
    failures: list[str] = []

    def many() -> None:
        for _ in range(30):
            if not all(np.array_equal(g, w) for g, w in zip(session.run(None, other), want)):
                failures.append("differs")

    threads = [threading.Thread(target=many) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@needs_compiler
def test_the_profile_times_each_planned_layer():
    path, feeds, shapes = _corpus("resnet_qdq_ort17")
    outputs, rows = _session(path, input_shapes=shapes).run_profiled(None, feeds)
    ops = [row.op_type for row in rows]
    assert ops.count("Conv") == 6 and "QcnnImport" in ops and "QcnnExport" in ops
    for g, w in zip(outputs, _ort(path, feeds)):
        np.testing.assert_array_equal(g, w)


@st.composite
def qlinear_cases(draw):
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    pads = [draw(st.integers(0, k // 2 * d)) for k, d in ((kh, dh), (kw, dw))] * 2
    c, depthwise = draw(st.integers(1, 20)), draw(st.booleans())
    return dict(n=draw(st.integers(1, 2)), c=c, group=c if depthwise else 1,
                oc=c if depthwise else draw(st.integers(1, 40)), k=(kh, kw), dilations=[dh, dw], pads=pads,
                h=draw(st.integers((kh - 1) * dh + 1, 12)),
                w=draw(st.integers((kw - 1) * dw + 1, 12)),
                strides=[draw(st.integers(1, 2)), draw(st.integers(1, 2))],
                signed=draw(st.booleans()), per_channel=draw(st.booleans()),
                bias=draw(st.booleans()), head=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def _qlinear_model(case: dict):
    """QuantizeLinear -> QLinearConv [-> QLinearMatMul of the pooled-free flattened 1x1 pixels]
    -> DequantizeLinear, ONNX Runtime's QOperator format; weights within +-63 where ONNX
    Runtime's u8 x s8 sums saturate (no VNNI): the pairs then stay below 2^15."""
    rng = np.random.default_rng(case["seed"])
    (kh, kw), (sh, sw), (dh, dw) = case["k"], case["strides"], case["dilations"]
    pt, pl, pb, pr = case["pads"]
    oh = (case["h"] + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (case["w"] + pl + pr - (kw - 1) * dw - 1) // sw + 1
    reach = 127 if ort_int8_exact() else 63
    xtype, xdt = (TensorProto.INT8, np.int8) if case["signed"] else (TensorProto.UINT8, np.uint8)
    oc = case["oc"]
    scales = rng.uniform(0.002, 0.02, oc if case["per_channel"] else 1).astype(np.float32)
    inits = [numpy_helper.from_array(np.float32(0.03), "xs"),
             numpy_helper.from_array(xdt(rng.integers(-20, 20) + (0 if case["signed"] else 128)),
                                     "xz"),
             numpy_helper.from_array(rng.integers(-reach, reach + 1, (
                 oc, case["c"] // case["group"], kh, kw)).astype(np.int8), "w"),
             numpy_helper.from_array(scales, "ws"),
             numpy_helper.from_array(np.zeros(scales.size, np.int8), "wz"),
             numpy_helper.from_array(np.float32(rng.uniform(0.05, 0.3)), "ys"),
             numpy_helper.from_array(xdt(rng.integers(-10, 10) + (0 if case["signed"] else 128)),
                                     "yz"),
             numpy_helper.from_array(rng.integers(-3000, 3000, oc).astype(np.int32), "b")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("QLinearConv", ["xq", "xs", "xz", "w", "ws", "wz", "ys", "yz"]
                              + (["b"] if case["bias"] else []), ["yq"],
                              kernel_shape=[kh, kw], strides=[sh, sw], dilations=[dh, dw],
                              pads=case["pads"], group=case["group"])]
    last, shape = "yq", [case["n"], oc, oh, ow]
    if case["head"]:  # the pooled channels' product: QLinearMatMul of (n, oc) by (oc, 7)
        inits += [numpy_helper.from_array(rng.integers(-reach, reach + 1, (oc, 7))
                                          .astype(np.int8), "m"),
                  numpy_helper.from_array(rng.uniform(0.002, 0.02, 7).astype(np.float32), "ms"),
                  numpy_helper.from_array(np.zeros(7, np.int8), "mz"),
                  # the pooled values' own step, no simple fraction of y's: an average of y's
                  # steps quantized by y's step is often a tie, which a float sum's order decides
                  numpy_helper.from_array(numpy_helper.to_array(inits[5]) * np.float32(0.7131),
                                          "gs")]
        nodes += [helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["yf"]),
                  helper.make_node("Relu", ["yf"], ["yr"]),
                  helper.make_node("GlobalAveragePool", ["yr"], ["g"]),
                  helper.make_node("Flatten", ["g"], ["gf"]),
                  helper.make_node("QuantizeLinear", ["gf", "gs", "yz"], ["gq"]),
                  helper.make_node("QLinearMatMul", ["gq", "gs", "yz", "m", "ms", "mz", "xs",
                                                     "xz"], ["zq"])]
        last, shape = "zq", [case["n"], 7]
    scale_zero = ["xs", "xz"] if case["head"] else ["ys", "yz"]
    nodes.append(helper.make_node("DequantizeLinear", [last, *scale_zero], ["out"]))
    x = (rng.standard_normal((case["n"], case["c"], case["h"], case["w"])) * 2).astype(np.float32)
    return make_model(nodes, [float_input("x", list(x.shape))], [float_input("out", shape)],
                      inits, opset=13), {"x": x}


@needs_compiler
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qlinear_cases())
def test_a_qlinear_conv_and_matmul_match_onnx_runtime_bit_for_bit(case):
    model, feeds = _qlinear_model(case)
    session = _session(model)
    assert _ops(session) == ["NativeInt8"]
    (got,) = session.run(None, feeds)
    (want,) = _ort(model, feeds)
    np.testing.assert_array_equal(got, want)
    (reference,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    step = float(numpy_helper.to_array(next(
        i for i in model.graph.initializer if i.name == ("xs" if case["head"] else "ys"))))
    assert np.abs(got - reference).max(initial=0) <= step * 1.0001


@needs_compiler
@pytest.mark.parametrize("group, c, oc", [(2, 4, 4), (4, 8, 12), (3, 6, 3)])
def test_a_grouped_convolution_is_planned_group_by_group(group, c, oc):
    """Each group a record of its own over its channels of the input and the output (qcnn.c's
    cs / ocs strides): ONNX Runtime's outputs bit for bit."""
    case = dict(n=2, c=c, oc=oc, group=group, k=(3, 3), dilations=[1, 1], pads=[1, 1, 1, 1],
                h=6, w=7, strides=[1, 2], signed=False, per_channel=True, bias=True, head=False,
                seed=3)
    model, feeds = _qlinear_model(case)
    session = _session(model)
    assert _ops(session) == ["NativeInt8"]
    (got,) = session.run(None, feeds)
    (want,) = _ort(model, feeds)
    np.testing.assert_array_equal(got, want)


# qcnn.c built for plain x86-64 and for AVX2 beside this CPU's build, each running both kinds of
# plan of the corpus ResNets to ONNX Runtime's outputs bit for bit: tests/native/test_qcnn_bytes.py.
