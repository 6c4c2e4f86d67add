"""The native int8 plan where ONNX Runtime's QDQ fusions leave integers (native/qcnn_float.py,
qcnn_float.h): a QAT export's float biases, kept in float as the graph writes them (ONNX Runtime
unoptimized: the graph as written, CpuRef's semantics; its optimizer would round them to int32
steps), and a depthwise convolution run in float (a Relu or Clip its step does not make
redundant keeps ONNX Runtime from fusing it), MLAS's operations in MLAS's order: bit for bit.
Against ONNX Runtime's fused integer convolutions, ONNX Runtime runs the model with its int8
steps moved to uint8 (``with_uint8_steps``: the same values, its u8 x u8 products exact on a CPU
without VNNI, where its u8 x s8 ones saturate)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.ort_int8 import with_uint8_steps  # noqa: E402

CORPUS = "tests/data/corpus"
needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


def _session(model, native: str = "auto", shapes=None) -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"], input_shapes=shapes,
                            provider_options=[{"CpuAcc.native": native}, {}])


def _ops(session: InferenceSession) -> list[str]:
    loaded = session.runtime.network(session.network_id)
    return [layer.op_type for layer in loaded.layers if layer.backend == "CpuAcc"]


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
         as_written: bool = False) -> list[np.ndarray]:
    """ONNX Runtime's outputs: optimized (its QDQ fusions, on the model's uint8 twin), or the
    graph as written (no optimizations: float convolutions of the dequantized values)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if as_written:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model if as_written else with_uint8_steps(model)
    return ort.InferenceSession(source.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)


@needs_compiler
def test_the_qat_export_runs_natively_as_its_graph_is_written(tmp_path):
    """fakequant_qdq_ts13: float biases, int8 steps, a depthwise convolution under a Clip(-2, 2)
    its step (2/127, zero 0) does not fill. Each convolution's DequantizeLinear against the graph
    as written (ONNX Runtime unoptimized) on the corpus input and seeded ones: bit for bit (the
    dense convolutions' sums are exact integers here and float sums there, which could land a
    step apart at a near-tie: none on these inputs); the logits (a float head, summed in another
    order) within the corpus test's tolerance."""
    path = f"{CORPUS}/fakequant_qdq_ts13.onnx"
    feeds = dict(np.load(f"{CORPUS}/fakequant_qdq_ts13.s0.npz"))
    shapes = {k: list(v.shape) for k, v in feeds.items()}
    session = _session(path, shapes=shapes)
    assert _ops(session) == ["NativeInt8"]
    (got,) = session.run(None, feeds)
    (want,) = _ort(onnx.load(path), feeds, as_written=True)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    rng = np.random.default_rng(1)
    inputs = [feeds] + [{"input": (rng.standard_normal(feeds["input"].shape) * scale)
                         .astype(np.float32)} for scale in (0.5, 1.0, 2.0, 4.0)]
    for output in ("/DequantizeLinear_2_output_0", "/DequantizeLinear_4_output_0",
                   "/DequantizeLinear_6_output_0"):
        part = tmp_path / "part.onnx"
        onnx.utils.extract_model(path, str(part), ["input"], [output])
        session = _session(str(part), shapes=shapes)
        assert _ops(session) == ["NativeInt8"]
        for x in inputs:
            (got,) = session.run(None, x)
            (want,) = _ort(onnx.load(str(part)), x, as_written=True)
            np.testing.assert_array_equal(got, want)


