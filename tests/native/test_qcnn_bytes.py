"""The int8 plan's byte products (native/qcnn_bytes.h, qcnn_bytes.py: u8 x s8 with AVX-512 VNNI's
vpdpbusd, the input's zero point folded into the bias) beside its int16 pairs (qconv: AVX2's
madd, VNNI's vpdpwssd): each plan run by each build of qcnn.c this CPU can run (plain x86-64: the
scalar loops; x86-64-v3: AVX2 without VNNI; native), against ONNX Runtime's outputs bit for bit on
the corpus's int8 ResNets, so that the paths a CI machine of another CPU takes are tested here."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import numpy as np
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build, qcnn, qcnn_bytes  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.ort_int8 import ort_int8_exact  # noqa: E402
from tests.native import flavours  # noqa: E402

CORPUS = "tests/data/corpus"
needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
x86 = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 build flags")


def _plan(path, feeds, monkeypatch, on_bytes: bool):
    """The session's own plan (caught as it plans), with the byte products on or off."""
    monkeypatch.setattr(qcnn_bytes, "available", lambda: on_bytes)
    planned = []
    real_plan = qcnn.plan

    def caught(*args):
        planned.append((real_plan(*args), list(args[4])))
        return planned[-1][0]

    monkeypatch.setattr(qcnn, "plan", caught)
    InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                     input_shapes={k: list(v.shape) for k, v in feeds.items()})
    assert planned  # at the substitution and at the workload
    return planned[-1]


def _ort(path, feeds):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _built(march: str, folder: Path) -> ctypes.CDLL:
    return flavours.built("qcnn", march, folder)


@needs_compiler
@x86
@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "native"])
@pytest.mark.parametrize("on_bytes", [True, False])
@pytest.mark.parametrize("name", ["resnet_qlinear_ort15", "resnet_qdq_ort17"])
def test_each_build_runs_either_products_plan_as_onnx_runtime_does(name, on_bytes, march,
                                                                   tmp_path, monkeypatch):
    if march == "x86-64-v3" and "avx2" not in build._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    feeds = dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    made, outputs = _plan(f"{CORPUS}/{name}.onnx", feeds, monkeypatch, on_bytes)
    products = {op for op in made.ops if op in ("qconv", "qconv8")}
    assert products == {"qconv8" if on_bytes else "qconv"}
    library = _built(march, tmp_path)
    got = dict(zip(outputs, qcnn.Executor(made, library).numpy(feeds["input"])))
    for output, want in _ort(f"{CORPUS}/{name}.onnx", feeds).items():
        np.testing.assert_array_equal(got[output], want)


@needs_compiler
def test_the_byte_products_are_planned_where_the_library_has_vnni(monkeypatch):
    """Where this machine's library multiplies bytes (AVX-512 VNNI) the plan takes them, else
    the int16 pairs; the library says which (backplane_qcnn_bytes)."""
    flags = build._cpu_flags()
    assert qcnn_bytes.available() == ("avx512_vnni" in flags and "avx512bw" in flags
                                      and "avx512vl" in flags)
    feeds = dict(np.load(f"{CORPUS}/resnet_qdq_ort17.s0.npz"))
    real = qcnn_bytes.available()
    made, _ = _plan(f"{CORPUS}/resnet_qdq_ort17.onnx", feeds, monkeypatch, real)
    assert ("qconv8" in made.ops) == real and ("qconv" in made.ops) != real


def test_the_input_zero_point_is_folded_into_the_bias():
    rng = np.random.default_rng(5)
    centred = rng.integers(-128, 128, (20, 5, 3, 3)).astype(np.int32)
    bias = rng.integers(-1000, 1000, 20)
    packed, folded, icp = qcnn_bytes.pack(centred, bias, 7, True, 2)
    assert icp == 8 and packed.dtype == np.int8
    np.testing.assert_array_equal(folded, bias - (7 + 128) * centred.sum((1, 2, 3)))
    # [blocks][kh][kw][icp / 4][OCB][4]: weight (o, k, y, x) at [o // 16][y][x][k // 4][o % 16][k % 4]
    assert packed.shape == (2, 3, 3, 2, 16, 4)
    assert packed[1, 2, 0, 1, 3, 0] == centred[19, 4, 2, 0]
    assert packed[1, 2, 0, 1, 3, 1] == 0  # the channels past c
    packed, _, icp = qcnn_bytes.pack(centred, bias, 7, False, 1)  # a row's values one run
    assert icp == 5 and packed.shape == (2, 3, 4, 16, 4)
    assert packed[0, 1, 2, 5, 1] == centred[5, 4, 1, 1]  # row 1, x 1 channel 4: value 9 of 15
    assert (packed[:, :, 3, :, 3] == 0).all()  # past the row's 15 values


def test_a_weight_or_sum_past_the_bytes_keeps_the_int16_pairs():
    wide = np.full((4, 3, 1, 1), 200, np.int32)  # uint8 weights of zero point 0
    assert qcnn_bytes.pack(wide, np.zeros(4), 0, False, 1) is None
    deep = np.full((1, 70000, 1, 1), -128, np.int32)  # 255 * 128 * 70000 > 2^31
    assert qcnn_bytes.pack(deep, np.zeros(1), 0, False, 1) is None
    assert qcnn_bytes.pack(deep[:, :100], np.zeros(1), 0, False, 1) is not None


