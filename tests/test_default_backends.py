"""Default backends (issue 19, item 3): the fastest the machine has (GpuAcc where CUDA is, then CpuAcc
where torch is, then CpuRef), shown in the command's output; ``backends=`` / ``--backends`` still
choose."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

import backplane
from backplane import cli, session
from backplane.backends.api.backend import SUPPORTED, unsupported
from backplane.backends.torch.backend import CpuAcc, GpuAcc
from tests.conftest import small_cnn_model

TINY_MOBILENET = Path(__file__).parent / "data" / "tiny_mobilenet_v3.onnx"


@pytest.fixture
def fresh_default():
    session.default_backends.cache_clear()
    yield
    session.default_backends.cache_clear()


@pytest.mark.parametrize("gpu, cpu, expected", [
    (True, True, ("GpuAcc", "CpuAcc", "CpuRef")),
    (False, True, ("CpuAcc", "CpuRef")),
    (False, False, ("CpuRef",)),  # no torch
])
def test_the_default_is_the_fastest_available(fresh_default, monkeypatch, gpu, cpu,
                                             expected) -> None:
    monkeypatch.setattr(GpuAcc, "availability",
                        lambda self: SUPPORTED if gpu else unsupported("no CUDA device"))
    monkeypatch.setattr(CpuAcc, "availability",
                        lambda self: SUPPORTED if cpu else unsupported("torch is not installed"))
    assert session.default_backends() == expected


def test_on_this_machine(fresh_default) -> None:
    try:
        import torch
    except ImportError:
        assert session.default_backends() == ("CpuRef",)
        return
    expected = ("GpuAcc",) if torch.cuda.is_available() else ()
    assert session.default_backends() == (*expected, "CpuAcc", "CpuRef")


def test_a_session_given_no_backends_takes_the_default_and_says_so() -> None:
    pytest.importorskip("torch")
    chosen = backplane.InferenceSession(small_cnn_model())
    assert chosen.get_providers() == list(session.default_backends())
    assert chosen.report.counts().get("CpuAcc", 0) + chosen.report.counts().get("GpuAcc", 0) > 0
    given = backplane.InferenceSession(small_cnn_model(), backends=["CpuRef"])
    assert given.get_providers() == ["CpuRef"] and set(given.report.counts()) == {"CpuRef"}


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn_model(), str(path))
    return path


def test_the_command_shows_the_default_and_the_json_marks_it(model_path, capsys,
                                                              monkeypatch) -> None:
    from rich.console import Console

    monkeypatch.setattr(cli, "console", Console(width=300))
    default = ", ".join(session.default_backends())
    assert cli.main(["inspect", str(model_path)]) == 0
    assert f"backends: {default} (the fastest available: --backends to choose)" in \
        capsys.readouterr().out
    assert cli.main(["inspect", str(model_path), "--backends", "CpuRef"]) == 0
    out = capsys.readouterr().out
    assert "backends: CpuRef\n" in out and "the fastest available" not in out
    assert cli.main(["inspect", str(model_path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["default_backends"] is True and document["backends"] == default.split(", ")


def test_the_tiny_mobilenet_on_the_default_runs_with_at_most_a_few_warning_lines(capsys) -> None:
    pytest.importorskip("torch")
    assert cli.main(["run", str(TINY_MOBILENET), "--repeat", "1"]) == 0
    captured = capsys.readouterr()
    assert "CpuAcc" in captured.out
    warnings = [line for line in captured.err.splitlines() if line.startswith("WARNING")]
    assert len(warnings) <= 3, warnings
