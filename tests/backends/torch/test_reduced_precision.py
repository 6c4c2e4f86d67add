"""``CpuAcc.precision`` "bf16": a CpuAcc subgraph computes float32 in bfloat16 (one OneDnnGraph or
Reduced layer), float32 at its edges, close to float32's results; float32 where the CPU has no
bfloat16 instructions, with a warning.

The bfloat16 path is forced here (``reduced.hardware``) with torch's own routes, which compute in
bfloat16 on any CPU (emulated where it has no instructions for it); oneDNN's bfloat16 routes are run
on the GPU machine's Xeon (AMX), ``bench/bench_openvino.py --precision bf16``."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

import backplane  # noqa: E402
from backplane import InferenceSession  # noqa: E402
from backplane.backends.api.backend import OptionError  # noqa: E402
from backplane.backends.torch.fusion import reduced  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.models.test_models import DATA  # noqa: E402

PORTABLE = {"CpuAcc.precision": "bf16", "CpuAcc.conv_route": "torch", "CpuAcc.linear_route": "mkl",
            "CpuAcc.route_cache": False}


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reduced, "hardware", lambda: True)


def _session(path, options: dict, backends=("CpuAcc", "CpuRef")) -> InferenceSession:
    return InferenceSession(path, backends=list(backends),
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _cpuacc_steps(session: InferenceSession) -> list:
    loaded = session.runtime.network(session.network_id)
    return [(lay, step.workload) for step, lay in zip(loaded.steps, loaded.layers)
            if lay.backend == "CpuAcc"]


def _relative(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(float(np.abs(g - w).max() / np.abs(w).max()) for g, w in zip(got, want))


def test_an_unknown_precision_is_an_error_that_lists_the_choices() -> None:
    with pytest.raises(OptionError, match=r"CpuAcc.precision 'int4' is not one of fp32, bf16"):
        _session(DATA / "tiny_bert.onnx", {"CpuAcc.precision": "int4"})


@pytest.mark.parametrize("name", ["tiny_bert", "tiny_gpt2", "tiny_mobilenet_v3"])
def test_a_subgraph_computes_in_bfloat16_close_to_float32(name: str, bf16_cpu: None) -> None:
    """One CpuAcc layer computing in bfloat16 (its fused weights bfloat16), float32 outputs within
    bfloat16's error of CpuRef's, and not float32's own results."""
    feeds = dict(np.load(DATA / f"{name}.npz"))
    want = _session(DATA / f"{name}.onnx", {}, ["CpuRef"]).run(None, feeds)
    fp32 = _session(DATA / f"{name}.onnx", {"CpuAcc.route_cache": False}).run(None, feeds)
    session = _session(DATA / f"{name}.onnx", {**PORTABLE, "CpuAcc.compile": "layers"})
    ((layer, workload),) = _cpuacc_steps(session)
    assert layer.op_type == ("OneDnnGraph" if "mobilenet" in name else "Reduced")
    assert workload.precision == "bf16"
    weights = [w for _, inner in workload.inner for w in getattr(inner, "weights", ())]
    assert weights and all(w.dtype == torch.bfloat16 for w in weights)
    got = session.run(None, feeds)
    assert all(g.dtype == np.float32 and g.shape == w.shape for g, w in zip(got, want))
    assert 1e-4 < _relative(got, want) < 3e-2
    assert _relative(fp32, want) < 1e-5


def test_oneDNN_Graph_compiles_a_bfloat16_subgraph_as_the_layers_compute_it(bf16_cpu: None) -> None:
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    layers = _session(DATA / "tiny_mobilenet_v3.onnx", {**PORTABLE, "CpuAcc.compile": "layers"})
    compiled = _session(DATA / "tiny_mobilenet_v3.onnx",
                        {**PORTABLE, "CpuAcc.compile": "onednn_graph"})
    ((_, workload),) = _cpuacc_steps(compiled)
    assert workload.route == "onednn_graph"
    assert _relative(compiled.run(None, feeds), layers.run(None, feeds)) < 3e-2


