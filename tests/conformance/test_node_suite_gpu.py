"""The ONNX backend node suite through GpuAcc,CpuRef (issue 17): every case CpuRef passes passes with
GpuAcc taking what it claims (CpuRef the rest, with copies between them), at the suite's tolerance
or the case's own for GpuAcc in torch_tolerances.txt (``test_node_suite_cpuacc.py`` says which
differences may be there). Cases CpuRef fails (known_failures.txt) are not asked of GpuAcc. Skipped
without a CUDA device; on the GPU machine:

    python -m pytest tests/conformance/test_node_suite_gpu.py -q -p no:cacheprovider
"""

from __future__ import annotations

import pytest

from backplane.backends.registry import registry
from tests.conformance.test_node_suite import cases, known_failures, run_case
from tests.conformance.test_node_suite_cpuacc import (
    check_tolerance_needed,
    tolerance_on,
    torch_tolerances,
)

AVAILABILITY = registry.create("GpuAcc").availability()
pytestmark = [pytest.mark.skipif(not AVAILABILITY.ok, reason=f"GpuAcc: {AVAILABILITY.reason}"),
              pytest.mark.slow]  # the node suite on GpuAcc: `python -m pytest -m slow`
BACKENDS = ["GpuAcc", "CpuRef"]


@pytest.mark.parametrize("name", sorted(cases()))
def test_node_case_on_gpuacc(name: str) -> None:
    if name in known_failures():
        pytest.skip("CpuRef fails it too (known_failures.txt)")
    failure = run_case(cases()[name], BACKENDS, tolerance=tolerance_on(name, "GpuAcc"))
    assert failure is None, f"{name} fails on GpuAcc,CpuRef: {failure}"


@pytest.mark.parametrize("name", sorted(n for n, e in torch_tolerances().items()
                                        if "GpuAcc" in e.backends))
def test_gpuacc_tolerance_is_needed(name: str) -> None:
    check_tolerance_needed(name, "GpuAcc", BACKENDS)
