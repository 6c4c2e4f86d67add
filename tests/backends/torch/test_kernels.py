"""CpuAcc's kernels against CpuRef on the ONNX node suite: every case of every op CpuAcc claims.

A case goes straight through the support check and workload factory, as in the CpuRef test (whose
case loading this reuses); CpuAcc's inputs and outputs pass through its tensor-handle factory (NumPy
in, torch CPU tensors inside, NumPy out). Where CpuRef runs the case too, CpuAcc must match CpuRef's
outputs within the case's tolerances; else it must match the case's expected outputs.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.reference.backend import CpuRef  # noqa: E402
from backplane.backends.torch.backend import TORCH_CPU_FACTORY, CpuAcc  # noqa: E402
from backplane.backends.torch.kernels import KERNELS  # noqa: E402
from tests.backends.test_reference_kernels import (  # noqa: E402
    _assert_same,
    _info,
    _layer,
    _value,
    node_cases,
)

CLAIMED = sorted(name for name, case in node_cases().items()
                 if case.model.graph.node[0].op_type in CpuAcc().KERNELS)


def _run(backend: Any, layer: Any, args: list[Any], in_infos: list[Any], out_infos: list[Any],
         to_backend: Any = None, to_host: Any = None) -> tuple[Any, ...] | None:
    if not backend.is_layer_supported(layer, in_infos, out_infos):
        return None
    workload = backend.create_workload_factory().create_workload(layer, in_infos, out_infos)
    if to_backend is not None:
        args = [None if a is None else to_backend(a) for a in args]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NaN and inf cases are intended
        results = workload(*args)
    assert isinstance(results, tuple), f"{layer.op_type} returned a {type(results).__name__}"
    return tuple(to_host(r) for r in results) if to_host is not None else results


@pytest.mark.parametrize("case_name", CLAIMED)
def test_node_case_matches_cpuref(case_name: str) -> None:
    case = node_cases()[case_name]
    layer = _layer(case.model)
    graph_inputs = [i.name for i in case.model.graph.input]
    graph_outputs = [o.name for o in case.model.graph.output]
    acc, ref = CpuAcc(), CpuRef()
    for inputs, expected in case.data_sets:
        by_name = dict(zip(graph_inputs, map(_value, inputs)))
        args = [by_name[name] if name else None for name in layer.inputs]
        expected_by_name = dict(zip(graph_outputs, map(_value, expected)))
        in_infos = [_info(a) for a in args]
        out_infos = [_info(expected_by_name.get(name)) for name in layer.outputs]
        support = acc.is_layer_supported(layer, in_infos, out_infos)
        if not support:
            assert support.reason, "a refusal must give a reason"
            pytest.skip(f"not supported: {support.reason}")
        actual = _run(acc, layer, args, in_infos, out_infos, TORCH_CPU_FACTORY.copy_in,
                      TORCH_CPU_FACTORY.copy_out)
        assert actual is not None and len(actual) == len(layer.outputs)
        reference = _run(ref, layer, args, in_infos, out_infos)
        for index, name in enumerate(layer.outputs):
            if name not in expected_by_name:
                continue
            want = reference[index] if reference is not None else expected_by_name[name]
            _assert_same(name, actual[index], want, case.rtol, case.atol)


def test_integer_div_of_the_most_negative_value_by_minus_one_wraps_as_numpy_does() -> None:
    """torch's truncating division traps on INT_MIN / -1 (SIGFPE, the whole process dies): run in a
    child so that a regression fails this test instead of the test run."""
    import subprocess
    import sys

    code = (
        "import numpy as np, torch\n"
        "from backplane.backends.torch.kernels.elementwise import div\n"
        "from backplane.backends.reference.kernels.elementwise import div as ref\n"
        "for t in (np.int8, np.int16, np.int32, np.int64, np.uint8):\n"
        "    a = np.array([np.iinfo(t).min, 7, 1, 5, np.iinfo(t).min], t)\n"
        "    b = np.array([-1, -1, -1, 0, 3]).astype(t)  # uint: -1 is the largest value\n"
        "    with np.errstate(all='ignore'):\n"
        "        want = ref(a, b)[0]\n"
        "    got = div(torch.from_numpy(a), torch.from_numpy(b))[0].numpy()\n"
        "    assert (got == want).all(), (t, got, want)\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-800:])



def _fp16_scores() -> np.ndarray:
    """fp16 scores with a dominant element in many rows: log-softmax outputs near 0 there, where
    rounding a step to fp16 costs most."""
    return (np.random.default_rng(0).standard_normal((5, 33, 7)) * 4).astype(np.float16)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("axis", [0, 1, 2])
def test_fp16_softmax_is_computed_in_float32_and_rounded_once(op: str, axis: int) -> None:
    """Within half an fp16 ulp of the exact value, plus float32's rounding of the shifted scores and
    the log of their sum. torch's own CPU kernels round steps to fp16: on these scores, LogSoftmax
    over the last axis was 1793 fp16 ulps off near 0, Softmax over the others 1.2."""
    x = _fp16_scores()
    wide = x.astype(np.float64)
    shifted = wide - wide.max(axis, keepdims=True)
    log_sum = np.log(np.exp(shifted).sum(axis, keepdims=True))
    exact = shifted - log_sum if op == "LogSoftmax" else np.exp(shifted - log_sum)
    got = KERNELS[op][13](torch.from_numpy(x), axis=axis)[0].numpy()
    assert got.dtype == np.float16
    float32_error = 4 * np.finfo(np.float32).eps * (np.abs(shifted) + log_sum + 1)
    bound = np.spacing(np.abs(exact).astype(np.float16)).astype(np.float64) / 2 + float32_error
    assert (np.abs(got - exact) <= bound).all(), np.abs(got - exact).max()


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_fp16_softmax_is_onnx_runtimes(op: str) -> None:
    """ONNX Runtime's CPU Softmax and LogSoftmax compute fp16 in float and round once: CpuAcc gives
    its results over every axis, to an fp16 ulp (the order of the float32 steps differs)."""
    ort = pytest.importorskip("onnxruntime")
    x = _fp16_scores()
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    x_info, y_info = (helper.make_tensor_value_info(n, TensorProto.FLOAT16, x.shape) for n in "xy")
    for axis in range(x.ndim):
        node = helper.make_node(op, ["x"], ["y"], axis=axis)
        model = helper.make_model(helper.make_graph([node], op, [x_info], [y_info]),
                                  opset_imports=[helper.make_opsetid("", 13)],
                                  ir_version=8)  # ONNX Runtime 1.30 reads IR versions up to 13
        want = ort.InferenceSession(model.SerializeToString(), options,
                                    providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        session = InferenceSession(model, backends=["CpuAcc"])
        assert [p.backend for p in session.report.layers.values()] == ["CpuAcc"]
        np.testing.assert_array_max_ulp(session.run(None, {"x": x})[0], want, maxulp=1)
