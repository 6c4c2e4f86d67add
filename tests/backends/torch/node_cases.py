"""The ONNX node suite's single-op cases of some op types, run on CpuAcc, CpuRef: where each op's
layer went (CpuAcc, or refused with the reason) and whether the outputs match the suite's."""

from __future__ import annotations

import functools
from typing import Any

from backplane import InferenceSession
from tests.conformance.test_node_suite import cases, known_failures, run_case

TORCH_LACKS = ("bfloat16", "uint16", "uint32", "uint64", "float8", "int4", "uint4", "string")
"""Element types the torch kernels do not claim (``common.TORCH_DTYPES``): a case of one of them
stays on CpuRef, refused with its reason."""


@functools.lru_cache(maxsize=1)
def single_op_cases() -> dict[str, list[str]]:
    """op type -> the names of the node cases made of that one op (expanded functions left out)."""
    by_op: dict[str, list[str]] = {}
    for name, case in sorted(cases().items()):
        nodes = case.model.graph.node
        if len(nodes) == 1 and "_expanded" not in name:
            by_op.setdefault(nodes[0].op_type, []).append(name)
    return by_op


def case_names(ops: tuple[str, ...]) -> list[str]:
    return [name for op in ops for name in single_op_cases().get(op, [])]


def check_case(name: str, refusals: tuple[str, ...] = ()) -> None:
    """The case's layer runs on CpuAcc and its outputs match (or it is refused for an element
    type torch lacks, or for a reason containing one of ``refusals``, and then still matches on
    CpuRef)."""
    case: Any = cases()[name]
    if name in known_failures():
        return  # CpuRef does not pass it either (known_failures.txt): nothing to hold CpuAcc to
    session = InferenceSession(case.model, backends=["CpuAcc", "CpuRef"])
    (placement,) = session.report.layers.values()
    if placement.backend != "CpuAcc":
        reasons = "; ".join(reason for _, reason in placement.refusals)
        allowed = (*TORCH_LACKS, *refusals)
        assert any(t in reasons for t in allowed), f"{name}: CpuAcc refused it: {reasons}"
    failure = run_case(case, ["CpuAcc", "CpuRef"])
    assert failure is None, f"{name} on {placement.backend}: {failure}"
