"""Generic passes: constant folding (Shape of static tensors included), identity / dropout removal."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession, OptimizerOptions
from tests.conftest import float_input, make_model


def shape_chain_model():
    shape = numpy_helper.from_array(np.array([2, -1], np.int64), "target")
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Identity", ["x"], ["xi"], name="ident"),
        helper.make_node("Dropout", ["xi"], ["xd"], name="drop"),
        helper.make_node("Reshape", ["xd", "target"], ["r"], name="reshape"),
        helper.make_node("Cast", ["s"], ["sf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["sf"], ["n"], name="sum", keepdims=0),
        helper.make_node("Mul", ["r", "n"], ["y"], name="mul"),
    ]
    return make_model(nodes, [float_input("x", [2, 3, 4])], [float_input("y", [2, 12])], [shape])


def test_folding_and_identity_removal_leave_the_work() -> None:
    session = InferenceSession(shape_chain_model(), ["CpuRef"])
    assert [layer.op_type for layer in session.optimized.graph.layers] == ["Reshape", "Mul"]
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x.reshape(2, 12) * 9)


def test_passes_can_be_turned_off() -> None:
    options = OptimizerOptions(fold_constants=False, remove_identities=False)
    session = InferenceSession(shape_chain_model(), ["CpuRef"], optimizer_options=options)
    assert len(session.optimized.graph.layers) == 7
    x = np.ones((2, 3, 4), np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.full((2, 12), 9, np.float32))


def test_folded_shape_computations_give_static_shapes() -> None:
    """ONNX's whole-model inference cannot see through Shape -> Cast -> Abs -> Cast; once folded, the
    Reshape's target is a constant and its output (and everything after it) gets a static shape."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Cast", ["s"], ["sf"], name="to_float", to=TensorProto.FLOAT),
        helper.make_node("Abs", ["sf"], ["sa"], name="abs"),
        helper.make_node("Cast", ["sa"], ["si"], name="to_int", to=TensorProto.INT64),
        helper.make_node("ReduceProd", ["si"], ["n"], name="count", keepdims=1),
        helper.make_node("Reshape", ["x", "n"], ["flat"], name="flatten"),
        helper.make_node("Relu", ["flat"], ["y"], name="relu"),
    ]
    model = make_model(nodes, [float_input("x", [2, 3, 4])], [float_input("y", None)])
    unfolded = InferenceSession(model, ["CpuRef"], optimizer_options=OptimizerOptions(fold_constants=False))
    assert not unfolded.optimized.graph.info("flat").is_static
    session = InferenceSession(model, ["CpuRef"])
    assert [layer.op_type for layer in session.optimized.graph.layers] == ["Reshape", "Relu"]
    assert session.optimized.graph.info("flat").shape == (24,)
    assert session.optimized.graph.info("y").shape == (24,)
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 3, 4)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x.reshape(-1), 0))


def test_a_cast_to_its_inputs_own_type_is_dropped() -> None:
    """Cast of a bool comparison to bool, and of float32 to float32, reads its input as it is (a
    Loop body's per iteration); a cast to another type stays; a Cast giving a graph output keeps
    its layer (the output is the caller's own array). NaN passes through as ONNX Runtime's."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["gt"], name="gt"),
             helper.make_node("Cast", ["gt"], ["gt_b"], name="same_bool", to=TensorProto.BOOL),
             helper.make_node("Cast", ["x"], ["x_f"], name="same_float", to=TensorProto.FLOAT),
             helper.make_node("Where", ["gt_b", "x_f", "zero"], ["w"], name="where"),
             helper.make_node("Cast", ["w"], ["y"], name="to_double", to=TensorProto.DOUBLE),
             helper.make_node("Cast", ["x"], ["z"], name="out_same", to=TensorProto.FLOAT)]
    model = make_model(nodes, [float_input("x", [2, 3])],
                       [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3]),
                        float_input("z", [2, 3])],
                       [numpy_helper.from_array(np.float32(0.0), "zero")])
    session = InferenceSession(model, ["CpuRef"])
    names = {layer.name for layer in session.optimized.graph.layers}
    assert "same_bool" not in names and "same_float" not in names
    assert {"to_double", "out_same"} <= names
    x = np.array([[1, -2, np.nan], [0, 3, -0.5]], np.float32)
    y, z = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, np.where(x > 0, x, 0).astype(np.float64))
    np.testing.assert_array_equal(z, x)
    assert not np.shares_memory(z, x)
