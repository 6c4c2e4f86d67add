"""CpuAcc's fused QOperator layers (fusion/qlinear.py): QuantizeLinear -> QLinearConv ->
DequantizeLinear [-> Relu] and QLinearMatMul [-> DequantizeLinear -> Add] are one layer each,
requantizing in float32 as ONNX Runtime does (the reference for these ops): within one step of
CpuRef's float64 requantization and of ONNX Runtime's outputs, on inputs with ties (a multiplier
of exactly 1/2), values past both ends of the type, NaN and infinities."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from tests.backends.torch.qlinear_models import (  # noqa: E402
    RNG,
    qlinear_conv_model,
    qlinear_matmul_model,
    within_a_step,
)
from tests.backends.torch.test_quantized_fusion import (  # noqa: E402, F401
    compile_mode,
    ort_output,
    placed,
    placed_types,
    run_both,
)
from backplane import InferenceSession  # noqa: E402
from tests.conftest import float_input  # noqa: E402


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("group", [1, 3, 6])
@pytest.mark.parametrize("quantized_io", [True, False], ids=["float-in-out", "integer-in-out"])
def test_qlinear_conv_is_one_layer_within_a_step(quantized_io: bool, group: int, dtype: type,
                                                 compile_mode: str) -> None:
    model = qlinear_conv_model(quantized_io, group, dtype)
    info = np.iinfo(dtype)
    if quantized_io:  # every step from far below to far above the type's range, NaN, +-inf
        x = np.round(RNG.uniform(-260, 260, (1, 6, 7, 8)) * 2) / 2
        x.reshape(-1)[:3] = [np.nan, np.inf, -np.inf]
        feeds = {"x": x.astype(np.float32)}
    else:
        feeds = {"xq": RNG.integers(info.min, info.max + 1, (1, 6, 7, 8)).astype(dtype)}
    session, got, want = run_both(model, feeds, compile_mode)
    if placed_types(session) == ["NativeInt8"]:  # float in and out: the native int8 route
        assert quantized_io and compile_mode == "auto"  # (1: dense, 3: by groups, 6:
        # depthwise; tests/native/test_qcnn)
        # which quantizes NaN as ONNX Runtime does, to the type's low end (as -inf): CpuRef's
        # is NumPy's cast of NaN
        low = {"x": np.where(np.isnan(feeds["x"]), -np.inf, feeds["x"]).astype(np.float32)}
        want = InferenceSession(model, backends=["CpuRef"]).run(None, low)[0]
    else:
        assert placed_types(session) == ["QLinearConv"]
        assert {lay.domain for lay in placed(session) if lay.op_type == "QLinearConv"} \
            == {"backplane.torch"}  # CpuAcc's, not the integer kernel (in a OneDnnGraph, or alone)
    within_a_step(got, want, 1.0)  # y's scale: 1
    if not quantized_io:  # the requantized sums reach both ends of the type
        assert got.min() == info.min and got.max() == info.max
    if not quantized_io and dtype == np.uint8:  # ORT has no int8 x uint8 QLinearConv
        within_a_step(got, ort_output(model, feeds), 1.0)


@pytest.mark.parametrize("per_column", [False, True], ids=["per-tensor", "per-column"])
def test_qlinear_matmul_with_bias_is_one_layer_within_a_step(per_column: bool,
                                                             compile_mode: str) -> None:
    model = qlinear_matmul_model(per_column)
    feeds = {"x": (RNG.standard_normal((2, 3, 24)) * 3).astype(np.float32)}
    session, got, want = run_both(model, feeds, compile_mode)
    assert placed_types(session) == ["QLinearMatMul"]
    assert float(np.max(np.abs(got - want))) <= 0.004 * 1.001  # y's scale
    assert float(np.max(np.abs(got - ort_output(model, feeds)))) <= 0.004 * 1.001


def test_qlinear_conv_with_a_computed_scale_stays_as_it_is(compile_mode: str) -> None:
    """x's scale fed at run time: no fusion (its multiplier is unknown at load), CpuRef's answer."""
    model = qlinear_conv_model(False, 1, np.uint8)
    model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "xs"))
    model.graph.input.append(float_input("xs", []))
    feeds = {"xq": RNG.integers(0, 256, (1, 6, 7, 8)).astype(np.uint8),
             "xs": np.array(1.0, np.float32)}
    session, got, want = run_both(model, feeds, compile_mode)
    assert "QLinearConv" in placed_types(session)
    assert all(lay.domain == "" for lay in placed(session) if lay.op_type == "QLinearConv")
    np.testing.assert_array_equal(got, want)
