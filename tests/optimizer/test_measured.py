"""Measured placement: a backend made slow on purpose loses its partitions, copies at the edges are
timed, refused layers and pins stay, the report's table, the cache, and unknown placements."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from backplane import InferenceSession, OptimizerOptions
from backplane.backends.api.backend import OptionError
from backplane.backends.reference.backend import CpuRef
from backplane.backends.reference.kernels import KERNELS as REF_KERNELS
from backplane.backends.registry import registry
from backplane.optimizer import measured
from backplane.optimizer.report import PlacementReport
from tests.conftest import PartialBackend, small_cnn_model

X = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
MEASURED = OptimizerOptions(placement="measured")
SLEEP_S = 0.01
CALLS = {"relu": 0}  # the slow Relu's calls


def slow(kernel: Any) -> Any:
    def relu(x: np.ndarray) -> tuple[np.ndarray]:
        CALLS["relu"] += 1
        time.sleep(SLEEP_S)
        return kernel(x)

    return relu


SLOW_RELU = {version: slow(kernel) for version, kernel in REF_KERNELS["Relu"].items()}


class SlowRef(CpuRef):
    """CpuRef, but its Relu sleeps: slower than CpuRef on anything with a Relu, for certain."""

    id = "TestSlowRef"
    KERNELS = {**CpuRef.KERNELS, "Relu": SLOW_RELU}


class SlowPartial(PartialBackend):
    """TestPartial (Conv, Relu, Add, MatMul, Gemm, Mul) with the slow Relu."""

    id = "TestSlowPartial"
    KERNELS = {**PartialBackend.KERNELS, "Relu": SLOW_RELU}


@pytest.fixture(autouse=True)
def slow_backends(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The slow backends registered, and measured placement's caches empty for each test."""
    for cache in ("_TIMES", "_OUTPUTS", "_EDGES"):
        monkeypatch.setattr(measured, cache, {})
    with registry.temporarily(SlowRef.id, SlowRef), \
            registry.temporarily(SlowPartial.id, SlowPartial):
        yield


def reference() -> list[np.ndarray]:
    return InferenceSession(small_cnn_model(), backends=["CpuRef"]).run(None, {"x": X})


def chosen(report: PlacementReport) -> dict[str, str]:
    return {m.partition: m.backend for m in report.measurements if m.chosen}


def test_a_slow_backend_keeps_its_layers_by_preference_and_loses_them_measured() -> None:
    preferred = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"])
    assert set(preferred.report.counts()) == {"TestSlowRef"}
    assert preferred.report.measurements == []
    session = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                               optimizer_options=MEASURED)
    assert set(session.report.counts()) == {"CpuRef"}
    rows = {m.backend: m for m in session.report.measurements}
    assert set(rows) == {"TestSlowRef", "CpuRef"}
    assert {m.partition for m in rows.values()} == {"conv1..softmax"}
    assert rows["TestSlowRef"].ms >= 2 * SLEEP_S * 1e3 > rows["CpuRef"].ms  # two Relus sleep
    assert rows["CpuRef"].chosen and not rows["TestSlowRef"].chosen
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], reference()[0])


def test_layers_a_backend_refuses_stay_and_the_choice_is_the_least_time_recorded() -> None:
    session = InferenceSession(small_cnn_model(), backends=["TestSlowPartial", "CpuRef"],
                               optimizer_options=MEASURED)
    report = session.report
    parts = {m.partition for m in report.measurements}
    assert parts == {"conv1..relu2", "pool..flatten", "fc..fc", "softmax..softmax"}
    for part in ("pool..flatten", "softmax..softmax"):  # TestSlowPartial refuses them
        assert [m.backend for m in report.measurements if m.partition == part] == ["CpuRef"]
    assert chosen(report)["conv1..relu2"] == "CpuRef"
    for part in parts:
        rows = [m for m in report.measurements if m.partition == part]
        best = min(rows, key=lambda m: m.ms + m.edge_ms)
        assert [m for m in rows if m.chosen] == [best]
    for name in ("conv1", "relu1", "conv2", "skip", "relu2", "pool", "flatten", "softmax"):
        assert report.backend_of(name) == "CpuRef"
    np.testing.assert_array_equal(session.run(None, {"x": X})[0], reference()[0])