def test_without_bfloat16_instructions_it_computes_in_float32_and_warns(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(reduced, "hardware", lambda: False)
    reduced._warn.cache_clear()
    feeds = dict(np.load(DATA / "tiny_bert.npz"))
    with caplog.at_level(logging.WARNING, logger="backplane.torch"):
        session = _session(DATA / "tiny_bert.onnx", {**PORTABLE})
    assert "no bfloat16 instructions" in caplog.text and "computing in fp32" in caplog.text
    assert "Reduced" not in {lay.op_type for lay, _ in _cpuacc_steps(session)}
    want = _session(DATA / "tiny_bert.onnx", {}, ["CpuRef"]).run(None, feeds)
    assert _relative(session.run(None, feeds), want) < 1e-5


def _model(nodes, inputs, outputs, initializers):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_float32_made_inside_is_computed_in_bfloat16_too(bf16_cpu: None, tmp_path) -> None:
    """A Cast to float inside (here of an integer weight) yields bfloat16, or MatMul would mix
    types and fail."""
    weight = np.arange(12, dtype=np.int32).reshape(4, 3) - 5
    model = _model(
        [helper.make_node("Cast", ["w"], ["wf"], to=TensorProto.FLOAT),
         helper.make_node("MatMul", ["x", "wf"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(weight, "w")])
    path = tmp_path / "cast.onnx"
    path.write_bytes(model.SerializeToString())
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    (got,) = _session(path, PORTABLE).run(None, {"x": x})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, x @ weight.astype(np.float32), rtol=3e-2, atol=3e-2)


def test_constants_read_on_the_host_keep_float32(bf16_cpu: None, tmp_path) -> None:
    """Resize's scales stay float32: 0.3333 in bfloat16 is 0.33398, and 6 x that would make a
    2x2 image where ONNX's floor(6 x 0.3333) makes 1x1."""
    model = _model(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("Resize", ["r", "", "scales"], ["y"], mode="nearest")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([1, 1, 0.3333, 0.3333], np.float32), "scales")])
    path = tmp_path / "resize.onnx"
    path.write_bytes(model.SerializeToString())
    x = np.random.default_rng(0).standard_normal((1, 1, 6, 6)).astype(np.float32)
    (want,) = _session(path, {}, ["CpuRef"]).run(None, {"x": x})
    session = _session(path, PORTABLE)
    assert [lay.op_type for lay, _ in _cpuacc_steps(session)] == ["Reduced"]
    (got,) = session.run(None, {"x": x})
    assert got.shape == want.shape == (1, 1, 1, 1)


@pytest.mark.parametrize("name, compile_mode", [("tiny_bert", "auto"),
                                                ("tiny_mobilenet_v3", "onednn_graph")])
def test_an_artifact_keeps_the_precision(name: str, compile_mode: str, bf16_cpu: None, tmp_path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKPLANE_CACHE_DIR", str(tmp_path / "routes"))
    path, feeds = DATA / f"{name}.onnx", dict(np.load(DATA / f"{name}.npz"))
    backends = [("CpuAcc", {**PORTABLE, "CpuAcc.compile": compile_mode}), "CpuRef"]
    want = InferenceSession(path, backends=backends).run(None, feeds)
    artifact = tmp_path / "model.bpl"
    backplane.compile(path, backends, artifact)
    got = InferenceSession(artifact).run(None, feeds)
    assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want))
    reference = _session(path, {}, ["CpuRef"]).run(None, feeds)
    assert 1e-4 < _relative(got, reference) < 3e-2


@pytest.mark.skipif(not reduced.hardware(), reason="this CPU has no bfloat16 instructions for oneDNN")
@pytest.mark.parametrize("name", ["tiny_bert", "tiny_gpt2", "tiny_mobilenet_v3"])
def test_oneDNN_routes_in_bfloat16_where_the_cpu_has_them(name: str) -> None:
    """The measured routes (oneDNN's packed bfloat16 weights among them) and oneDNN Graph's
    bfloat16 partitions, on a CPU with AVX512-BF16 or AMX."""
    feeds = dict(np.load(DATA / f"{name}.npz"))
    want = _session(DATA / f"{name}.onnx", {}, ["CpuRef"]).run(None, feeds)
    session = _session(DATA / f"{name}.onnx", {"CpuAcc.precision": "bf16",
                                               "CpuAcc.route_cache": False})
    ((_, workload),) = _cpuacc_steps(session)
    assert workload.precision == "bf16"
    assert 1e-4 < _relative(session.run(None, feeds), want) < 3e-2


@pytest.mark.parametrize("flags, native", [("fpu avx2 avx512f avx512bw avx512vl avx512dq", False),
                                           ("fpu avx512f avx512_bf16", True),
                                           ("fpu avx512f amx_tile amx_bf16", True)])
def test_bfloat16_hardware_needs_a_flag_of_its_own(flags: str, native: bool, tmp_path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's check passes on plain AVX-512, where oneDNN emulates bfloat16: not taken for it."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(reduced, "Path", lambda _: cpuinfo)
    monkeypatch.setattr(reduced, "cpu_flags", reduced.cpu_flags.__wrapped__)  # read, not cached
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    assert reduced.hardware.__wrapped__() is native
