"""The GPU rule's first run may build for longer than ``against_cpu.FIRST_RUN_S`` (its own
``Rule.first_run_s``): GpuAcc's first run captures its partitions and compiles their elementwise
trees, 4.5-6.8 s a model on a fresh H100 machine, and a stopped first run kept the GPU's placement
untimed. Checked here with CpuRef standing in for the placed network and FIRST_RUN_S made tiny."""

from __future__ import annotations

import dataclasses

import numpy as np
from onnx import TensorProto, helper

from backplane import against_cpu
from backplane.frontends.onnx import import_onnx
from backplane.frontends.onnx_file import read_model
from backplane.optimizer.optimize import optimize
from backplane.runtime.runtime import Runtime


def _graph():
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "c"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (1, 8))],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, (1, 8))],
        [helper.make_tensor("c", TensorProto.FLOAT, (8,), np.arange(8, dtype=np.float32))])
    return import_onnx(read_model(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17)])))


def _note(rule: against_cpu.Rule) -> str:
    """What ``choose`` records of the placed network's timing, every run counting as work enough
    (``limit_ms`` 0: kept after its warm-up, no other placement built)."""
    runtime = Runtime()
    placed = optimize(_graph(), ["CpuRef"], registry=runtime.registry)
    placed_id = runtime.load(placed)

    def never():
        raise AssertionError("the other placement was built")

    assert against_cpu.choose(runtime, dataclasses.replace(rule, limit_ms=0.0), placed, placed_id,
                              never) == (placed, placed_id)
    (record,) = runtime.network(placed_id).network.report.measurements
    return record.note


def test_the_gpu_rule_s_first_run_is_not_held_to_first_run_s(monkeypatch) -> None:
    monkeypatch.setattr(against_cpu, "FIRST_RUN_S", 1e-9)  # a first run under it stops at once
    assert "its run failed (RunTerminated)" in _note(
        dataclasses.replace(against_cpu.GPU, first_run_s=None))
    assert against_cpu.GPU.first_run_s >= 30
    assert "its fastest warm-up run took" in _note(against_cpu.GPU)  # its warm-up ran: timed
    assert against_cpu.CONTROL_FLOW.first_run_s is None  # the CPU's rule keeps FIRST_RUN_S
