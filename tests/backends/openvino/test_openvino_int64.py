"""OpenVINO's CPU plugin computes int64 as int32 and answers a reduction over an empty axis
wrongly: what it would answer wrongly runs on CpuRef, or the run is refused (checks.py, int64.py).
Skipped where OpenVINO is not installed."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("openvino")

from backplane import InferenceSession  # noqa: E402
from backplane.runtime.loaded_network import ExecutionError  # noqa: E402

I64, F = TensorProto.INT64, TensorProto.FLOAT
I64_MIN, I64_MAX = np.iinfo(np.int64).min, np.iinfo(np.int64).max
BACKENDS = ["OpenVINO", "CpuRef"]


def model_of(nodes: list, inputs: list, outputs: list, initializers: list = (),
             opset: int = 17) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]) \
        .SerializeToString()


def vi(name: str, shape: list | None, kind: int = F) -> object:
    return helper.make_tensor_value_info(name, kind, shape)


def both(model: bytes, feeds: dict) -> tuple[list, list, InferenceSession]:
    session = InferenceSession(model, backends=BACKENDS)
    reference = InferenceSession(model, backends=["CpuRef"])
    return session.run(None, feeds), reference.run(None, feeds), session


def test_int64_arithmetic_on_given_values_runs_on_cpuref_and_wraps_as_onnx() -> None:
    """OpenVINO gave 0 for INT64_MIN * -1 (bench/hostile.py's int64_mul_overflow) and 1 for
    2**40 + 1: a Mul or Add of the user's int64 values is left to CpuRef."""
    model = model_of([helper.make_node("Mul", ["a", "b"], ["m"], name="mul"),
                      helper.make_node("Add", ["m", "c"], ["y"], name="add")],
                     [vi("a", [3], I64), vi("b", [3], I64)], [vi("y", [3], I64)],
                     [numpy_helper.from_array(np.array([1, 1, 1], np.int64), "c")])
    feeds = {"a": np.array([I64_MIN, I64_MAX, 2**40], np.int64),
             "b": np.array([-1, 2, 1], np.int64)}
    got, want, session = both(model, feeds)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[0], [I64_MIN + 1, -1, 2**40 + 1])
    for name in ("mul", "add"):
        layer = session.report.layers[name]
        assert layer.backend == "CpuRef"
        assert "32 bits" in dict(layer.refusals)["OpenVINO"]


