"""The native CNN route (native/cnn.c, fusion/native_cnn.py): a whole static float32 CpuAcc
partition in one C call, against CpuRef on each op's cases (hypothesis: strides, pads, dilations, groups, odd
sizes, NaN in) and on the corpus CNNs; pinned by option (CpuAcc.native), never by a measurement."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

CORPUS = "tests/data/corpus"
needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
ACTIVATIONS = ["", "Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid", "SiLU", "LeakyRelu",
               "Tanh"]


def _session(model, native: str = "auto", **kwargs) -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                            provider_options=[{"CpuAcc.native": native}, {}], **kwargs)


def _routes(session: InferenceSession) -> list[str]:
    loaded = session.runtime.network(session.network_id)
    return [getattr(step.workload, "route", None) for step, layer in
            zip(loaded.steps, loaded.layers) if layer.op_type == "OneDnnGraph"]


def _activation(kind: str, x: str, out: str, inits: list) -> list:
    if kind == "SiLU":
        return [helper.make_node("Sigmoid", [x], [out + "_s"]),
                helper.make_node("Mul", [x, out + "_s"], [out])]
    if kind == "Clip":
        inits += [numpy_helper.from_array(np.float32(0), "lo"),
                  numpy_helper.from_array(np.float32(6), "hi")]
        return [helper.make_node("Clip", [x, "lo", "hi"], [out])]
    attrs = {"LeakyRelu": {"alpha": 0.1}, "HardSigmoid": {"alpha": 1 / 6, "beta": 0.5}}
    return [helper.make_node(kind, [x], [out], **attrs.get(kind, {}))]


@st.composite
def conv_cases(draw):
    kind = draw(st.sampled_from(["dense", "depthwise", "grouped"]))
    groups = {"dense": 1, "grouped": draw(st.integers(2, 4))}.get(kind, 0)
    icg = 1 if kind == "depthwise" else draw(st.integers(1, 5))
    c = draw(st.integers(1, 20)) if kind == "depthwise" else icg * groups
    groups = groups or c
    oc = c if kind == "depthwise" else groups * draw(st.integers(1, 20))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    pads = [draw(st.integers(0, k // 2 * d)) for k, d in ((kh, dh), (kw, dw))] * 2
    h = draw(st.integers((kh - 1) * dh + 1, 11))
    w = draw(st.integers((kw - 1) * dw + 1, 11))
    return dict(n=draw(st.integers(1, 2)), c=c, oc=oc, groups=groups, h=h, w=w, k=(kh, kw),
                strides=[draw(st.integers(1, 2)), draw(st.integers(1, 2))], dilations=[dh, dw],
                pads=pads, act=draw(st.sampled_from(ACTIVATIONS)), residual=draw(st.booleans()),
                tail=draw(st.sampled_from(["", "maxpool", "avgpool", "classifier"])),
                seed=draw(st.integers(0, 2**16)))


def _conv_model(case: dict):
    rng = np.random.default_rng(case["seed"])
    (kh, kw), (sh, sw), (dh, dw) = case["k"], case["strides"], case["dilations"]
    pt, pl, pb, pr = case["pads"]
    oh = (case["h"] + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (case["w"] + pl + pr - (kw - 1) * dw - 1) // sw + 1
    weight = rng.standard_normal((case["oc"], case["c"] // case["groups"], kh, kw)) * 0.4
    inits = [numpy_helper.from_array(weight.astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(case["oc"]).astype(np.float32), "b")]
    inputs = [float_input("x", [case["n"], case["c"], case["h"], case["w"]])]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=case["groups"],
                              kernel_shape=[kh, kw], strides=case["strides"],
                              dilations=case["dilations"], pads=case["pads"])]
    last = "y"
    if case["residual"]:
        inputs.append(float_input("r", [case["n"], case["oc"], oh, ow]))
        nodes.append(helper.make_node("Add", ["y", "r"], ["sum"]))
        last = "sum"
    if case["act"]:
        nodes += _activation(case["act"], last, "a", inits)
        last = "a"
    shape = [case["n"], case["oc"], oh, ow]
    if case["tail"] == "maxpool":
        nodes.append(helper.make_node("MaxPool", [last], ["out"], kernel_shape=[2, 2],
                                      strides=[2, 1], pads=[1, 0, 1, 1], ceil_mode=1))
        shape = None
    elif case["tail"] == "avgpool":
        nodes.append(helper.make_node("AveragePool", [last], ["out"], kernel_shape=[2, 2],
                                      strides=[2, 2], pads=[1, 1, 0, 0], ceil_mode=1,
                                      count_include_pad=1))
        shape = None
    elif case["tail"] == "classifier":
        inits.append(numpy_helper.from_array(
            rng.standard_normal((5, case["oc"])).astype(np.float32), "fc"))
        nodes += [helper.make_node("GlobalAveragePool", [last], ["g"]),
                  helper.make_node("Flatten", ["g"], ["f"]),
                  helper.make_node("Gemm", ["f", "fc"], ["out"], transB=1)]
        shape = [case["n"], 5]
    else:
        nodes.append(helper.make_node("Identity", [last], ["out"]))
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
             .astype(np.float32) for i in inputs}
    return make_model(nodes, inputs, [float_input("out", shape)], inits), feeds


@needs_compiler
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=conv_cases())
def test_a_convolution_and_its_post_ops_match_cpuref(case):
    model, feeds = _conv_model(case)
    if np.random.default_rng(case["seed"]).random() < 0.3:
        feeds["x"].reshape(-1)[case["seed"] % feeds["x"].size] = np.nan  # NaN in, NaN out
    session = _session(model)
    assert _routes(session) == ["native"], case
    got = session.run(None, feeds)[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    scale = np.abs(want[np.isfinite(want)]).max(initial=1.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


@st.composite
def upsampling_cases(draw):
    return dict(c=draw(st.integers(1, 9)), oc=draw(st.integers(1, 12)), h=draw(st.integers(1, 7)),
                w=draw(st.integers(1, 7)), op=draw(st.sampled_from(["ConvTranspose", "Resize"])),
                k=draw(st.integers(1, 3)), s=draw(st.integers(1, 3)), pad=draw(st.integers(0, 1)),
                mode=draw(st.sampled_from(["linear", "nearest"])),
                where=draw(st.sampled_from(["half_pixel", "asymmetric", "align_corners",
                                            "pytorch_half_pixel"])),
                scale=draw(st.sampled_from([2.0, 1.5, 3.0, 0.5])), seed=draw(st.integers(0, 999)))


@needs_compiler
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=upsampling_cases())
def test_a_transposed_convolution_and_a_resize_match_cpuref(case):
    """After a 1x1 convolution (a OneDnnGraph holds a convolution): ConvTranspose (strides,
    pads, kernels) or Resize (linear or nearest, four coordinate modes, up and down)."""
    rng = np.random.default_rng(case["seed"])
    c, oc, h, w, k, s = case["c"], case["oc"], case["h"], case["w"], case["k"], case["s"]
    pad = min(case["pad"], k - 1)
    inits = [numpy_helper.from_array(rng.standard_normal((c, c, 1, 1)).astype(np.float32), "w1")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["y"])]
    if case["op"] == "ConvTranspose":
        inits += [numpy_helper.from_array(rng.standard_normal((c, oc, k, k)).astype(np.float32),
                                          "wt"),
                  numpy_helper.from_array(rng.standard_normal(oc).astype(np.float32), "bt")]
        nodes.append(helper.make_node("ConvTranspose", ["y", "wt", "bt"], ["out"],
                                      kernel_shape=[k, k], strides=[s, s], pads=[pad] * 4))
    else:
        scale = case["scale"] if min(h, w) * case["scale"] >= 1 else 2.0
        inits.append(numpy_helper.from_array(np.array([1, 1, scale, scale], np.float32), "sc"))
        nodes.append(helper.make_node("Resize", ["y", "", "sc"], ["out"], mode=case["mode"],
                                      coordinate_transformation_mode=case["where"]))
    model = make_model(nodes, [float_input("x", [1, c, h, w])], [float_input("out", None)],
                       inits, opset=13)
    x = rng.standard_normal((1, c, h, w)).astype(np.float32)
    x.reshape(-1)[case["seed"] % x.size] = np.nan
    session = _session(model)
    assert _routes(session) == ["native"], case
    got = session.run(None, {"x": x})[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    scale_of = np.abs(want[np.isfinite(want)]).max(initial=1.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale_of)


CNNS = ["mobilenet_dw_ts13", "resnet_basic_ts16", "mobilenet_dw_dyn18", "resnet_basic_dyn21",
        "unet_resize_ts13", "unet_resize_dyn20"]


def _corpus(name: str):
    feeds = dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    return f"{CORPUS}/{name}.onnx", feeds, {k: list(v.shape) for k, v in feeds.items()}


@needs_compiler
@pytest.mark.parametrize("name", CNNS)
def test_the_corpus_cnns_run_natively_and_match_cpuref_and_onnx_runtime(name):
    path, feeds, shapes = _corpus(name)
    session = _session(path, input_shapes=shapes)
    assert _routes(session) == ["native"]
    got = session.run(None, feeds)
    for want in (InferenceSession(path, backends=["CpuRef"]).run(None, feeds),
                 __import__("onnxruntime").InferenceSession(path).run(None, feeds)):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * max(1.0, abs(w).max()))
    nan = {k: v.copy() for k, v in feeds.items()}
    next(iter(nan.values())).reshape(-1)[7] = np.nan
    logits = session.run(None, nan)
    reference = InferenceSession(path, backends=["CpuRef"]).run(None, nan)
    for g, w in zip(logits, reference):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))


@needs_compiler
def test_off_keeps_the_torch_route_and_a_pinned_compile_mode_wins():
    path, feeds, shapes = _corpus("resnet_basic_ts16")
    assert _routes(_session(path, "off", input_shapes=shapes)) != ["native"]
    pinned = InferenceSession(path, backends=["CpuAcc", "CpuRef"], input_shapes=shapes,
                              provider_options=[{"CpuAcc.compile": "layers"}, {}])
    assert _routes(pinned) == ["layers"]


def test_without_a_compiler_the_partition_keeps_its_torch_route(tmp_path, monkeypatch):
    monkeypatch.setenv("BACKPLANE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    path, feeds, shapes = _corpus("resnet_basic_ts16")
    session = _session(path, input_shapes=shapes)
    assert "native" not in _routes(session)
    got = session.run(None, feeds)
    want = InferenceSession(path, backends=["CpuRef"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@needs_compiler
def test_outputs_are_the_callers_and_threads_at_once_get_their_own_arena():
    path, feeds, shapes = _corpus("mobilenet_dw_ts13")
    session = _session(path, input_shapes=shapes)
    first = session.run(None, feeds)
    kept = [o.copy() for o in first]
    other = {k: (v * 2).astype(np.float32) for k, v in feeds.items()}
    session.run(None, other)
    for a, b in zip(first, kept):
        np.testing.assert_array_equal(a, b)  # a later run wrote nothing of the first one's
    want = InferenceSession(path, backends=["CpuRef"]).run(None, other)
    failures: list[str] = []

    def many() -> None:
        for _ in range(30):
            for g, w in zip(session.run(None, other), want):
                if not np.allclose(g, w, rtol=1e-4, atol=1e-5):
                    failures.append("differs")

    threads = [threading.Thread(target=many) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@needs_compiler
def test_the_profile_times_each_planned_layer():
    path, feeds, shapes = _corpus("resnet_basic_ts16")
    session = _session(path, input_shapes=shapes)
    outputs, rows = session.run_profiled(None, feeds)
    ops = [row.op_type for row in rows]
    assert ops.count("FusedConv") == 6 and "NativeImport" in ops and "NativeExport" in ops
    assert all(isinstance(row.seconds, float) and row.seconds >= 0 for row in rows)
    want = InferenceSession(path, backends=["CpuRef"]).run(None, feeds)
    for g, w in zip(outputs, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
