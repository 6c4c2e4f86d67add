"""Round trip: outputs from the artifact equal outputs from the ONNX file (bitwise on CpuRef)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import backplane
from backplane import InferenceSession
from backplane.backends.api.backend import DELEGATE_DOMAIN
from tests.artifact.conftest import LIGHT_DIR, model_and_feeds

TINY = ["tiny_mobilenet_v3", "tiny_bert", "tiny_gpt2"]
LIGHT = sorted(p.stem for p in LIGHT_DIR.glob("light_*.onnx")
               if p.stem not in ("light_vgg19", "light_densenet121"))  # the slowest on CpuRef
CORPUS = ["cond_nested_dyn18", "loop_scripted_ts16", "lstm_bi2_dyn18", "detect_nms_dyn21",
          "resnet_qdq_ort17", "gpt_fp16_dyn19", "encoder_padmask_dyn17"]
"""Control flow (If, Loop bodies), recurrent layers, NMS, QDQ, float16, free dimensions."""
CPUACC = ["tiny_bert", "tiny_gpt2", "cond_nested_dyn18", "audio_conv1d_dyn19"]
"""tiny_mobilenet_v3 (a compiled OneDnnGraph) in ``test_cpuacc_loads_without_tracing_or_measuring``."""


def round_trip(name: str, backends: list[str], tmp_path: Path) -> tuple[list, list, Path]:
    path, feeds = model_and_feeds(name)
    artifact = tmp_path / f"{name}.bpl"
    size = backplane.compile(path, backends, artifact)
    assert size == artifact.stat().st_size
    loaded = InferenceSession(artifact)
    from_onnx = InferenceSession(path, backends=backends)
    assert [a.name for a in loaded.get_inputs()] == [a.name for a in from_onnx.get_inputs()]
    assert loaded.get_outputs() == from_onnx.get_outputs()
    assert loaded.get_modelmeta() == from_onnx.get_modelmeta()
    return loaded.run(None, feeds), from_onnx.run(None, feeds), artifact


@pytest.mark.parametrize("name", TINY + LIGHT + CORPUS)
def test_cpuref_is_bitwise_equal(name: str, tmp_path: Path) -> None:
    got, want, _ = round_trip(name, ["CpuRef"], tmp_path)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", CPUACC)
def test_cpuacc_cpuref_is_equal(name: str, tmp_path: Path) -> None:
    """Equal to the session from the ONNX file, measured routes and all (both read the routes the
    compile measured); within 1e-5 of the largest value where a route measured differently."""
    pytest.importorskip("torch")
    got, want, _ = round_trip(name, ["CpuAcc", "CpuRef"], tmp_path)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        scale = max(float(np.max(np.abs(b.astype(np.float64)))), 1e-12) if b.size else 1.0
        assert float(np.max(np.abs(a.astype(np.float64) - b), initial=0.0)) <= 1e-5 * scale


def test_loading_needs_no_model_and_no_support_query(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The ONNX file gone, the importer and every support check out of reach: it still loads."""
    path, feeds = model_and_feeds("tiny_bert")
    copy = tmp_path / "model.onnx"
    copy.write_bytes(path.read_bytes())
    artifact = tmp_path / "model.bpl"
    backplane.compile(copy, ["CpuRef"], artifact)
    expected = InferenceSession(copy, ["CpuRef"]).run(None, feeds)
    copy.unlink()

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("called while loading an artifact")

    monkeypatch.setattr("backplane.session.import_onnx", refuse)
    monkeypatch.setattr("backplane.session.optimize", refuse)
    monkeypatch.setattr("backplane.backends.api.backend.Backend.is_layer_supported", refuse)
    session = InferenceSession(artifact)
    for a, b in zip(session.run(None, feeds), expected):
        assert a.tobytes() == b.tobytes()
    assert session.report.counts() == {"CpuRef": 84}  # its Cast of float32 to float32 dropped


def test_constants_are_stored_once_and_mapped(tmp_path: Path) -> None:
    """The constants section is no larger than the model's weights, and the constants are views of
    the mapped file, not copies."""
    from backplane.artifact import container

    path, _ = model_and_feeds("tiny_mobilenet_v3")
    artifact = tmp_path / "m.bpl"
    backplane.compile(path, ["CpuRef"], artifact)
    weights = sum(np.asarray(v).nbytes for v in backplane.import_onnx(path).constants.values())
    assert len(container.read(artifact).sections["constants"]) <= 1.1 * weights  # + alignment
    session = InferenceSession(artifact)
    constants = list(session.optimized.graph.constants.values())
    big = [c for c in constants if c.nbytes >= 1024]
    assert big and all(not c.flags.owndata for c in big)


def test_control_flow_bodies_and_copy_layers_survive(tmp_path: Path) -> None:
    """If bodies come back as networks of their own; MemCopy / MemImport layers with their
    tensor-handle factories."""
    pytest.importorskip("torch")
    _, _, artifact = round_trip("cond_nested_dyn18", ["CpuAcc", "CpuRef"], tmp_path)
    session = InferenceSession(artifact)
    ops = {layer.op_type for layer in session.optimized.graph.layers}
    assert "If" in ops
    copies = [lay for lay in session.optimized.graph.layers if lay.op_type in ("MemCopy", "MemImport")]
    for layer in copies:
        assert layer.attrs["source"].id and layer.attrs["target"].id
    assert not any(lay.domain == DELEGATE_DOMAIN and lay.backend == "CpuRef"
                   for lay in session.optimized.graph.layers)


def test_cpuacc_loads_without_tracing_or_measuring(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """CpuAcc's blob keeps the routes it measured and which OneDnnGraph it compiled: loading the
    artifact traces nothing and measures nothing, its first run traces that OneDnnGraph once from
    its layer (the blob holds no module), and its outputs are the ONNX session's, bit for bit."""
    pytest.importorskip("torch")
    path, feeds = model_and_feeds("tiny_mobilenet_v3")
    artifact = tmp_path / "m.bpl"
    backplane.compile(path, ["CpuAcc", "CpuRef"], artifact)
    expected = InferenceSession(path, backends=["CpuAcc", "CpuRef"]).run(None, feeds)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("traced or measured while loading an artifact")

    from backplane.backends.torch.fusion import onednn_graph

    traces = []
    trace = onednn_graph._trace
    monkeypatch.setattr(onednn_graph, "_trace", lambda *a: traces.append(1) or trace(*a))
    monkeypatch.setattr("backplane.backends.torch.route_cache.store", refuse)
    monkeypatch.setenv("BACKPLANE_CACHE_DIR", str(tmp_path / "empty"))  # no route on disk either
    session = InferenceSession(artifact)
    (delegate,) = [lay for lay in session.optimized.graph.layers if lay.domain == DELEGATE_DOMAIN]
    blob = delegate.attrs["blob"]
    compiled = json.loads(bytes(blob[8:8 + int.from_bytes(blob[:8], "little")]))["compiled"]
    assert delegate.backend == "CpuAcc" and traces == []
    inner = delegate.attrs["graph"].layers
    assert [lay.op_type for lay in inner] == ["OneDnnGraph"]
    assert delegate.attrs["debug_handle_map"][inner[0].name][0] == \
        "/features/features.0/features.0.0/Conv"  # the model node the blob starts with
    for a, b in zip(session.run(None, feeds), expected):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert len(traces) == len(compiled) <= 1
