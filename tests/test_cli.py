"""The backplane command: run, inspect, backends, and its errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from backplane import cli, cli_tables
from tests.conftest import float_input, make_model, small_cnn_model


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
    code, out = run_cli(["run", str(model_path), "--backends", "CpuRef", "--repeat", "2"], capsys)
    assert code == 0
    for layer in ("conv1", "relu1", "pool", "softmax"):
        assert layer in out
    assert "Where each layer ran" in out and "median of 2 runs" in out
    assert "output probs: float32[1, 5]" in out
    # the per-layer tables hold each layer's fastest run: their sum is said beside the median
    assert "the tables give each layer's fastest run" in " ".join(out.split())


def test_run_reads_inputs_from_npy_files(model_path, tmp_path, capsys) -> None:
    x = np.ones((1, 3, 8, 8), np.float32)
    np.save(tmp_path / "x.npy", x)
    code, out = run_cli(["run", str(model_path), "--backends", "CpuRef", "--input", f"x={tmp_path / 'x.npy'}",
                         "--repeat", "1"], capsys)
    assert code == 0 and "output probs" in out
    code, out = run_cli(["run", str(model_path), "--backends", "CpuRef", "--input",
                         f"nope={tmp_path / 'x.npy'}"], capsys)
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
    # the options each backend takes, each with what it takes, in a table of their own
    assert re.search(r"CpuAcc\.conv_route +│ auto \(measured\), onednn", out)


def test_backends_on_a_100_column_terminal_keeps_each_capability_and_option_whole() -> None:
    """Issue 31, item 6: on a 100-column terminal 'AsyncExecution=Fa|lse' was folded across two
    lines; each capability is a line of its own in its cell now, never cut, and the options are a
    table of their own, each whole, every line within the 100 columns (a real terminal: a
    pseudo-terminal of 100 columns)."""
    leader, follower = os.openpty()
    env = {**os.environ, "COLUMNS": "100", "LINES": "50", "TERM": "xterm"}
    with subprocess.Popen([sys.executable, "-m", "backplane", "backends"], stdout=follower,
                          stderr=follower, env=env) as child:
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert child.wait(timeout=120) == 0
    os.close(leader)
    out = re.sub(r"\x1b\[[0-9;]*m", "", b"".join(chunks).decode())
    assert "Registered backends" in out and "Backend options" in out
    for whole in ("AsyncExecution=False", "ProtectedContentAllocation=False", "HostThreads=blas",
                  "CpuAcc.conv_route", "CpuAcc.route_cache", "OpenVINO.performance_hint"):
        assert whole in out
    # every line fits the terminal: none is wrapped by it (the options column made the table
    # 112 columns wide, its names cut: 'CpuAcc.conv_rout|e')
    assert max(len(line.rstrip("\r")) for line in out.split("\n")) <= 100


def test_backends_shows_where_each_came_from_and_what_was_skipped(tmp_path, capsys,
                                                                  monkeypatch) -> None:
    from tests.registry.test_dynamic import source
    from tests.registry.test_example_backend import fresh_registry, install_entry_point

    (tmp_path / "paths").mkdir()
    (tmp_path / "paths" / "Acme_File_backend.py").write_text(source("AcmeFile"))
    (tmp_path / "paths" / "Acme_Old_backend.py").write_text(source("AcmeOld", version="(0, 3)"))
    install_entry_point(tmp_path / "site", monkeypatch)
    monkeypatch.setattr(cli_tables, "registry", fresh_registry())
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
    monkeypatch.setattr(cli_tables, "registry", registry)
    monkeypatch.setenv("COLUMNS", "200")
    code, out = run_cli(["backends"], capsys)
    assert code == 0 and "pip install 'backplane[torch]'" in out


# -- machine-readable output, pictures, traces, tables that keep paths whole, quiet progress -----------------
def run_json(args: list[str], capfd) -> tuple[int, object, str]:
    """The command with --json: its exit code, stdout parsed as one JSON document, and stderr."""
    import json

    code = cli.main(args + ["--json"])
    out, err = capfd.readouterr()
    return code, json.loads(out), err


def test_inspect_json_is_the_whole_report(model_path, capfd, partial_backends) -> None:
    code, doc, _ = run_json(["inspect", str(model_path), "--backends", "TestPrivate,CpuRef",
                             "--graph"], capfd)
    assert code == 0 and doc["backends"] == ["TestPrivate", "CpuRef"]
    placement = doc["placement"]
    assert placement["counts"] == {"TestPrivate": 6, "CpuRef": 3}
    pool = next(layer for layer in placement["layers"] if layer["name"] == "pool")
    assert pool["backend"] == "CpuRef"
    assert pool["refusals"][0]["backend"] == "TestPrivate"
    assert "GlobalAveragePool is not one of" in pool["refusals"][0]["reason"]
    assert {(c["tensor"], c["strategy"], c["nbytes"]) for c in placement["copies"]} >= \
        {("x", "copy", 768)}
    assert [layer["op_type"] for layer in doc["graph"]][0] == "MemCopy"


def test_run_json_and_a_trace(model_path, tmp_path, capfd) -> None:
    import json

    trace = tmp_path / "run.json"
    code, doc, err = run_json(["run", str(model_path), "--backends", "CpuRef", "--repeat", "3",
                               "--trace", str(trace)], capfd)
    assert code == 0 and doc["runs"]["count"] == 3 and doc["runs"]["median_ms"] > 0
    assert [layer["layer"] for layer in doc["layers"]][:2] == ["conv1", "relu1"]
    assert doc["outputs"] == [{"name": "probs", "dtype": "float32", "shape": [1, 5],
                               "first": doc["outputs"][0]["first"],
                               "argmax": doc["outputs"][0]["argmax"]}]
    assert doc["per_backend"][0]["backend"] == "CpuRef" and doc["trace"] == str(trace)
    events = json.loads(trace.read_text())["traceEvents"]
    assert len([e for e in events if e.get("name") == "run"]) == 4  # the warm-up and 3 timed runs
    assert "timed runs" not in err  # no progress bar when stderr is not a terminal


def test_run_is_not_run_again_for_another_sessions_routes(model_path, tmp_path, capfd) -> None:
    """A CpuAcc Trial of another session in the process, still choosing, is not this run's to
    wait for: the trace holds the warm-up and the timed runs only (it once held one more)."""
    import json

    pytest.importorskip("torch")
    from backplane.backends.torch import trials

    other = trials.Trial({"a": lambda: (), "b": lambda: ()}, {}, None)
    trials._adopt([other])  # a root, as the background makes them
    trace = tmp_path / "run.json"
    code, _, _ = run_json(["run", str(model_path), "--backends", "CpuRef", "--repeat", "2",
                           "--trace", str(trace)], capfd)
    events = json.loads(trace.read_text())["traceEvents"]
    assert code == 0 and len([e for e in events if e.get("name") == "run"]) == 3
    assert not other.settled()


def test_backends_json_lists_ids_origins_and_options(capfd) -> None:
    code, doc, _ = run_json(["backends"], capfd)
    by_id = {b["id"]: b for b in doc["backends"]}
    assert code == 0 and by_id["CpuRef"]["available"] is True and by_id["CpuRef"]["ops"] > 100
    assert by_id["CpuRef"]["origin"] == "built in"
    assert "CpuAcc.threads" in by_id["CpuAcc"]["options"]
    assert by_id["GpuAcc"]["available"] is (by_id["GpuAcc"]["reason"] is None)


def test_bench_json(model_path, capfd) -> None:
    code, doc, err = run_json(["bench", str(model_path), "--backends", "CpuRef", "--no-ort",
                               "--no-torch", "--no-peak", "--rounds", "1", "--runs", "2",
                               "--warmup", "1"], capfd)
    assert code == 0, doc
    (row,) = doc["results"]
    assert row["runtime"] == "CpuRef" and row["backplane"] is True
    assert len(row["times_ms"]) == 2 and row["median_ms"] > 0 and row["load_s"] > 0
    assert (row["partitions"], row["crossings"]) == (1, 0)
    assert doc["rounds"] == 1 and doc["peak_gflops"] is None
    assert "round" not in err  # the progress bar stays off a pipe


def test_bench_shows_the_plans_partitions_and_crossings(tmp_path, capfd) -> None:
    """A model CpuAcc takes but for one layer (an inverse DFT, which it refuses) runs in three
    partitions with two tensors handed between backends; ONNX Runtime's row has no plan. The model
    is IR 8 (conftest's make_model): onnx 1.23 writes IR 14, which ONNX Runtime 1.30 (the GPU
    machine's) refuses to load, and an ONNX Runtime row that fails makes the bench exit 1."""
    pytest.importorskip("torch")
    from onnx import helper

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("DFT", ["a"], ["b"], inverse=1),
             helper.make_node("Relu", ["b"], ["y"])]
    path = tmp_path / "split.onnx"
    onnx.save(make_model(nodes, [float_input("x", [1, 8, 2])], [float_input("y", [1, 8, 2])]),
              str(path))
    code, doc, _ = run_json(["bench", str(path), "--backends", "CpuAcc,CpuRef", "--no-torch",
                             "--no-peak", "--rounds", "1", "--runs", "2", "--warmup", "1"], capfd)
    assert code == 0, doc
    rows = {row["runtime"]: row for row in doc["results"]}
    assert (rows["CpuAcc,CpuRef"]["partitions"], rows["CpuAcc,CpuRef"]["crossings"]) == (3, 2)
    assert "partitions" not in rows["onnxruntime"]
    from backplane.bench_engine import plan_text

    assert plan_text({"partitions": 3, "crossings": 2}) == "3 parts, 2 crossings"
    assert plan_text({"partitions": 1, "crossings": 0}) == "1 part, 0 crossings"
    assert plan_text({}) == ""


