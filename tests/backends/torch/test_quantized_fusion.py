"""CpuAcc's quantized fusions (fusion/quantized.py, fusion/qlinear.py): which patterns become one
layer, and that it computes CpuRef's values: bit for bit where the layers' arithmetic is exact
(QuantizeLinear -> DequantizeLinear, DynamicQuantizeLinear -> MatMulInteger), within one
quantization step where a float convolution precedes the rounding or the layer requantizes in
float32 as ONNX Runtime does (QLinearConv, QLinearMatMul: ONNX Runtime is the reference; their
own tests are test_qlinear_fusion's).

The inputs hold what a wrong fusion gets wrong: values exactly halfway between two steps (rint
rounds them to even; torch's fake_quantize, which multiplies by 1 / s, does not), values past
both ends of the integer type (saturation), non-zero and per-channel zero points, NaN and
infinities (a NaN quantizes to 0, as CpuRef's cast makes it), and, for the integer products,
a multiplier of exactly 1/2 (every odd sum a tie)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.int8_cpu import torch_int8_exact  # noqa: E402
from tests.ort_int8 import ort_int8_exact, with_uint8_weights  # noqa: E402
from tests.backends.torch.qlinear_models import qlinear_conv_model, within_a_step  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(29)
ort = pytest.importorskip("onnxruntime")


def _init(name: str, value: np.ndarray | float | int, dtype: type = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def placed(session: InferenceSession) -> list:
    """The layers as placed, copies left out, a Traced or OneDnnGraph layer's own in its place (and
    an artifact's Delegate's)."""
    return _flat(session.optimized.graph.layers)


def _flat(layers: list) -> list:
    found = []
    for layer in layers:
        if layer.op_type in ("Traced", "OneDnnGraph"):
            found += layer.attrs["layers"]
        elif layer.op_type == "Delegate":
            found += _flat(layer.attrs["graph"].layers)
        elif layer.op_type not in ("MemCopy", "MemImport"):
            found.append(layer)
    return found


def placed_types(session: InferenceSession) -> list[str]:
    return [layer.op_type for layer in placed(session)]


def held(session: InferenceSession) -> list[str]:
    """The op types the QuantDequant layers hold (a FusedConv, a Linear), in order."""
    return [inner.op_type for layer in placed(session) if layer.op_type == "QuantDequant"
            for inner in layer.attrs["layers"]]


@pytest.fixture(params=["auto", "layers"])
def compile_mode(request: pytest.FixtureRequest) -> str:
    """CpuAcc's default (its subgraph traced where that measures faster) and its layers run one by
    one (``CpuAcc.compile`` "layers")."""
    return request.param


def run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray], compile_mode: str,
             ) -> tuple[InferenceSession, np.ndarray, np.ndarray]:
    """The CpuAcc session (with ``CpuAcc.compile`` ``compile_mode``), its output and CpuRef's."""
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": compile_mode})])
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    return session, session.run(None, feeds)[0], expected


