"""Fallback warnings gathered (issue 19, item 4): the log gets one line per (op type, backend, reason)
with a count, each layer's detail stays in the report, and the command line's --quiet / --verbose
set standard logging levels."""

from __future__ import annotations

import logging

import onnx
import pytest

import backplane
from backplane import cli
from backplane.backends.api.backend import unsupported
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import registry
from tests.conftest import small_cnn_model

REFUSED = {"Conv": "no convolutions here", "Relu": "no activations here"}


class Refuser(CpuRef):
    """CpuRef that refuses every Conv and Relu, each op type with one reason."""

    id = "TestRefuser"

    def is_layer_supported(self, layer, inputs, outputs):
        if layer.op_type in REFUSED:
            return unsupported(REFUSED[layer.op_type])
        return super().is_layer_supported(layer, inputs, outputs)


@pytest.fixture
def refuser():
    with registry.temporarily(Refuser.id, Refuser):
        yield


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn_model(), str(path))
    return path


SUMMARY = ["2 layers of type Conv not supported on TestRefuser (reason: no convolutions here), "
           "fell back to the next backend",
           "2 layers of type Relu not supported on TestRefuser (reason: no activations here), "
           "fell back to the next backend"]


def test_one_warning_per_op_type_backend_and_reason_with_the_details_in_the_report(refuser,
                                                                                   caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="backplane"):
        session = backplane.InferenceSession(small_cnn_model(), backends=["TestRefuser", "CpuRef"],
                                             sess_options=backplane.SessionOptions(
                                                 log_severity_level=0))  # debug messages too
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == SUMMARY
    details = [w for w in session.report.warnings if "is not supported on requested backend" in w]
    assert len(details) == 4 and any("Relu" in d and "no activations here" in d for d in details)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert sorted(d for d in debug if "requested backend" in d) == sorted(details)
    assert session.report.fallbacks() == {("Conv", "TestRefuser", "no convolutions here"): 2,
                                          ("Relu", "TestRefuser", "no activations here"): 2}
    assert {p.name for p in session.report.layers.values() if p.backend == "CpuRef"} == \
        {"conv1", "conv2", "relu1", "relu2"}


def run_cli(args: list[str], capsys) -> str:
    assert cli.main(args) == 0
    return capsys.readouterr().err


def test_the_command_line_logs_the_summary_and_quiet_and_verbose_change_the_level(
        refuser, model_path, capsys) -> None:
    command = ["inspect", str(model_path), "--backends", "TestRefuser,CpuRef"]
    lines = [line for line in run_cli(command, capsys).splitlines() if "not supported" in line]
    assert len(lines) == 2 and "2 layers of type Conv" in lines[0] + lines[1]
    assert "not supported" not in run_cli([*command, "--quiet"], capsys)
    verbose = run_cli([*command, "-vv"], capsys)
    assert verbose.count("is not supported on requested backend") == 4  # each layer's, as debug
    assert verbose.count("layers of type") == 2


def test_quiet_and_verbose_are_one_or_the_other(model_path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["run", str(model_path), "--quiet", "--verbose"])
    assert exited.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_log_level_follows_the_flags() -> None:
    parser = cli._parser()
    levels = [cli.log_level(parser.parse_args(["backends", *flags]))
              for flags in ([], ["-q"], ["-v"], ["-vv"], ["-vvv"])]
    assert levels == [logging.WARNING, logging.ERROR, logging.INFO, logging.DEBUG, logging.DEBUG]
