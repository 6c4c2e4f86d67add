"""How many of CpuRef's op types CpuAcc takes (issue 17), counted on the ONNX node suite.

Every single-op case of the suite (one node; the expanded function bodies are other ops' cases) is
loaded on CpuAcc,CpuRef, as a user would, and run. CpuRef's op types are those of the cases whose op
CpuRef has a kernel for, less the cases CpuRef fails (``tests/conformance/known_failures.txt``). An
op type is taken when each of its cases that torch has types for (every input and output a tensor of
a type in ``TORCH_DTYPES``: no uint16, bfloat16, float8, string, sequence or optional) placed the
op's layers on CpuAcc and matched the case's expected outputs, and it has at least one such case.
The strict count asks that of every case of the op type, whatever its types.

Both counts must stay at or above their floors (the numbers reached when the floors were set), so
that an op CpuAcc stops taking, or starts getting wrong, fails here. Run with ``-s`` to see the
counts and, for each op type not taken, its first case that was not and why::

    python -m pytest tests/backends/torch/test_coverage.py -q -p no:cacheprovider -s
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.api.backend import kernel_key  # noqa: E402
from backplane.backends.reference.backend import CpuRef  # noqa: E402
from backplane.backends.torch.backend import CpuAcc  # noqa: E402
from backplane.backends.torch.kernels.common import TORCH_DTYPES  # noqa: E402
from backplane.frontends.onnx_types import onnx_to_numpy_dtype  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402
from tests.backends.test_reference_kernels import _assert_same, _value  # noqa: E402
from tests.conformance.test_node_suite import cases, known_failures  # noqa: E402

TAKEN_FLOOR = 175
"""Op types CpuAcc takes on their torch-typed cases: 78 before issue 17, 112 with its indexing and
network kernels, 152 with its numeric ones too, 175 with the vision, attention and ml ones."""
STRICT_FLOOR = 142
"""Op types CpuAcc takes on every case: 65 before issue 17, 94, then 122, then 142."""

BACKENDS = [("CpuAcc", {"route_cache": False}), "CpuRef"]


def op_type(case: Any) -> str:
    node = case.model.graph.node[0]
    layer = Layer(node.name, node.op_type, [], [], {}, node.domain, 1)
    return kernel_key(layer)


def torch_typed(case: Any) -> bool:
    """Whether every input and output of the case is a tensor of a type the torch kernels have."""
    graph = case.model.graph
    for value in (*graph.input, *graph.output):
        if value.type.WhichOneof("value") != "tensor_type":
            return False
        dtype = onnx_to_numpy_dtype(value.type.tensor_type.elem_type)
        if dtype is None or np.dtype(dtype) not in TORCH_DTYPES:
            return False
    return True


def outcome(case: Any) -> str | None:
    """None if CpuAcc ran the case's op and matched its expected outputs, else why not."""
    node = case.model.graph.node[0]
    try:
        session = InferenceSession(case.model, backends=BACKENDS)
        placed = [p for p in session.report.layers.values() if p.op_type == node.op_type]
        if not placed:
            return "no layer left to run (folded at load)"
        elsewhere = [p for p in placed if p.backend != "CpuAcc"]
        if elsewhere:
            reasons = [r for b, r in elsewhere[0].refusals if b == "CpuAcc"]
            return f"on {elsewhere[0].backend}: {reasons[0] if reasons else 'not refused'}"
        names = [arg.name for arg in session.get_inputs()]
        for inputs, expected in case.data_sets:
            feeds = {name: _value(value) for name, value in zip(names, inputs)}
            actual = session.run(None, feeds)
            assert len(actual) == len(expected), f"{len(actual)} outputs, not {len(expected)}"
            for name, act, exp in zip(session.optimized.output_names, actual, expected):
                _assert_same(name, act, _value(exp), case.rtol, case.atol)
    except AssertionError as exc:
        return "wrong answer: " + " ".join(str(exc).split())[:160]
    except Exception as exc:  # noqa: BLE001 - any failure is an outcome to count and show
        return f"{type(exc).__name__}: " + " ".join(str(exc).split())[:160]
    return None


@functools.lru_cache(maxsize=1)
def coverage() -> dict[str, list[tuple[str, bool, str | None]]]:
    """op type -> (case name, torch-typed, outcome) per single-op case CpuRef passes. Cases of ops
    without a CpuAcc kernel are not run (they cannot go to CpuAcc)."""
    reference, acc, known = CpuRef(), CpuAcc(), known_failures()
    table: dict[str, list[tuple[str, bool, str | None]]] = defaultdict(list)
    for name, case in sorted(cases().items()):
        if len(case.model.graph.node) != 1 or name in known:
            continue
        op = op_type(case)
        if op not in reference.KERNELS:
            continue
        if op not in acc.KERNELS:
            table[op].append((name, torch_typed(case), f"no CpuAcc kernel for {op}"))
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            table[op].append((name, torch_typed(case), outcome(case)))
    return dict(table)


def taken(strict: bool) -> tuple[list[str], dict[str, str]]:
    """The op types taken, and for each other op type its first case not taken and why."""
    ops, missed = [], {}
    for op, results in sorted(coverage().items()):
        counted = [r for r in results if strict or r[1]]
        bad = [r for r in counted if r[2] is not None]
        if counted and not bad:
            ops.append(op)
        else:
            missed[op] = f"{bad[0][0]}: {bad[0][2]}" if bad else "no torch-typed case"
    return ops, missed


def test_cpuacc_takes_cpuref_op_types() -> None:
    ops, missed = taken(strict=False)
    strict, _ = taken(strict=True)
    print(f"\nCpuAcc takes {len(ops)} of CpuRef's {len(coverage())} op types on their "
          f"torch-typed single-op node cases ({len(strict)} on every case)")
    for op, why in missed.items():
        print(f"    {op}: {why}")
    assert len(ops) >= TAKEN_FLOOR, f"{len(ops)} op types taken, fewer than {TAKEN_FLOOR}"
    assert len(strict) >= STRICT_FLOOR, f"{len(strict)} taken on every case, not {STRICT_FLOOR}"


def test_no_torch_typed_case_goes_wrong_on_cpuacc() -> None:
    """A case CpuAcc claims may not give a wrong answer or fail, whether or not its op counts."""
    wrong = [f"{name}: {why}" for results in coverage().values() for name, _, why in results
             if why is not None and not why.startswith(("on ", "no CpuAcc kernel", "no layer"))]
    assert wrong == []
