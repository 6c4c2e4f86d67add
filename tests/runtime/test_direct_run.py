"""A network that is one call runs from the session's ``run`` by one function of straight code
(``runtime/prepared_run.direct_run``, issue 27): the feeds' check, the handovers, the call and the
outputs' ownership in one frame. These tests hold it to every promise of a run: wrong feeds named
as the full check names them, outputs the caller's alone, NaN in, NaN out, a failing layer named."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from backplane import ExecutionError, InferenceSession, InvalidInputError
from tests.conftest import float_input, make_model

torch = pytest.importorskip("torch")
CORPUS = Path(__file__).resolve().parents[1] / "data" / "corpus"


def _entered(call) -> list[tuple[str, str]]:
    """The (file, function) of each Python function ``call`` enters, ``call`` itself not counted."""
    entered: list[tuple[str, str]] = []

    def seen(frame, event, arg) -> None:
        if event == "call":
            entered.append((frame.f_code.co_filename, frame.f_code.co_name))

    sys.setprofile(seen)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered[1:]


def _is_direct(session: InferenceSession) -> bool:
    run = getattr(session, "_direct", None)
    return run is not None and run.__code__.co_filename == "<backplane direct run>"


def _two_inputs(first: str = "N", second: str = "N") -> InferenceSession:
    """y = Relu(a) + b, z = a - b: one CpuAcc partition, two inputs, two outputs."""
    nodes = [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Add", ["r", "b"], ["y"]),
             helper.make_node("Sub", ["a", "b"], ["z"])]
    model = make_model(nodes, [float_input("a", [first, 4]), float_input("b", [second, 4])],
                       [float_input("y", [first, 4]), float_input("z", [first, 4])])
    session = InferenceSession(model.SerializeToString(), ["CpuAcc", "CpuRef"])
    assert session.report.counts() == {"CpuAcc": 3}
    return session


def test_a_corpus_cnn_runs_its_partition_from_one_frame() -> None:
    """resnet_basic_ts16 (one Specialized layer on CpuAcc): session.run enters the direct run and
    nothing of the runtime's between it and the Specialized layer's workload (it entered
    Runtime.run, the host run, the prepared check and the one call's before); its outputs are
    ONNX Runtime's, NaN where ONNX Runtime has NaN, and the caller's."""
    ort = pytest.importorskip("onnxruntime")
    path = str(CORPUS / "resnet_basic_ts16.onnx")
    feeds = dict(np.load(CORPUS / "resnet_basic_ts16.s0.npz"))
    (name,) = feeds
    feeds[name] = feeds[name].copy()
    feeds[name][0, 1, 5, 7] = np.nan
    session = InferenceSession(path, ["CpuAcc", "CpuRef"])
    for _ in range(2):
        session.run(None, feeds)
    assert _is_direct(session)
    entered = _entered(lambda: session.run(None, feeds))
    runtime = [f for f, _ in entered if "/backplane/runtime/" in f or "/backplane/session" in f]
    assert len(runtime) <= 3, entered  # session.run, and a fresh_outputs check per output
    assert [n for f, n in entered if f == "<backplane direct run>"] == ["run"], entered
    expected = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    first = session.run(None, feeds)
    assert any(np.isnan(e).any() for e in expected)
    for got, want in zip(first, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # NaN where it has NaN
    kept = [o.copy() for o in first]
    second = session.run(None, feeds)
    for got, mine in zip(second, first):
        assert not np.shares_memory(got, mine)
    for mine, was in zip(first, kept):
        np.testing.assert_array_equal(mine, was)  # not overwritten by the next run


@pytest.mark.parametrize("feeds, message", [
    ({"a": np.zeros((2, 4), np.float64), "b": np.zeros((2, 4), np.float32)},
     "input 'a' has dtype float64"),
    ({"a": np.zeros((2, 5), np.float32), "b": np.zeros((2, 4), np.float32)},
     "input 'a' has size 5 in dimension 1"),
    ({"a": np.zeros((2, 4, 1), np.float32), "b": np.zeros((2, 4), np.float32)},
     r"input 'a' has shape \(2, 4, 1\) \(rank 3\)"),
    ({"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)}, "'N'"),
    ({"a": np.zeros((2, 4), np.float32)}, r"input\(s\) \['b'\] missing"),
    ({"a": np.zeros((2, 4), np.float32), "b": np.zeros((2, 4), np.float32),
      "c": np.zeros(1, np.float32)}, r"\['c'\] is not an input of the model"),
])
def test_the_direct_run_leaves_a_wrong_feed_to_the_full_check(feeds, message) -> None:
    session = _two_inputs()
    assert _is_direct(session)
    with pytest.raises(InvalidInputError, match=message):
        session.run(None, feeds)


def test_its_outputs_are_the_callers_and_an_input_given_back_is_a_copy() -> None:
    session = _two_inputs()
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    a[1, 2] = np.nan
    y, z = session.run(["y", "z"], {"a": a, "b": b})
    np.testing.assert_allclose(y, np.maximum(a, 0) + b, rtol=1e-6)  # NaN where a has it
    np.testing.assert_allclose(z, a - b, rtol=1e-6)
    assert np.isnan(y[1, 2]) and np.isnan(z[1, 2])
    assert not any(np.shares_memory(o, i) for o in (y, z) for i in (a, b))
    model = make_model([helper.make_node("Identity", ["a"], ["y"])], [float_input("a", ["N", 4])],
                       [float_input("y", ["N", 4])])
    identity = InferenceSession(model.SerializeToString(), ["CpuAcc", "CpuRef"])
    (same,) = identity.run(None, {"a": a})  # whatever runs it, not the caller's input itself
    np.testing.assert_array_equal(same, a)
    assert not np.shares_memory(same, a)


def test_a_failing_layer_is_named() -> None:
    """Feeds the check takes (two free dimensions) on which the Add fails: the error names the
    layer, as the network's own run names it, and the session runs on."""
    session = _two_inputs("N", "M")
    assert _is_direct(session)
    with pytest.raises(ExecutionError, match=r"layer .* failed on CpuAcc"):
        session.run(None, {"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)})
    y, _ = session.run(None, {"a": np.ones((2, 4), np.float32), "b": np.ones((2, 4), np.float32)})
    np.testing.assert_array_equal(y, np.full((2, 4), 2, np.float32))


def test_steps_as_straight_code_run_from_the_check_and_keep_the_promises() -> None:
    """A CpuRef network of several steps (``steps.straight_run``): the direct run calls their
    code itself (no execute_owned, no straight_run frame); an output that is an input comes back
    a copy, NaN goes through, a failing step is named and the session runs on."""
    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Identity", ["a"], ["z"]),
             helper.make_node("Add", ["y", "b"], ["w"])]
    model = make_model(nodes, [float_input("a", ["N", 4]), float_input("b", ["M", 4])],
                       [float_input("y", ["N", 4]), float_input("z", ["N", 4]),
                        float_input("w", ["N", 4])])
    session = InferenceSession(model.SerializeToString(), ["CpuRef"])
    assert _is_direct(session)
    a = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    a[0, 0] = np.nan
    b = np.ones((2, 4), np.float32)
    session.run(None, {"a": a, "b": b})
    entered = _entered(lambda: session.run(None, {"a": a, "b": b}))
    between = [n for f, n in entered if f.endswith(("loaded_network.py", "steps.py"))]
    assert not between and ("<backplane steps>", "run") in entered, entered
    y, z, w = session.run(None, {"a": a, "b": b})
    assert np.isnan(y[0, 0]) and np.isnan(z[0, 0]) and np.isnan(w[0, 0])
    np.testing.assert_array_equal(z, a)
    assert not np.shares_memory(z, a)
    np.testing.assert_allclose(w, np.maximum(a, 0) + 1)  # NaN where a has it
    with pytest.raises(ExecutionError, match=r"Add.* failed on CpuRef"):
        session.run(None, {"a": a, "b": np.ones((3, 4), np.float32)})
    again = session.run(None, {"a": a, "b": b})
    np.testing.assert_array_equal(again[1], a)


def test_the_direct_run_leaves_no_cycle_to_its_network() -> None:
    """The function's globals do not hold the function: at the unload the network goes with its
    last reference, not at some later garbage collection (where another test saw its release)."""
    import gc
    import weakref

    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Neg", ["y"], ["z"])]
    model = make_model(nodes, [float_input("a", ["N", 4])], [float_input("z", ["N", 4])])
    session = InferenceSession(model.SerializeToString(), ["CpuRef"])
    assert _is_direct(session)
    session.run(None, {"a": np.ones((2, 4), np.float32)})
    network = weakref.ref(session.runtime.network(session.network_id))
    gc.collect()
    gc.disable()
    try:
        session.close()
        assert network() is None
    finally:
        gc.enable()


def test_steps_as_straight_code_leave_no_cycle_to_their_workloads() -> None:
    """steps.compiled's function (and flat's and looped's, made alike) does not hold itself in
    its globals: a CpuRef network's kernels go with the network at the unload."""
    import gc
    import weakref

    nodes = [helper.make_node("Relu", ["a"], ["y"]), helper.make_node("Neg", ["y"], ["z"])]
    model = make_model(nodes, [float_input("a", ["N", 4])], [float_input("z", ["N", 4])])
    session = InferenceSession(model.SerializeToString(), ["CpuRef"])
    session.run(None, {"a": np.ones((2, 4), np.float32)})
    loaded = session.runtime.network(session.network_id)
    code = weakref.ref(loaded.execute.straight[0])  # the steps' function (steps.straight_run)
    loaded = None
    gc.collect()
    gc.disable()
    try:
        session.close()
        assert code() is None
    finally:
        gc.enable()
