"""A hostile CpuAcc blob runs nothing: its bytes are read as data or refused, by name.

The blobs here are what anyone can write: the artifact's checksums recomputed after the change
(``container.write``), its manifest naming this CpuAcc. The payload is a TorchScript archive whose
scripted ``__setstate__`` overwrites a file through ``torch.from_file(path, shared=True)``, which
``torch.jit.load`` runs (``test_the_archive_writes_its_file_when_torch_loads_it``): CpuAcc's blobs
of layouts 1 and 2 were such archives, handed to ``torch.jit.load`` at every load.
"""

from __future__ import annotations

import io
import json
import marshal
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest

import backplane
from backplane import InferenceSession
from backplane.artifact import container
from backplane.artifact.container import ArtifactError
from tests.artifact.conftest import model_and_feeds

torch = pytest.importorskip("torch")
COMPILED = [("CpuAcc", {"compile": "onednn_graph"}), "CpuRef"]
UNTOUCHED = b"\0" * 8


def hostile_archive(marker: Path) -> bytes:
    """A TorchScript archive whose loading writes b"!" over the first 8 bytes of ``marker``."""
    class Payload(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.path = str(marker)
            self.kept = torch.zeros(1, dtype=torch.uint8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

        @torch.jit.export
        def __getstate__(self) -> str:
            return self.path

        @torch.jit.export
        def __setstate__(self, state: str) -> None:
            self.path = state
            self.training = False
            written = torch.from_file(state, shared=True, size=8, dtype=torch.uint8)
            written.fill_(33)
            self.kept = written  # kept: else TorchScript drops the write as dead code

    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation
        torch.jit.save(torch.jit.script(Payload()), buffer)
    return buffer.getvalue()


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    path = tmp_path / "marker"
    path.write_bytes(UNTOUCHED)
    return path


@pytest.fixture
def compiled(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """tiny_mobilenet_v3 compiled with its OneDnnGraph compiled, and the blob's header."""
    path, _ = model_and_feeds("tiny_mobilenet_v3")
    artifact = tmp_path / "m.bpl"
    backplane.compile(path, COMPILED, artifact)
    blob = _blob(artifact)
    return artifact, json.loads(bytes(blob[8:8 + int.from_bytes(blob[:8], "little")]))


def _blob(artifact: Path) -> memoryview:
    (blob,) = [v for k, v in container.read(artifact).sections.items() if k.startswith("blob:")]
    return blob


def blob_of(header: dict[str, Any], payload: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % container.ALIGNMENT)
    return len(text).to_bytes(8, "little") + text + payload


def rewrite(artifact: Path, blob: bytes, cpuacc_version: str | None = None) -> None:
    """The artifact with its CpuAcc blob replaced (its manifest's CpuAcc version too, where
    given), every checksum recomputed: what anyone can write."""
    contents = container.read(artifact)
    header = {k: v for k, v in contents.header.items() if k != "sections"}
    if cpuacc_version is not None:
        for entry in header["manifest"]["backends"]:
            if entry["id"] == "CpuAcc":
                entry["version"] = cpuacc_version
    sections = [(name, blob if name.startswith("blob:") else bytes(data))
                for name, data in contents.sections.items()]
    container.write(artifact, header, sections)


def refused(artifact: Path, **options: Any) -> str:
    """The message of the ArtifactError that loading ``artifact`` raises (or that its workload's
    error was raised from)."""
    with pytest.raises(Exception) as info:
        InferenceSession(artifact, **options)
    error: BaseException | None = info.value
    while error is not None and not isinstance(error, ArtifactError):
        error = error.__cause__
    assert error is not None, f"not an ArtifactError: {info.value!r}"
    return str(error)


@pytest.fixture
def no_code_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way torch or Python loads code or objects from bytes fails the test when called."""
    def called(*args: object, **kwargs: object) -> None:
        raise AssertionError("code or objects loaded from bytes while loading an artifact")

    for owner, name in [(torch.jit, "load"), (torch, "load"), (torch._C, "import_ir_module"),
                        (torch._C, "import_ir_module_from_buffer"), (pickle, "loads"),
                        (pickle, "load"), (marshal, "loads")]:
        monkeypatch.setattr(owner, name, called)


def test_the_archive_writes_its_file_when_torch_loads_it(marker: Path) -> None:
    """The control: the payload is hostile, torch.jit.load runs its __setstate__."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.load(io.BytesIO(hostile_archive(marker)))
    assert marker.read_bytes() == b"!" * 8


def test_an_artifact_loads_and_runs_without_loading_code(
        compiled: tuple[Path, dict[str, Any]], no_code_loaded: None) -> None:
    """A genuine artifact with a compiled OneDnnGraph loads and runs with every code loader
    refusing: its blob is read as data, the module traced again from the layer."""
    artifact, header = compiled
    assert header["compiled"]
    path, feeds = model_and_feeds("tiny_mobilenet_v3")
    got = InferenceSession(artifact).run(None, feeds)
    expected = InferenceSession(path, backends=COMPILED).run(None, feeds)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_a_blob_of_the_archive_layout_is_refused_and_runs_nothing(
        compiled: tuple[Path, dict[str, Any]], marker: Path) -> None:
    """A blob of layout 2 (the compiled OneDnnGraph as a TorchScript archive), under a manifest
    that names this CpuAcc: refused, "compile the model again", the archive never loaded."""
    artifact, header = compiled
    archive = hostile_archive(marker)
    old = {"routes": header["routes"], "packed": {},
           "modules": {name: {"archive": [0, len(archive)], "weights": {}}
                       for name in header["compiled"]}}
    rewrite(artifact, blob_of(old, archive))
    message = refused(artifact)
    assert "layout 1 or 2" in message and "compile the model again" in message
    assert marker.read_bytes() == UNTOUCHED


def test_an_artifact_of_the_archive_layout_is_refused_by_its_manifest(
        compiled: tuple[Path, dict[str, Any]], marker: Path) -> None:
    """An artifact compiled by CpuAcc 0.2 (its blob a layout 2 one): refused before any blob is
    read, by the manifest's CpuAcc version; with repreprocess=True its partition is preprocessed
    again from the stored subgraph, and runs as the ONNX file does."""
    artifact, header = compiled
    archive = hostile_archive(marker)
    old = {"routes": header["routes"],
           "modules": {name: {"archive": [0, len(archive)], "weights": {}}
                       for name in header["compiled"]}}
    rewrite(artifact, blob_of(old, archive), cpuacc_version="0.2.0")
    message = refused(artifact)
    assert "CpuAcc 0.2.0" in message and "compile the model again" in message
    path, feeds = model_and_feeds("tiny_mobilenet_v3")
    got = InferenceSession(artifact, repreprocess=True).run(None, feeds)
    expected = InferenceSession(path, backends=COMPILED).run(None, feeds)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.tobytes() == b.tobytes()
    assert marker.read_bytes() == UNTOUCHED


@pytest.mark.parametrize("change, named", [
    (lambda h, n: h.update(modules={n: {"archive": [0, 1], "weights": {}}}), "keys"),
    (lambda h, n: h.update(compiled=["os.system"]), "'os.system' a compiled OneDnnGraph"),
    (lambda h, n: h.update(compiled=[{"__class__": n}]), "keys"),
    (lambda h, n: h.update(routes={"a": ["torch.jit.load"]}), "keys"),
    (lambda h, n: h.update(layout=2.5), "layout 2.5"),
    (lambda h, n: h.update(packed={"builtins.eval": {}}), "'builtins.eval', which is no fused")])
def test_a_layout_3_blob_with_anything_else_is_refused_by_name(
        compiled: tuple[Path, dict[str, Any]], marker: Path, no_code_loaded: None,
        change: Any, named: str) -> None:
    """Keys, names and values a layout 3 blob does not have: refused, naming them; the hostile
    archive in the payload is never loaded."""
    artifact, header = compiled
    change(header, header["compiled"][0])
    rewrite(artifact, blob_of(header, hostile_archive(marker)))
    assert named in refused(artifact)
    assert marker.read_bytes() == UNTOUCHED


@pytest.mark.parametrize("blob", [b"", b"\xff" * 8, (2**62).to_bytes(8, "little") + b"{}",
                                  (4).to_bytes(8, "little") + b"[1]x"])
def test_a_blob_that_is_no_header_is_refused(compiled: tuple[Path, dict[str, Any]],
                                             blob: bytes) -> None:
    artifact, _ = compiled
    rewrite(artifact, blob)
    assert "CpuAcc's blob" in refused(artifact)
