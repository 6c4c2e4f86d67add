"""A feed for a graph input that has an initializer (its default, IR 4 on) is taken and computed
with, as ONNX Runtime does, on every backend; without it the initializer is used (overriding.py)."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from backplane.runtime.runtime import InvalidInputError

F = TensorProto.FLOAT
LISTS = [["CpuRef"], ["CpuAcc", "CpuRef"],
         pytest.param(["OpenVINO", "CpuRef"], marks=pytest.mark.skipif(
             importlib.util.find_spec("openvino") is None, reason="OpenVINO is not installed"))]


def _model(ir_version: int = 8) -> bytes:
    """y = x + 2 * w, w an input whose default is [1, 2, 3] (2 * w folds to a constant)."""
    nodes = [helper.make_node("Mul", ["w", "two"], ["w2"], name="double"),
             helper.make_node("Add", ["x", "w2"], ["y"], name="add")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, [3]),
                     helper.make_tensor_value_info("w", F, [3])],
        [helper.make_tensor_value_info("y", F, [3])],
        [numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w"),
         numpy_helper.from_array(np.array(2, np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = ir_version
    return model.SerializeToString()


@pytest.mark.parametrize("backends", LISTS, ids=lambda b: b[0])
def test_a_feed_for_an_input_with_an_initializer_is_used(backends: list[str]) -> None:
    session = InferenceSession(_model(), backends=backends)
    ort = onnxruntime.InferenceSession(_model(), providers=["CPUExecutionProvider"])
    x = np.array([10, 20, 30], np.float32)
    for feeds in ({"x": x}, {"x": x, "w": np.array([-1, 0, 5], np.float32)}, {"x": x},
                  {"x": x, "w": np.array([7, 7, 7], np.float32)}):
        want = ort.run(None, feeds)[0]
        np.testing.assert_array_equal(session.run(None, feeds)[0], want)
    assert [i.name for i in session.get_inputs()] == ["x"]  # as ONNX Runtime lists them
    session.close()


def test_before_ir_4_an_initializer_listed_as_input_is_a_constant() -> None:
    """Before IR 4 every initializer had to be listed among the inputs: none is a default."""
    session = InferenceSession(_model(ir_version=3), backends=["CpuRef"])
    with pytest.raises(InvalidInputError, match="'w'"):
        session.run(None, {"x": np.zeros(3, np.float32), "w": np.zeros(3, np.float32)})
