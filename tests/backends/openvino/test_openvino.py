"""The OpenVINO backend: OpenVINO's support answers and reasons, partitions with a fallback to CpuRef,
options, zero-copy edges, and outputs within 1e-4 of CpuRef and ONNX Runtime on the tiny models and
onnx's light models. Skipped where OpenVINO is not installed."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("openvino")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.api.backend import OptionError  # noqa: E402
from backplane.backends.openvino import partition  # noqa: E402
from backplane.backends.registry import registry  # noqa: E402
from backplane.install_hints import hint  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.models import test_corpus as corpus  # noqa: E402
from tests.models.test_models import (  # noqa: E402
    COMPARE_INSTEAD,
    DATA,
    LIGHT,
    LIGHT_DIR,
    TINY,
    assert_close,
    light_inputs,
    ort_outputs,
)

F = TensorProto.FLOAT


def compiled_layers(session: InferenceSession) -> list:
    return [layer for layer in session.optimized.graph.layers if layer.domain == partition.DOMAIN]


def model_of(nodes: list, inputs: list, outputs: list, initializers: list = ()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def det_model() -> bytes:
    """Relu -> Det -> Add: OpenVINO's ONNX frontend has no rule for Det."""
    return model_of(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Det", ["r"], ["d"], name="det"),
         helper.make_node("Add", ["d", "one"], ["y"], name="add")],
        [helper.make_tensor_value_info("x", F, [2, 3, 3])],
        [helper.make_tensor_value_info("y", F, [2])],
        [numpy_helper.from_array(np.ones(2, np.float32), "one")])


def dynamic_axes_model() -> bytes:
    """Relu -> Unsqueeze(axes from an input) -> Relu: converted, but the CPU plugin takes neither
    the Unsqueeze nor a Relu of an input whose rank is unknown."""
    return model_of(
        [helper.make_node("Relu", ["x"], ["r"], name="relu1"),
         helper.make_node("Unsqueeze", ["r", "axes"], ["u"], name="unsqueeze"),
         helper.make_node("Relu", ["u"], ["y"], name="relu2")],
        [helper.make_tensor_value_info("x", F, [2, 3]),
         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", F, None)])


def test_registered_as_built_in_and_available() -> None:
    assert registry.origin("OpenVINO") == "built in"
    backend = registry.create("OpenVINO")
    assert backend.availability().ok, backend.availability().reason
    assert backend.capabilities()["ZeroCopyNumPy"]


@pytest.mark.parametrize("name", TINY)
def test_tiny_models_whole_on_openvino(name: str) -> None:
    path = DATA / f"{name}.onnx"
    feeds = dict(np.load(DATA / f"{name}.npz"))
    session = InferenceSession(path, backends=["OpenVINO", "CpuRef"])
    assert session.report.counts() == {"OpenVINO": len(session.report.layers)}
    assert len(compiled_layers(session)) == 1
    got = session.run(None, feeds)
    assert_close(got, ort_outputs(path, feeds))
    assert_close(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds))
    assert session.report.copies == []


@pytest.mark.skipif(not LIGHT, reason="the installed onnx ships no light models")
@pytest.mark.parametrize("name", LIGHT)
def test_onnx_light_models_match_onnx_runtime(name: str, tmp_path: Path) -> None:
    path = LIGHT_DIR / f"{name}.onnx"
    feeds = light_inputs(path)
    if name in COMPARE_INSTEAD:  # as tests/models does: the logits, not a softmax of ties
        model = onnx.load(str(path))
        del model.graph.output[:]
        model.graph.output.append(helper.make_empty_tensor_value_info(COMPARE_INSTEAD[name]))
        path = tmp_path / f"{name}.onnx"
        onnx.save(model, str(path))
    session = InferenceSession(path, backends=["OpenVINO", "CpuRef"])
    assert session.report.counts() == {"OpenVINO": len(session.report.layers)}
    got = session.run(None, feeds)
    assert_close(got, ort_outputs(path, feeds))
    assert_close(got, InferenceSession(path, backends=["CpuRef"]).run(None, feeds))


def test_no_conversion_rule_falls_back_to_cpuref_with_the_reason() -> None:
    session = InferenceSession(det_model(), backends=["OpenVINO", "CpuRef"])
    report = session.report
    assert report.backend_of("det") == "CpuRef"
    assert report.backend_of("relu") == report.backend_of("add") == "OpenVINO"
    ((backend, reason),) = report.layers["det"].refusals
    assert backend == "OpenVINO" and "no conversion rule for Det-17" in reason
    assert len(compiled_layers(session)) == 2  # Relu and Add, one partition each side of Det
    assert report.copies == []  # host memory both: direct edges
    x = np.random.default_rng(0).standard_normal((2, 3, 3)).astype(np.float32)
    want = np.linalg.det(np.maximum(x, 0)) + 1
    np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)


