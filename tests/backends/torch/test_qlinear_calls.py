"""The float route of a fused QLinearConv in few torch calls, requantizing in float32 as ONNX
Runtime does (fusion/qlinear.py): a trace (a QOperator model's subgraph) pays each call, about
as much as a small tensor's arithmetic, and a float64 requantization is a pass and a casting loop
over every activation. ONNX Runtime is the reference for these ops (MLAS: the int32 sum as float32
times a float32 multiplier s_x * s_w / s_y, rounded half to even, plus the zero point,
saturated); CpuRef requantizes in float64, so the route is within one step of CpuRef's
(test_quantized_fusion holds whole layers to CpuRef and ONNX Runtime). Here the calls are counted,
and the values checked against MLAS's formula."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from onnx import helper  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import qlinear, qlinear_float  # noqa: E402
from tests.backends.torch.qlinear_models import _init, qlinear_conv_model  # noqa: E402
from tests.backends.torch.test_quantized_fusion import placed  # noqa: E402
from tests.conftest import make_model  # noqa: E402


def _fused(quantized_io: bool) -> dict:
    model = qlinear_conv_model(quantized_io, 1, np.uint8)
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "layers"})])
    (layer,) = [lay for lay in placed(session) if lay.op_type == "QLinearConv"]
    # as a plain trace (``Traced``) holds it: a OneDnnGraph's copy is marked ``fusable``, and
    # traced out of place for its fuser (``qlinear_traced``, test_qlinear_compiled)
    return {k: v for k, v in layer.attrs.items() if k != "fusable"}


def _calls(function, *sample) -> list[str]:
    with torch.no_grad():
        graph = torch.jit.trace(function, sample).graph
    return [node.kind() for node in graph.nodes() if node.kind().startswith("aten::")]


class _Recorded(TorchDispatchMode):
    """The ops a call runs and the dtypes of their tensor results, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, set]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func.overloadpacket.__name__),
                         {r.dtype for r in results if isinstance(r, torch.Tensor)}))
        return out


def _recorded(function, *args) -> list[tuple[str, set]]:
    with torch.no_grad(), _Recorded() as mode:
        function(*args)
    return mode.ops


def test_the_requantization_is_float32_and_takes_the_relu_into_its_clamp() -> None:
    """The scaled sums (acc * multiplier, the product's) rounded, clamped and dequantized in
    float32: three calls (five before, in float64: the widening product, round, clamp, the
    scale, the narrowing ``to``), the Relu after the DequantizeLinear the clamp's floor at 0."""
    a = _fused(quantized_io=True)
    assert a["activation"][0] == "relu"
    scaled = torch.from_numpy(np.random.default_rng(3).uniform(-300, 300, (1, 6, 9, 4))
                              .astype(np.float32))
    scaled.view(-1)[:8] = torch.arange(-4, 4) + 0.5  # ties: half to even
    calls = _calls(qlinear_float._finisher(a), scaled.clone())
    assert calls == ["aten::round_", "aten::clamp_", "aten::mul_"]  # in the product's tensor
    got = qlinear_float._finisher(a)(scaled.clone())
    assert got.dtype == torch.float32
    y = np.clip(np.rint(scaled.numpy()), max(a["y_low"] - a["y_zero"], 0), a["y_high"] - a["y_zero"])
    np.testing.assert_array_equal(got.numpy(), y * np.float32(a["back"]["scale"]))


def test_an_integer_input_is_centred_in_one_call() -> None:
    a = _fused(quantized_io=False)
    x = torch.from_numpy(np.random.default_rng(4).integers(0, 256, (1, 6, 7, 8)).astype(np.uint8))
    centre = qlinear_float._centring(a)
    assert _calls(centre, x) == ["aten::sub"]
    got = centre(x)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), x.numpy().astype(np.float32) - a["x_zero"])


def test_large_conversions_take_two_vectorized_passes() -> None:
    """From ``PASSES_FROM`` values float32 integers become uint8 through int32, and uint8 less a
    zero point converts first (one call of two types is a casting loop: (1, 64, 112, 112),
    583 -> 285 us and 477 -> 279, 1 thread); below, one call each. The same values either way."""
    a = _fused(quantized_io=False)
    rng = np.random.default_rng(7)
    for shape, narrow, centre in (((1, 6, 9, 4), ["aten::to"], ["aten::sub"]),
                                  ((1, 6, 64, 64), ["aten::to", "aten::to"],
                                   ["aten::to", "aten::sub_"])):
        y = torch.from_numpy(rng.integers(0, 256, shape).astype(np.float32))
        assert _calls(lambda t: qlinear.narrowed(t, torch.uint8), y) == narrow
        np.testing.assert_array_equal(qlinear.narrowed(y, torch.uint8).numpy(),
                                      y.numpy().astype(np.uint8))
        x = y.to(torch.uint8)
        assert _calls(qlinear_float._centring(a), x) == centre
        np.testing.assert_array_equal(qlinear_float._centring(a)(x).numpy(),
                                      x.numpy().astype(np.float32) - a["x_zero"])
    assert 6 * 9 * 4 < qlinear.PASSES_FROM <= 6 * 64 * 64


