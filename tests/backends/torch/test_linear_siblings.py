"""Plain products by constant weights of one input (attention's separate Q, K and V projections)
become one ``LinearSiblings`` layer, one product split into views, with CpuRef's and ONNX
Runtime's values; a sibling with more fused to it, or read outside the subgraph, stays its own."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_fusion import placed  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.models.test_models import DATA, ort_outputs  # noqa: E402

TAGGER = DATA / "corpus" / "char_tagger_ts14"


def _static_tagger() -> bytes:
    """The corpus's char tagger (separate q, k, v ``nn.Linear`` in each of its 4 blocks, exported
    by torch.onnx) with its input fixed at its first size, so that it is fused at load."""
    model = onnx.load(f"{TAGGER}.onnx")
    for dim, size in zip(model.graph.input[0].type.tensor_type.shape.dim, (1, 48)):
        dim.ClearField("dim_param")
        dim.dim_value = size
    return model.SerializeToString()


def test_each_blocks_projections_become_one_product(tmp_path) -> None:
    model = _static_tagger()
    path = tmp_path / "tagger.onnx"
    path.write_bytes(model)
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
    ops = [layer.op_type for layer in placed(session)]
    assert ops.count("LinearSiblings") == 4  # q, k and v of each block
    (siblings,) = {tuple(lay.attrs["sizes"]) for lay in placed(session)
                   if lay.op_type == "LinearSiblings"}
    assert siblings == (32, 32, 32)
    feeds = dict(np.load(f"{TAGGER}.s0.npz"))
    (got,), (want,) = session.run(None, feeds), ort_outputs(path, feeds)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def _projections(relu_on: str | None = None, output: str | None = None) -> onnx.ModelProto:
    """x (1, 8, 16) -> q, k, v = x Wq + bq, x Wk + bk, x Wv (no bias) -> y = q * k * v (an
    Add would be the last product's residual), with
    ``relu_on``'s product followed by a Relu and ``output``'s also an output of the graph."""
    rng = np.random.default_rng(3)
    inits, nodes = [], []
    for name, width in (("q", 12), ("k", 12), ("v", 12)):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((16, width)) * 0.3).astype(np.float32), f"w{name}"))
        nodes.append(helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}0"], name=f"mm_{name}"))
        last = f"{name}0"
        if name != "v":
            inits.append(numpy_helper.from_array(rng.standard_normal(width).astype(np.float32),
                                                 f"b{name}"))
            nodes.append(helper.make_node("Add", [last, f"b{name}"], [f"{name}1"],
                                          name=f"add_{name}"))
            last = f"{name}1"
        if name == relu_on:
            nodes.append(helper.make_node("Relu", [last], [f"{name}2"], name=f"relu_{name}"))
            last = f"{name}2"
        nodes.append(helper.make_node("Identity", [last], [name], name=f"id_{name}"))
    nodes += [helper.make_node("Mul", ["q", "k"], ["qk"], name="mul"),
              helper.make_node("Mul", ["qk", "v"], ["y"], name="times")]
    outputs = [float_input("y", [1, 8, 12])]
    if output is not None:  # its biased product itself an output (q or k)
        outputs.append(float_input(f"{output}1", [1, 8, 12]))
    return make_model(nodes, [float_input("x", [1, 8, 16])], outputs, inits)


def _against_cpuref(model: onnx.ModelProto) -> list[str]:
    x = np.random.default_rng(4).standard_normal((1, 8, 16)).astype(np.float32)
    x[0, 2, 5] = np.nan  # a NaN in one row: NaN in that row of every product, as on CpuRef
    session = InferenceSession(model.SerializeToString(), backends=["CpuAcc", "CpuRef"])
    reference = InferenceSession(model.SerializeToString(), backends=["CpuRef"])
    for got, want in zip(session.run(None, {"x": x}), reference.run(None, {"x": x})):
        assert np.isnan(got[0, 2]).all() and np.isnan(want[0, 2]).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return [layer.op_type for layer in placed(session)]


def test_plain_projections_with_and_without_bias_become_one() -> None:
    ops = _against_cpuref(_projections())
    assert ops.count("LinearSiblings") == 1 and "Linear" not in ops


def test_a_product_with_its_activation_stays_its_own() -> None:
    ops = _against_cpuref(_projections(relu_on="v"))
    assert ops.count("LinearSiblings") == 1 and ops.count("Linear") == 1


def test_a_product_read_as_an_output_stays_its_own() -> None:
    ops = _against_cpuref(_projections(output="k"))
    assert ops.count("LinearSiblings") == 1 and ops.count("Linear") == 1


def test_products_after_a_convolution_stay_apart() -> None:
    """A subgraph with convolutions is oneDNN Graph's to compile whole, from the ops it knows."""
    rng = np.random.default_rng(5)
    kernel = (rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32)
    inits = [numpy_helper.from_array(kernel, "wc"),
             numpy_helper.from_array(np.array([1, 64], np.int64), "flat")]
    nodes = [helper.make_node("Conv", ["x", "wc"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["c", "flat"], ["f"], name="flatten")]
    for name in ("a", "b"):
        inits.append(numpy_helper.from_array(
            (rng.standard_normal((64, 10)) * 0.1).astype(np.float32), f"w{name}"))
        nodes.append(helper.make_node("MatMul", ["f", f"w{name}"], [name], name=f"mm_{name}"))
    nodes.append(helper.make_node("Mul", ["a", "b"], ["y"], name="times"))
    model = make_model(nodes, [float_input("x", [1, 3, 4, 4])], [float_input("y", [1, 10])], inits)
    x = np.random.default_rng(6).standard_normal((1, 3, 4, 4)).astype(np.float32)
    session = InferenceSession(model.SerializeToString(), backends=["CpuAcc", "CpuRef"])
    reference = InferenceSession(model.SerializeToString(), backends=["CpuRef"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0],
                               rtol=1e-5, atol=1e-5)
    assert "LinearSiblings" not in [layer.op_type for layer in placed(session)]