def test_copies_at_the_edges_are_timed(partial_backends: None) -> None:
    """TestPrivate's tensors live in memory of its own: on it, the partition pays copies in and
    out; on CpuRef, whose neighbours (the user, pool) share host memory, it pays nothing."""
    report = InferenceSession(small_cnn_model(), backends=["TestPrivate", "CpuRef"],
                              optimizer_options=MEASURED).report
    rows = {m.backend: m for m in report.measurements if m.partition == "conv1..relu2"}
    assert rows["TestPrivate"].edge_ms > 0
    assert rows["CpuRef"].edge_ms == 0


def test_a_pinned_partition_stays_where_its_pin_puts_it() -> None:
    session = InferenceSession(small_cnn_model(), backends=["CpuRef"],
                               pins={"relu1": "TestSlowRef"}, optimizer_options=MEASURED)
    assert session.report.backend_of("relu1") == "TestSlowRef"
    (row,) = [m for m in session.report.measurements if m.partition == "relu1..relu1"]
    assert (row.backend, row.chosen, row.note) == ("TestSlowRef", True, "pinned")


def test_the_report_shows_the_table_and_keeps_it_as_data() -> None:
    report = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                              optimizer_options=MEASURED).report
    text = str(report)
    assert "Measured placement" in text and "edge ms" in text
    line = next(line for line in text.splitlines() if "TestSlowRef" in line and "conv1" in line)
    assert "conv1..softmax" in line
    again = PlacementReport.from_dict(report.to_dict())
    assert again.measurements == report.measurements
    assert "Measured placement" not in str(InferenceSession(small_cnn_model(),
                                                            backends=["CpuRef"]).report)


def test_measurements_are_kept_for_the_process() -> None:
    InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                     optimizer_options=MEASURED)
    assert CALLS["relu"] > 0
    before = CALLS["relu"]
    session = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                               optimizer_options=MEASURED)
    assert CALLS["relu"] == before  # nothing ran again
    assert set(session.report.counts()) == {"CpuRef"}
    InferenceSession(small_cnn_model(seed=1), backends=["TestSlowRef", "CpuRef"],
                     optimizer_options=MEASURED)
    assert CALLS["relu"] > before  # other weights: another partition


def test_an_unknown_placement_lists_the_choices() -> None:
    with pytest.raises(OptionError, match="'fastest' is not one of the choices: preference: .*; "
                                          "measured: "):
        OptimizerOptions(placement="fastest")
    assert issubclass(OptionError, ValueError)


def test_openvino_partitions_are_measured_against_cpuref() -> None:
    from backplane.backends.openvino.backend import openvino_missing

    if openvino_missing():
        pytest.skip(openvino_missing())
    session = InferenceSession(small_cnn_model(), backends=["OpenVINO", "CpuRef"],
                               optimizer_options=MEASURED)
    report = session.report
    assert {m.backend for m in report.measurements} == {"OpenVINO", "CpuRef"}
    assert all(m.ms is not None and m.ms > 0 for m in report.measurements)
    (part,) = {m.partition for m in report.measurements}  # OpenVINO takes every layer
    assert set(report.counts()) == {chosen(report)[part]}
    np.testing.assert_allclose(session.run(None, {"x": X})[0], reference()[0], rtol=1e-4,
                               atol=1e-6)


def test_the_compile_cache_keeps_the_measured_placement(tmp_path: Any) -> None:
    first = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                             optimizer_options=MEASURED, cache_dir=tmp_path)
    for cache in (measured._TIMES, measured._OUTPUTS, measured._EDGES):
        cache.clear()  # a new process, as far as measurements go
    before = CALLS["relu"]
    again = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                             optimizer_options=MEASURED, cache_dir=tmp_path)
    assert CALLS["relu"] == before  # loaded from the artifact: nothing measured again
    assert set(again.report.counts()) == {"CpuRef"}
    assert again.report.measurements == first.report.measurements
    preferred = InferenceSession(small_cnn_model(), backends=["TestSlowRef", "CpuRef"],
                                 cache_dir=tmp_path)  # another key: the optimizer options differ
    assert set(preferred.report.counts()) == {"TestSlowRef"}
