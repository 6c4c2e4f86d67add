"""A GELU written out after ``quantize_dynamic``'s product (GPT-2's tanh form, nine layers) is the
fused DynamicQuantMatMul's post-op (``fusion/dynamic_quant.py``): one layer, within one
quantization step of ONNX Runtime and CpuRef (the contract for ONNX Runtime's quantized models),
NaN where they have NaN."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_quantized_fusion import _init, placed_types  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.ort_int8 import ort_int8_exact, with_uint8_weights  # noqa: E402

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(2929)


def gelu_after_dynamic_product(k: int = 32, n: int = 16) -> onnx.ModelProto:
    """x @ W + bias by quantize_dynamic's layers, then 0.5 * h * (1 + tanh(sqrt(2 / pi) * (h +
    0.044715 * h * (h * h)))) as torch.onnx exports GPT-2's GELU, then a second product reading it
    (whose own quantization puts the GELU's values on a grid)."""
    node, nodes, inits = helper.make_node, [], []
    for i, (rows, cols) in enumerate(((k, n), (n, 8))):
        inits += [_init(f"w{i}", RNG.integers(-127, 128, (rows, cols)), np.int8),
                  _init(f"wz{i}", 0, np.int8), _init(f"ws{i}", RNG.uniform(0.01, 0.03, cols)),
                  _init(f"b{i}", RNG.standard_normal(cols))]
    inits += [_init("c", 0.044715), _init("r", math.sqrt(2 / math.pi)), _init("one", 1.0),
              _init("half", 0.5)]

    def product(i: int, x: str, y: str) -> None:
        nodes.extend([node("DynamicQuantizeLinear", [x], [f"q{i}", f"s{i}", f"z{i}"]),
                      node("Mul", [f"s{i}", f"ws{i}"], [f"scales{i}"]),
                      node("MatMulInteger", [f"q{i}", f"w{i}", f"z{i}", f"wz{i}"], [f"acc{i}"]),
                      node("Cast", [f"acc{i}"], [f"accf{i}"], to=TensorProto.FLOAT),
                      node("Mul", [f"accf{i}", f"scales{i}"], [f"m{i}"]),
                      node("Add", [f"b{i}", f"m{i}"], [y])])

    product(0, "x", "h")
    nodes += [node("Mul", ["h", "h"], ["sq"]), node("Mul", ["h", "sq"], ["cube"]),
              node("Mul", ["c", "cube"], ["cc"]), node("Add", ["h", "cc"], ["inner"]),
              node("Mul", ["r", "inner"], ["scaled"]), node("Tanh", ["scaled"], ["t"]),
              node("Add", ["one", "t"], ["t1"]), node("Mul", ["h", "t1"], ["ht"]),
              node("Mul", ["half", "ht"], ["g"])]
    product(1, "g", "y")
    return make_model(nodes, [float_input("x", [2, 4, k])], [float_input("y", [2, 4, 8])], inits)


@pytest.mark.parametrize("case", ["random", "nan"])
@pytest.mark.parametrize("compile_mode", ["auto", "layers"])
def test_a_gelu_after_a_dynamic_product_is_its_post_op(case: str, compile_mode: str) -> None:
    model = gelu_after_dynamic_product()
    x = (RNG.standard_normal((2, 4, 32)) * 2).astype(np.float32)
    if case == "nan":
        x[1, 2, 3] = np.nan
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": compile_mode})])
    assert placed_types(session) == ["DynamicQuantMatMul", "DynamicQuantMatMul"]
    (got,) = session.run(None, {"x": x})
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    # one step of the second product's input grid, times the largest |weight| column sum
    step = _second_step(model, x)
    assert float(np.nanmax(np.abs(got - want))) <= step * 1.001
    if case == "random":
        reference = model if ort_int8_exact() else with_uint8_weights(model)
        (theirs,) = ort.InferenceSession(reference.SerializeToString()).run(None, {"x": x})
        assert float(np.max(np.abs(got - theirs))) <= step * 1.001


def _second_step(model: onnx.ModelProto, x: np.ndarray) -> float:
    """What one step of the second product's quantized input moves an output by at most: its
    grid's scale times the largest |dequantized weight| of a column."""
    from onnx import numpy_helper

    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    probe = onnx.ModelProto.FromString(model.SerializeToString())
    probe.graph.output.append(helper.make_tensor_value_info("s1", TensorProto.FLOAT, []))
    _, scale = InferenceSession(probe, backends=["CpuRef"]).run(None, {"x": x})
    weight = np.abs(values["w1"].astype(np.float64) * values["ws1"])
    return float(scale) * float(weight.max())
