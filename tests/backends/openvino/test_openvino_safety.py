"""The OpenVINO backend never returns memory it did not write, checks before OpenVINO what OpenVINO
would crash on or answer silently wrong (negative shapes, indices out of range, contradictory
attributes), and lets NaN through as CpuRef does. Skipped where OpenVINO is not installed."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("openvino")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.api.memory import LIMIT_VARIABLE  # noqa: E402
from backplane.optimizer.optimize import OptimizationError  # noqa: E402
from backplane.runtime.loaded_network import ExecutionError  # noqa: E402

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


def refusal(session: InferenceSession, layer: str) -> str:
    return next(reason for backend, reason in session.report.layers[layer].refusals
                if backend == "OpenVINO")


def gather_model(indices: object | None = None, data_shape: list | None = None) -> bytes:
    """Gather(x, i) along axis 0; ``i`` a constant when given, else an input."""
    inits = [] if indices is None else [numpy_helper.from_array(np.array(indices, np.int64), "i")]
    inputs = [vi("x", data_shape or [4, 3])] + \
        ([vi("i", [2], TensorProto.INT64)] if indices is None else [])
    return model_of([helper.make_node("Gather", ["x", "i"], ["y"], name="g")], inputs,
                    [vi("y", None)], inits)


def test_gather_indices_out_of_range_are_refused_as_cpuref_refuses() -> None:
    """OpenVINO returns zeros for them; CpuRef, CpuAcc and ONNX Runtime raise."""
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    session = InferenceSession(gather_model(), backends=["OpenVINO", "CpuRef"])
    assert session.report.counts() == {"OpenVINO": 1}
    np.testing.assert_array_equal(session.run(None, {"x": x, "i": np.array([3, -4])})[0],
                                  x[[3, -4]])
    for bad in (7, -5):
        with pytest.raises(ExecutionError, match=f"Gather 'g': index {bad} is out of range"):
            session.run(None, {"x": x, "i": np.array([1, bad])})
    constant = InferenceSession(gather_model([1, 7]), backends=["OpenVINO", "CpuRef"])
    assert constant.report.backend_of("g") == "CpuRef"
    assert "index 7 is out of range for an axis of size 4" in refusal(constant, "g")


def test_indices_computed_inside_the_partition_are_checked_after_the_run() -> None:
    """i + 1 is computed by OpenVINO: it is an extra output of the compiled model, checked before
    the outputs are returned; the axis is a free dimension, read from an extra Shape output.
    (int32 indices: an Add of the user's int64 values goes to CpuRef, test_openvino_int64.)"""
    model = model_of(
        [helper.make_node("Add", ["i", "one"], ["j"], name="add"),
         helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Gather", ["r", "j"], ["y"], name="g", axis=1)],
        [vi("x", [2, "n"]), vi("i", [2], TensorProto.INT32)], [vi("y", None)],
        [numpy_helper.from_array(np.array(1, np.int32), "one")])
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert session.report.counts() == {"OpenVINO": 3}
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    np.testing.assert_array_equal(session.run(None, {"x": x, "i": np.array([0, 3], np.int32)})[0],
                                  x[:, [1, 4]])
    with pytest.raises(ExecutionError, match="index 5 is out of range for an axis of size 5"):
        session.run(None, {"x": x, "i": np.array([0, 4], np.int32)})


def test_gathernd_with_indices_computed_inside_goes_to_cpuref() -> None:
    """OpenVINO's GatherND reads past its data for an index out of range: checked before, or not
    given to OpenVINO."""
    model = model_of(
        [helper.make_node("Add", ["i", "one"], ["j"], name="add"),
         helper.make_node("GatherND", ["x", "j"], ["y"], name="g")],
        [vi("x", [4, 3]), vi("i", [2, 2], TensorProto.INT64)], [vi("y", None)],
        [numpy_helper.from_array(np.array(1, np.int64), "one")])
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("g") == "CpuRef"
    assert "computed in the partition" in refusal(session, "g")
    with pytest.raises(ExecutionError, match="out of bounds"):
        session.run(None, {"x": np.ones((4, 3), np.float32), "i": np.array([[0, 0], [8, 0]])})


def test_expand_to_a_negative_size_never_reaches_openvino() -> None:
    """A constant negative size gave an empty tensor (OpenVINO), an input one an OpenVINO error:
    CpuRef's reason for both."""
    constant = model_of([helper.make_node("Expand", ["x", "s"], ["y"], name="e")],
                        [vi("x", [1, 3])], [vi("y", None)],
                        [numpy_helper.from_array(np.array([-2, 3], np.int64), "s")])
    session = InferenceSession(constant, backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("e") == "CpuRef"
    assert "negative size [-2, 3]" in refusal(session, "e")
    given = model_of([helper.make_node("Expand", ["x", "s"], ["y"], name="e")],
                     [vi("x", [1, 3]), vi("s", [2], TensorProto.INT64)], [vi("y", None)])
    session = InferenceSession(given, backends=["OpenVINO", "CpuRef"])
    assert session.report.counts() == {"OpenVINO": 1}
    x = np.ones((1, 3), np.float32)
    assert session.run(None, {"x": x, "s": np.array([2, 3])})[0].shape == (2, 3)
    with pytest.raises(ExecutionError, match=r"Expand 'e': a negative size \[-2, 3\]"):
        session.run(None, {"x": x, "s": np.array([-2, 3])})


def test_data_sized_outputs_are_held_to_cpurefs_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LIMIT_VARIABLE, str(1 << 20))
    given = model_of([helper.make_node("ConstantOfShape", ["s"], ["y"], name="c")],
                     [vi("s", [2], TensorProto.INT64)], [vi("y", None)])
    session = InferenceSession(given, backends=["OpenVINO", "CpuRef"])
    assert session.report.counts() == {"OpenVINO": 1}
    assert session.run(None, {"s": np.array([256, 256])})[0].shape == (256, 256)
    with pytest.raises(ExecutionError, match="ConstantOfShape 'c'.*would take 16 MiB"):
        session.run(None, {"s": np.array([2048, 2048])})
    constant = model_of([helper.make_node("Tile", ["x", "r"], ["y"], name="t")],
                        [vi("x", [4, 4])], [vi("y", None)],
                        [numpy_helper.from_array(np.array([1024, 1024], np.int64), "r")])
    session = InferenceSession(constant, backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("t") == "CpuRef"
    assert "the limit is 1 MiB" in refusal(session, "t")


def test_range_whose_delta_points_away_from_its_limit_runs_as_cpuref() -> None:
    """OpenVINO made 10 elements of Range(0, 10, -1), where ONNX makes none."""
    given = model_of([helper.make_node("Range", ["a", "b", "c"], ["y"], name="r")],
                     [vi("a", []), vi("b", []), vi("c", [])], [vi("y", None)])
    session = InferenceSession(given, backends=["OpenVINO", "CpuRef"])
    feeds = {"a": np.float32(0), "b": np.float32(10)}
    np.testing.assert_array_equal(session.run(None, {**feeds, "c": np.float32(2)})[0],
                                  np.arange(0, 10, 2, dtype=np.float32))
    with pytest.raises(ExecutionError, match="Range 'r': start 0.0, limit 10.0, delta -1.0"):
        session.run(None, {**feeds, "c": np.float32(-1)})


@pytest.mark.parametrize(("op", "gates"), [("LSTM", 4), ("GRU", 3), ("RNN", 1)])
def test_recurrent_weights_contradicting_hidden_size_are_refused(op: str, gates: int) -> None:
    """OpenVINO reads the weights by their own shapes: an LSTM of hidden_size 64 on weights of 4
    returned 64 columns of whatever lay past them. OpenVINO refuses the layer with the reason (and
    CpuRef too since a1c2039, so the model does not load)."""
    model = model_of([helper.make_node(op, ["x", "W", "R"], ["y"], name="rnn", hidden_size=64)],
                     [vi("x", [5, 1, 2]), vi("W", [1, gates * 4, 2]), vi("R", [1, gates * 4, 4])],
                     [vi("y", None)])
    with pytest.raises(OptimizationError, match=f"OpenVINO: {op} 'rnn': W has shape "
                                                r"\(1, \d+, 2\), which contradicts hidden_size 64"):
        InferenceSession(model, backends=["OpenVINO", "CpuRef"])


def test_a_conversion_that_changes_an_output_shape_goes_to_cpuref() -> None:
    """OpenVINO 2026.4 converts ReduceLogSumExp-17 over all axes, not its ``axes``: with a free
    batch dimension it returned a [1, 1, 1, 1] tensor for [n, 1, 4, 1]."""
    model = model_of([helper.make_node("ReduceLogSumExp", ["x"], ["y"], name="r", axes=[3])],
                     [vi("x", ["n", 1, 4, 4])], [vi("y", None)])
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("r") == "CpuRef"
    assert "OpenVINO infers shape [1, 1, 1, 1] for 'y'" in refusal(session, "r")
    x = np.random.default_rng(0).standard_normal((2, 1, 4, 4)).astype(np.float32)
    want = np.log(np.exp(x).sum(axis=3, keepdims=True))
    np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-5)


def test_an_output_declared_larger_than_it_comes_out_is_returned_as_written() -> None:
    """The model says [2, 3], its free dimension makes [2, 1]: OpenVINO wrote 2 values into the
    [2, 3] array it was given and left 4 as np.empty found them (bench/fuzz_loader's case 126 of
    seed 7, run on OpenVINO)."""
    model = model_of([helper.make_node("Mul", ["x", "k"], ["m"], name="mul"),
                      helper.make_node("Softmax", ["m"], ["y"], name="softmax")],
                     [vi("x", [2, "n"])], [vi("y", [2, 3])],
                     [numpy_helper.from_array(np.array(3, np.float32), "k")])
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert session.report.counts() == {"OpenVINO": 2}
    junk = np.full((2, 3), 7.0, np.float32)
    del junk
    got = session.run(None, {"x": np.ones((2, 1), np.float32)})[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": np.ones((2, 1), np.float32)})[0]
    np.testing.assert_array_equal(got, want)


def test_a_pad_cropping_more_than_its_axis_never_reaches_openvino() -> None:
    """Pad [-3, 4] of a 1-element axis: OpenVINO corrupts its heap (double free, SIGSEGV, SIGBUS in
    a child process here); CpuRef answers. Constant pads go to CpuRef, input pads are refused."""
    constant = model_of([helper.make_node("Pad", ["x", "p"], ["y"], name="pad")], [vi("x", [1])],
                        [vi("y", None)], [numpy_helper.from_array(np.array([-3, 4]), "p")], 18)
    session = InferenceSession(constant, backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("pad") == "CpuRef"
    assert "crop more than the axes [1] hold" in refusal(session, "pad")
    given = model_of([helper.make_node("Pad", ["x", "p"], ["y"], name="pad")],
                     [vi("x", [1]), vi("p", [2], TensorProto.INT64)], [vi("y", None)], (), 18)
    session = InferenceSession(given, backends=["OpenVINO", "CpuRef"])
    x = np.ones(1, np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x, "p": np.array([-1, 2])})[0], [0, 0])
    with pytest.raises(ExecutionError, match=r"Pad 'pad': pads \[-3, 4\] crop more"):
        session.run(None, {"x": x, "p": np.array([-3, 4])})


@pytest.mark.parametrize(("op", "second", "feed", "kind"), [
    ("Squeeze", "axes", np.array([1]), TensorProto.INT64),
    ("Reshape", "shape", np.array([4]), TensorProto.INT64),
    ("Compress", "condition", np.array([True, False, True, True]), TensorProto.BOOL)])
def test_axes_shapes_and_conditions_the_user_gives_go_to_cpuref(op: str, second: str,
                                                                 feed: np.ndarray, kind: int) -> None:
    """OpenVINO answered each of these silently on a [2, 3] input (squeezing an axis of 3, a
    shape of 4 elements, a condition longer than its axis); CpuRef raises."""
    attrs = {"axis": 1} if op == "Compress" else {}
    model = model_of([helper.make_node(op, ["x", "s"], ["y"], name="n", **attrs)],
                     [vi("x", [2, 3]), vi("s", [len(feed)], kind)], [vi("y", None)], (), 18)
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("n") == "CpuRef"
    assert f"its {second} 's' is given at run time" in refusal(session, "n")
    with pytest.raises(ExecutionError):
        session.run(None, {"x": np.ones((2, 3), np.float32), "s": feed})


def test_a_constant_compress_condition_longer_than_its_axis_goes_to_cpuref() -> None:
    condition = numpy_helper.from_array(np.array([True, False, True, True]), "c")
    model = model_of([helper.make_node("Compress", ["x", "c"], ["y"], name="n", axis=1)],
                     [vi("x", [2, 3])], [vi("y", None)], [condition], 18)
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("n") == "CpuRef"
    assert "a condition of 4 values on an axis of size 3" in refusal(session, "n")


def test_a_slice_step_past_32_bits_never_reaches_openvino() -> None:
    """A step of -(2**63 - 1) killed the process with SIGFPE in OpenVINO (bench/hostile.py's
    slice_huge_step_backward); on CpuRef it is a backward slice of one element."""
    big = np.iinfo(np.int64)
    inits = [numpy_helper.from_array(np.array([v], np.int64), n)
             for n, v in (("a", 4), ("b", 0), ("c", 0), ("d", -big.max))]
    model = model_of([helper.make_node("Slice", ["x", "a", "b", "c", "d"], ["y"], name="s")],
                     [vi("x", [5])], [vi("y", None)], inits)
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("s") == "CpuRef"
    assert "past 32 bits" in refusal(session, "s")
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], x[4:0:-big.max])


