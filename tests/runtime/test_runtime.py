"""Runtime: load / unload / run, backend context hooks, memory managers, profiling, input checks."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import (ExecutionError, InferenceSession, InvalidInputError, Runtime, RuntimeOptions,
                       import_onnx, optimize)
from backplane.backends.api.backend import BackendContext, ProfilingContext
from backplane.backends.api.memory import MemoryManager
from backplane.backends.registry import registry
from backplane.backends.reference.backend import CpuRef
from tests.conftest import float_input, make_model, small_cnn_model

X = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)


class Recorder(BackendContext, MemoryManager):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def before_load_network(self, network_id: int) -> None:
        self.calls.append(f"before_load {network_id}")

    def after_load_network(self, network_id: int) -> None:
        self.calls.append(f"after_load {network_id}")

    def before_unload_network(self, network_id: int) -> None:
        self.calls.append(f"before_unload {network_id}")

    def after_unload_network(self, network_id: int) -> None:
        self.calls.append(f"after_unload {network_id}")

    def acquire(self) -> None:
        self.calls.append("acquire")

    def release(self) -> None:
        self.calls.append("release")


RECORDER = Recorder()


class Hooked(CpuRef):
    id = "TestHooked"

    def create_backend_context(self, options):
        return RECORDER

    def create_memory_manager(self):
        return RECORDER

    def create_profiling_context(self, options):
        return ProfilingContext()


def test_contexts_hear_load_and_unload_and_memory_is_acquired_around_runs() -> None:
    RECORDER.calls.clear()
    with registry.temporarily(Hooked.id, Hooked):
        runtime = Runtime(RuntimeOptions(profiling=True))
        network_id = runtime.load(optimize(import_onnx(small_cnn_model()), ["TestHooked"]))
        runtime.run(network_id, {"x": X})
        _, timings = runtime.run_profiled(network_id, {"x": X})
        runtime.unload(network_id)
    assert RECORDER.calls == [f"before_load {network_id}", f"after_load {network_id}", "acquire",
                              "release", f"before_unload {network_id}", f"after_unload {network_id}"]
    assert [t.layer for t in timings] == [name for name, _ in runtime.profiling["TestHooked"].events]
    with pytest.raises(KeyError, match=f"no network loaded under id {network_id}"):
        runtime.run(network_id, {"x": X})


def test_two_networks_in_one_runtime_run_independently() -> None:
    runtime = Runtime()
    a = runtime.load(optimize(import_onnx(small_cnn_model(seed=0)), ["CpuRef"]))
    b = runtime.load(optimize(import_onnx(small_cnn_model(seed=1)), ["CpuRef"]))
    assert a != b
    out_a, out_b = runtime.run(a, {"x": X})[0], runtime.run(b, [X])[0]
    assert not np.allclose(out_a, out_b)
    np.testing.assert_array_equal(out_a, runtime.run(a, [X])[0])


def test_a_run_is_a_flat_list_of_steps_that_frees_dead_tensors() -> None:
    session = InferenceSession(small_cnn_model())
    loaded = session.runtime.network(session.network_id)
    assert len(loaded.steps) == len(session.optimized.graph.layers)
    freed = {slot for step in loaded.steps for slot in step.frees}
    assert freed and not freed & set(loaded.output_slots)


@pytest.mark.parametrize("feeds, message", [
    ({"x": X.astype(np.float64)}, "input 'x' has dtype float64; the model expects float32"),
    ({"x": X[0]}, r"input 'x' has shape \(3, 8, 8\) \(rank 3\); the model expects rank 4"),
    ({"x": np.zeros((1, 3, 8, 9), np.float32)}, "input 'x' has size 9 in dimension 3; the model expects 8"),
    ({"y": X}, r"\['y'\] is not an input of the model; its inputs are: x: float32\[1,3,8,8\]"),
    ({}, r"input\(s\) \['x'\] missing"),
])
def test_bad_inputs_are_clear_errors(feeds, message) -> None:
    with pytest.raises(InvalidInputError, match=message):
        InferenceSession(small_cnn_model()).run(None, feeds)


def test_unknown_output_names_list_the_outputs() -> None:
    with pytest.raises(InvalidInputError, match="not output.*its outputs are: probs"):
        InferenceSession(small_cnn_model()).run(["logits"], {"x": X})


def test_a_failing_kernel_names_its_layer() -> None:
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshaper")
    model = make_model([node], [float_input("x", [6]), shape], [float_input("y", None)])
    session = InferenceSession(model)
    with pytest.raises(ExecutionError, match=r"layer 'reshaper' \(Reshape, opset 17\) failed on CpuRef"):
        session.run(None, {"x": np.zeros(6, np.float32), "shape": np.array([4, 4], np.int64)})


def test_session_describes_inputs_and_outputs_like_onnx_runtime() -> None:
    session = InferenceSession(small_cnn_model())
    (inp,), (out,) = session.get_inputs(), session.get_outputs()
    assert (inp.name, inp.shape, inp.type) == ("x", [1, 3, 8, 8], "tensor(float)")
    assert (out.name, out.shape, out.type) == ("probs", [1, 5], "tensor(float)")


def test_onnx_backend_api() -> None:
    from backplane import onnx_backend

    model = small_cnn_model()
    assert onnx_backend.supports_device("CPU") and not onnx_backend.supports_device("NoSuch")
    rep = onnx_backend.prepare(model, "CpuRef")
    np.testing.assert_array_equal(rep.run([X])[0], onnx_backend.run_model(model, [X])[0])


def test_a_custom_allocator_a_backend_refuses_is_an_error() -> None:
    class Allocator:
        pass

    runtime = Runtime(RuntimeOptions(custom_allocators={"CpuRef": Allocator()}))
    with pytest.raises(ValueError, match="backend CpuRef does not accept the custom allocator"):
        runtime.load(optimize(import_onnx(small_cnn_model()), ["CpuRef"]))