@needs_compiler
def test_a_uint8_weight_past_a_signed_byte_runs_on_the_int16_pairs(monkeypatch):
    """A QLinearConv of uint8 weights (zero point 0, values to 255: no signed byte once centred)
    is planned as qconv, and runs to ONNX Runtime's outputs where its products are exact, within
    one step of CpuRef's everywhere."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(np.float32(0.03), "xs"),
             numpy_helper.from_array(np.uint8(120), "xz"),
             numpy_helper.from_array(rng.integers(0, 256, (6, 5, 3, 3)).astype(np.uint8), "w"),
             numpy_helper.from_array(np.float32(0.004), "ws"),
             numpy_helper.from_array(np.uint8(0), "wz"),
             numpy_helper.from_array(np.float32(2.5), "ys"),
             numpy_helper.from_array(np.uint8(100), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("QLinearConv", ["xq", "xs", "xz", "w", "ws", "wz", "ys", "yz"],
                              ["yq"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"])]
    x = rng.standard_normal((1, 5, 7, 6)).astype(np.float32)
    model = make_model(nodes, [float_input("x", list(x.shape))],
                       [float_input("out", [1, 6, 7, 6])], inits, opset=13)
    ops = []
    real_plan = qcnn.plan
    monkeypatch.setattr(qcnn, "plan", lambda *a: ops.append(real_plan(*a).ops) or real_plan(*a))
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                               input_shapes={"x": [1, 5, 7, 6]})
    assert ops and "qconv" in ops[-1] and "qconv8" not in ops[-1]
    (got,) = session.run(None, {"x": x})
    (reference,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    assert np.abs(got - reference).max() <= 2.5 * 1.0001
    if ort_int8_exact():
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        (want,) = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"]).run(None, {"x": x})
        np.testing.assert_array_equal(got, want)


@needs_compiler
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("c", [5, 16, 21])
@pytest.mark.parametrize("pool", [dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
                                  dict(kernel_shape=[2, 3], dilations=[2, 1], pads=[0, 1, 1, 0])])
def test_a_max_pool_of_bytes_matches_onnx_runtime(signed, c, pool):
    """DequantizeLinear -> MaxPool -> QuantizeLinear of one step, planned as a max pool of the
    bytes (qcnn_bytes.h's maxpool_bytes: 16 channels an instruction, then the rest one by one),
    then a 1x1 QLinearConv: ONNX Runtime's outputs bit for bit (small weights: exact on any
    CPU), CpuRef's within a step."""
    rng = np.random.default_rng(c + 7 * signed)
    xdt, zero = (np.int8, 3) if signed else (np.uint8, 131)
    inits = [numpy_helper.from_array(np.float32(0.05), "xs"),
             numpy_helper.from_array(xdt(zero), "xz"),
             numpy_helper.from_array(rng.integers(-60, 61, (4, c, 1, 1)).astype(np.int8), "w"),
             numpy_helper.from_array(np.float32(0.01), "ws"),
             numpy_helper.from_array(np.int8(0), "wz"),
             numpy_helper.from_array(np.float32(0.2), "ys"),
             numpy_helper.from_array(xdt(zero), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("MaxPool", ["xd"], ["p"], **pool),
             helper.make_node("QuantizeLinear", ["p", "xs", "xz"], ["pq"]),
             helper.make_node("QLinearConv", ["pq", "xs", "xz", "w", "ws", "wz", "ys", "yz"],
                              ["yq"], kernel_shape=[1, 1]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"])]
    x = (rng.standard_normal((2, c, 9, 8)) * 3).astype(np.float32)
    ref = InferenceSession(make_model(nodes, [float_input("x", list(x.shape))],
                                      [float_input("out", None)], inits, opset=13),
                           backends=["CpuRef"])
    (reference,) = ref.run(None, {"x": x})
    model = make_model(nodes, [float_input("x", list(x.shape))],
                       [float_input("out", list(reference.shape))], inits, opset=13)
    ops = []
    real_plan = qcnn.plan
    import unittest.mock

    with unittest.mock.patch.object(qcnn, "plan",
                                    lambda *a: ops.append(real_plan(*a).ops) or real_plan(*a)):
        session = InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                                   input_shapes={"x": list(x.shape)})
    assert ops and "maxpool_q" in ops[-1]
    (got,) = session.run(None, {"x": x})
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    (want,) = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(got, want)
    assert np.abs(got - reference).max() <= 0.2 * 1.0001


@needs_compiler
@x86
def test_every_build_runs_the_float_depthwise_and_bias_plan_alike(tmp_path, monkeypatch):
    """fakequant_qdq_ts13 (a QAT export: float biases, a depthwise convolution ONNX Runtime runs
    in float: fdwconv_q's AVX-512, AVX2 and scalar loops, requantize_f's): the same outputs from
    every build this CPU runs, on both of the corpus's inputs."""
    builds = [_built(m, tmp_path) for m in ("x86-64", "x86-64-v3", "native")
              if m != "x86-64-v3" or "avx2" in build._cpu_flags()]
    for size in ("s0", "s1"):
        feeds = dict(np.load(f"{CORPUS}/fakequant_qdq_ts13.{size}.npz"))
        made, _ = _plan(f"{CORPUS}/fakequant_qdq_ts13.onnx", feeds, monkeypatch,
                        qcnn_bytes.available())
        assert "fdwconv_q" in made.ops
        outputs = [qcnn.Executor(made, library).numpy(feeds["input"]) for library in builds]
        for other in outputs[1:]:
            for got, want in zip(other, outputs[0]):
                np.testing.assert_array_equal(got, want)
