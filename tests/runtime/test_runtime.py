"""Runtime: load / unload / run, backend context hooks, memory managers, profiling, input checks."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import (ExecutionError, InferenceSession, InvalidInputError, Runtime, RuntimeOptions,
                       import_onnx, optimize)
from backplane.backends.api.backend import BackendContext, ProfilingContext
from backplane.backends.api.memory import CustomAllocator, MemoryManager, MemorySource
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


def test_contexts_hear_load_and_unload_and_memory_is_held_from_load_to_unload() -> None:
    RECORDER.calls.clear()
    with registry.temporarily(Hooked.id, Hooked):
        runtime = Runtime(RuntimeOptions(profiling=True))
        network_id = runtime.load(optimize(import_onnx(small_cnn_model()), ["TestHooked"]))
        runtime.run(network_id, {"x": X})
        _, timings = runtime.run_profiled(network_id, {"x": X})
        runtime.unload(network_id)
    # seed 000: Acquire() before the network executes, Release() in the LoadedNetwork's destructor
    assert RECORDER.calls == [f"before_load {network_id}", "acquire", f"after_load {network_id}",
                              f"before_unload {network_id}", "release",
                              f"after_unload {network_id}"]
    recorded = [name for name, _ in runtime.profiling["TestHooked"].events]
    assert recorded == [t.layer for t in timings] * 2  # RuntimeOptions.profiling: plain runs too
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
    session = InferenceSession(small_cnn_model(), ["CpuRef"])
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
        InferenceSession(small_cnn_model(), ["CpuRef"]).run(None, feeds)


def test_unknown_output_names_list_the_outputs() -> None:
    with pytest.raises(InvalidInputError, match="not output.*its outputs are: probs"):
        InferenceSession(small_cnn_model(), ["CpuRef"]).run(["logits"], {"x": X})


def test_a_failing_kernel_names_its_layer() -> None:
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    node = helper.make_node("Reshape", ["x", "shape"], ["y"], name="reshaper")
    model = make_model([node], [float_input("x", [6]), shape], [float_input("y", None)])
    session = InferenceSession(model, ["CpuRef"])
    with pytest.raises(ExecutionError, match=r"layer 'reshaper' \(Reshape, opset 17\) failed on CpuRef"):
        session.run(None, {"x": np.zeros(6, np.float32), "shape": np.array([4, 4], np.int64)})


def test_session_describes_inputs_and_outputs_like_onnx_runtime() -> None:
    session = InferenceSession(small_cnn_model(), ["CpuRef"])
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
    class Allocator(CustomAllocator):
        memory = MemorySource.CUDA  # CpuRef takes host allocators only

    runtime = Runtime(RuntimeOptions(custom_allocators={"CpuRef": Allocator()}))
    with pytest.raises(ValueError, match="backend CpuRef does not accept the custom allocator"):
        runtime.load(optimize(import_onnx(small_cnn_model()), ["CpuRef"]))


class Optioned(CpuRef):
    """Records the options its instances had when they made workloads."""

    id = "TestOptioned"
    OPTIONS = {"TestOptioned.flavour": "sweet or sour", "TestOptioned.size": "any"}
    seen: list[tuple[int, object]] = []

    def create_workload_factory(self, memory_manager=None):
        Optioned.seen.append((id(self), self.options.get("TestOptioned.flavour")))
        return super().create_workload_factory(memory_manager)


def test_backend_options_belong_to_the_network_that_was_given_them() -> None:
    """Two runtimes with different options, loads alternating: each network's backend is its own,
    with its runtime's options (they lived on one shared instance, and the last context set won)."""
    Optioned.seen.clear()
    with registry.temporarily(Optioned.id, Optioned):
        sweet = Runtime(RuntimeOptions(backend_options={"TestOptioned.flavour": "sweet"}))
        sour = Runtime(RuntimeOptions(backend_options={"TestOptioned.flavour": "sour"}))
        order = [sweet, sour, sweet, sour]
        sessions = [InferenceSession(small_cnn_model(), ["TestOptioned"], runtime=r) for r in order]
    assert [flavour for _, flavour in Optioned.seen] == ["sweet", "sour", "sweet", "sour"]
    assert len({instance for instance, _ in Optioned.seen}) == 4
    backends = [s.optimized.backends["TestOptioned"] for s in sessions]
    assert [b.options.get("TestOptioned.flavour") for b in backends] == ["sweet", "sour"] * 2


