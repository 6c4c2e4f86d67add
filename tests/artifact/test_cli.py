"""``backplane compile MODEL -o FILE --backends ...`` and ``backplane run FILE``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession
from backplane.cli import main
from tests.artifact.conftest import model_and_feeds


def test_compile_then_run_the_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, feeds = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    assert main(["compile", str(model), "-o", str(artifact), "--backends", "CpuRef", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["artifact"] == str(artifact) and document["bytes"] == artifact.stat().st_size
    inputs = []
    for name, value in feeds.items():
        np.save(tmp_path / f"{name}.npy", value)
        inputs += ["--input", f"{name}={tmp_path / name}.npy"]
    assert main(["run", str(artifact), "--repeat", "1", "--json", *inputs]) == 0
    ran = json.loads(capsys.readouterr().out)
    expected = InferenceSession(model, ["CpuRef"]).run(None, feeds)
    assert [o["shape"] for o in ran["outputs"]] == [list(e.shape) for e in expected]


def test_run_refuses_other_backends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    assert main(["compile", str(model), "-o", str(artifact), "--backends", "CpuRef"]) == 0
    capsys.readouterr()
    assert main(["run", str(artifact), "--backends", "CpuAcc,CpuRef", "--json"]) == 2
    error = json.loads(capsys.readouterr().out)
    assert error["type"] == "ArtifactError" and "compiled for backends ['CpuRef']" in error["error"]


def test_compile_signs_with_a_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from backplane import SessionOptions
    from backplane.artifact import ArtifactError, SigningKey

    model, feeds = model_and_feeds("tiny_bert")
    keyfile, other = tmp_path / "backplane.key", tmp_path / "other.key"
    keyfile.write_bytes(bytes(range(32)))
    other.write_bytes(bytes(range(1, 33)))
    artifact = tmp_path / "bert.bpl"
    assert main(["compile", str(model), "-o", str(artifact), "--backends", "CpuRef",
                 "--sign", str(keyfile), "--json"]) == 0
    key = SigningKey.from_file(keyfile)
    assert json.loads(capsys.readouterr().out)["signed_with"] == key.id
    session = InferenceSession(artifact, SessionOptions(artifact_key=key))
    expected = InferenceSession(model, ["CpuRef"]).run(None, feeds)
    for a, b in zip(session.run(None, feeds), expected):
        assert a.tobytes() == b.tobytes()
    with pytest.raises(ArtifactError, match=f"signed with key '{key.id}', not with this session's"):
        InferenceSession(artifact, SessionOptions(artifact_key=SigningKey.from_file(other)))


def test_compile_refuses_a_short_or_missing_key_file(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = model_and_feeds("tiny_bert")
    short = tmp_path / "short.key"
    short.write_bytes(b"password\n")
    for keyfile, message in ((short, "a signing key needs at least 16 bytes, got 9"),
                             (tmp_path / "missing.key", "cannot be read")):
        assert main(["compile", str(model), "-o", str(tmp_path / "x.bpl"), "--backends", "CpuRef",
                     "--sign", str(keyfile), "--json"]) == 2
        assert message in json.loads(capsys.readouterr().out)["error"]
        assert not (tmp_path / "x.bpl").exists()
