"""Valid models on empty tensors run as ONNX Runtime runs them (issue 32): a Softmax, LogSoftmax
or Hardmax of an empty input, a Conv or ConvTranspose of batch 0, on CpuRef and on CpuAcc (CpuRef
raised NumPy's "zero-size array to reduction operation maximum" and "cannot reshape array of size
0"); the results are ONNX Runtime's, dtype and shape."""

from __future__ import annotations

import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession

F = TensorProto.FLOAT
LISTS = [["CpuRef"], pytest.param(["CpuAcc", "CpuRef"], id="CpuAcc")]


def _model(op: str, x_shape: list, weight: np.ndarray | None = None, **attrs) -> bytes:
    inputs = ["x", "w"] if weight is not None else ["x"]
    inits = [numpy_helper.from_array(weight, "w")] if weight is not None else []
    graph = helper.make_graph([helper.make_node(op, inputs, ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", F, x_shape)],
                              [helper.make_tensor_value_info("y", F, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


CASES = {
    "softmax_2x0": (_model("Softmax", [2, 0]), (2, 0)),
    "softmax_0x3": (_model("Softmax", [0, 3]), (0, 3)),
    "logsoftmax_2x0": (_model("LogSoftmax", [2, 0]), (2, 0)),
    "hardmax_2x0": (_model("Hardmax", [2, 0]), (2, 0)),
    "conv_batch0": (_model("Conv", [0, 1, 4, 4], np.ones((2, 1, 3, 3), np.float32)), (0, 1, 4, 4)),
    "conv_batch0_groups": (_model("Conv", [0, 4, 4, 4], np.ones((4, 2, 3, 3), np.float32),
                                  group=2, pads=[1, 1, 1, 1]), (0, 4, 4, 4)),
    "conv_batch0_depthwise": (_model("Conv", [0, 3, 5, 5], np.ones((3, 1, 3, 3), np.float32),
                                     group=3), (0, 3, 5, 5)),
    "convtranspose_batch0": (_model("ConvTranspose", [0, 1, 3, 3],
                                    np.ones((1, 2, 3, 3), np.float32), strides=[2, 2]),
                             (0, 1, 3, 3)),
}


@pytest.mark.parametrize("backends", LISTS)
@pytest.mark.parametrize("name", CASES)
def test_empty_tensor_runs_as_onnx_runtime_runs_it(name: str, backends: list[str]) -> None:
    model, shape = CASES[name]
    feeds = {"x": np.zeros(shape, np.float32)}
    want = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = InferenceSession(model, backends=backends).run(None, feeds)
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape, (got[0], want[0])