def test_json_errors_are_json_too(model_path, capfd) -> None:
    code, doc, _ = run_json(["run", str(model_path), "--backends", "Nope"], capfd)
    assert code == 2 and doc["type"] == "OptimizationError"
    assert "unknown backend 'Nope'" in doc["error"]


def test_json_keeps_what_a_library_prints_off_stdout(model_path, capfd) -> None:
    import os

    from backplane.backends.registry import registry
    from tests.conftest import PartialBackend

    def noisy_relu(x):
        print("python noise")
        os.write(1, b"fd noise\n")  # as C code writing to stdout would
        return (np.maximum(x, 0),)

    class Noisy(PartialBackend):
        id = "TestNoisy"
        KERNELS = {"Relu": {6: noisy_relu}}

    with registry.temporarily(Noisy.id, Noisy):
        code, doc, err = run_json(["run", str(model_path), "--backends", "TestNoisy,CpuRef",
                                   "--repeat", "1"], capfd)
    assert code == 0 and doc["placement"] == {"TestNoisy": 2, "CpuRef": 7}
    assert "python noise" in err and "fd noise" in err


def test_backend_options_after_at(model_path, capsys) -> None:
    assert cli.backend_specs("CpuAcc,CpuRef@CpuAcc.threads=1@CpuAcc.compile=layers") == \
        [("CpuAcc", {"threads": 1, "compile": "layers"}), "CpuRef"]
    code, out = run_cli(["inspect", str(model_path), "--backends", "CpuRef@CpuRef.threads=2"],
                        capsys)
    assert code == 2 and "'CpuRef.threads': not an option of CpuRef" in out
    code, out = run_cli(["inspect", str(model_path), "--backends", "CpuRef@CpuAcc.threads=2"],
                        capsys)
    assert code == 2 and "name it <backend>.<option> with a backend of the list (CpuRef)" in out


