"""ONNX Runtime's com.microsoft ops on CpuRef, one-node models against ONNX Runtime (the reference
for this domain): integer outputs within one quantization step (ONNX Runtime rounds some products
in fixed point or through lookup tables, so a value at a half step may round the other way), float
outputs within 1e-5 of the output's scale."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from backplane import InferenceSession, OptimizerOptions
from backplane.backends.reference.backend import CpuRef
from backplane.frontends.onnx import ModelError, import_onnx
from backplane.frontends.onnx_contrib import ONNX_EQUIVALENTS, ORT_OPS
from backplane.optimizer.optimize import OptimizationError
from tests.backends.contrib_cases import (
    CASES, F32, MS, OLD_ORT, Case, _lstm_with_lengths, _model, assert_matches_ort, f, ort_run, q,
    skip_where_ort_crashes)


AS_IS = OptimizerOptions(fold_constants=False)
"""The optimizer's passes off: each op to its own kernel (with them, SkipLayerNormalization and
Attention are written as plain ops where they can be: tests/optimizer/test_ort_lowered.py)."""


@pytest.mark.parametrize("name", CASES)
def test_cpuref_matches_onnx_runtime(name: str) -> None:
    skip_where_ort_crashes(name)
    model, feeds = _model(CASES[name])
    session = InferenceSession(model, backends=["CpuRef"], optimizer_options=AS_IS)
    assert [p.op_type for p in session.report.layers.values()] == [CASES[name].op]
    assert_matches_ort(session.run(None, feeds), ort_run(model, feeds))
    assert set(session.report.counts()) == {"CpuRef"}


def test_bias_add_is_its_documented_sum() -> None:
    # ONNX Runtime runs BiasAdd on CUDA only (its CPU provider: "Could not find an implementation")
    x, bias, skip = f(2, 4, 6), f(6), f(2, 4, 6)
    model, feeds = _model(Case("BiasAdd", [x, bias, skip], [F32], fed=3))
    (y,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_array_equal(y, x + bias + skip)


def test_every_op_backplane_knows_is_tested_and_has_a_cpuref_kernel() -> None:
    known = {(domain, op) for domain, ops in ORT_OPS.items() for op in ops}
    # BiasAdd: test_contrib_transformer.py; LayerNormalization below opset 17 (ONNX Runtime's):
    # torch/test_ort_optimized.py, the files its optimizer writes
    # its Q/DQ, imported as ONNX's (ONNX_EQUIVALENTS): models/test_ort_contrib_qdq.py
    tested = {(case.domain, case.op) for case in CASES.values()} | {(MS, "BiasAdd"),
                                                                    ("", "LayerNormalization")}
    assert known == tested | set(ONNX_EQUIVALENTS)
    kernels = {key for key in CpuRef.KERNELS}
    assert {f"{d}::{op}" if d else op for d, op in known - set(ONNX_EQUIVALENTS)} <= kernels
    assert {op for _, op in ONNX_EQUIVALENTS} <= kernels


def _onnx_own(schema: Any) -> bool:
    """An ONNX op's schema, which ONNX Runtime lists beside its own op of that name (its
    LayerNormalization from version 1, ONNX's from 17)."""
    try:
        return onnx.defs.get_schema(schema.name, schema.since_version,
                                    schema.domain).since_version == schema.since_version
    except onnx.defs.SchemaError:
        return False


def test_arity_matches_onnx_runtime_schemas() -> None:
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    schemas = {(s.domain, s.name): s for s in C.get_all_operator_schema()
               if s.domain in ORT_OPS and not _onnx_own(s)}
    for domain, ops in ORT_OPS.items():
        for op, arity in ops.items():
            schema = schemas[(domain, op)]
            got = (schema.since_version, schema.min_input, schema.max_input, schema.min_output,
                   schema.max_output)
            if OLD_ORT:  # later versions added optional inputs (GroupQueryAttention: 16 -> 17)
                assert got[2] <= arity[2] and got[:2] + got[3:] == tuple(arity)[:2] + \
                    tuple(arity)[3:], op
            else:
                assert got == tuple(arity), op


def _unknown_op_model(op: str, domain: str = MS) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], domain=domain)
    x = helper.make_tensor_value_info("x", F32, [2])
    graph = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info("y", F32, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(domain, 1)])


def test_unknown_contrib_op_is_a_model_error_listing_the_known_ones() -> None:
    with pytest.raises(ModelError) as info:
        import_onnx(_unknown_op_model("BeamSearch"))
    message = str(info.value)
    assert "unknown op 'BeamSearch' in domain 'com.microsoft'" in message
    assert "QLinearAdd" in message and "MatMulNBits" in message


def test_wrong_arity_of_a_contrib_op_is_a_model_error() -> None:
    with pytest.raises(ModelError, match=r"1 input\(s\); QLinearAdd takes 7 to 8"):
        import_onnx(_unknown_op_model("QLinearAdd"))


REFUSED = {
    "packed QKV": Case("MultiHeadAttention", [f(2, 4, 2, 3, 4)], [F32], {"num_heads": 2}),
    "transBatchA": Case("FusedMatMul", [f(2, 3, 4), f(2, 4, 5)], [F32], {"transBatchA": 1},
                        fed=2),
    "activation 'Elu' not supported": Case("FusedConv", [f(1, 2, 4, 4), f(3, 2, 1, 1)], [F32],
                                           {"activation": "Elu"}),
    "bits=3": Case("MatMulNBits", [f(2, 32), q((4, 2, 6)), f(4, 2)], [F32],
                   {"K": 32, "N": 4, "bits": 3, "block_size": 16}),
    "do_rotary=1": Case("Attention", [f(1, 3, 8), f(8, 24)], [F32],
                        {"num_heads": 2, "do_rotary": 1}),
    "sequence_lens": _lstm_with_lengths(),
}


@pytest.mark.parametrize("reason", REFUSED)
def test_modes_cpuref_does_not_run_are_refused_with_their_reason(reason: str) -> None:
    model, _ = _model(REFUSED[reason])
    with pytest.raises(OptimizationError, match=re.escape(reason)):
        InferenceSession(model, backends=["CpuRef"])


TORCH_CASES = ["QLinearWhere-uint8", "GatherBlockQuantized-uint4"]
# CpuAcc has no kernel for these (it has for the other quantized ops and MatMulNBits,
# test_contrib_quant.py, for the normalizations, GELUs and attention ops,
# test_contrib_transformer.py, and for FusedConv, FusedGemm, FusedMatMul, test_ort_optimized.py)


@pytest.mark.parametrize("name", TORCH_CASES)
def test_cpuacc_refuses_contrib_ops_and_falls_back_to_cpuref(name: str) -> None:
    pytest.importorskip("torch")
    model, feeds = _model(CASES[name])
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"])
    assert_matches_ort(session.run(None, feeds), ort_run(model, feeds))
    assert set(session.report.counts()) == {"CpuRef"}