def _mlas(acc: np.ndarray, multiplier: np.ndarray, zero: float, low: int, high: int) -> np.ndarray:
    """MLAS's requantization: float32(acc) * the float32 multiplier, rounded half to even, plus
    the zero point, saturated."""
    return np.clip(np.rint(acc.astype(np.float32) * multiplier) + zero, low, high)


def test_the_multiplier_is_in_the_weight_and_no_value_is_float64() -> None:
    """The product's weight is the centred integers times the multiplier (per output channel), so
    the product gives the scaled sums; the integer route traced holds no float64 tensor, and its
    integers are MLAS's within one step (equal but for values within float32 roundings of a
    half step)."""
    layer = next(lay for lay in placed(InferenceSession(
        qlinear_conv_model(False, 1, np.uint8), backends=[("CpuAcc", {"compile": "layers"})]))
        if lay.op_type == "QLinearConv")
    a, scaled = layer.attrs, qlinear_float._scaled(layer).attrs
    m = a["multiplier"].reshape(-1, 1, 1, 1)
    np.testing.assert_array_equal(scaled["weight"], (a["weight"] * m.astype(np.float64))
                                  .astype(np.float32))
    assert scaled["weight"].dtype == np.float32 and scaled["split"] is None

    class Backend:
        options: dict = {}
    route = qlinear_float._float_route(layer, Backend())
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.integers(0, 256, a["input_shape"]).astype(np.uint8))
    ops = _recorded(route, x)
    assert ops and not any(torch.float64 in dtypes for _, dtypes in ops)
    (got,) = route(x)
    acc = torch.nn.functional.conv2d(
        torch.nn.functional.pad(x.double() - a["x_zero"], (0, 2, 1, 1)),
        torch.from_numpy(a["weight"].astype(np.float64)),
        torch.from_numpy(a["bias"].astype(np.float64)), stride=(1, 2)).numpy()
    want = _mlas(acc, a["multiplier"], a["y_zero"], a["y_low"], a["y_high"])
    off = np.abs(got.numpy().astype(np.int32) - want)
    assert off.max() <= 1 and np.mean(off > 0) < 0.05
    assert got.numpy().min() == 0 and got.numpy().max() == 255


def _pooled_model():
    """QLinearConv (uint8 in and out) -> MaxPool 3x3 stride 2, pads 1: a QOperator ResNet's stem."""
    rng = np.random.default_rng(8)
    inits = [_init("xs", 0.02), _init("xz", 7, np.uint8),
             _init("w", rng.integers(-127, 128, (8, 3, 5, 5)), np.int8),
             _init("ws", rng.uniform(0.002, 0.006, 8)), _init("wz", np.zeros(8), np.int8),
             _init("ys", 0.05), _init("yz", 3, np.uint8),
             _init("b", rng.integers(-900, 900, 8), np.int32)]
    nodes = [helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"],
                              ["c"], pads=[2] * 4, strides=[2, 2]),
             helper.make_node("MaxPool", ["c"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1] * 4)]
    u8 = helper.np_dtype_to_tensor_dtype(np.dtype(np.uint8))
    return make_model(nodes, [helper.make_tensor_value_info("x", u8, [1, 3, 32, 32])],
                      [helper.make_tensor_value_info("y", u8, None)], inits), rng


def test_a_max_pool_after_is_taken_before_the_requantization() -> None:
    """The requantization is monotonic (rounding, clamp, the zero point), so the max of the
    requantized values is the requantized max: the pool reads the scaled sums and the
    requantization a quarter of the values (the full tier's QOperator stem: (1, 64, 112, 112)
    pooled to (1, 64, 56, 56), its round, clamp, add and cast there), the same integers."""
    model, rng = _pooled_model()
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "layers"})])
    (layer,) = [lay for lay in placed(session) if lay.op_type == "QLinearConv"]
    assert layer.attrs["pool"] is not None

    class Backend:
        options: dict = {}
    route = qlinear_float._float_route(layer, Backend())
    x = torch.from_numpy(rng.integers(0, 256, (1, 3, 32, 32)).astype(np.uint8))
    calls = [name for name, _ in _recorded(route, x)]
    pool = next(k for k, call in enumerate(calls) if call.startswith("max_pool2d"))
    assert pool < calls.index("round_")
    feeds = {"x": x.numpy()}
    got = session.run(None, feeds)[0].astype(np.int32)
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    assert np.abs(got - want).max() <= 1 and np.mean(got != want) < 0.05
    assert len(np.unique(want)) > 20


