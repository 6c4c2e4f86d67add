"""The backplane command: run, inspect, backends, and its errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from backplane import cli
from tests.conftest import small_cnn_model


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """Tables wide enough that reasons are not folded across lines."""
    from rich.console import Console

    monkeypatch.setattr(cli, "console", Console(width=300))


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn_model(), str(path))
    return path


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main(args)
    return code, capsys.readouterr().out


def test_run_prints_each_layers_backend_and_time_and_the_outputs(model_path, capsys) -> None:
    code, out = run_cli(["run", str(model_path), "--repeat", "2"], capsys)
    assert code == 0
    for layer in ("conv1", "relu1", "pool", "softmax"):
        assert layer in out
    assert "Where each layer ran" in out and "median of 2 runs" in out
    assert "output probs: float32[1, 5]" in out


def test_run_reads_inputs_from_npy_files(model_path, tmp_path, capsys) -> None:
    x = np.ones((1, 3, 8, 8), np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out = run_cli(["run", str(model_path), "--input", f"x={tmp_path / 'x.npy'}",
                         "--repeat", "1"], capsys)
    assert code == 0 and "output probs" in out
    code, out = run_cli(["run", str(model_path), "--input", f"nope={tmp_path / 'x.npy'}"], capsys)
    assert code == 2 and "--input nope: not an input of the model; its inputs are: x" in out


def test_inspect_shows_placement_with_reasons(model_path, capsys, partial_backends) -> None:
    code, out = run_cli(["inspect", str(model_path), "--backends", "TestPartial,CpuRef"], capsys)
    assert code == 0
    assert "GlobalAveragePool is not one of" in out and "TestPartial" in out


def test_unknown_backend_is_a_clear_error(model_path, capsys) -> None:
    code, out = run_cli(["inspect", str(model_path), "--backends", "Nope"], capsys)
    assert code == 2 and "unknown backend 'Nope'. Known backends are:" in out


def test_backends_lists_the_registered_backends(capsys) -> None:
    code, out = run_cli(["backends"], capsys)
    assert code == 0 and "CpuRef" in out and "builtin" in out and "built in" in out


def test_backends_shows_where_each_came_from_and_what_was_skipped(tmp_path, capsys,
                                                                  monkeypatch) -> None:
    from tests.registry.test_dynamic import source
    from tests.registry.test_example_backend import fresh_registry, install_entry_point

    (tmp_path / "paths").mkdir()
    (tmp_path / "paths" / "Acme_File_backend.py").write_text(source("AcmeFile"))
    (tmp_path / "paths" / "Acme_Old_backend.py").write_text(source("AcmeOld", version="(0, 3)"))
    install_entry_point(tmp_path / "site", monkeypatch)
    monkeypatch.setattr(cli, "registry", fresh_registry())
    code, out = run_cli(["backends", "--dynamic-backends-path", str(tmp_path / "paths")], capsys)
    assert code == 0
    assert "built in" in out
    assert "entry point acme-tiny-backend acme_tiny_backend" in out and "AcmeTiny" in out
    assert f"file {tmp_path / 'paths' / 'Acme_File_backend.py'}" in out
    assert "Skipped candidates" in out
    assert "its backend API version 0.3 is not compatible with backplane's backend API version 1.0" in out


def test_backends_prints_reasons_as_text_not_markup(capsys, monkeypatch) -> None:
    """An availability reason with brackets ("pip install 'backplane[torch]'") keeps them."""
    from backplane.backends.api.backend import Backend, unsupported
    from tests.registry.test_example_backend import fresh_registry

    class Absent(Backend):
        id = "Absent"

        def availability(self):
            return unsupported("torch is not installed (pip install 'backplane[torch]')")

    registry = fresh_registry()
    registry.register(Absent.id, Absent)
    monkeypatch.setattr(cli, "registry", registry)
    monkeypatch.setenv("COLUMNS", "200")
    code, out = run_cli(["backends"], capsys)
    assert code == 0 and "pip install 'backplane[torch]'" in out
