"""Progress on long work (backplane.progress): bars on a terminal, nothing when piped, with --quiet,
or with no display open; the commands, measured placement, CpuAcc's routes and compile report to it."""

from __future__ import annotations

import io

import onnx
import pytest
from rich.console import Console

from backplane import InferenceSession, OptimizerOptions, cli, progress
from tests.conftest import small_cnn_model


def terminal() -> Console:
    """A console that says it is a terminal (as stderr on one would), writing to a string."""
    return Console(file=io.StringIO(), force_terminal=True, width=200)


def piped() -> Console:
    return Console(file=io.StringIO())


def written(console: Console) -> str:
    return console.file.getvalue()  # type: ignore[attr-defined]


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn_model(), str(path))
    return path


def work(console: Console, quiet: bool = False) -> None:
    with progress.shown(console, quiet=quiet), progress.task("long work", total=3) as step:
        for _ in range(3):
            step()
        progress.count("things measured")


def test_a_bar_shows_on_a_terminal() -> None:
    console = terminal()
    work(console)
    assert "long work" in written(console) and "things measured" in written(console)


@pytest.mark.parametrize("console, quiet", [(piped(), False), (terminal(), True)],
                         ids=["piped", "quiet"])
def test_nothing_when_piped_or_quiet(console: Console, quiet: bool) -> None:
    work(console, quiet)
    assert written(console) == ""


def test_with_no_display_open_reporting_does_nothing() -> None:
    assert progress.active() is None
    with progress.task("unseen", total=2) as step:
        step()
        step("still unseen")
    progress.count("unseen")


def test_an_inner_display_reuses_the_outer_one_off_or_on() -> None:
    outer, inner = piped(), terminal()
    with progress.shown(outer):
        work(inner)  # bench's own bar, under the command's: off where the command's is off
    assert written(inner) == "" and written(outer) == ""
    outer = terminal()
    with progress.shown(outer):
        work(terminal())
    assert "long work" in written(outer)


def test_measured_placement_shows_its_partitions() -> None:
    console = terminal()
    with progress.shown(console):
        InferenceSession(small_cnn_model(), backends=["CpuRef"],
                         optimizer_options=OptimizerOptions(placement="measured"))
    assert "measured placement: timing each partition" in written(console)


# -- the commands: a bar on a terminal, none piped, none with --quiet -------------------------------------
def test_run_shows_the_load_and_the_timed_runs_on_a_terminal(model_path, monkeypatch, capsys) -> None:
    console = terminal()
    monkeypatch.setattr(cli, "err_console", console)
    assert cli.main(["run", str(model_path), "--backends", "CpuRef", "--repeat", "3"]) == 0
    assert "loading cnn.onnx on CpuRef" in written(console) and "timed runs" in written(console)
    assert "timed runs" not in capsys.readouterr().out  # stdout keeps the tables alone


@pytest.mark.parametrize("console, flags", [(piped(), []), (terminal(), ["--quiet"])],
                         ids=["piped", "quiet"])
def test_run_is_silent_piped_or_quiet(console, flags, model_path, monkeypatch) -> None:
    monkeypatch.setattr(cli, "err_console", console)
    assert cli.main(["run", str(model_path), "--backends", "CpuRef", "--repeat", "3", *flags]) == 0
    assert written(console) == ""


def test_cpuacc_counts_the_routes_it_measures(model_path, monkeypatch) -> None:
    pytest.importorskip("torch")
    console = terminal()
    monkeypatch.setattr(cli, "err_console", console)
    backends = "CpuAcc,CpuRef@CpuAcc.route_cache=false@CpuAcc.compile=layers"
    assert cli.main(["inspect", str(model_path), "--backends", backends]) == 0
    assert "CpuAcc: routes measured" in written(console)


def test_inspect_placement_measured_shows_its_partitions(model_path, monkeypatch, capsys) -> None:
    console = terminal()
    monkeypatch.setattr(cli, "err_console", console)
    assert cli.main(["inspect", str(model_path), "--backends", "CpuRef", "--placement",
                     "measured"]) == 0
    assert "measured placement: timing each partition" in written(console)
    assert "Measured placement" in capsys.readouterr().out  # the report's table of measurements


def test_compile_shows_its_partitions(model_path, tmp_path, monkeypatch) -> None:
    console = terminal()
    monkeypatch.setattr(cli, "err_console", console)
    output = tmp_path / "cnn.bpl"
    assert cli.main(["compile", str(model_path), "--backends", "CpuRef", "-o", str(output)]) == 0
    assert output.is_file()
    assert "compiling cnn.onnx for CpuRef" in written(console)
    assert "compiling the partitions" in written(console)
