"""ONNX Runtime's quantized com.microsoft ops on the torch backends (kernels/contrib_quant.py): one
node against CpuRef (bit for bit where CpuRef's steps are single float32 operations, one step at
most where it calls NumPy's exp or sums in its own order) and against ONNX Runtime (one step), and
whole models made at test time by ONNX Runtime's static quantizer (QOperator) in one partition.

The hard cases hold what a wrong kernel gets wrong: power-of-two scales, so that real values lie
exactly half way between two steps (rint rounds them to even) and past both ends of the type."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.int8_cpu import ort_int8_exact, torch_int8_exact  # noqa: E402
from tests.backends.contrib_cases import (  # noqa: E402
    Case,
    _model,
    _quantized,
    assert_matches_ort,
    ort_run,
)

ROUNDED_ELSEWHERE = {"QLinearSigmoid", "QLinearSoftmax", "QLinearGlobalAveragePool",
                     "QLinearAveragePool"}
"""Ops whose CpuRef kernel calls NumPy's exp or sums in NumPy's order: one step at most."""
DEVICES = ["CpuAcc", pytest.param("GpuAcc", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device"))]
U8, I8 = onnx.TensorProto.UINT8, onnx.TensorProto.INT8
F32 = onnx.TensorProto.FLOAT


def _u8(values) -> np.ndarray:
    return np.asarray(values, np.uint8)


def _s(value: float) -> np.ndarray:
    return np.array(value, np.float32)


def _hard() -> dict[str, Case]:
    """Every pair of 8-bit values (or every value) with scales that make half steps real."""
    a, b = (np.repeat(np.arange(256), 256).reshape(256, 256).astype(np.uint8),
            np.tile(np.arange(256), 256).reshape(256, 256).astype(np.uint8))
    signed = a.view(np.int8)
    # (a + 2b) / 2 and a * b / 2: a tie at every odd a and product, saturated at both ends
    add = [a, _s(0.25), _u8(128), b, _s(0.5), _u8(100), _s(0.5), _u8(128)]
    mul = [a, _s(0.5), _u8(120), b, _s(0.5), _u8(130), _s(0.5), _u8(128)]
    leaky = [signed, _s(1.0), np.array(3, np.int8), _s(1.0), np.array(-5, np.int8)]
    concat = [_s(0.5), _u8(128), a, _s(0.25), _u8(128), b, _s(0.75), _u8(7)]
    k = np.arange(-128, 128, dtype=np.int32)
    gemm = [a[:, :16].copy(), _s(0.5), _u8(131), b[:16, :].copy(),
            np.where(np.arange(256) % 2, 1.0, 0.5).astype(np.float32),
            _u8(np.arange(256) % 7 + 125), k * 3, _s(1.0), _u8(128)]
    return {
        "QLinearAdd-ties": Case("QLinearAdd", add, [U8], fed=4),
        "QLinearMul-ties": Case("QLinearMul", mul, [U8], fed=4),
        "QLinearLeakyRelu-ties": Case("QLinearLeakyRelu", leaky, [I8], {"alpha": 0.5}),
        "QLinearConcat-ties": Case("QLinearConcat", concat, [U8], {"axis": 0}, fed=0),
        "QGemm-ties": Case("QGemm", gemm, [U8]),
        "QGemm-float": Case("QGemm", gemm[:7], [F32], {"alpha": 0.375}),
        "DynamicQuantizeMatMul-nan": Case(
            "DynamicQuantizeMatMul", [np.where(np.eye(4, 16, dtype=bool), np.nan,
                                               np.linspace(-3, 5, 64, dtype=np.float32)
                                               .reshape(4, 16)).astype(np.float32),
                                      b[:16, :8].copy(), _s(0.01), _u8(128)], [F32]),
    }


CASES = {**_quantized(), **_hard()}
CASES = {name: case for name, case in CASES.items() if case.op != "QLinearWhere"}  # CpuRef only


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], backend: str,
         compile_mode: str, int8: str = "exact") -> tuple[list[np.ndarray], InferenceSession]:
    """The outputs and the session; on CpuAcc ``compile_mode`` and ``int8`` ("exact", the
    default here: no int8 convolution); GpuAcc takes neither."""
    options = {"compile": compile_mode, "int8": int8} if backend == "CpuAcc" else {}
    session = InferenceSession(model, backends=[(backend, options)])
    return session.run(None, feeds), session


@pytest.mark.parametrize("compile_mode", ["auto", "layers"])
@pytest.mark.parametrize("backend", DEVICES)
@pytest.mark.parametrize("name", CASES)
def test_one_node_against_cpuref_and_onnx_runtime(name: str, backend: str,
                                                  compile_mode: str) -> None:
    case = CASES[name]
    model, feeds = _model(case)
    got, session = _run(model, feeds, backend, compile_mode)
    assert {p.backend for p in session.report.layers.values()} == {backend}
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        if case.op in ROUNDED_ELSEWHERE:
            assert np.max(np.abs(g.astype(np.int32) - w.astype(np.int32)), initial=0) <= 1
        else:
            np.testing.assert_array_equal(g, w)
    # ort_run moves int8 weights to uint8 where ONNX Runtime's u8 x s8 products saturate (no
    # VNNI, tests/ort_int8.py), but for QGemm, whose B ONNX Runtime takes as int8 only
    if "nan" not in name and (case.op != "QGemm" or ort_int8_exact()):
        assert_matches_ort(got, ort_run(model, feeds))


def test_the_tie_cases_round_half_to_even_and_saturate() -> None:
    """The hard cases hold what they promise: ties and both ends of the type in CpuRef's
    output (so that the bit-for-bit comparison above tests rounding and saturation)."""
    case = CASES["QLinearAdd-ties"]
    model, feeds = _model(case)
    (y,) = InferenceSession(model, backends=["CpuAcc"]).run(None, feeds)
    total = (feeds["in0"].astype(np.int32) - 128) + 2 * (feeds["in3"].astype(np.int32) - 100)
    assert np.array_equal(y, np.clip(np.rint(total / 2) + 128, 0, 255).astype(np.uint8))
    assert (total % 2 == 1).any() and y.min() == 0 and y.max() == 255


def test_an_int16_input_stays_on_cpuref() -> None:
    """The kernels take 8-bit tensors (as ONNX Runtime's): another type is refused with the
    reason, and the layer falls back."""
    case = Case("QLinearSigmoid", [np.arange(12, dtype=np.int16).reshape(3, 4), _s(0.1),
                                   np.array(0, np.int16), _s(1 / 256), np.array(0, np.int16)],
                [onnx.TensorProto.INT16])
    model, feeds = _model(case)
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
    (placed,) = session.report.layers.values()
    assert placed.backend == "CpuRef"
    assert ("CpuAcc", "QLinearSigmoid of int16 (takes uint8, int8)") in placed.refusals


# -- whole models from ONNX Runtime's quantizer ------------------------------------------------
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_qoperator_cnn_is_one_cpuacc_partition(per_channel: bool, tmp_path) -> None:
    from onnxruntime import quantization

    from tests.models.test_ort_tools import RandomReader, contrib_ops, small_cnn

    path = tmp_path / "q.onnx"
    quantization.quantize_static(small_cnn(tmp_path / "cnn.onnx"), path,
                                 RandomReader("x", (1, 3, 16, 16)),
                                 quant_format=quantization.QuantFormat.QOperator,
                                 per_channel=per_channel)
    assert len(contrib_ops(path)) == 9
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    session = InferenceSession(path, backends=[("CpuAcc", {"int8": "exact"}), "CpuRef"])
    assert set(session.report.counts()) == {"CpuAcc"}
    layers = [lay for lay in session.optimized.graph.layers
              if lay.op_type not in ("MemImport", "MemCopy")]
    assert [lay.op_type for lay in layers] == ["Traced"]
    (got,) = session.run(None, feeds)
    (want,) = InferenceSession(path, backends=["CpuRef"]).run(None, feeds)
    step = 1 / 256  # QLinearSoftmax's output scale
    assert float(np.max(np.abs(got - want))) <= step * 1.001
    assert float(np.max(np.abs(got - ort_run(onnx.load(str(path)), feeds)[0]))) <= step * 1.001


# -- QLinearConv -> QLinearAdd: one layer --------------------------------------------------------
def residual_blocks(split: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Two QOperator residual blocks: x -> QLinearConv -> QLinearAdd(x) -> QLinearConv ->
    QLinearAdd(the first sum), as ONNX Runtime's quantizer writes a ResNet's. The second
    convolution reads a QLinearAdd's output, whose shape onnx's inference cannot give. With
    ``split``, weights whose float32 sums could pass 2^24 (split in two halves)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(7)
    channels = 128 if split else 16
    w_scale = rng.uniform(0.001, 0.004, channels) / (50 if split else 1)
    inits = {"xs": _s(0.05), "xz": _u8(3), "ws": w_scale.astype(np.float32),
             "wz": np.zeros(channels, np.int8), "ys": _s(0.125), "yz": _u8(100),
             "ss": _s(0.0625), "sz": _u8(120), "b": rng.integers(-999, 999, channels)}
    inits["b"] = inits["b"].astype(np.int32)
    for k in (1, 2):  # split: |w| of 100 to 127, 1152 to a sum, times up to 252: past 2^24
        shape = (channels, channels, 3, 3)
        w = rng.integers(100, 128, shape) * rng.choice([-1, 1], shape) if split \
            else rng.integers(-127, 128, shape)
        inits[f"w{k}"] = w.astype(np.int8)
    node = helper.make_node
    conv = ["xs", "xz", "w{k}", "ws", "wz", "ys", "yz", "b"]
    nodes = [node("QLinearConv", [src, *[c.format(k=k) for c in conv]], [f"c{k}"], pads=[1] * 4)
             for k, src in ((1, "x"), (2, "s1"))]
    nodes.insert(1, node("QLinearAdd", ["c1", "ys", "yz", "x", "xs", "xz", "xs", "xz"], ["s1"],
                         domain="com.microsoft"))
    nodes.append(node("QLinearAdd", ["s1", "xs", "xz", "c2", "ys", "yz", "ss", "sz"], ["y"],
                      domain="com.microsoft"))
    shape = [1, channels, 6, 7]
    graph = helper.make_graph(nodes, "blocks", [helper.make_tensor_value_info("x", U8, shape)],
                              [helper.make_tensor_value_info("y", U8, None)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("com.microsoft", 1)],
                              ir_version=8)  # one every ONNX Runtime reads
    return model, {"x": rng.integers(0, 256, shape).astype(np.uint8)}


@pytest.mark.parametrize("compile_mode", ["auto", "layers"])
@pytest.mark.parametrize("split", [False, True], ids=["exact", "split-weight"])
def test_qlinear_conv_and_its_residual_add_are_one_layer(split: bool, compile_mode: str) -> None:
    from tests.backends.torch.test_quantized_fusion import placed

    model, feeds = residual_blocks(split)
    got, session = _run(model, feeds, "CpuAcc", compile_mode)
    fused = placed(session)
    assert [(lay.op_type, lay.domain) for lay in fused] == [("QLinearConv", "backplane.torch")] * 2
    assert all(lay.attrs["residual"] is not None for lay in fused)
    assert {lay.attrs["split"] for lay in fused} == ({128} if split else {None})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    # requantized in float32 as ONNX Runtime does (CpuRef: float64): a value within a float32
    # rounding of a half step may land one step away, and the next layer carries that on (2-3
    # steps of the last sum's on 3.6-4.4% of the values here; ONNX Runtime's own: 3, on 10-25%)
    off = np.abs(got[0].astype(np.int32) - want)
    assert off.max() <= 4 and np.mean(off > 0) < 0.1
    assert 10 < len(np.unique(want)) and want.max() == 255  # a spread of values, saturated
    # ONNX Runtime requantizes in fixed point: a convolution's value at a tie may round the
    # other way, one step of its scale, two of the last sum's, carried on by the next convolution
    # (3 steps at most here, on 1 value in 10 to 1 in 4)
    if ort_int8_exact():  # its u8 x s8 products saturate without VNNI (int8_cpu)
        assert np.max(np.abs(got[0].astype(np.int32) - ort_run(model, feeds)[0])) <= 4


@pytest.mark.parametrize("route", ["auto", "onednn"])
def test_the_residual_layer_survives_an_artifact(tmp_path, route: str) -> None:
    """The fused layer's residual parameters and split weight are stored in a compiled artifact
    and give the session's outputs when loaded; oneDNN's convolution packs the halves joined."""
    import backplane
    from tests.backends.torch.test_quantized_fusion import placed

    model, feeds = residual_blocks(split=True)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    # "exact": the float route, which reads the split weight (the int8 one takes the int8 weight)
    options = {"compile": "layers", "int8": "exact", "conv_route": route}
    backplane.compile(path, [("CpuAcc", options)], tmp_path / "model.bpl")
    loaded = InferenceSession(tmp_path / "model.bpl")
    assert [lay.attrs["split"] for lay in placed(loaded)] == [128, 128]
    session = InferenceSession(model, backends=[("CpuAcc", options)])
    np.testing.assert_array_equal(loaded.run(None, feeds)[0], session.run(None, feeds)[0])


PREPACKED = {"QGemm-float-uint8": "QGemm", "QGemm-quantized-int8": "QGemm", "QGemm-ties": "QGemm",
             "QGemm-float": "QGemm", "DynamicQuantizeMatMul": "DynamicQuantMatMul",
             "DynamicQuantizeMatMul-uint8": "DynamicQuantMatMul",
             "DynamicQuantizeMatMul-nan": "DynamicQuantMatMul"}


@pytest.mark.parametrize("name", PREPACKED)
def test_products_by_a_constant_weight_are_prepacked_layers(name: str) -> None:
    """QGemm and DynamicQuantizeMatMul by constant weights: one CpuAcc layer each, its product
    by Linear's route (fusion/contrib_quant.py), CpuRef's values bit for bit."""
    from tests.backends.torch.test_quantized_fusion import placed

    model, feeds = _model(CASES[name])
    got, session = _run(model, feeds, "CpuAcc", "layers")
    assert [(lay.op_type, lay.domain) for lay in placed(session)] == [(PREPACKED[name],
                                                                      "backplane.torch")]
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_array_equal(got[0], want)


def test_a_transposed_a_stays_with_the_kernel() -> None:
    model, feeds = _model(CASES["QGemm-transA-no-C"])
    _, session = _run(model, feeds, "CpuAcc", "layers")
    (layer,) = session.optimized.graph.layers[1:-1]
    assert (layer.op_type, layer.domain) == ("QGemm", "com.microsoft")


@pytest.mark.parametrize("split", [False, True], ids=["exact", "split-weight"])
def test_qlinear_convs_on_int8_kernels(split: bool) -> None:
    """``CpuAcc.int8`` "kernels": a QLinearConv between int8 or uint8 tensors with an int8 weight
    runs on torch's int8 convolution (its residual QLinearAdd after it, as on the float route):
    its requantization rounds its own way, as ONNX Runtime's does, so a value at a tie may be a
    step off, which the next block carries on, as against ONNX Runtime above. Where torch's
    int8 kernels saturate (no VNNI) "kernels" still takes them, and "auto" takes the float
    route, held to the same bounds."""
    from tests.conftest import inner_workloads

    model, feeds = residual_blocks(split)
    got, session = _run(model, feeds, "CpuAcc", "layers", int8="kernels")
    assert [getattr(w, "route", None) for w in inner_workloads(session, "QLinearConv")] \
        == ["int8", "int8"]
    if not torch_int8_exact():
        got, session = _run(model, feeds, "CpuAcc", "layers", int8="auto")
        routes = [getattr(w, "route", None) for w in inner_workloads(session, "QLinearConv")]
        assert "int8" not in routes, routes
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    off = np.abs(got[0].astype(np.int32) - want)
    assert off.max() <= 4 and np.mean(off == 0) > 0.5
    if ort_int8_exact():  # its u8 x s8 products saturate without VNNI (int8_cpu)
        assert np.max(np.abs(got[0].astype(np.int32) - ort_run(model, feeds)[0])) <= 4


def test_an_int8_qoperator_cnn_on_int8_kernels_is_within_a_step_or_two(tmp_path) -> None:
    """The QOperator CNN with int8 activations (ONNX Runtime's default) on the int8 route:
    its convolutions int8 ones, the output within 2 steps of CpuRef's and ONNX Runtime's."""
    from onnxruntime import quantization

    from tests.conftest import inner_workloads
    from tests.models.test_ort_tools import RandomReader, small_cnn

    path = tmp_path / "q.onnx"
    quantization.quantize_static(small_cnn(tmp_path / "cnn.onnx"), path,
                                 RandomReader("x", (1, 3, 16, 16)),
                                 quant_format=quantization.QuantFormat.QOperator, per_channel=True)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    session = InferenceSession(path, backends=[("CpuAcc", {"int8": "kernels",
                                                           "compile": "layers"})])
    assert "int8" in [getattr(w, "route", None) for w in inner_workloads(session, "QLinearConv")]
    (got,) = session.run(None, feeds)
    (want,) = InferenceSession(path, backends=["CpuRef"]).run(None, feeds)
    step = 1 / 256
    assert float(np.max(np.abs(got - want))) <= 2 * step * 1.001
    assert float(np.max(np.abs(got - ort_run(onnx.load(str(path)), feeds)[0]))) <= 2 * step * 1.001


@pytest.mark.parametrize("name", ["QGemm-quantized-int8", "DynamicQuantizeMatMul"])
def test_prepacked_products_survive_an_artifact(name: str, tmp_path) -> None:
    """The fused QGemm's and DynamicQuantMatMul's attributes (weights, scales, y's grid) are
    stored in a compiled artifact and give CpuRef's outputs when loaded."""
    import backplane
    from tests.backends.torch.test_quantized_fusion import placed

    model, feeds = _model(CASES[name])
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    backplane.compile(path, [("CpuAcc", {"compile": "layers"})], tmp_path / "model.bpl")
    loaded = InferenceSession(tmp_path / "model.bpl")
    assert [lay.op_type for lay in placed(loaded)] == [PREPACKED[name]]
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_array_equal(loaded.run(None, feeds)[0], want)


# -- MatMulNBits: 2-, 4- and 8-bit block-quantized weights ---------------------------------------
def _nbits_cases() -> dict[str, Case]:
    from tests.backends.contrib_cases import QUANT_CASES

    return {name: case for name, case in QUANT_CASES.items() if case.op == "MatMulNBits"}


NBITS = _nbits_cases()


@pytest.mark.parametrize("compile_mode", ["auto", "layers"])
@pytest.mark.parametrize("backend", DEVICES)
@pytest.mark.parametrize("name", NBITS)
def test_mat_mul_n_bits_against_cpuref_and_onnx_runtime(name: str, backend: str,
                                                        compile_mode: str) -> None:
    """On CpuAcc a constant weight is dequantized once at load into one Linear layer
    (fusion/contrib_quant.py); GpuAcc runs the kernel, dequantizing the blocks at each call."""
    from tests.backends.torch.test_quantized_fusion import placed

    model, feeds = _model(NBITS[name])
    got, session = _run(model, feeds, backend, compile_mode)
    assert {p.backend for p in session.report.layers.values()} == {backend}
    if backend == "CpuAcc":
        assert [(lay.op_type, lay.domain) for lay in placed(session)] == [("Linear",
                                                                          "backplane.torch")]
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    assert_matches_ort(got, ort_run(model, feeds))


@pytest.mark.parametrize("backend", DEVICES)
def test_mat_mul_n_bits_of_fed_blocks_runs_the_kernel(backend: str) -> None:
    """Blocks that are no constant (fed at run time) are dequantized by the kernel at each call."""
    from tests.backends.torch.test_quantized_fusion import placed

    case = NBITS["MatMulNBits-4bit"]
    model, feeds = _model(Case(case.op, case.inputs, case.outputs, case.attrs, fed=3))
    got, session = _run(model, feeds, backend, "layers")
    assert {p.backend for p in session.report.layers.values()} == {backend}
    assert [layer.op_type for layer in placed(session)] == ["MatMulNBits"]
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", DEVICES)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_decoder_from_the_4bit_quantizer_is_wholly_on_the_device(bits: int, backend: str,
                                                                  tmp_path) -> None:
    """tiny_gpt2 through ONNX Runtime's MatMulNBitsQuantizer: every layer on the torch backend,
    each MatMulNBits a Linear on CpuAcc, the outputs ONNX Runtime's."""
    pytest.importorskip("onnx_ir")  # the quantizer's own dependency
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from tests.backends.torch.test_quantized_fusion import placed
    from tests.models.test_models import DATA, assert_close, ort_outputs

    quantizer = MatMulNBitsQuantizer(onnx.load(str(DATA / "tiny_gpt2.onnx")), block_size=16,
                                     is_symmetric=False, bits=bits)
    quantizer.process()
    path = tmp_path / "nbits.onnx"
    quantizer.model.save_model_to_file(str(path))
    nbits = [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "MatMulNBits"]
    assert nbits
    session = InferenceSession(path, backends=[backend, "CpuRef"])
    assert set(session.report.counts()) == {backend}
    if backend == "CpuAcc":
        linear = {lay.name for lay in placed(session) if lay.op_type == "Linear"}
        assert set(nbits) <= linear
    feeds = dict(np.load(DATA / "tiny_gpt2.npz"))
    feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))


@pytest.mark.parametrize("compile_mode", ["auto", "layers"])
@pytest.mark.parametrize("backend", DEVICES)
def test_mat_mul_n_bits_propagates_nan(backend: str, compile_mode: str) -> None:
    """A NaN or an Inf in A: CpuRef's rows NaN (an Inf times weights of both signs), the rest
    close."""
    model, feeds = _model(NBITS["MatMulNBits-4bit"])
    feeds = {"in0": feeds["in0"].copy()}
    feeds["in0"][0, 3], feeds["in0"][2, 5] = np.nan, np.inf
    got, _ = _run(model, feeds, backend, compile_mode)
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    assert np.isnan(want[0]).all() and not np.isnan(want[1]).any()
    np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want))
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