def test_a_networks_own_options_win_over_its_runtimes() -> None:
    Optioned.seen.clear()
    with registry.temporarily(Optioned.id, Optioned):
        runtime = Runtime(RuntimeOptions(backend_options={"TestOptioned.flavour": "sour",
                                                          "TestOptioned.size": 2}))
        network = optimize(import_onnx(small_cnn_model()), ["TestOptioned"],
                           backend_options={"TestOptioned.flavour": "sweet"})
        runtime.load(network)
    options = network.backends["TestOptioned"].options
    assert options.get("TestOptioned.flavour") == "sweet" and options.get("TestOptioned.size") == 2
    assert [flavour for _, flavour in Optioned.seen] == ["sweet"]


def test_a_custom_allocator_reaches_the_backend_of_every_network_loaded() -> None:
    class Allocator:
        def allocate(self, nbytes: int, alignment: int) -> np.ndarray:
            raw = np.empty(nbytes + alignment, np.uint8)
            start = -raw.ctypes.data % alignment
            return raw[start:start + nbytes]

        def free(self, buffer) -> None:
            pass

    class Accepting(CpuRef):
        id = "TestAccepting"

        def use_custom_allocator(self, allocator) -> bool:
            self.allocator = allocator
            return True

    allocator = Allocator()
    with registry.temporarily(Accepting.id, Accepting):
        runtime = Runtime(RuntimeOptions(custom_allocators={"TestAccepting": allocator}))
        networks = [optimize(import_onnx(small_cnn_model()), ["TestAccepting"]) for _ in range(2)]
        for network in networks:
            runtime.load(network)
        plain = optimize(import_onnx(small_cnn_model()), ["TestAccepting"])
        Runtime().load(plain)
    assert [n.backends["TestAccepting"].allocator for n in networks] == [allocator, allocator]
    assert not hasattr(plain.backends["TestAccepting"], "allocator")


@pytest.mark.parametrize("backends", [["CpuRef"], ["CpuAcc", "CpuRef"]])
def test_runs_from_several_threads_give_each_its_own_answer(backends) -> None:
    from concurrent.futures import ThreadPoolExecutor

    if "CpuAcc" in backends:
        pytest.importorskip("torch")
    session = InferenceSession(small_cnn_model(), backends)
    feeds = [np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype(np.float32)
             for seed in range(16)]
    expected = [session.run(None, {"x": x})[0] for x in feeds]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            got = list(pool.map(lambda x: session.run(None, {"x": x})[0], feeds))
            for g, e in zip(got, expected):
                np.testing.assert_array_equal(g, e)


def test_a_network_with_an_exclusive_workload_runs_one_run_at_a_time() -> None:
    """A workload that keeps state across calls (GpuAcc's captured graphs) says ``exclusive``; its
    network then takes a lock for each whole run. Here the state is a shared output buffer that
    each call overwrites, as a captured graph's static outputs are."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    class Shared(CpuRef):
        id = "TestShared"

        def create_workload_factory(self, memory_manager=None):
            factory = super().create_workload_factory(memory_manager)
            make = factory.create_workload

            def create_workload(layer, inputs, outputs):
                inner, buffer = make(layer, inputs, outputs), {}

                def workload(*values):
                    (out,) = inner(*values)
                    buffer["out"] = out
                    time.sleep(0.001)  # another thread's call would overwrite it here
                    return (buffer["out"],)

                workload.exclusive = True
                return workload

            factory.create_workload = create_workload
            return factory

    with registry.temporarily(Shared.id, Shared):
        session = InferenceSession(small_cnn_model(), ["TestShared"])
    loaded = session.runtime.network(session.network_id)
    assert session.runtime.network(session.network_id).exclusive
    feeds = [np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype(np.float32)
             for seed in range(8)]
    expected = [InferenceSession(small_cnn_model(), ["CpuRef"]).run(None, {"x": x})[0] for x in feeds]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: session.run(None, {"x": x})[0], feeds))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_a_misspelled_option_is_an_error_that_lists_the_options() -> None:
    pytest.importorskip("torch")
    from backplane.backends.api.backend import OptionError

    with pytest.raises(OptionError, match=r"'CpuAcc.compiel': not an option of CpuAcc; its options "
                                          r"are: CpuAcc.threads, .*CpuAcc.compile"):
        InferenceSession(small_cnn_model(), ["CpuAcc", "CpuRef"],
                         runtime=Runtime(RuntimeOptions(backend_options={"CpuAcc.compiel": "layers"})))
    with pytest.raises(OptionError, match="'CpuRef.threads': not an option of CpuRef; its options "
                                          "are: none"):
        Runtime(RuntimeOptions(backend_options={"CpuRef.threads": 2})).load(
            optimize(import_onnx(small_cnn_model()), ["CpuRef"]))
    # an option of a backend the network does not use is not its business
    InferenceSession(small_cnn_model(), ["CpuRef"],
                     runtime=Runtime(RuntimeOptions(backend_options={"GpuAcc.tf32": True})))
