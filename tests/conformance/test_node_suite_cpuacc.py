"""The ONNX backend node suite through CpuAcc,CpuRef (issue 17): every case that CpuRef passes
passes with CpuAcc taking what it claims (CpuRef the rest, with imports between them), the
multi-node cases and the ``_expanded`` function bodies included. Cases CpuRef fails
(known_failures.txt) are not asked of CpuAcc.

A case passes at the suite's own tolerance, except where ``torch_tolerances.txt`` gives it another
for the backend that needs it: only a difference of rounding where torch is at least as accurate as
the reference (never a bug), and only as much as it needs. That list is shared with
``test_node_suite_gpu.py``, and, like known_failures.txt, it may only shrink: each entry must name a
real case that fails at the suite's tolerance and passes at its own.

CpuAcc measures its routes at every load, as a user's first load does (``route_cache`` False: no
route comes from an earlier case or run). All of it takes about 40 s on 2 cores.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import pytest

from backplane.session import BackendSpec

pytest.importorskip("torch")

from backplane.backends.torch.fusion.reduced import cpu_flags  # noqa: E402
from tests.conformance.test_node_suite import cases, known_failures, run_case  # noqa: E402

pytestmark = pytest.mark.slow  # the node suite on CpuAcc: `python -m pytest -m slow` (.ci/run)
TORCH_TOLERANCES = Path(__file__).with_name("torch_tolerances.txt")
BACKENDS = [("CpuAcc", {"route_cache": False}), "CpuRef"]


class Tolerance(NamedTuple):
    """A case's tolerance on the torch backends named, and why it is not the suite's."""

    backends: frozenset[str]
    rtol: float
    atol: float
    reason: str
    flags: dict[str, str]  # backend -> the CPU flag without which the suite's tolerance holds there


@functools.lru_cache(maxsize=1)
def torch_tolerances() -> dict[str, Tolerance]:
    """case name -> its tolerance, from the lines ``NAME BACKENDS RTOL ATOL REASON`` of
    torch_tolerances.txt (BACKENDS: CpuAcc, GpuAcc or both, comma-separated; ``CpuAcc@FLAG``: needed
    on CPUs with that flag only, the rounding of torch's kernels for it)."""
    tolerances = {}
    for line in TORCH_TOLERANCES.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, backends, rtol, atol, reason = line.split(maxsplit=4)
        named = [b.partition("@") for b in backends.split(",")]
        tolerances[name] = Tolerance(frozenset(b for b, _, _ in named), float(rtol), float(atol),
                                     reason.strip(), {b: flag for b, _, flag in named if flag})
    return tolerances


def tolerance_on(name: str, backend: str) -> tuple[float, float] | None:
    """The (rtol, atol) the case is compared at on ``backend``, or None for the suite's own."""
    entry = torch_tolerances().get(name)
    return (entry.rtol, entry.atol) if entry and backend in entry.backends else None


def check_tolerance_needed(name: str, backend: str, backends: Sequence[BackendSpec]) -> None:
    """The override of ``name`` on ``backend`` is needed: the case fails at the suite's tolerance
    and passes at the override's."""
    assert name in cases(), f"{TORCH_TOLERANCES.name}: {name} is not a node case"
    assert name not in known_failures(), f"{TORCH_TOLERANCES.name}: CpuRef fails {name}"
    entry = torch_tolerances()[name]
    assert entry.reason, f"{TORCH_TOLERANCES.name}: {name} has no reason"
    flag = entry.flags.get(backend)
    if flag and flag not in cpu_flags():  # a CPU whose kernels round as the reference does
        failure = run_case(cases()[name], backends)
        assert failure is None, f"{name} fails on {backend} without {flag} too: {failure}"
        return
    assert run_case(cases()[name], backends) is not None, \
        f"{name} passes on {backend} at the suite's tolerance: take it off {TORCH_TOLERANCES.name}"
    failure = run_case(cases()[name], backends, tolerance=(entry.rtol, entry.atol))
    assert failure is None, f"{name} fails on {backend} at its override too: {failure}"


@pytest.mark.parametrize("name", sorted(cases()))
def test_node_case_on_cpuacc(name: str) -> None:
    if name in known_failures():
        pytest.skip("CpuRef fails it too (known_failures.txt)")
    failure = run_case(cases()[name], BACKENDS, tolerance=tolerance_on(name, "CpuAcc"))
    assert failure is None, f"{name} fails on CpuAcc,CpuRef: {failure}"


def test_tolerances_name_known_backends() -> None:
    for name, entry in torch_tolerances().items():
        assert entry.backends and entry.backends <= {"CpuAcc", "GpuAcc"}, \
            f"{TORCH_TOLERANCES.name}: {name} is for {sorted(entry.backends)}, not CpuAcc or GpuAcc"


@pytest.mark.parametrize("name", sorted(n for n, e in torch_tolerances().items()
                                        if "CpuAcc" in e.backends))
def test_cpuacc_tolerance_is_needed(name: str) -> None:
    check_tolerance_needed(name, "CpuAcc", BACKENDS)
