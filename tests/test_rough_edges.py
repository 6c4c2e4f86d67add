"""A new user's rough edges (issue 19, items 6 and 7): each is a clear error naming the thing and the
valid choices, or it works; and the package's hygiene (LICENSE, py.typed, --version, python -m)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import onnx
import pytest

import backplane
from backplane import cli
from backplane.ir.graph import Layer
from tests.conftest import small_cnn_model

ROOT = Path(__file__).resolve().parents[1]
X = np.ones((1, 3, 8, 8), np.float32)


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    from rich.console import Console

    monkeypatch.setattr(cli, "console", Console(width=300))


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn_model(), str(path))
    return path


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main(args)
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# -- the command line ------------------------------------------------------------------------------------
def test_a_missing_or_unreadable_input_file_is_an_error_not_a_traceback(model_path, tmp_path,
                                                                          capsys) -> None:
    code, out = run_cli(["run", str(model_path), "--input", "x=missing.npy"], capsys)
    assert code == 2 and "--input x=missing.npy: the file does not exist" in out
    (tmp_path / "junk.npy").write_text("not an array")
    code, out = run_cli(["run", str(model_path), "--input", f"x={tmp_path / 'junk.npy'}"], capsys)
    assert code == 2 and "not a readable .npy file" in out and "Traceback" not in out


def test_a_directory_given_as_the_model_is_called_a_directory(tmp_path, capsys) -> None:
    code, out = run_cli(["run", str(tmp_path)], capsys)
    assert code == 2 and f"'{tmp_path}' is a directory: give the model's .onnx file" in out
    with pytest.raises(backplane.ModelError, match="is a directory"):
        backplane.InferenceSession(str(tmp_path), backends=["CpuRef"])


def test_a_pin_naming_nothing_in_the_model_is_an_error_with_the_closest_names(model_path,
                                                                                capsys) -> None:
    code, out = run_cli(["run", str(model_path), "--pin", "NoSuchLayer=CpuRef"], capsys)
    assert code == 2 and "pin 'NoSuchLayer': no layer of the model has that name or op type" in out
    assert "op types are: Add, Conv, Flatten, Gemm, GlobalAveragePool, Relu, Softmax" in out
    code, out = run_cli(["run", str(model_path), "--pin", "Sofmax=CpuRef"], capsys)
    assert code == 2 and "(did you mean 'Softmax', 'softmax'?)" in out
    # a layer name, an op type of the model, and an ONNX op type the model does not use all work
    for pin in ("conv1=CpuRef", "Relu=CpuRef", "LSTM=CpuRef"):
        code, out = run_cli(["run", str(model_path), "--pin", pin, "--repeat", "1"], capsys)
        assert code == 0, (pin, out)


@pytest.mark.parametrize("option", ["--repeat", "--threads", "--seed"])
def test_negative_counts_are_refused_by_the_parser(model_path, option, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", str(model_path), option, "-1"])
    assert exited.value.code == 2
    assert f"argument {option}: expected a whole number >= 0, got -1" in capsys.readouterr().err


def test_backend_ids_in_the_wrong_case_get_a_suggestion_and_builtin_is_not_offered(model_path,
                                                                                     capsys) -> None:
    code, out = run_cli(["run", str(model_path), "--backends", "cpuref"], capsys)
    assert code == 2 and "unknown backend 'cpuref' (did you mean 'CpuRef'?)" in out
    known = out.split("Known backends are:")[1]
    assert "CpuRef" in known and "builtin" not in known
    with pytest.raises(ValueError, match="'builtin' is backplane's own backend"):
        backplane.InferenceSession(str(model_path), backends=["builtin", "CpuRef"])


def test_run_takes_backend_options_and_a_misspelled_one_lists_the_valid_ones(model_path,
                                                                             capsys) -> None:
    pytest.importorskip("torch")
    code, out = run_cli(["run", str(model_path), "--backends", "CpuAcc,CpuRef@CpuAcc.thread=1"],
                        capsys)
    assert code == 2 and "'CpuAcc.thread': not an option of CpuAcc" in out
    assert "CpuAcc.threads" in out
    code, out = run_cli(["run", str(model_path), "--backends",
                         "CpuAcc,CpuRef@CpuAcc.compile=layers@CpuAcc.conv_route=onednn",
                         "--repeat", "1"], capsys)
    assert code == 0 and "CpuAcc" in out


def test_version_and_python_dash_m(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    line = capsys.readouterr().out
    assert line.startswith(f"backplane {backplane.__version__} (Python ") and "numpy" in line
    reply = subprocess.run([sys.executable, "-m", "backplane", "--version"], capture_output=True,
                           text=True, cwd=ROOT)
    assert reply.returncode == 0 and reply.stdout == line


def test_inspect_graph_prints_no_memory_addresses(model_path, capsys) -> None:
    pytest.importorskip("torch")
    code, out = run_cli(["inspect", str(model_path), "--graph", "--backends",
                         "CpuAcc,CpuRef@CpuAcc.compile=layers@CpuAcc.conv_route=onednn",
                         "--pin", "Softmax=CpuRef"], capsys)
    assert code == 0 and "graph " in out and "MemImport[" in out
    assert " at 0x" not in out and "<function" not in out


def test_a_layers_printout_names_functions_objects_and_long_lists_shortly() -> None:
    def double(x):
        return 2 * x

    class Holder:
        id = "torch-cpu"

    inner = [Layer("a", "Relu", ["x"], ["y"]), Layer("b", "Relu", ["y"], ["z"])]
    layer = Layer("n", "Fused", ["x"], ["z"], {"fn": double, "where": Holder(), "layers": inner,
                                              "sizes": list(range(10)), "pair": (1,)})
    text = repr(layer)
    assert "fn=test_a_layers_printout_names_functions_objects_and_long_lists_shortly.<locals>.double"\
        in text
    assert "where=Holder('torch-cpu')" in text and "layers=<2 layers>" in text
    assert "sizes=[0, 1, 2, 3, ... 10 items]" in text and "pair=(1,)" in text
    assert " at 0x" not in text


# -- the Python API ------------------------------------------------------------------------------------
def test_a_string_given_as_the_backend_list_says_to_make_it_a_list(model_path) -> None:
    with pytest.raises(TypeError, match=r"got 'CpuRef' \(a list: \['CpuRef'\]\)"):
        backplane.InferenceSession(str(model_path), backends="CpuRef")


def test_running_a_closed_session_says_it_is_closed(model_path) -> None:
    session = backplane.InferenceSession(str(model_path), backends=["CpuRef"])
    session.run(None, {"x": X})
    session.close()
    session.close()  # twice: nothing more to do
    for run in (lambda: session.run(None, {"x": X}), lambda: session.run_profiled(None, {"x": X}),
                lambda: session.run(None, {"x": X}, backplane.RunOptions(logid="a"))):
        with pytest.raises(RuntimeError, match="this InferenceSession is closed"):
            run()


def test_runtime_options_profiling_profiles_every_run(model_path) -> None:
    runtime = backplane.Runtime(backplane.RuntimeOptions(profiling=True))
    network_id = runtime.load(backplane.optimize(backplane.import_onnx(str(model_path)), ["CpuRef"]))
    runtime.run(network_id, {"x": X})
    runtime.run(network_id, {"x": X})
    names = [name for name, _ in runtime.profiling["CpuRef"].events]
    assert names.count("conv1") == 2 and names.count("softmax") == 2
    assert all(seconds >= 0 for _, seconds in runtime.profiling["CpuRef"].events)


# -- hygiene ---------------------------------------------------------------------------------------------
def test_license_and_py_typed_are_shipped() -> None:
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.startswith("MIT License") and \
        "Copyright (c) 2026 the backplane developers" in license_text
    assert (ROOT / "src" / "backplane" / "py.typed").is_file()
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["backplane"]
    # PEP 561's marker, and the native kernels' C sources (built on first use where installed)
    assert {"py.typed", "native/*.c", "native/*.h"} <= set(shipped)


def test_no_docstring_or_document_cites_the_seed_documents() -> None:
    tracked = subprocess.run(["git", "ls-files", "src", "docs", "examples", "README.md"],
                             capture_output=True, text=True, cwd=ROOT).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    citing = [p for p in tracked if p.endswith((".py", ".md"))
              and "seed 000" in (ROOT / p).read_text(encoding="utf-8")]
    assert citing == []


def test_the_submodules_users_are_told_of_need_no_import_of_their_own() -> None:
    """``backplane.placement_picture.write_html`` in a fresh interpreter (issue 31, item 6): it was
    an AttributeError unless imported explicitly; an unknown name still is one."""
    probe = ("import backplane; print(backplane.placement_picture.write_html.__name__); "
             "print(backplane.profiling.__name__)\n"
             "try:\n    backplane.no_such_thing\nexcept AttributeError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          check=True)
    assert done.stdout.splitlines() == ["write_html", "backplane.profiling",
                                        "module 'backplane' has no attribute 'no_such_thing'"]
