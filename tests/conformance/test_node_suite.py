"""The ONNX backend node suite through backplane: CpuRef alone, and CpuRef behind a partial backend
with memory of its own (so that fallback and copies are exercised on every case).

A case that fails must be in known_failures.txt with its reason, and a case in that list must still
fail: the list may only shrink. Refresh it after making cases pass with
``python -m tests.conformance.test_node_suite --update``.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from backplane import InferenceSession, progress
from backplane.backends.api.memory import MemorySource, TensorHandleFactory
from backplane.backends.reference.backend import CpuRef
from backplane.backends.registry import registry
from backplane.session import BackendSpec
from tests.backends.test_reference_kernels import _assert_same, _value

pytestmark = pytest.mark.slow  # the node suite, twice: `python -m pytest -m slow` (.ci/run)
KNOWN_FAILURES = Path(__file__).with_name("known_failures.txt")
HALF_OF_CPUREF = sorted(CpuRef.KERNELS)[::2]


class HalfBackend(CpuRef):
    """Every other op of CpuRef's table, in memory of its own: crossings need MemCopy layers."""

    id = "HalfCpuRef"
    KERNELS = {op: CpuRef.KERNELS[op] for op in HALF_OF_CPUREF}

    def tensor_handle_factories(self) -> Sequence[TensorHandleFactory]:
        return (TensorHandleFactory("half-private", MemorySource.BACKEND),)


MODES = {"cpuref": ["CpuRef"], "half+cpuref": ["HalfCpuRef", "CpuRef"]}


@functools.lru_cache(maxsize=1)
def cases() -> dict[str, Any]:
    from onnx.backend.test.loader import load_node_model_tests

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {case.name: case for case in load_node_model_tests()}


def known_failures() -> dict[str, str]:
    known = {}
    for line in KNOWN_FAILURES.read_text().splitlines():
        name, _, reason = line.partition(" ")
        if name and not name.startswith("#"):
            known[name] = reason.strip()
    return known


def run_case(case: Any, backends: Sequence[BackendSpec],
             tolerance: tuple[float, float] | None = None) -> str | None:
    """None if the case passes (at the suite's rtol and atol, or ``tolerance``'s), else why not (one
    line). A backend is an id or an (id, options) pair, as InferenceSession takes them."""
    rtol, atol = tolerance or (case.rtol, case.atol)
    try:
        session = InferenceSession(case.model, backends=backends)
        names = [arg.name for arg in session.get_inputs()]
        for inputs, expected in case.data_sets:
            feeds = {name: _value(value) for name, value in zip(names, inputs)}
            actual = session.run(None, feeds)
            assert len(actual) == len(expected), f"{len(actual)} outputs, expected {len(expected)}"
            for name, act, exp in zip(session.optimized.output_names, actual, expected):
                _assert_same(name, act, _value(exp), rtol, atol)
    except AssertionError as exc:
        return "wrong answer: " + " ".join(str(exc).split())[:200]
    except Exception as exc:
        return f"{type(exc).__name__}: " + " ".join(str(exc).split())[:200]
    return None


@pytest.fixture(scope="module")
def half_backend():
    with registry.temporarily(HalfBackend.id, HalfBackend):
        yield


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(cases()))
def test_node_case(name: str, mode: str, half_backend) -> None:
    failure = run_case(cases()[name], MODES[mode])
    known = known_failures()
    if name in known:
        assert failure is not None, f"{name} passes now: remove it from {KNOWN_FAILURES.name}"
    else:
        assert failure is None, f"{name} fails ({mode}): {failure}"


def test_known_failures_name_real_cases_with_reasons() -> None:
    for name, reason in known_failures().items():
        assert name in cases(), f"{name} is not a node case"
        assert reason, f"{name} has no reason"


def update() -> None:
    """Rewrite the list from a CpuRef-alone run, keeping the reasons of the failures."""
    lines = ["# Node-suite cases CpuRef does not pass yet, with the reason. It may only shrink."]
    with progress.shown(), progress.task("node suite on CpuRef", total=len(cases())) as step:
        for name in sorted(cases()):
            failure = run_case(cases()[name], MODES["cpuref"])
            if failure is not None:
                lines.append(f"{name} {failure}")
            step()
    KNOWN_FAILURES.write_text("\n".join(lines) + "\n")
    print(f"{len(lines) - 1} known failures of {len(cases())} cases written to {KNOWN_FAILURES}")


if __name__ == "__main__":
    if "--update" in sys.argv:
        update()