def ort_output(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """ONNX Runtime's output; of the model's int8 weights moved to uint8 where its u8 x s8
    products saturate (no VNNI: tests/ort_int8.py, the same integers multiplied exactly)."""
    if not ort_int8_exact():
        feeds = dict(feeds)
        model = with_uint8_weights(model, feeds)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def hard_values(shape: tuple[int, ...], scale: np.ndarray, zero: np.ndarray, axis: int,
                low: int, high: int) -> np.ndarray:
    """Random values with, along ``axis``'s channels' own scale: ties (k + 1/2 steps), values a
    few steps past both ends, NaN, +-inf and -0.0 at fixed places."""
    x = RNG.standard_normal(shape).astype(np.float32) * 2
    steps = np.broadcast_to(scale.reshape([-1 if d == axis else 1 for d in range(len(shape))])
                            if scale.size > 1 else scale, shape)
    flat, per = x.reshape(-1), steps.reshape(-1)
    ties = RNG.integers(-140, 140, flat.size // 3) + 0.5
    flat[: ties.size] = (ties * per[: ties.size]).astype(np.float32)
    ends = np.concatenate([np.full(4, high + 3), np.full(4, low - 3)]) - float(np.max(zero))
    flat[-len(ends) - 4:-4] = ends * per[-len(ends) - 4:-4]
    flat[-4:] = [np.nan, np.inf, -np.inf, -0.0]
    return RNG.permutation(flat).reshape(shape)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("same", [True, False], ids=["same-params", "other-dequantize"])
def test_quantize_dequantize_pair_is_one_exact_layer(dtype: type, per_channel: bool,
                                                    same: bool, compile_mode: str) -> None:
    info = np.iinfo(dtype)
    shape = (2, 6, 5, 7)
    scale = (RNG.uniform(0.005, 0.05, 6) if per_channel else np.array(0.0173)).astype(np.float32)
    zero = (RNG.integers(info.min + 20, info.max - 20, scale.shape)).astype(dtype)
    back_scale, back_zero = (scale, zero) if same else (scale * np.float32(1.5), zero // 2)
    inits = [_init("s", scale), _init("z", zero, dtype), _init("s2", back_scale),
             _init("z2", back_zero, dtype)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], axis=1),
             helper.make_node("DequantizeLinear", ["q", "s2", "z2"], ["y"], axis=1)]
    model = make_model(nodes, [float_input("x", shape)], [float_input("y", shape)], inits)
    feeds = {"x": hard_values(shape, scale, zero, 1, info.min, info.max)}
    session, got, want = run_both(model, feeds, compile_mode)
    assert placed_types(session) == ["QuantDequant"]
    np.testing.assert_array_equal(got, want)  # NaN where CpuRef has NaN (none: NaN -> 0 -> -z * s)
    finite = np.isfinite(feeds["x"])
    np.testing.assert_array_equal(got[finite], ort_output(model, feeds)[finite])


def qdq_conv_model(activation: str | None, rng: np.random.Generator = RNG,
                   ) -> tuple[onnx.ModelProto, float]:
    """QDQ as ONNX Runtime writes it: x -> Q -> DQ -> Conv(DQ(int8 per-channel weight), bias)
    [-> activation] -> Q -> DQ -> Gemm(DQ(weight)) -> Q -> DQ; and the last step's scale."""
    w = rng.integers(-127, 128, (8, 4, 3, 3)).astype(np.int8)
    fc = rng.integers(-127, 128, (5, 8 * 6 * 6)).astype(np.int8)
    inits = [_init("xs", 0.02), _init("xz", 131, np.uint8), _init("w", w, np.int8),
             _init("ws", rng.uniform(0.002, 0.01, 8)), _init("wz", np.zeros(8), np.int8),
             _init("b", rng.standard_normal(8) * 0.1), _init("cs", 0.05), _init("cz", 17, np.uint8),
             _init("fc", fc, np.int8), _init("fs", 0.001), _init("fz", 0, np.int8),
             _init("shape", [1, -1], np.int64), _init("ys", 0.01), _init("yz", 120, np.uint8)]
    node = helper.make_node
    nodes = [node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             node("Conv", ["xd", "wd", "b"], ["c"], pads=[1, 1, 1, 1])]
    last = "a" if activation else "c"
    if activation == "Clip":  # ReLU6's form, with a bound the convolution's values pass
        inits += [_init("lo", 0.0), _init("hi", 1.5)]
        nodes.append(node("Clip", ["c", "lo", "hi"], ["a"]))
    elif activation:
        nodes.append(node(activation, ["c"], ["a"]))
    nodes += [node("QuantizeLinear", [last, "cs", "cz"], ["cq"]),
              node("DequantizeLinear", ["cq", "cs", "cz"], ["cd"]),
              node("Reshape", ["cd", "shape"], ["flat"]),
              node("DequantizeLinear", ["fc", "fs", "fz"], ["fd"]),
              node("Gemm", ["flat", "fd"], ["g"], transB=1),
              node("QuantizeLinear", ["g", "ys", "yz"], ["gq"]),
              node("DequantizeLinear", ["gq", "ys", "yz"], ["y"])]
    model = make_model(nodes, [float_input("x", [1, 4, 6, 6])], [float_input("y", [1, 5])], inits)
    return model, 0.01


@pytest.mark.parametrize("activation", [None, "Relu", "Clip"])
def test_qdq_conv_and_gemm_take_their_quantize_dequantize(
        activation: str | None, compile_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from backplane.backends.torch.fusion import qdq_chain

    monkeypatch.setattr(qdq_chain, "CHAIN_MACS", 1 << 20)  # QuantDequant layers, not chained
    model, step = qdq_conv_model(activation)
    feeds = {"x": RNG.standard_normal((1, 4, 6, 6)).astype(np.float32)}
    session, got, want = run_both(model, feeds, compile_mode)
    assert held(session) == ["FusedConv", "Linear"], placed_types(session)
    # the float convolution's sums may round a tie the other way: one step at most
    assert float(np.max(np.abs(got - want))) <= step * 1.001
    assert float(np.max(np.abs(got - ort_output(model, feeds)))) <= step * 1.001


def dynamic_model(k: int, weight: np.ndarray | None = None) -> onnx.ModelProto:
    """What quantize_dynamic writes for x @ W + bias: DynamicQuantizeLinear, MatMulInteger,
    Cast, Mul by the product of the two scales, Add."""
    n = 7
    w = RNG.integers(-127, 128, (k, n)).astype(np.int8) if weight is None else weight
    inits = [_init("w", w, w.dtype.type), _init("wz", 3, w.dtype.type),
             _init("ws", RNG.uniform(0.001, 0.01, n)), _init("bias", RNG.standard_normal(n))]
    node = helper.make_node
    nodes = [node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             node("Mul", ["xs", "ws"], ["scales"]),
             node("MatMulInteger", ["xq", "w", "xz", "wz"], ["acc"]),
             node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             node("Mul", ["accf", "scales"], ["m"]),
             node("Add", ["bias", "m"], ["y"])]
    return make_model(nodes, [float_input("x", [3, 4, k])], [float_input("y", [3, 4, n])], inits)


@pytest.mark.parametrize("case", ["random", "all-positive", "nan", "constant"])
def test_dynamic_quantization_matmul_is_one_layer_bit_for_bit(case: str, compile_mode: str) -> None:
    model = dynamic_model(32)
    x = (RNG.standard_normal((3, 4, 32)) * 2).astype(np.float32)
    if case == "all-positive":  # the range widened to include 0: zero point 0
        x = np.abs(x) + 0.5
    elif case == "nan":
        x[1, 2, 3] = np.nan
    elif case == "constant":
        x = np.full_like(x, 0.0)
    feeds = {"x": x}
    session, got, want = run_both(model, feeds, compile_mode)
    assert placed_types(session) == ["DynamicQuantMatMul"]
    np.testing.assert_array_equal(got, want)
    if case != "nan":  # ONNX Runtime's float32 steps round a few values one ulp apart: an ulp
        # of the product before the bias is added (a sum near 0 was 2.4e-7 off, 1e-5 relative)
        ulps = 2 * np.spacing(np.max(np.abs(want)))
        np.testing.assert_allclose(got, ort_output(model, feeds), rtol=1e-6, atol=ulps)


def test_products_that_float32_cannot_hold_exactly_stay_integer_layers(compile_mode: str) -> None:
    """uint8 weights of 255 over 300 inputs: sums up to 255 * 255 * 300, past 2^24: no fusion,
    the layers run as they are, and the answer is CpuRef's all the same."""
    model = dynamic_model(300, np.full((300, 7), 255, np.uint8))
    feeds = {"x": np.abs(RNG.standard_normal((3, 4, 300))).astype(np.float32)}
    session, got, want = run_both(model, feeds, compile_mode)
    assert "DynamicQuantMatMul" not in placed_types(session)
    assert "MatMulInteger" in placed_types(session)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("activation", [None, "Relu", "Clip"])
def test_qdq_conv_on_int8_kernels_is_within_one_step(activation: str | None) -> None:
    """``CpuAcc.int8`` "kernels": the convolution runs on torch's int8 kernel (quantize, integer
    convolution requantizing to the output's step, dequantize): within one step of CpuRef. Where
    those saturate (no VNNI: 32 steps off here) "kernels" still takes them, the caller's choice,
    and "auto" does not: its float route is within one step of CpuRef."""
    from tests.conftest import inner_workloads

    model, step = qdq_conv_model(activation)
    session = InferenceSession(model, backends=[("CpuAcc", {"int8": "kernels",
                                                            "compile": "layers"})])
    routes = [getattr(w, "route", None) for w in inner_workloads(session, "QuantDequant")]
    assert "int8" in routes, routes
    if not torch_int8_exact():
        session = InferenceSession(model, backends=[("CpuAcc", {"compile": "layers"})])
        routes = [getattr(w, "route", None) for w in inner_workloads(session, "QuantDequant")]
        assert "int8" not in routes, routes
    for seed in range(3):
        feeds = {"x": np.random.default_rng(seed).standard_normal((1, 4, 6, 6)).astype(np.float32)}
        got = session.run(None, feeds)[0]
        want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
        assert float(np.max(np.abs(got - want))) <= step * 1.001


def test_int8_weights_are_found_again_only_where_exact() -> None:
    """The folded float weight of DequantizeLinear(int8 k, scale): k and the scales come back,
    per tensor and per channel; a weight that is no int8 multiple of one scale is refused."""
    from backplane.backends.torch.fusion.int8 import integer_weight

    k = RNG.integers(-127, 128, (6, 3, 3, 3)).astype(np.int8)
    k[:, 0, 0, 0] = 127  # each channel's peak at 127, as a symmetric quantizer puts it
    for scale in (np.full(6, 0.0123, np.float32), RNG.uniform(0.001, 0.1, 6).astype(np.float32)):
        weight = (k.astype(np.float64) * scale.reshape(-1, 1, 1, 1)).astype(np.float32)
        found = integer_weight(weight)
        assert found is not None
        np.testing.assert_array_equal(found[0], k)
        np.testing.assert_array_equal((found[0] * found[1].reshape(-1, 1, 1, 1).astype(np.float64))
                                      .astype(np.float32), weight)
    assert integer_weight(RNG.standard_normal((6, 3, 3, 3)).astype(np.float32)) is None


@pytest.mark.parametrize("case", ["qdq-int8", "qlinear", "dynamic"])
def test_quantized_layers_survive_an_artifact(case: str, tmp_path) -> None:
    """The fused layers' attributes (scales, zero points, the int8 route's integer weight, a held
    FusedConv) are stored in a compiled artifact and give the session's outputs when loaded."""
    import backplane

    options = {"compile": "layers", "int8": "kernels"}
    model, shape = {"qdq-int8": (qdq_conv_model("Relu")[0], (1, 4, 6, 6)),
                    "qlinear": (qlinear_conv_model(True, 3, np.uint8), (1, 6, 7, 8)),
                    "dynamic": (dynamic_model(32), (3, 4, 32))}[case]
    feeds = {"x": (RNG.standard_normal(shape) * 20).astype(np.float32)}
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    backplane.compile(path, [("CpuAcc", options)], tmp_path / "model.bpl")
    expected = InferenceSession(path, backends=[("CpuAcc", options)]).run(None, feeds)[0]
    loaded = InferenceSession(tmp_path / "model.bpl")
    assert {"QuantDequant", "QLinearConv", "DynamicQuantMatMul"} & set(placed_types(loaded))
    np.testing.assert_array_equal(loaded.run(None, feeds)[0], expected)


SEED = 29


@pytest.mark.parametrize("case", ["qdq", "qlinear", "dynamic"])
def test_quantized_layers_inside_a_bf16_subgraph(case: str) -> None:
    """``CpuAcc.precision`` "bf16": a QDQ convolution computes in bfloat16 with its neighbours,
    but the integer products of QLinearConv and DynamicQuantMatMul stay float32 (on an input
    bfloat16 holds exactly, QLinearConv is within one step of CpuRef's values)."""
    import torch

    from backplane.backends.torch.fusion import reduced

    if not reduced.hardware():
        pytest.skip("no bfloat16 instructions for oneDNN on this CPU")
    # a generator of its own: the weights drawn from the shared one depended on the tests run
    # before (under xdist, a Gemm output 5 steps off one time in a few)
    rng = np.random.default_rng(SEED)
    model, shape = {"qdq": lambda: (qdq_conv_model("Relu", rng)[0], (1, 4, 6, 6)),
                    "qlinear": lambda: (qlinear_conv_model(True, 1, np.uint8), (1, 6, 7, 8)),
                    "dynamic": lambda: (dynamic_model(32), (3, 4, 32))}[case]()
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).bfloat16().float()
    feeds = {"x": x.numpy()}
    session = InferenceSession(model, backends=[("CpuAcc", {"precision": "bf16"})])
    assert [lay.op_type for lay in session.optimized.graph.layers
            if lay.op_type not in ("MemImport", "MemCopy")] == ["Reduced"]
    got = session.run(None, feeds)[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    if case == "qlinear":
        within_a_step(got, want, 1.0)
    else:  # bfloat16's 8 bits through the QDQ steps and a 288-term Gemm: 0.2% to 5.3% of the
        # largest value over 20 seeds of the qdq model (3% was passed one time in four)
        assert float(np.max(np.abs(got - want))) <= 0.06 * float(np.max(np.abs(want)))


def qdq_matmul_model(k: int = 32, n: int = 16) -> tuple[onnx.ModelProto, float]:
    """A QDQ MatMul as ONNX Runtime's quantizer writes a transformer's: x -> Q(uint8) -> DQ ->
    MatMul(DQ(int8 weight, a scale per column)) -> Add(bias) -> Q -> DQ; and the last step."""
    rng = np.random.default_rng(3)
    w = rng.integers(-127, 128, (k, n)).astype(np.int8)
    w[0] = 127  # each column's peak at 127, as the symmetric quantizer puts it
    inits = [_init("xs", 0.03), _init("xz", 120, np.uint8), _init("w", w, np.int8),
             _init("ws", rng.uniform(0.001, 0.004, n)), _init("wz", np.zeros(n), np.int8),
             _init("bias", rng.standard_normal(n) * 0.1), _init("ys", 0.02),
             _init("yz", 128, np.uint8)]
    node = helper.make_node
    nodes = [node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=1),
             node("MatMul", ["xd", "wd"], ["m"]), node("Add", ["m", "bias"], ["a"]),
             node("QuantizeLinear", ["a", "ys", "yz"], ["yq"]),
             node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    model = make_model(nodes, [float_input("x", [2, 3, k])], [float_input("y", [2, 3, n])], inits)
    return model, 0.02


@pytest.mark.parametrize("mode", ["kernels", "exact"])
def test_qdq_matmul_on_int8_kernels_is_within_one_step(mode: str) -> None:
    """``CpuAcc.int8`` "kernels": a QDQ MatMul's integer product by ``torch._int_mm`` (int32,
    exact), then the scales: within one step of CpuRef and ONNX Runtime (the float route sums
    dequantized products in float32); "exact" keeps the float route, bit for bit."""
    from tests.conftest import inner_workloads

    model, step = qdq_matmul_model()
    session = InferenceSession(model, backends=[("CpuAcc", {"int8": mode, "compile": "layers"})])
    routes = [getattr(w, "route", None) for w in inner_workloads(session, "QuantDequant")]
    assert ("int8" in routes) == (mode == "kernels"), routes
    for seed in range(3):
        feeds = {"x": (np.random.default_rng(seed).standard_normal((2, 3, 32)) * 2)
                 .astype(np.float32)}
        got = session.run(None, feeds)[0]
        want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
        if mode == "exact":
            np.testing.assert_array_equal(got, want)
        assert float(np.max(np.abs(got - want))) <= step * 1.001
        assert float(np.max(np.abs(got - ort_output(model, feeds)))) <= step * 1.001


def shared_dynamic_model() -> onnx.ModelProto:
    """quantize_dynamic's Q, K and V projections of one input: one DynamicQuantizeLinear, three
    MatMulInteger -> Cast -> Mul(scales) -> Add(bias) branches (per-column and per-tensor weight
    scales), a layer reading the first branch's result before the second branch starts."""
    rng = np.random.default_rng(4)
    k, node = 24, helper.make_node
    nodes = [node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"])]
    inits = []
    for name, n in (("q", 8), ("k", 8), ("v", 6)):
        per_column = name != "v"
        inits += [_init(f"w{name}", rng.integers(-127, 128, (k, n)), np.int8),
                  _init(f"z{name}", 0, np.int8),
                  _init(f"s{name}", rng.uniform(0.001, 0.01, n if per_column else ())),
                  _init(f"b{name}", rng.standard_normal(n))]
        nodes += [node("Mul", ["xs", f"s{name}"], [f"scales_{name}"]),
                  node("MatMulInteger", ["xq", f"w{name}", "xz", f"z{name}"], [f"acc_{name}"]),
                  node("Cast", [f"acc_{name}"], [f"accf_{name}"], to=TensorProto.FLOAT),
                  node("Mul", [f"accf_{name}", f"scales_{name}"], [f"m_{name}"]),
                  node("Add", [f"m_{name}", f"b{name}"], [f"y_{name}"])]
        if name == "q":
            nodes.append(node("Relu", ["y_q"], ["out_q"]))
    nodes.append(node("Sub", ["y_k", "out_q"], ["out_k"]))
    outputs = [float_input(name, [2, 5, n]) for name, n in (("out_q", 8), ("out_k", 8),
                                                            ("y_v", 6))]
    return make_model(nodes, [float_input("x", [2, 5, k])], outputs, inits)


def test_a_dynamic_quantization_shared_by_three_products_is_one_layer(compile_mode: str) -> None:
    """One DynamicQuantizeLinear, three projections: x quantized once, one product by the three
    weights stacked, split into three outputs, CpuRef's values bit for bit."""
    model = shared_dynamic_model()
    feeds = {"x": (RNG.standard_normal((2, 5, 24)) * 2).astype(np.float32)}
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": compile_mode})])
    fused = [lay for lay in placed(session) if lay.op_type == "DynamicQuantMatMul"]
    assert len(fused) == 1 and len(fused[0].outputs) == 3
    assert "MatMulInteger" not in placed_types(session)
    got = session.run(None, feeds)
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    if not ort_int8_exact():  # its u8 x s8 products saturate without VNNI (tests/ort_int8.py)
        model = with_uint8_weights(model)
    for g, w, o in zip(got, want, ort.InferenceSession(model.SerializeToString()).run(None, feeds)):
        np.testing.assert_allclose(g, o, rtol=1e-6, atol=2 * np.spacing(np.max(np.abs(w))))