def test_inspect_html_and_dot(model_path, tmp_path, capsys, partial_backends) -> None:
    from backplane import placement_picture

    page, dot = tmp_path / "p.html", tmp_path / "p.dot"
    code, out = run_cli(["inspect", str(model_path), "--backends", "TestPrivate,CpuRef",
                         "--html", str(page), "--dot", str(dot)], capsys)
    assert code == 0 and f"wrote {page} ({page.stat().st_size:,} bytes" in out
    assert dot.read_text().startswith("digraph placement {")
    html = page.read_text()
    assert "<script" not in html and "GlobalAveragePool is not one of" in html
    drawn = placement_picture.dot_program() is not None
    assert ("<svg" in html) is drawn and ("drawn with Graphviz" in out) is drawn


def test_tables_never_fold_a_path_or_a_layer_name(tmp_path, capsys, monkeypatch) -> None:
    from rich.console import Console

    model = small_cnn_model()
    long_name = "/encoder/" + "/".join(f"block.{i}/sub_block_{i}" for i in range(12)) + "/Conv"
    model.graph.node[0].name = long_name
    path = tmp_path / "long.onnx"
    onnx.save(model, str(path))
    monkeypatch.setattr(cli, "console", Console(width=60, force_terminal=True))  # a narrow terminal
    code, out = run_cli(["inspect", str(path), "--backends", "CpuRef"], capsys)
    assert code == 0 and long_name in out
    monkeypatch.setattr(cli, "console", Console())  # piped: as wide as the tables
    code, out = run_cli(["run", str(path), "--backends", "CpuRef", "--repeat", "1"], capsys)
    assert code == 0 and long_name in out and cli.console.width == cli.WIDE