def test_a_layer_the_cpu_plugin_refuses_fails_with_openvinos_reason() -> None:
    session = InferenceSession(dynamic_axes_model(), backends=["OpenVINO", "CpuRef"])
    report = session.report
    assert report.backend_of("unsqueeze") == "CpuRef"
    ((backend, reason),) = report.layers["unsqueeze"].refusals
    assert backend == "OpenVINO" and reason == "OpenVINO's CPU plugin does not take Unsqueeze 'u'"
    assert report.backend_of("relu1") == "OpenVINO"
    assert any(record.outcome == "failed" and "unsqueeze" in record.layers
               for record in report.subgraphs)
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    (y,) = session.run(None, {"x": x, "axes": np.array([1], np.int64)})
    np.testing.assert_array_equal(y, np.maximum(x, 0)[:, None, :])


def test_float64_is_refused_with_the_reason() -> None:
    model = model_of([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                     [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3])],
                     [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [3])])
    session = InferenceSession(model, backends=["OpenVINO", "CpuRef"])
    ((backend, reason),) = session.report.layers["relu"].refusals
    assert backend == "OpenVINO" and "float64" in reason
    assert session.report.backend_of("relu") == "CpuRef"


def test_acyclic_pieces_keep_a_refused_layer_between_them() -> None:
    """a -> x(refused) -> b and a -> b: a and b cannot be one compiled layer."""
    from backplane.ir.graph import Layer

    a = Layer("a", "Relu", ["in"], ["ta"])
    x = Layer("x", "Det", ["ta"], ["tx"])
    b = Layer("b", "Add", ["ta", "tx"], ["tb"])
    c = Layer("c", "Relu", ["in"], ["tc"])
    pieces = partition.acyclic_pieces([a, x, b, c], {"x"})
    assert [[layer.name for layer in piece] for piece in pieces] == [["a", "c"], ["b"]]


def test_edges_to_cpuacc_are_imports_and_to_cpuref_direct() -> None:
    pytest.importorskip("torch")
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    session = InferenceSession(path, backends=["OpenVINO", "CpuRef"],
                               pins={"Gemm": "CpuAcc", "GlobalAveragePool": "CpuRef"})
    counts = session.report.counts()
    assert counts["CpuAcc"] >= 1 and counts["CpuRef"] >= 1 and counts["OpenVINO"] > 1
    strategies = {(c.source, c.target): c.strategy for c in session.report.copies}
    assert strategies and set(strategies.values()) == {"import"}, strategies
    assert all("CpuRef" not in pair for pair in strategies)  # OpenVINO <-> CpuRef: direct
    assert [c for c in session.report.copies if c.strategy == "copy"] == []
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))


def test_outputs_are_fresh_arrays_each_run_and_inputs_shared() -> None:
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    session = InferenceSession(path, backends=["OpenVINO"])
    first = session.run(None, feeds)[0]
    kept = first.copy()
    second = session.run(None, {"input": feeds["input"] * 2})[0]
    assert not np.shares_memory(first, second)
    np.testing.assert_array_equal(first, kept)  # the second run did not write into the first's


def test_inputs_neither_contiguous_nor_writable_are_kept_alive_through_the_run() -> None:
    """Such an input is copied for OpenVINO; the copy must live until the infer call is over (it
    did not once: cond_nested_dyn18 read freed memory inside its If bodies)."""
    path = DATA / "tiny_mobilenet_v3.onnx"
    x = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))["input"]
    session = InferenceSession(path, backends=["OpenVINO"])
    (workload,) = [step.workload for step in session.runtime.network(session.network_id).steps]
    want = workload(x)[0]
    strided = np.zeros((1, 3, 64, 128), np.float32)
    strided[..., ::2] = x
    frozen = x.copy()
    frozen.flags.writeable = False
    for value in [strided[..., ::2], frozen] * 3:
        got = workload(value)[0]
        noise = [np.full(x.shape, 1e6, np.float32) for _ in range(4)]  # reuse freed memory, if any
        np.testing.assert_array_equal(got, want)
        del noise


