"""The OpenVINO backend never returns memory it did not write, checks before OpenVINO what OpenVINO
would crash on or answer silently wrong (negative shapes, indices out of range, contradictory
attributes), and lets NaN through as CpuRef does. Skipped where OpenVINO is not installed."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

pytest.importorskip("openvino")

from backplane import InferenceSession  # noqa: E402

F = TensorProto.FLOAT


def model_of(nodes: list, inputs: list, outputs: list, initializers: list = (),
             opset: int = 17) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]) \
        .SerializeToString()


def vi(name: str, shape: list | None, kind: int = F) -> object:
    return helper.make_tensor_value_info(name, kind, shape)


def test_an_output_that_is_an_input_is_a_fresh_copy_of_it() -> None:
    """Dropout and a one-input Sum become Parameter -> Result in OpenVINO, which never writes the
    output tensor it is given: the array returned held whatever memory np.empty found."""
    model = model_of(
        [helper.make_node("Relu", ["a"], ["r"], name="relu"),
         helper.make_node("Dropout", ["b"], ["d"], name="drop"),
         helper.make_node("Sum", ["a"], ["s"], name="sum")],
        [vi("a", [64, 64]), vi("b", [128, 128])], [vi("s", [64, 64]), vi("r", [64, 64]),
                                                  vi("d", [128, 128])])
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert session.report.counts() == {"OpenVINO": 3}
    rng = np.random.default_rng(0)
    for _ in range(3):  # freed arrays of the size of the outputs lie about for np.empty to find
        junk = [np.full((128, 128), 7.0, np.float32), np.full((64, 64), 7.0, np.float32)]
        del junk
        a = rng.standard_normal((64, 64)).astype(np.float32)
        b = rng.standard_normal((128, 128)).astype(np.float32)
        s, r, d = session.run(None, {"a": a, "b": b})
        np.testing.assert_array_equal(d, b)
        np.testing.assert_array_equal(s, a)
        np.testing.assert_array_equal(r, np.maximum(a, 0))
        assert not np.shares_memory(d, b) and not np.shares_memory(s, a)
        b[...] = 0  # the caller refills its buffer: what was returned stays
        assert np.abs(d).sum() > 0
