"""LayerNormalization written out (as torch.onnx exports nn.LayerNorm below opset 17) on CpuAcc: one
LayerNormalization layer (``fusion/layernorm.py``) equal to CpuRef's nine layers, NaN and infinities
where they put them; a chain with other constants or another axis is left as it is."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_fusion import _on_cpuacc, placed  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

WIDTH = 16


def _chain(x: str = "x", axis: int = -1, exponent: float = 2.0, eps_in_root: bool = True,
           bias: bool = True, opset: int = 14) -> tuple[list[onnx.NodeProto],
                                                        list[onnx.TensorProto]]:
    """torch.onnx's nn.LayerNorm at opset 14: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div,
    Mul, Add; ``eps_in_root`` False adds epsilon to the root instead of the variance."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.float32(exponent), "two"),
             numpy_helper.from_array(np.float32(1e-5), "eps"),
             numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), "scale"),
             numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), "bias")]
    if opset >= 18:
        inits.append(numpy_helper.from_array(np.array([axis], dtype=np.int64), "axes"))

    def mean(src: str, out: str) -> onnx.NodeProto:
        if opset >= 18:
            return helper.make_node("ReduceMean", [src, "axes"], [out], name=out)
        return helper.make_node("ReduceMean", [src], [out], name=out, axes=[axis])

    root = ["v", "eps"] if eps_in_root else ["v"]
    nodes = [mean(x, "m"), helper.make_node("Sub", [x, "m"], ["d"], name="sub"),
             helper.make_node("Pow", ["d", "two"], ["p"], name="pow"), mean("p", "v")]
    if eps_in_root:
        nodes += [helper.make_node("Add", root, ["ve"], name="add_eps"),
                  helper.make_node("Sqrt", ["ve"], ["s"], name="sqrt")]
    else:
        nodes += [helper.make_node("Sqrt", ["v"], ["r"], name="sqrt"),
                  helper.make_node("Add", ["r", "eps"], ["s"], name="add_eps")]
    nodes += [helper.make_node("Div", ["d", "s"], ["n"], name="div"),
              helper.make_node("Mul", ["n", "scale"], ["y" if not bias else "ns"], name="mul")]
    if bias:
        nodes.append(helper.make_node("Add", ["ns", "bias"], ["y"], name="add_bias"))
    return nodes, inits


def _model(shape: tuple[int, ...] = (2, 5, WIDTH), **chain) -> onnx.ModelProto:
    nodes, inits = _chain(**chain)
    opset = chain.get("opset", 14)
    return make_model(nodes, [float_input("x", list(shape))], [float_input("y", list(shape))],
                      inits, opset=opset)


def _compare(model: onnx.ModelProto, shape: tuple[int, ...], special: bool) -> None:
    session = _on_cpuacc(model, **{"CpuAcc.compile": "layers"})
    x = (np.random.default_rng(3).standard_normal(shape) * 3).astype(np.float32)
    if special:
        x[0, 0, :3] = [np.nan, 1.0, 2.0]
        x[0, 1, 4] = np.inf
        x[1, 2, :] = 7.0  # a constant row: variance 0
    got = session.run(None, {"x": x})[0]
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chain", [{}, {"bias": False}, {"opset": 18}, {"axis": 2}],
                         ids=["opset14", "no-bias", "axes-input", "positive-axis"])
def test_the_written_out_chain_is_one_layer_norm(chain) -> None:
    model = _model(**chain)
    session = _on_cpuacc(model, **{"CpuAcc.compile": "layers"})
    assert [layer.op_type for layer in placed(session)] == ["LayerNormalization"]
    for special in (False, True):
        _compare(model, (2, 5, WIDTH), special)


@pytest.mark.parametrize("chain", [{"eps_in_root": False}, {"axis": 1}, {"exponent": 3.0}],
                         ids=["epsilon-outside-root", "other-axis", "cube"])
def test_other_chains_are_left_alone(chain) -> None:
    shape = (2, WIDTH, WIDTH)  # axis 1 of the same width: only the axis differs
    model = _model(shape, **chain)
    session = _on_cpuacc(model, **{"CpuAcc.compile": "layers"})
    assert "LayerNormalization" not in [layer.op_type for layer in placed(session)]
    _compare(model, shape, special=False)


def test_an_intermediate_read_elsewhere_stops_the_fusion() -> None:
    nodes, inits = _chain()
    model = make_model(nodes, [float_input("x", [2, 5, WIDTH])],
                       [float_input("y", [2, 5, WIDTH]), float_input("v", [2, 5, 1])], inits,
                       opset=14)
    session = _on_cpuacc(model, **{"CpuAcc.compile": "layers"})
    assert "LayerNormalization" not in [layer.op_type for layer in placed(session)]
