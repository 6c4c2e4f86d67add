"""Planned memory: each backend's peak bytes of intermediate tensors and its constants' bytes, in
the placement report, computed from the plan (each tensor dropped after its last reader)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession
from backplane.optimizer.report import PlacementReport

SIZE = 1024  # float32: 4 KiB a tensor


def _chain(length: int, weight: bool = False) -> bytes:
    names = ["x"] + [f"t{i}" for i in range(length)]
    nodes = [helper.make_node("Relu", [names[i]], [names[i + 1]], name=names[i + 1])
             for i in range(length)]
    initializers = []
    if weight:
        nodes.append(helper.make_node("Add", [names[-1], "w"], ["y"], name="y"))
        initializers.append(helper.make_tensor("w", TensorProto.FLOAT, [SIZE],
                                               np.ones(SIZE, np.float32)))
    out = "y" if weight else names[-1]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "chain", [info("x", TensorProto.FLOAT, [1, SIZE])],
                              [info(out, TensorProto.FLOAT, [1, SIZE])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_chain_holds_two_tensors_at_once_however_long() -> None:
    for length in (3, 8):
        report = InferenceSession(_chain(length), ["CpuRef"]).report
        assert report.peak_bytes == {"CpuRef": 2 * 4 * SIZE}, length  # not length * 4 KiB
        assert report.constant_bytes == {}


def test_constants_are_counted_once_per_backend_and_shown() -> None:
    report = InferenceSession(_chain(2, weight=True), ["CpuRef"]).report
    assert report.constant_bytes == {"CpuRef": 4 * SIZE}
    assert "memory planned (CpuRef: 0.01 MiB peak + 0.00 MiB constants)" in str(report)
    again = PlacementReport.from_dict(report.to_dict())
    assert again.peak_bytes == report.peak_bytes and again.constant_bytes == report.constant_bytes


def test_a_split_counts_each_backends_own_tensors_and_imports_nothing() -> None:
    pytest.importorskip("torch")
    session = InferenceSession(_chain(4), ["CpuAcc", "CpuRef"], pins={"t1": "CpuRef",
                                                                      "t2": "CpuRef"})
    report = session.report
    assert set(report.peak_bytes) == {"CpuAcc", "CpuRef"}
    assert report.peak_bytes["CpuRef"] == 2 * 4 * SIZE  # t1 and t2: imports add nothing
    assert all(c.strategy == "import" for c in report.copies)


def test_the_report_counts_a_runs_partitions_and_crossings() -> None:
    pytest.importorskip("torch")
    report = InferenceSession(_chain(5), ["CpuAcc", "CpuRef"], pins={"t1": "CpuRef",
                                                                     "t3": "CpuRef"}).report
    assert report.partitions == ["CpuAcc", "CpuRef", "CpuAcc", "CpuRef", "CpuAcc"]
    assert report.crossings() == {"import": 4}
    assert "a run: 5 partitions (CpuAcc -> CpuRef -> CpuAcc -> CpuRef -> CpuAcc), 0 tensors " \
           "copied and 4 imported between backends" in str(report)
    assert InferenceSession(_chain(5), ["CpuRef"]).report.partitions == ["CpuRef"]
