"""Stopping a run (issue 32, item 7): ``RunOptions.terminate``, as ONNX Runtime's flag, and
``RunOptions.timeout_s``, checked before every layer, control-flow bodies' included."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import Backend, InferenceSession, RunOptions, RunTerminated, registry

TRIPS = 1000


class CountingBackend(Backend):
    """Runs Relu, counting its calls and calling ``hook`` with the count (the test's "other
    thread" or clock)."""

    id = "CountingRelu"
    calls = 0
    hook = staticmethod(lambda count: None)

    def __init__(self) -> None:
        super().__init__()
        self.KERNELS = {"Relu": {6: self._relu}}

    @classmethod
    def _relu(cls, x: np.ndarray) -> tuple[np.ndarray]:
        cls.calls += 1
        cls.hook(cls.calls)
        return (np.maximum(x, 0),)


def _loop_model() -> bytes:
    """y = x run through Relu TRIPS times, in a Loop."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Relu", ["v_in"], ["v_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_in", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [3])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body)], "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [helper.make_tensor("trips", TensorProto.INT64, [], [TRIPS]),
         helper.make_tensor("cond", TensorProto.BOOL, [], [True])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.fixture
def session():
    CountingBackend.calls = 0
    CountingBackend.hook = staticmethod(lambda count: None)
    with registry.temporarily(CountingBackend.id, CountingBackend):
        yield InferenceSession(_loop_model(), providers=[CountingBackend.id, "CpuRef"])


X = np.array([-1.0, 0.5, 2.0], np.float32)


def test_a_run_without_a_stop_runs_every_trip(session) -> None:
    (y,) = session.run(None, {"x": X}, RunOptions())
    np.testing.assert_array_equal(y, np.maximum(X, 0))
    assert CountingBackend.calls == TRIPS


def test_terminate_set_while_running_stops_inside_the_loop(session) -> None:
    options = RunOptions(logid="stopped")

    def set_on_the_third(count: int) -> None:
        if count == 3:
            options.terminate = True  # as another thread would, while the run goes on

    CountingBackend.hook = staticmethod(set_on_the_third)
    with pytest.raises(RunTerminated, match="terminate"):
        session.run(None, {"x": X}, options)
    assert CountingBackend.calls == 3
    options.terminate = False  # ONNX Runtime's way: the flag is the caller's to clear
    CountingBackend.hook = staticmethod(lambda count: None)
    (y,) = session.run(None, {"x": X}, options)
    np.testing.assert_array_equal(y, np.maximum(X, 0))


def test_terminate_from_another_thread(session) -> None:
    options = RunOptions()
    started = threading.Event()

    def slow(count: int) -> None:
        started.set()
        time.sleep(0.01)  # the run takes 10 s unless stopped

    CountingBackend.hook = staticmethod(slow)
    stopper = threading.Thread(target=lambda: (started.wait(), setattr(options, "terminate", True)))
    stopper.start()
    with pytest.raises(RunTerminated):
        session.run(None, {"x": X}, options)
    stopper.join()
    assert CountingBackend.calls < TRIPS


def test_a_run_set_to_terminate_does_not_start(session) -> None:
    with pytest.raises(RunTerminated):
        session.run(None, {"x": X}, RunOptions(terminate=True))
    assert CountingBackend.calls == 0


def test_timeout_stops_a_run_that_takes_too_long(session, monkeypatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def tick(count: int) -> None:
        clock[0] += 1.0  # each trip "takes" a second

    CountingBackend.hook = staticmethod(tick)
    with pytest.raises(RunTerminated, match="timeout_s = 5.0"):
        session.run(None, {"x": X}, RunOptions(timeout_s=5))
    assert 5 <= CountingBackend.calls <= 7


@pytest.mark.parametrize("value", [0, -1, "1", True])
def test_a_timeout_is_a_positive_number_of_seconds(value) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        RunOptions(timeout_s=value)