def test_progress_shows_on_a_terminal_only(monkeypatch) -> None:
    import argparse
    import io

    from rich.console import Console

    from backplane import progress

    for console, quiet, shown in ((Console(file=io.StringIO()), False, False),
                                  (Console(file=io.StringIO(), force_terminal=True), True, False),
                                  (Console(file=io.StringIO(), force_terminal=True), False, True)):
        monkeypatch.setattr(cli, "err_console", console)
        with cli._working(argparse.Namespace(quiet=quiet), "work"):
            assert (progress.active() is not None) is shown  # more in tests/test_progress.py


def test_log_lines_in_a_file_or_pipe_are_as_long_as_their_message(model_path) -> None:
    """Rich padded every log line to the console's width (10,000 characters) off a terminal.
    The warning: an unavailable backend (GpuAcc without CUDA, which CI's machine lacks)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("GpuAcc is available here: no warning to look at")
    done = subprocess.run([sys.executable, "-m", "backplane", "run", str(model_path),
                           "--backends", "GpuAcc,CpuRef", "--repeat", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert any("GpuAcc is not available" in line for line in lines), done.stderr
    assert max(len(line) for line in lines) < 400, max(lines, key=len)[:200]
    assert all(line == line.rstrip() for line in lines)


DECODE = Path(__file__).resolve().parent / "data" / "tiny_gpt2_decode.onnx"


def test_run_says_what_inputs_it_made_and_which_free_dimension_it_set(capsys) -> None:
    code = cli.main(["run", str(DECODE), "--backends", "CpuRef", "--repeat", "1",
                     "--dim", "total=7", "--dim", "past=6"])
    err = capsys.readouterr().out
    assert code == 0, err
    assert "input 'past_key_0': made float32[1, 2, 6, 16] in [" in err
    assert "input 'attention_mask': made int64[1, 7]" in err
    assert "set to 1" not in err
    cli.main(["run", str(DECODE), "--backends", "CpuRef", "--repeat", "0", "--dim", "total=7",
              "--shape", "past_key_0=1,2,6,16", "--shape", "past_value_0=1,2,6,16",
              "--shape", "past_key_1=1,2,6,16", "--shape", "past_value_1=1,2,6,16"])
    err = capsys.readouterr().out
    assert "made float32[1, 2, 6, 16]" in err and "set to 1" not in err


def test_a_free_dimension_left_open_is_named_with_how_to_choose_it(capsys) -> None:
    cli.main(["run", str(DECODE), "--backends", "CpuRef", "--repeat", "0"])
    err = capsys.readouterr().out.replace("\n", "")
    assert "free 'past' set to 1: --dim NAME=SIZE or --shape past_key_0=... to choose" in err


@pytest.mark.parametrize("args, message", [
    (["--dim", "nope=3"], "--dim nope: no input has a free dimension of that name; the free "
                          "dimensions are: past, total"),
    (["--dim", "past=x"], "--dim past=x: the size is an integer"),
    (["--shape", "input_ids=2,1"], "--shape input_ids=2,1: the model declares input_ids: int64[1,1]"),
    (["--shape", "nope=1"], "--shape nope: not an input of the model"),
    (["--shape", "input_ids=a,1"], "sizes are integers separated by commas"),
])
def test_bad_shapes_and_dims_are_user_errors(args, message, capsys) -> None:
    code = cli.main(["run", str(DECODE), "--backends", "CpuRef", "--repeat", "0", *args])
    out = capsys.readouterr().out
    assert code == 2 and message in out.replace("\n", ""), out


def test_verbose_flags_say_each_step(model_path, capsys) -> None:
    """-v: the load's steps and times; -vv: the placement plan and each layer as it runs (the
    help promised it; a normal run printed nothing). `backplane run` times each layer itself."""
    assert cli.main(["run", str(model_path), "--backends", "CpuRef", "--repeat", "0", "-v"]) == 0
    err = capsys.readouterr().err
    assert "imported in" in err and "CpuRef: " in err and "loaded in" in err, err
    assert cli.main(["run", str(model_path), "--backends", "CpuRef", "--repeat", "0", "-vv"]) == 0
    err = capsys.readouterr().err
    assert "Placement" in err and "conv1" in err, err[-2000:]
    assert "BACKPLANE_DEBUG" not in os.environ  # the knob is the command's, put back after
