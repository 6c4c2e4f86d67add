"""A device backend first in the list that refuses layers is named in one warning line, with the
layers and the reasons (issue 28: a model GpuAcc refused ran on CpuAcc with only per-op counts)."""

from __future__ import annotations

import logging

from backplane import InferenceSession
from backplane.backends.registry import registry
from backplane.optimizer.optimize import first_choice_refusals
from tests.conftest import small_cnn_model


def test_the_layers_a_device_backend_refused_are_named_with_the_reason(partial_backends,
                                                                        caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="backplane.optimizer"):
        session = InferenceSession(small_cnn_model(), backends=["TestPrivate", "CpuRef"])
    (line,) = [m for m in caplog.messages if "first in the list" in m]
    assert line.startswith("TestPrivate, first in the list, refused 3 of 9 layers, placed on "
                           "CpuRef (3) instead: ")
    for name, op in (("pool", "GlobalAveragePool"), ("flatten", "Flatten"), ("softmax", "Softmax")):
        assert f"{op} is not one of Conv, Relu, Add, MatMul, Gemm, Mul: {name} ({op})" in line
    assert line in session.report.warnings


def test_host_backends_and_backends_that_refuse_nothing_get_no_such_line(partial_backends) -> None:
    host = InferenceSession(small_cnn_model(), backends=["TestPartial", "CpuRef"]).report
    assert host.layers["pool"].refusals  # it refused, but computes in host memory
    assert first_choice_refusals(host, registry) is None
    alone = InferenceSession(small_cnn_model(), backends=["CpuRef"]).report
    assert first_choice_refusals(alone, registry) is None


def test_past_the_named_count_the_rest_are_counted(partial_backends) -> None:
    report = InferenceSession(small_cnn_model(), backends=["TestPrivate", "CpuRef"]).report
    line = first_choice_refusals(report, registry, named=0)
    assert line is not None and line.count(" and 1 more") == 3