def test_shape_arithmetic_in_int64_stays_on_openvino() -> None:
    """Sizes computed from shapes fit in 32 bits: Shape, Gather, Mul, Concat, Reshape stay."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"),
             helper.make_node("Gather", ["s", "zero"], ["n"], name="first"),
             helper.make_node("Mul", ["n", "three"], ["n3"], name="mul"),
             helper.make_node("Concat", ["n3", "minus1"], ["to"], name="concat", axis=0),
             helper.make_node("Reshape", ["x", "to"], ["r"], name="reshape"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    constants = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
                 numpy_helper.from_array(np.array([3], np.int64), "three"),
                 numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    model = model_of(nodes, [vi("x", ["n", 6])], [vi("y", None)], constants)
    feeds = {"x": np.arange(-12, 12, dtype=np.float32).reshape(4, 6)}
    got, want, session = both(model, feeds)
    np.testing.assert_array_equal(got[0], want[0])
    assert session.report.counts() == {"OpenVINO": 6}


@pytest.mark.parametrize("op", ["Identity", "Equal", "Concat"])
def test_given_int64_values_past_32_bits_are_refused_not_truncated(op: str) -> None:
    """OpenVINO gave 5 for an Identity of 2**40 + 5 and True for Equal(2**40 + 5, 5): an int64
    input it reads as data is checked before the run; within 32 bits it runs there."""
    inputs = {"Identity": ["a"], "Equal": ["a", "five"], "Concat": ["a", "a"]}[op]
    kind = TensorProto.BOOL if op == "Equal" else I64
    attrs = {"axis": 0} if op == "Concat" else {}
    model = model_of([helper.make_node(op, inputs, ["y"], name="op", **attrs)],
                     [vi("a", [3], I64)], [vi("y", None, kind)],
                     [numpy_helper.from_array(np.array([5, 5, 5], np.int64), "five")])
    session = InferenceSession(model, backends=BACKENDS)
    assert session.report.layers["op"].backend == "OpenVINO"
    small = {"a": np.array([5, -2**31, 2**31 - 1], np.int64)}
    np.testing.assert_array_equal(session.run(None, small)[0],
                                  InferenceSession(model, backends=["CpuRef"]).run(None, small)[0])
    with pytest.raises(ExecutionError, match="past 32 bits"):
        session.run(None, {"a": np.array([2**40 + 5, 1, 2], np.int64)})


def test_gather_indices_given_as_int64_stay_on_openvino_and_are_checked() -> None:
    """input_ids -> Reshape -> Gather (GPT-2's embedding): the Reshape stays (its values are only
    indices, checked against the axis before the run)."""
    model = model_of([helper.make_node("Reshape", ["ids", "flat"], ["r"], name="reshape"),
                      helper.make_node("Gather", ["table", "r"], ["y"], name="gather")],
                     [vi("ids", [1, 3], I64)], [vi("y", None)],
                     [numpy_helper.from_array(np.arange(8, dtype=np.float32).reshape(4, 2),
                                              "table"),
                      numpy_helper.from_array(np.array([-1], np.int64), "flat")])
    session = InferenceSession(model, backends=BACKENDS)
    assert session.report.counts() == {"OpenVINO": 2}
    np.testing.assert_array_equal(session.run(None, {"ids": np.array([[3, 0, 1]])})[0],
                                  [[6, 7], [0, 1], [2, 3]])
    with pytest.raises(ExecutionError, match="out of range"):
        session.run(None, {"ids": np.array([[2**32 + 1, 0, 1]])})


@pytest.mark.parametrize("op", ["ReduceMax", "ArgMax"])
@pytest.mark.parametrize("inside", [False, True], ids=["input", "computed"])
def test_a_reduction_over_an_axis_empty_at_run_time_is_refused(op: str, inside: bool) -> None:
    """OpenVINO gave float32's lowest for a ReduceMax over an empty axis (ONNX: -inf) and 0 for
    an ArgMax of one: the free dimension it reduces is checked at run time, on the partition's
    input or (computed inside) on the Shape the compiled model also outputs."""
    attrs = {"axes": [1]} if op == "ReduceMax" else {"axis": 1}
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu")] if inside else []
    nodes.append(helper.make_node(op, ["r" if inside else "x"], ["y"], name="reduce", **attrs))
    model = model_of(nodes, [vi("x", [2, "m"])], [vi("y", None, I64 if op == "ArgMax" else F)],
                     opset=13)
    session = InferenceSession(model, backends=BACKENDS)
    assert session.report.layers["reduce"].backend == "OpenVINO"
    feeds = {"x": np.array([[1, 5, 2], [-3, -1, -2]], np.float32)}
    np.testing.assert_array_equal(session.run(None, feeds)[0],
                                  InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0])
    with pytest.raises(ExecutionError, match="empty axis"):
        session.run(None, {"x": np.zeros((2, 0), np.float32)})


def test_a_reduction_over_an_axis_known_empty_runs_on_cpuref() -> None:
    model = model_of([helper.make_node("ReduceMax", ["x"], ["y"], name="reduce", axes=[1])],
                     [vi("x", [2, 0])], [vi("y", None)], opset=13)
    got, want, session = both(model, {"x": np.zeros((2, 0), np.float32)})
    assert session.report.layers["reduce"].backend == "CpuRef"
    np.testing.assert_array_equal(got[0], [[-np.inf], [-np.inf]])
