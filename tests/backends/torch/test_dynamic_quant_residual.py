"""A residual Add after ``quantize_dynamic``'s product (a transformer block's sum: x + (h @ W +
bias)) is the fused DynamicQuantMatMul's last step (``fusion/dynamic_quant.py``): one layer, its
outputs CpuRef's bit for bit (one rounding, the Add's own) natively and on torch's route, NaN where
CpuRef has NaN; an Add of a constant or of a broadcast tensor stays a layer of its own."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_quantized_fusion import _init, placed_types  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(3131)


def residual_after_dynamic_product(k: int = 32, other: str = "x", flipped: bool = False,
                                   other_shape: list[int] | None = None) -> onnx.ModelProto:
    """y = Add(other, x @ W + bias) by quantize_dynamic's layers (``other`` x itself, an input
    "r" of ``other_shape``, or the constant "c"), the Add's operands in either order."""
    node = helper.make_node
    inits = [_init("w", RNG.integers(-127, 128, (k, k)), np.int8), _init("wz", 0, np.int8),
             _init("ws", RNG.uniform(0.01, 0.03, k)), _init("b", RNG.standard_normal(k)),
             _init("c", RNG.standard_normal((2, 4, k)))]
    operands = ["m2", other] if flipped else [other, "m2"]
    nodes = [node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
             node("Mul", ["s", "ws"], ["scales"]),
             node("MatMulInteger", ["q", "w", "z", "wz"], ["acc"]),
             node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             node("Mul", ["accf", "scales"], ["m"]), node("Add", ["b", "m"], ["m2"]),
             node("Add", operands, ["y"])]
    inputs = [float_input("x", [2, 4, k])]
    if other == "r":
        inputs.append(float_input("r", other_shape or [2, 4, k]))
    return make_model(nodes, inputs, [float_input("y", [2, 4, k])], inits)


def _feeds(model: onnx.ModelProto, nan: bool) -> dict[str, np.ndarray]:
    feeds = {"x": (RNG.standard_normal((2, 4, 32)) * 2).astype(np.float32)}
    if len(model.graph.input) > 1:
        shape = [d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim]
        feeds["r"] = RNG.standard_normal(shape).astype(np.float32)
    if nan:
        feeds["x"][1, 2, 3] = np.nan
    return feeds


@pytest.mark.parametrize("other,flipped", [("x", False), ("r", False), ("r", True)])
@pytest.mark.parametrize("native", ["auto", "off"])
@pytest.mark.parametrize("nan", [False, True])
def test_a_residual_add_after_a_dynamic_product_is_its_last_step(other, flipped, native, nan):
    model = residual_after_dynamic_product(other=other, flipped=flipped)
    session = InferenceSession(model, backends=[("CpuAcc", {"native": native,
                                                            "compile": "layers"})])
    assert placed_types(session) == ["DynamicQuantMatMul"]
    feeds = _feeds(model, nan)
    (got,) = session.run(None, feeds)
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_array_equal(got, want)  # NaN where CpuRef has NaN


@pytest.mark.parametrize("other,shape", [("c", None), ("r", [1, 1, 32])])
def test_an_add_of_a_constant_or_a_broadcast_stays_apart(other, shape):
    model = residual_after_dynamic_product(other=other, other_shape=shape)
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "layers"})])
    assert placed_types(session) == ["DynamicQuantMatMul", "Add"]
    feeds = _feeds(model, False)
    (got,) = session.run(None, feeds)
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_array_equal(got, want)