def test_an_integer_division_by_a_value_given_at_run_time_goes_to_cpuref() -> None:
    """OpenVINO answered INT32_MIN for 7 / 0 and 7 % 0 (bench/hostile.py), where CpuRef answers 0
    and ONNX Runtime refuses; a constant divisor without a zero stays on OpenVINO."""
    ints = TensorProto.INT32
    for op in ("Div", "Mod"):
        graph = helper.make_graph(
            [helper.make_node(op, ["a", "b"], ["q"], name="by_input"),
             helper.make_node(op, ["q", "eight"], ["y"], name="by_eight")], op,
            [helper.make_tensor_value_info("a", ints, [2]),
             helper.make_tensor_value_info("b", ints, [2])],
            [helper.make_tensor_value_info("y", ints, [2])],
            [numpy_helper.from_array(np.array([8, 8], np.int32), "eight")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        session = InferenceSession(model.SerializeToString(), backends=["OpenVINO", "CpuRef"])
        assert session.report.backend_of("by_input") == "CpuRef"
        assert session.report.backend_of("by_eight") == "OpenVINO"
        (y,) = session.run(None, {"a": np.array([7, 7], np.int32), "b": np.array([0, 2], np.int32)})
        np.testing.assert_array_equal(y, [0, 0] if op == "Div" else [0, 1])  # (7 op [0, 2]) op 8


def test_a_reduction_of_an_empty_input_goes_to_cpuref() -> None:
    """OpenVINO's ReduceMax of a [2, 0] input gave float32's lowest where ONNX gives -inf."""
    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["x"], ["y"], name="empty", keepdims=0)], "r",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 0])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = InferenceSession(model.SerializeToString(), backends=["OpenVINO", "CpuRef"])
    assert session.report.backend_of("empty") == "CpuRef"
    (y,) = session.run(None, {"x": np.zeros((2, 0), np.float32)})
    assert np.isneginf(y)
