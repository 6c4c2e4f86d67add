"""Hostile graphs (tests/runtime/hostile_graphs.py) on CpuRef and on CpuAcc before CpuRef: each a
clean refusal (one of backplane's errors, with a message) or a run; CpuAcc's runs are CpuRef's
answers; no crash, hang, foreign exception, or output that shares memory with an input or another
output. Each case runs in a forked child (tests/runtime/verdicts.py), so a crash fails its case
only. The children are forked from a parent of their own, a fresh interpreter that never ran a
model: forked from the test process after other tests had run CpuAcc (torch's OpenMP and oneDNN
pools up), CpuAcc's load hung in the child (three cases, 120 s each, in the whole suite only).
The long run, with OpenVINO, ONNX Runtime and fuzzed models, is bench/hostile.py.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Iterator

import numpy as np
import pytest

from tests.runtime import verdicts as v
from tests.runtime.hostile_graphs import CASES

LEFT_OUT: dict[str, str] = {}  # cases that crash or hang the process today (none on CpuRef and
# CpuAcc since the Slice steps of +-(2**63 - 1) and -2**63 are inferred without data propagation)
pytestmark = pytest.mark.slow  # a spawned child per case: `python -m pytest -m slow` (.ci/run)
CHILD_TIMEOUT = 120.0  # seconds for a load and a run on a busy machine
RUN_TIMEOUT = 3.0  # RunOptions.timeout_s: stops the Loop of 2**62 trips


@pytest.fixture(scope="module")
def parent() -> Iterator[concurrent.futures.Executor]:
    """A fresh interpreter that forks the cases' children (it imports, never runs a model)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context,
                                                initializer=v.warm_imports) as pool:
        yield pool


def judged(name: str) -> str | None:
    """Run in ``parent``: the case on CpuRef and on CpuAcc before CpuRef; the finding, or None."""
    blob, feeds = _blob(name)
    reference = v.run_backend(blob, feeds, ["CpuRef"], CHILD_TIMEOUT, RUN_TIMEOUT)
    verdict, about = v.verdict(reference, None)
    if verdict in v.FINDINGS:
        return f"CpuRef: {verdict}: {about}"
    run = v.run_backend(blob, feeds, ["CpuAcc", "CpuRef"], CHILD_TIMEOUT, RUN_TIMEOUT)
    verdict, about = v.verdict(run, reference)
    return f"CpuAcc, CpuRef: {verdict}: {about}" if verdict in v.FINDINGS else None


def _blob(name: str) -> tuple[bytes, dict[str, np.ndarray]]:
    built, feeds = CASES[name]()
    return (built if isinstance(built, bytes) else built.SerializeToString()), feeds


@pytest.mark.parametrize("name", [n for n in CASES if n not in LEFT_OUT])
def test_hostile_graph_is_refused_or_answered_as_cpuref(name: str, parent) -> None:
    finding = parent.submit(judged, name).result()
    assert finding is None, finding


def test_left_out_cases_are_cases() -> None:
    assert set(LEFT_OUT) <= set(CASES)


def huge_loop() -> v.Run:
    blob, feeds = _blob("loop_huge_trip_count")
    return v.run_backend(blob, feeds, ["CpuRef"], CHILD_TIMEOUT, 0.5)


def test_the_huge_loop_is_stopped_by_its_timeout(parent) -> None:
    """The Loop of 2**62 trips ends as RunTerminated, an own error: RunOptions.timeout_s works."""
    run = parent.submit(huge_loop).result()
    assert (run.status, run.error, run.own) == ("error", "RunTerminated", True), run


def test_verdicts_tell_findings_from_answers() -> None:
    """The judge: a foreign class, an empty message, a different value, a NaN lost, a dtype changed
    and shared memory are findings; an own error, equal values and NaN where NaN are not."""
    want = v.Run("ran", outputs=[np.array([1.0, np.nan, np.inf], np.float32)])
    same = v.Run("ran", outputs=[np.array([1.00001, np.nan, np.inf], np.float32)])
    assert v.verdict(same, want)[0] == v.MATCHES
    for outputs in ([np.array([1.1, np.nan, np.inf], np.float32)],  # a value
                    [np.array([1.0, 0.0, np.inf], np.float32)],  # a NaN lost
                    [np.array([1.0, np.nan, -np.inf], np.float32)],  # an infinity's sign
                    [np.array([1.0, np.nan, np.inf])], []):  # the dtype, the arity
        assert v.verdict(v.Run("ran", outputs=outputs), want)[0] == v.DIFFERS, outputs
    assert v.verdict(v.Run("ran", outputs=[np.array([1.1, np.nan, np.inf], np.float32)]), want,
                     v.Run("ran", outputs=[np.array([1.1, np.nan, np.inf], np.float32)]))[0] == v.AS_ORT
    assert v.verdict(v.Run("error", "IndexError", False, "index 9"), want)[0] == v.FOREIGN
    assert v.verdict(v.Run("error", "ModelError", True, " "), want)[0] == v.EMPTY
    assert v.verdict(v.Run("error", "ModelError", True, "bad"), want)[0] == v.REFUSED_REF_RAN
    assert v.verdict(v.Run("ran", outputs=[], detail="output 0 shares memory"), want)[0] == v.SHARED
    ints = v.Run("ran", outputs=[np.array([1, 3])])
    assert v.verdict(v.Run("ran", outputs=[np.array([1, 2])]), ints)[0] == v.DIFFERS


def test_the_child_reports_refusals_and_crashes() -> None:
    """A model that is not one is a ModelError, a feed that is no array an own error; a child that
    dies by a signal is a crash, not an answer."""
    assert v.run_backend(b"\x08", {}, ["CpuRef"], CHILD_TIMEOUT).error == "ModelError"
    blob, feeds = _blob("nan_relu")
    wrong = {"x": "not an array"}
    refused = v.run_backend(blob, wrong, ["CpuRef"], CHILD_TIMEOUT)  # type: ignore[arg-type]
    assert refused.status == "error" and refused.own, refused
    assert v._in_child(lambda post: __import__("os").abort(), 30, v.MEMORY)[0] == "crash"
