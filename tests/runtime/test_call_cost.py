"""What a run costs around its partitions is prepared at load (issue 27, item 4): the inputs'
check made once per network, a MemImport's handover as one function, and a network that is one
partition run as one call between its handovers, keeping every promise of a run: the same errors
for wrong feeds, outputs the caller's alone, NaN in, NaN out, a stop honoured, failures named."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import ExecutionError, InferenceSession, InvalidInputError, RunOptions, RunTerminated
from backplane.ir.graph import TensorInfo
from backplane.runtime.runtime import check_inputs, prepared_check
from tests.conftest import float_input, make_model

torch = pytest.importorskip("torch")


def _relu_add(batch: int | str = "N") -> bytes:
    """y = Relu(a) + b and z = a - b over (batch, 4): one CpuAcc partition, two outputs."""
    nodes = [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Add", ["r", "b"], ["y"]),
             helper.make_node("Sub", ["a", "b"], ["z"])]
    model = make_model(nodes, [float_input("a", [batch, 4]), float_input("b", [batch, 4])],
                       [float_input("y", [batch, 4]), float_input("z", [batch, 4])])
    return model.SerializeToString()


def _one_partition(batch: int | str = "N") -> InferenceSession:
    session = InferenceSession(_relu_add(batch), ["CpuAcc", "CpuRef"])
    assert session.report.counts() == {"CpuAcc": 3}
    return session


def _feeds(rows: int = 2) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    return {name: rng.standard_normal((rows, 4)).astype(np.float32) for name in ("a", "b")}


SPECS = [("a", TensorInfo(("N", 4), np.dtype(np.float32))),
         ("b", TensorInfo((2, "N", "N"), np.dtype(np.int64))),
         ("c", TensorInfo((3,), np.dtype(np.float32)))]


def _given(n: int = 5, m: int = 5) -> dict[str, np.ndarray]:
    return {"a": np.zeros((n, 4), np.float32), "b": np.zeros((2, n, m), np.int64),
            "c": np.zeros(3, np.float32)}


def test_the_prepared_check_takes_what_the_full_check_takes_as_it_is() -> None:
    check = prepared_check(SPECS)
    feeds = _given()
    values = check(feeds)
    assert values is not None and all(v is feeds[n] for v, (n, _) in zip(values, SPECS))
    assert [v is w for v, w in zip(values, check_inputs(SPECS, feeds))] == [True] * 3


@pytest.mark.parametrize("change", [
    lambda f: f.pop("c"),  # a name missing
    lambda f: f.update(d=f.pop("c")),  # another name
    lambda f: f.update(c=f["c"].astype(np.float64)),  # another dtype
    lambda f: f.update(c=np.zeros((1, 3), np.float32)),  # another rank
    lambda f: f.update(c=np.zeros(4, np.float32)),  # another fixed size
    lambda f: f.update(b=np.zeros((3, 5, 5), np.int64)),  # a fixed size among free ones
    lambda f: f.update(a=np.zeros((6, 4), np.float32)),  # 'N' 6 in a, 5 in b
    lambda f: f.update(b=np.zeros((2, 5, 6), np.int64)),  # 'N' twice in b, two sizes
    lambda f: f.update(c=f["c"].tolist()),  # not an array: the full check converts it
])
def test_the_prepared_check_leaves_anything_else_to_the_full_check(change) -> None:
    feeds = _given()
    change(feeds)
    assert prepared_check(SPECS)(feeds) is None
    assert prepared_check(SPECS)(list(_given().values())) is None  # a sequence: the full check


@pytest.mark.parametrize("feeds, message", [
    ({"a": np.zeros((2, 4)), "b": np.zeros((2, 4), np.float32)},
     "input 'a' has dtype float64; the model expects float32"),
    ({"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)},
     "dimension 'N' is 2 in input 'a' but 3 in input 'b'"),
    ({"a": np.zeros((2, 5), np.float32), "b": np.zeros((2, 5), np.float32)},
     "input 'a' has size 5 in dimension 1; the model expects 4"),
    ({"a": np.zeros(4, np.float32), "b": np.zeros((1, 4), np.float32)},
     r"input 'a' has shape \(4,\) \(rank 1\); the model expects rank 2"),
    ({"a": np.zeros((2, 4), np.float32)}, r"input\(s\) \['b'\] missing"),
    ({"a": np.zeros((2, 4), np.float32), "b": np.zeros((2, 4), np.float32), "c": 1},
     r"\['c'\] is not an input of the model"),
])
def test_a_one_partition_session_gives_the_same_errors(feeds, message) -> None:
    with pytest.raises(InvalidInputError, match=message):
        _one_partition().run(None, feeds)


def test_a_one_partition_network_runs_as_one_call_between_its_handovers() -> None:
    session = _one_partition()
    loaded = session.runtime.network(session.network_id)
    ops = [layer.op_type for layer in loaded.layers]
    assert ops.count("MemImport") == 4 and len(ops) == 5  # a, b in; y, z out; the partition
    handovers = [step.convert for step, layer in zip(loaded.steps, loaded.layers)
                 if layer.op_type == "MemImport"]
    assert all(callable(convert) for convert in handovers)
    assert loaded.execute.__name__ == "call"  # steps.one_call: no slots, no loop
    feeds = _feeds()
    a, b = feeds["a"], feeds["b"]
    y, z = session.run(None, feeds)
    np.testing.assert_allclose(y, np.maximum(a, 0) + b, rtol=1e-6)
    np.testing.assert_allclose(z, a - b, rtol=1e-6)
    loop = loaded.execute_plan(loaded.host_plan, [a, b])  # the slots' loop gives the same
    np.testing.assert_array_equal(loop[0], y)
    np.testing.assert_array_equal(loop[1], z)


def test_its_outputs_are_the_callers_and_nan_goes_through() -> None:
    session = _one_partition()
    feeds = _feeds()
    feeds["a"][0, 1] = np.nan
    y, z = session.run(None, feeds)
    assert np.isnan(y[0, 1]) and np.isnan(z[0, 1])
    kept_y, kept_z = y.copy(), z.copy()
    assert not any(np.shares_memory(out, given) for out in (y, z) for given in feeds.values())
    y[...] = 5.0  # the caller's to write
    y2, z2 = session.run(None, _feeds(3))
    assert y2.shape == (3, 4) and not np.shares_memory(y2, y) and not np.shares_memory(z2, z)
    np.testing.assert_array_equal(z, kept_z)  # not overwritten by the next run
    y3, _ = session.run(None, feeds)
    np.testing.assert_array_equal(np.isnan(y3), np.isnan(kept_y))
    np.testing.assert_array_equal(y3[~np.isnan(y3)], kept_y[~np.isnan(kept_y)])


def test_an_output_that_is_its_input_is_a_copy() -> None:
    model = make_model([helper.make_node("Identity", ["a"], ["y"])], [float_input("a", ["N", 4])],
                       [float_input("y", ["N", 4])])
    session = InferenceSession(model.SerializeToString(), ["CpuAcc", "CpuRef"])
    a = _feeds()["a"]
    (y,) = session.run(None, {"a": a})
    np.testing.assert_array_equal(y, a)
    assert not np.shares_memory(y, a)


def test_a_stop_and_a_failure_are_as_the_loop_has_them() -> None:
    session = _one_partition()
    options = RunOptions()
    options.terminate = True
    with pytest.raises(RunTerminated):
        session.run(None, _feeds(), options)
    loaded = session.runtime.network(session.network_id)
    with pytest.raises(ExecutionError, match=r"layer .* failed on CpuAcc"):  # no broadcast
        loaded.execute([np.zeros((2, 4), np.float32), np.zeros((3, 4), np.float32)])


def test_a_session_of_static_shapes_takes_the_prepared_check() -> None:
    session = _one_partition(batch=2)
    feeds = _feeds()
    y, _ = session.run(None, feeds)
    np.testing.assert_allclose(y, np.maximum(feeds["a"], 0) + feeds["b"], rtol=1e-6)
    with pytest.raises(InvalidInputError, match="input 'b' has size 3 in dimension 0"):
        session.run(None, {"a": feeds["a"], "b": np.zeros((3, 4), np.float32)})


def _python_frames(call) -> list[str]:
    """The Python functions ``call`` enters, in order (``call`` itself and C functions not
    counted)."""
    import sys

    entered: list[str] = []

    def seen(frame, event, arg) -> None:
        if event == "call":
            entered.append(frame.f_code.co_name)

    sys.setprofile(seen)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered[1:]


def test_a_lone_relus_run_on_cpuacc_takes_few_python_frames() -> None:
    """The floor of a run (issue 27: ``session.run`` within 2x ONNX Runtime's): a lone Relu on
    CpuAcc, governed threads, enters 11 Python functions, where it entered 16 (``torch.jit.
    is_tracing``'s two, ``for_nan_keeping_graph`` and ``for_onednn_graph`` on every eager ReLU,
    the governor's ``tick``); its output is the caller's and NaN goes through."""
    model = make_model([helper.make_node("Relu", ["a"], ["y"])], [float_input("a", [1, 64])],
                       [float_input("y", [1, 64])])
    session = InferenceSession(model.SerializeToString(), ["CpuAcc", "CpuRef"])
    assert session.report.counts() == {"CpuAcc": 1}
    a = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    a[0, 3] = np.nan
    for _ in range(3):
        session.run(None, {"a": a})
    frames = _python_frames(lambda: session.run(None, {"a": a}))
    assert len(frames) <= 11, frames
    (y,) = session.run(None, {"a": a})
    assert np.isnan(y[0, 3]) and not np.shares_memory(y, a)
    np.testing.assert_array_equal(np.nan_to_num(y), np.nan_to_num(np.maximum(a, 0)))
    (again,) = session.run(None, {"a": a})
    assert not np.shares_memory(again, y)


@pytest.mark.parametrize("given", [
    lambda: np.arange(8, dtype=np.float32),
    lambda: np.arange(16, dtype=np.float32)[::2],  # strided: a contiguous copy
    lambda: np.arange(8, dtype=np.float32)[::-1],  # negative strides
    lambda: np.frombuffer(np.arange(8, dtype=np.float32).tobytes(), np.float32),  # read-only
    lambda: [0.0, 1.0, 2.0],  # not an array
])
def test_a_host_value_becomes_a_torch_tensor_of_its_values(given) -> None:
    from backplane.backends.torch.backend import _numpy_to_torch

    value = given()
    tensor = _numpy_to_torch(value)
    assert isinstance(tensor, torch.Tensor) and tensor.is_contiguous()
    np.testing.assert_array_equal(tensor.numpy(), np.asarray(value))
    if isinstance(value, np.ndarray) and value.flags.writeable and value.flags.c_contiguous:
        assert np.shares_memory(tensor.numpy(), value)  # no copy where none is needed


def test_cond_nested_on_cpuref_takes_few_python_frames() -> None:
    """cond_nested_dyn18 (Gemm, ReduceMean, Squeeze, Greater, then an If on that predicate) on
    CpuRef: 15 Python functions a run, where its ReduceMean's count and emptiness test took six
    generator frames and its Squeeze NumPy's dispatcher and wrapper (29), the If's branch two
    (21: FlatBody.execute and its compiled steps, one function now: flat._direct), and the run
    Runtime.run, the host run, its check, execute_owned, straight_run's run and its outputs' list
    (20: the direct run calls the steps' code, prepared_run.direct_run); ONNX Runtime's outputs."""
    ort = pytest.importorskip("onnxruntime")
    from pathlib import Path

    model = Path(__file__).resolve().parents[1] / "data" / "corpus" / "cond_nested_dyn18.onnx"
    with np.load(model.with_suffix(".s0.npz")) as stored:
        feeds = {name: stored[name] for name in stored.files}
    session = InferenceSession(str(model), ["CpuRef"])
    for _ in range(3):
        session.run(None, feeds)
    frames = _python_frames(lambda: session.run(None, feeds))
    assert len(frames) <= 15, frames
    expected = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, want in zip(session.run(None, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_vads_run_takes_few_python_frames() -> None:
    """vad_lstm_if_ts16 on CpuAcc at one thread: its If decided before the run (the sample rate
    looked up in line, no frame of the decision's own: builtin/decided.py), then the trace: 14
    Python functions a run (17, then 16; the feeds' check in line in the session's direct run
    now: prepared_run.direct_run); ONNX Runtime's outputs, and NaN in x gives NaN as on CpuRef
    (ONNX Runtime's Relu gives 0 for it). With its convolutions native (``CpuAcc.native`` auto,
    a C compiler here) three more: the native head's join, its call and the executor's (29 at
    first, its comprehensions each a frame)."""
    from pathlib import Path

    from backplane import SessionOptions
    from backplane.native import build

    ort = pytest.importorskip("onnxruntime")
    model = Path(__file__).resolve().parents[1] / "data" / "corpus" / "vad_lstm_if_ts16.onnx"
    with np.load(model.with_suffix(".s0.npz")) as stored:
        feeds = {name: stored[name] for name in stored.files}
    most = {"off": 14, "auto": 17 if build.available("cnn") else 14}
    for native in ("off", "auto"):
        session = InferenceSession(str(model), SessionOptions(intra_op_num_threads=1),
                                   backends=["CpuAcc", "CpuRef"],
                                   provider_options=[{"CpuAcc.native": native}, {}])
        for _ in range(3):
            session.run(None, feeds)
        # the fewest of three runs: a periodic tick (the thread governor's reading) adds a frame
        # to the run it falls in, now and then (15 in one of the final runs of session 18)
        frames = min((_python_frames(lambda: session.run(None, feeds)) for _ in range(3)),
                     key=len)
        assert len(frames) <= most[native], (native, " ".join(frames))
    expected = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, want in zip(session.run(None, feeds), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    nan = dict(feeds, x=feeds["x"].copy())
    nan["x"][0, 5] = np.nan
    reference = InferenceSession(str(model), backends=["CpuRef"]).run(None, nan)
    for got, want in zip(session.run(None, nan), reference):
        assert np.isnan(want).any() and np.array_equal(np.isnan(got), np.isnan(want))
