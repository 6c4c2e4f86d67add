"""Hard-swish written out (x * Clip(x + 3, 0, 6) / 6, as torch exports it below opset 14) on CpuAcc:
a convolution's post-op, or one HardSwishChain layer equal to CpuRef's four layers bit for bit,
NaN and infinities included; near misses stay as they are."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_fusion import _const, _on_cpuacc, placed  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402


def _chain(x: str, out: str, three: float = 3.0, six: float = 6.0, swap: bool = False,
           ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    inits = [numpy_helper.from_array(np.float32(v), f"{out}_{n}")
             for n, v in (("three", three), ("zero", 0.0), ("six", 6.0), ("div", six))]
    mul_inputs = [f"{out}_c", x] if swap else [x, f"{out}_c"]
    nodes = [helper.make_node("Add", [x, f"{out}_three"], [f"{out}_a"], name=f"{out}_add"),
             helper.make_node("Clip", [f"{out}_a", f"{out}_zero", f"{out}_six"], [f"{out}_c"],
                              name=f"{out}_clip"),
             helper.make_node("Mul", mul_inputs, [f"{out}_m"], name=f"{out}_mul"),
             helper.make_node("Div", [f"{out}_m", f"{out}_div"], [out], name=f"{out}_div")]
    return nodes, inits


def _model(**chain: float | bool) -> onnx.ModelProto:
    """x -> Conv -> hard-swish -> (+ skip) -> hard-swish: one chain after a convolution, one after
    an Add, where no convolution can take it."""
    first, inits1 = _chain("c", "h1", **chain)
    second, inits2 = _chain("s", "y", **chain)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]), *first,
             helper.make_node("Add", ["h1", "skip"], ["s"], name="skip_add"), *second]
    return make_model(nodes, [float_input("x", [1, 4, 6, 6]), float_input("skip", [1, 8, 6, 6])],
                      [float_input("y", [1, 8, 6, 6])], [_const("w", 8, 4, 3, 3), *inits1, *inits2],
                      opset=11)


def _feeds(special: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((1, 4, 6, 6)) * 4).astype(np.float32)
    skip = (rng.standard_normal((1, 8, 6, 6)) * 6).astype(np.float32)
    if special:
        skip.reshape(-1)[:6] = [np.nan, np.inf, -np.inf, -3.0, 3.0, -0.0]
        x[0, 0, 0, 0] = np.nan
    return {"x": x, "skip": skip}


@pytest.mark.parametrize("swap", [False, True])
def test_both_chains_are_fused_and_equal_cpuref(swap: bool) -> None:
    model = _model(swap=swap)
    session = _on_cpuacc(model, **{"CpuAcc.compile": "layers"})
    assert [layer.op_type for layer in placed(session)] == ["FusedConv", "Add", "HardSwishChain"]
    reference = InferenceSession(model, backends=["CpuRef"])
    for special in (False, True):
        feeds = _feeds(special)
        got, expected = session.run(None, feeds)[0], reference.run(None, feeds)[0]
        np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_lone_chain_is_bit_for_bit_cpurefs() -> None:
    nodes, inits = _chain("x", "y")
    model = make_model(nodes, [float_input("x", [4, 1000])], [float_input("y", [4, 1000])], inits,
                       opset=11)
    session = _on_cpuacc(model, **{"CpuAcc.compile": "layers"})
    assert [layer.op_type for layer in placed(session)] == ["HardSwishChain"]
    x = (np.random.default_rng(2).standard_normal((4, 1000)) * 5).astype(np.float32)
    x.reshape(-1)[:8] = [np.nan, np.inf, -np.inf, -3.0, 3.0, -0.0, 1e38, -2.9999998]
    got = session.run(None, {"x": x})[0]
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))  # NaN's payload may differ
    kept = ~np.isnan(expected)
    assert got[kept].tobytes() == expected[kept].tobytes()  # -0.0 and every bit of the rest


@pytest.mark.parametrize("near_miss", [{"three": 3.5}, {"six": 6.0001}])
def test_other_constants_are_left_alone(near_miss: dict[str, float]) -> None:
    model = _model(**near_miss)
    ops = [layer.op_type for layer in placed(_on_cpuacc(model, **{"CpuAcc.compile": "layers"}))]
    assert "HardSwishChain" not in ops and "Div" in ops


def test_a_chain_whose_step_is_read_elsewhere_is_left_alone() -> None:
    model = _model()
    model.graph.output.append(helper.make_empty_tensor_value_info("y_c"))  # the Clip is read
    ops = [layer.op_type for layer in placed(_on_cpuacc(model, **{"CpuAcc.compile": "layers"}))]
    assert "HardSwishChain" not in ops and "Clip" in ops