@st.composite
def depthwise_cases(draw):
    kh, kw = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    dh, dw = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    return dict(c=draw(st.integers(1, 20)), k=(kh, kw), dilations=[dh, dw],
                pads=[draw(st.integers(0, k // 2 * d)) for k, d in ((kh, dh), (kw, dw))] * 2,
                h=draw(st.integers((kh - 1) * dh + 1, 11)),
                w=draw(st.integers((kw - 1) * dw + 1, 11)),
                strides=[draw(st.integers(1, 2)), draw(st.integers(1, 2))],
                signed=draw(st.booleans()), per_channel=draw(st.booleans()),
                act=draw(st.sampled_from(["Clip", "Relu", "ClipRedundant", "none"])),
                depthwise=draw(st.booleans()), int32_bias=draw(st.booleans()),
                seed=draw(st.integers(0, 2 ** 16)))


def _qat_model(case: dict) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Q -> DQ -> Conv (a DequantizeLinear'd int8 weight; a float bias as a QAT export writes
    it, or a DequantizeLinear'd int32 one as ONNX Runtime's quantizer does) -> [Clip | Relu] ->
    Q -> DQ. "Clip": bounds inside the output step's range (ONNX Runtime keeps the Clip, so a
    float convolution); "Relu" with a zero point above the type's low end (kept too);
    "ClipRedundant": the step's own range (dropped: a fused integer convolution)."""
    rng = np.random.default_rng(case["seed"])
    (kh, kw), c = case["k"], case["c"]
    oc, group = (c, c) if case["depthwise"] else (int(rng.integers(1, 24)), 1)
    dtype = np.int8 if case["signed"] else np.uint8
    low = -128 if case["signed"] else 0
    y_scale, y_zero = np.float32(rng.uniform(0.01, 0.05)), int(rng.integers(0, 40)) + low
    scales = rng.uniform(0.002, 0.02, oc if case["per_channel"] else 1).astype(np.float32)
    lo, hi = (float(y_scale * (low - y_zero)), float(y_scale * (low + 255 - y_zero)))
    bounds = {"Clip": (lo * 0.6, hi * 0.7), "ClipRedundant": (lo, hi)}.get(case["act"])
    inits = [numpy_helper.from_array(np.float32(0.03), "xs"),
             numpy_helper.from_array(dtype(int(rng.integers(0, 20)) + low + 118), "xz"),
             numpy_helper.from_array(rng.integers(-127, 128, (oc, c // group, kh, kw))
                                     .astype(np.int8), "wq"),
             numpy_helper.from_array(scales, "ws"),
             numpy_helper.from_array(np.zeros(scales.size, np.int8), "wz"),
             numpy_helper.from_array(y_scale, "ys"), numpy_helper.from_array(dtype(y_zero), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["w"],
                              **({"axis": 0} if case["per_channel"] else {}))]
    if case["int32_bias"]:
        inits += [numpy_helper.from_array(rng.integers(-3000, 3000, oc).astype(np.int32), "bq"),
                  numpy_helper.from_array(np.float32(0.03) * np.broadcast_to(scales, (oc,))
                                          .astype(np.float32), "bs"),
                  numpy_helper.from_array(np.zeros(oc, np.int32), "bz")]
        nodes.append(helper.make_node("DequantizeLinear", ["bq", "bs", "bz"], ["b"], axis=0))
    else:
        inits.append(numpy_helper.from_array((rng.standard_normal(oc) * 0.5)
                                             .astype(np.float32), "b"))
    nodes.append(helper.make_node("Conv", ["xd", "w", "b"], ["conv"], kernel_shape=[kh, kw],
                                  strides=case["strides"], dilations=case["dilations"],
                                  pads=case["pads"], group=group))
    last = "conv"
    if case["act"] == "Relu":
        nodes.append(helper.make_node("Relu", ["conv"], ["act"]))
        last = "act"
    elif bounds is not None:
        inits += [numpy_helper.from_array(np.float32(bounds[0]), "lo"),
                  numpy_helper.from_array(np.float32(bounds[1]), "hi")]
        nodes.append(helper.make_node("Clip", ["conv", "lo", "hi"], ["act"]))
        last = "act"
    nodes += [helper.make_node("QuantizeLinear", [last, "ys", "yz"], ["yq"]),
              helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"])]
    x = (rng.standard_normal((1, c, case["h"], case["w"])) * 2).astype(np.float32)
    model = make_model(nodes, [float_input("x", list(x.shape))], [float_input("out", None)],
                       inits, opset=13)
    return model, {"x": x}


@needs_compiler
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(depthwise_cases())
def test_a_qdq_convolution_matches_onnx_runtime_bit_for_bit(case):
    """Planned, and bit for bit: a float bias against the graph as written, depthwise (MLAS's
    float operations) or dense (exact integer sums, within a step of the graph's float ones where a
    float sum lands at a step's midpoint: a rare value, seed 304's 1 of 648); an int32 bias against ONNX Runtime's fusions, its fused integer
    convolution or its float depthwise one, a dense one under a kept Relu / Clip within a step
    (ONNX Runtime's float SGEMM there, exact integers here)."""
    model, feeds = _qat_model(case)
    session = _session(model)
    assert _ops(session) == ["NativeInt8"]
    (got,) = session.run(None, feeds)
    (want,) = _ort(model, feeds, as_written=not case["int32_bias"])
    step = float(numpy_helper.to_array(next(i for i in model.graph.initializer
                                            if i.name == "ys")))
    if case["int32_bias"] and not case["depthwise"] and case["act"] in ("Clip", "Relu"):
        assert np.abs(got - want).max(initial=0) <= step * 1.0001
    elif not case["depthwise"] and not case["int32_bias"]:
        # exact integer sums against the graph's float ones: a sum that lands within float32's
        # rounding of a step's midpoint rounds to the neighbouring step (seed 304: 1 of 648)
        off = np.abs(got - want)
        assert off.max(initial=0) <= step * 1.0001 and np.count_nonzero(off) <= max(1, off.size // 100)
    else:
        np.testing.assert_array_equal(got, want)


@needs_compiler
def test_the_numpy_run_reads_each_arrays_own_address_and_gives_fresh_outputs():
    """Executor.numpy (the torch-free session's run) reads an array's address from its object:
    a view's is its own (an offset into its base), a float64 or strided input is converted, and
    each run's outputs are new arrays."""
    import gc

    from backplane.native import qcnn

    path = f"{CORPUS}/resnet_qdq_ort17.onnx"
    feeds = dict(np.load(f"{CORPUS}/resnet_qdq_ort17.s0.npz"))
    shapes = {k: list(v.shape) for k, v in feeds.items()}
    _session(path, shapes=shapes)
    executor = [o for o in gc.get_objects() if isinstance(o, qcnn.Executor)][-1]
    (x,) = feeds.values()
    wide = np.concatenate([x, x[:, :, ::-1]], axis=0)
    for array in (wide, wide[1:], wide[:, 1:], np.empty(5, np.float32)[2:]):
        assert qcnn._address(array) == array.ctypes.data
    want = executor.numpy(np.ascontiguousarray(wide[1:]))
    for value in (wide[1:], wide[1:].astype(np.float64), np.asfortranarray(wide[1:])):
        got = executor.numpy(value)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
            assert g.ctypes.data != w.ctypes.data and g.flags.owndata