def test_runs_from_several_threads_match() -> None:
    path = DATA / "tiny_bert.onnx"
    feeds = dict(np.load(DATA / "tiny_bert.npz"))
    session = InferenceSession(path, backends=["OpenVINO", "CpuRef"])
    want = session.run(None, feeds)
    results: list = []

    def run() -> None:
        for _ in range(5):
            results.append(session.run(None, feeds))

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 15
    for got in results:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("option, value, message", [
    ("OpenVINO.precision", "int8", "fp32, bf16, fp16"),
    ("OpenVINO.performance_hint", "FAST", "LATENCY, THROUGHPUT, CUMULATIVE_THROUGHPUT"),
    ("OpenVINO.threads", 0, "positive whole number"),
    ("OpenVINO.threads", "two", "positive whole number"),
    ("OpenVINO.thread", 2, "OpenVINO.threads, OpenVINO.precision, OpenVINO.performance_hint"),
])
def test_option_values_are_checked(option: str, value: object, message: str) -> None:
    with pytest.raises(OptionError, match=message):
        InferenceSession(DATA / "tiny_mobilenet_v3.onnx", backends=["OpenVINO", "CpuRef"],
                         runtime=Runtime(RuntimeOptions(backend_options={option: value})))


def test_options_reach_the_compiled_model() -> None:
    options = {"OpenVINO.threads": 1, "OpenVINO.performance_hint": "throughput"}
    session = InferenceSession(DATA / "tiny_mobilenet_v3.onnx", backends=["OpenVINO"],
                               runtime=Runtime(RuntimeOptions(backend_options=options)))
    loaded = session.runtime.network(session.network_id)
    (workload,) = [step.workload for step in loaded.steps]
    assert str(workload.compiled.get_property("PERFORMANCE_HINT")) == "THROUGHPUT"
    assert int(workload.compiled.get_property("INFERENCE_NUM_THREADS")) == 1
    assert workload.precision == "f32"  # fp32 by default: OpenVINO's own default may be bf16


def test_reduced_precision_on_request_stays_close() -> None:
    """bf16 where the CPU has it (f32 with a warning where not); either way near fp32."""
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    runtime = Runtime(RuntimeOptions(backend_options={"OpenVINO.precision": "bf16"}))
    session = InferenceSession(path, backends=["OpenVINO"], runtime=runtime)
    (workload,) = [step.workload for step in session.runtime.network(session.network_id).steps]
    assert workload.precision in ("bf16", "f32")
    got, want = session.run(None, feeds)[0], ort_outputs(path, feeds)[0]
    assert float(np.max(np.abs(got - want))) <= 0.05 * float(np.max(np.abs(want)))


def test_unavailable_without_openvino_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "openvino" else real(name, *args))
    status = registry.create("OpenVINO").availability()
    assert not status.ok and hint("openvino") in status.reason
    session = InferenceSession(det_model(), backends=["OpenVINO", "CpuRef"])
    assert session.report.unavailable["OpenVINO"] == status.reason
    assert session.report.counts() == {"CpuRef": 3}


def test_partition_model_round_trips_attributes(tmp_path: Path) -> None:
    """A partition written back to ONNX keeps every attribute's type (floats, ints, lists, tensors)."""
    from backplane.backends.openvino import onnx_model
    from backplane.frontends.onnx import import_onnx

    graph = import_onnx(str(DATA / "tiny_bert.onnx"))
    proto = onnx_model.model(graph.layers, graph.inputs, graph.outputs, graph)
    onnx.checker.check_model(proto, full_check=True)


@pytest.mark.parametrize("size", [0, 1], ids=["s0", "s1"])
@pytest.mark.parametrize("name", corpus.MANIFEST)
def test_corpus_models_match_onnx_runtime(name: str, size: int) -> None:
    """The corpus of real exports (free axes at two sizes, control flow, fp16, quantized) as
    tests/models/test_corpus.py holds CpuRef and CpuAcc to it, with OpenVINO first."""
    key = (name, "OpenVINO,CpuRef")
    if key not in _corpus_sessions:
        _corpus_sessions[key] = InferenceSession(corpus.CORPUS / corpus.MANIFEST[name]["file"],
                                                 backends=["OpenVINO", "CpuRef"])
    session = _corpus_sessions[key]
    actual = session.run(None, corpus.feeds(name, size))
    names = [o["name"] for o in corpus.MANIFEST[name]["outputs"]]
    _, problems = corpus.compare_outputs(actual, corpus.expected_for(name, size), names,
                                         corpus.quanta(name))
    assert not problems, (f"{name} at {corpus.size_text(name, size)} (placement "
                          f"{session.report.counts()}):\n  " + "\n  ".join(problems))
    assert [c for c in session.report.copies if c.strategy == "copy"] == []


_corpus_sessions: dict[tuple[str, str], InferenceSession] = {}
