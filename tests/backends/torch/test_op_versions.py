"""Every CpuAcc (and GpuAcc) kernel covers the ONNX versions whose semantics it implements (issue 27,
item 6): an op a torch backend runs is declared from the first version CpuRef, the executable spec,
runs, unless an entry below says why the older versions differ. A kernel declared from opset 15
only (Shape did) cut every opset 11-13 model into partitions around CpuRef."""

from __future__ import annotations

import onnx.defs
import pytest

pytest.importorskip("torch")

from backplane.backends.registry import registry  # noqa: E402

DIFFERENT_BEFORE: dict[str, str] = {}
"""op -> why the torch backends start later than CpuRef: none today."""


def _first(table, op: str) -> int:
    return min(table[op])


@pytest.mark.parametrize("backend_id", ["CpuAcc", "GpuAcc"])
def test_torch_kernels_start_where_the_reference_does(backend_id: str) -> None:
    reference = registry.create("CpuRef").KERNELS
    table = registry.create(backend_id).KERNELS
    gaps = []
    for op in sorted(table):
        if op in reference and op not in DIFFERENT_BEFORE and _first(table, op) > _first(reference, op):
            schemas = sorted({s.since_version for s in onnx.defs.get_all_schemas_with_history()
                              if s.name == op and s.domain == ""})
            missed = [v for v in schemas if _first(reference, op) <= v < _first(table, op)]
            gaps.append(f"{op}: from {_first(table, op)}, CpuRef from {_first(reference, op)} "
                        f"(ONNX versions {missed} missed)")
    assert not gaps, "\n".join(gaps)


@pytest.mark.parametrize("opset", [9, 11, 12, 13])
def test_an_old_opset_recognizer_stays_one_cpuacc_partition(opset: int) -> None:
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape, as Paddle and torch write a flatten at
    opsets 11-13: every layer on CpuAcc, none on CpuRef."""
    import numpy as np
    from onnx import TensorProto, helper

    from backplane import InferenceSession

    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n"], ["n1"], axes=[0]) if opset < 13 else
             helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["r", "target"], ["y"])]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("minus_one", TensorProto.INT64, [1], [-1]),
             helper.make_tensor("axes", TensorProto.INT64, [1], [0])]
    graph = helper.make_graph(nodes, "flatten", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", 3, 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, ["n", 12])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    session = InferenceSession(model.SerializeToString(), backends=["CpuAcc", "CpuRef"])
    assert "CpuRef" not in session.report.counts(), session.report.counts()
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(session.run(None, {"x": x})[0], np.maximum(x, 0).reshape(2, 12))