def test_a_residual_add_is_onnx_runtimes_in_few_calls() -> None:
    """QLinearAdd after the convolution as MLAS computes it: each operand centred, times its
    scale over the sum's, summed (one multiply-add), rounded, saturated, plus the zero point:
    the integers of that formula in NumPy, within one step (float32 roundings: the multiply-add
    may be fused or not), in 7 calls where CpuRef's dequantize-add-quantize took 12 (9 from
    ``PASSES_FROM`` values: two vectorized passes where a call of two types is a casting loop)."""
    a = {"y_zero": 100.0, "y_low": 0, "y_high": 255,
         "residual": {"mine_scale": np.float32(0.125), "mine_zero": 100,
                      "other_scale": np.float32(0.05), "other_zero": 3,
                      "sum_scale": np.float32(0.0625), "sum_zero": 120}}
    rng = np.random.default_rng(9)
    add = qlinear_float._residual_finisher(a)
    for shape, calls in (((1, 4, 6, 7), 7), ((1, 16, 32, 32), 9)):  # from PASSES_FROM: to, sub_
        # for the other operand, and the cast through int32 (``narrowed``)
        y = torch.from_numpy(rng.integers(-100, 156, shape).astype(np.float32))
        other = torch.from_numpy(rng.integers(0, 256, shape).astype(np.uint8))
        assert len(_calls(add, y.clone(), other)) == calls
        got = add(y.clone(), other).numpy().astype(np.int32)
        r = a["residual"]
        ratio_a, ratio_b = r["mine_scale"] / r["sum_scale"], r["other_scale"] / r["sum_scale"]
        real = ratio_a * y.numpy() + ratio_b * (other.numpy().astype(np.float32) - 3)
        want = np.clip(np.rint(real) + 120, 0, 255)
        off = np.abs(got - want)
        assert off.max() <= 1 and np.mean(off > 0) < 0.02


@pytest.mark.parametrize("dtype, zero", [(torch.uint8, 3), (torch.int8, -5)])
def test_large_integers_are_quantized_in_one_pass(dtype, zero) -> None:
    """From ``PASSES_FROM`` values, run one by one: rounded, then ``quantize_per_tensor`` at
    scale 1 (the zero point, saturation and narrowing in one pass) read in place, where the
    elementwise steps were five; the same integers, ties (half to even before the zero point is
    added, as ONNX Runtime) and both ends included. In a trace, and below the bound, the steps."""
    from backplane.backends.torch.fusion.int8_cast import integers

    info = torch.iinfo(dtype)
    rng = np.random.default_rng(11)
    v = torch.from_numpy((rng.standard_normal((1, 16, 32, 32)) * 90).astype(np.float32))
    v.view(-1)[:600] = torch.arange(600) * 0.5 - 150  # every tie from -150 to 150
    want = np.clip(np.rint(v.numpy()) + zero, info.min, info.max)
    ops = [name for name, _ in _recorded(integers, v.clone(), zero, info.min, info.max, dtype)]
    if hasattr(torch, "quantize_per_tensor"):
        assert "quantize_per_tensor" in ops and "clamp_" not in ops and len(ops) <= 4
    got = integers(v.clone(), zero, info.min, info.max, dtype)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.numpy(), want)
    assert got.numpy().min() == info.min and got.numpy().max() == info.max
    traced = _calls(lambda t: integers(t, zero, info.min, info.max, dtype), v.clone())
    assert "aten::quantize_per_tensor" not in traced and "aten::clamp_" in traced
    small = v[:, :1, :4].clone()
    assert small.numel() < qlinear.PASSES_FROM
    np.testing.assert_array_equal(integers(small, zero, info.min, info.max, dtype).numpy(),
                                  want[:, :1, :4])


def test_a_frozen_trace_of_the_route_casts_no_scale() -> None:
    """A Python float scale is a float64 0-d tensor in a frozen trace, cast to float32 at every
    call (a tensor call more): the input's quantization and the output's dequantization take
    theirs as float32 tensors, with the same values."""
    from torch.profiler import ProfilerActivity, profile

    class Step(torch.nn.Module):
        def __init__(self, step) -> None:
            super().__init__()
            self.step = step

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.step(x.clone())

    rng = np.random.default_rng(5)
    a = _fused(quantized_io=True)  # the input's QuantizeLinear and the output's dequantization
    for step in (qlinear_float._finisher(a), qlinear_float._centring(a)):
        x = torch.from_numpy(rng.uniform(-300, 300, (1, 6, 9, 4)).astype(np.float32))
        with torch.no_grad():
            frozen = torch.jit.freeze(torch.jit.trace(Step(step).eval(), (x,)))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            got = frozen(x)
        assert not [e for e in prof.events() if e.name == "aten::_to_copy"]
        torch.testing.assert_close(got, step(x.clone()), rtol=0, atol=0)
