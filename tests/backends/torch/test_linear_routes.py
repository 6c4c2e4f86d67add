"""CpuAcc's Linear route where oneDNN's product is known faster (``linear.ONEDNN_FROM``): taken
without measuring, on a quiet machine or a busy one, and held by a trace as oneDNN's product on
the packed weight (an input of the traced graph); below it the routes are measured as before."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion import linear  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.conftest import float_input, inner_workloads, make_model  # noqa: E402

RNG = np.random.default_rng(7)


def _head(rows: int, k: int, n: int, tail: bool = False) -> onnx.ModelProto:
    """x (1, rows, k) -> MatMul (k, n) -> Add bias [-> Sigmoid -> Mul 2 -> Add 1]: a CTC head."""
    inits = [numpy_helper.from_array((RNG.standard_normal((k, n)) * 0.1).astype(np.float32), "w"),
             numpy_helper.from_array(RNG.standard_normal(n).astype(np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="matmul"),
             helper.make_node("Add", ["m", "b"], ["a" if tail else "y"], name="bias")]
    if tail:  # layers after it, for a trace of more than MIN_LAYERS
        inits += [numpy_helper.from_array(np.float32(2), "two"),
                  numpy_helper.from_array(np.float32(1), "one")]
        nodes += [helper.make_node("Sigmoid", ["a"], ["s"], name="sigmoid"),
                  helper.make_node("Mul", ["s", "two"], ["t"], name="twice"),
                  helper.make_node("Add", ["t", "one"], ["y"], name="plus_one")]
    return make_model(nodes, [float_input("x", [1, rows, k])], [float_input("y", [1, rows, n])],
                      inits)


def _session(model: onnx.ModelProto, **options: str) -> InferenceSession:
    return InferenceSession(model, backends=["CpuAcc"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.route_cache": False, **options})))


def _feeds(rows: int, k: int) -> dict[str, np.ndarray]:
    x = RNG.standard_normal((1, rows, k)).astype(np.float32)
    x[0, 1, 3] = np.nan  # one row of NaN out, the others finite
    return {"x": x}


def _matches_cpuref(session: InferenceSession, model: onnx.ModelProto, feeds: dict) -> None:
    expected = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    got = session.run(None, feeds)[0]
    assert np.isnan(got[0, 1]).all() and not np.isnan(np.delete(got, 1, axis=1)).any()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("crowded", [False, True])
def test_a_large_weight_takes_onednn_without_measuring(monkeypatch, crowded: bool) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: crowded)
    model = _head(8, 512, 2048)  # 2^20 weights: ONEDNN_FROM
    session = _session(model, **{"CpuAcc.compile": "layers"})
    (workload,) = inner_workloads(session, "Linear")
    assert workload.why.startswith("onednn: a 2048x512 weight over 8 rows"), workload.why
    assert [w.is_mkldnn for w in workload.weights] == [True, False]  # packed weight, plain bias
    _matches_cpuref(session, model, _feeds(8, 512))


def test_one_row_and_a_smaller_weight_are_measured() -> None:
    for rows, k, n in ((1, 512, 2048), (8, 256, 512)):
        session = _session(_head(rows, k, n))
        (workload,) = inner_workloads(session, "Linear")
        assert "measured fastest at load" in workload.why, (rows, k, n, workload.why)


def test_a_trace_holds_onednn_on_the_packed_weight(monkeypatch) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    model = _head(8, 512, 2048, tail=True)
    session = _session(model, **{"CpuAcc.compile": "onednn_graph"})
    (traced,) = [lay for lay in session.optimized.graph.layers if lay.op_type == "Traced"]
    (workload,) = inner_workloads(session, "Traced")
    graph = str(workload.module.graph)
    assert "mkldnn::_linear_pointwise" in graph and "aten::linear" not in graph, traced.name
    assert [w.is_mkldnn for w in workload.weights] == [True]  # packed, an input of the graph
    _matches_cpuref(session, model, _feeds(8, 512))


def test_the_traced_product_is_torch_s_linear_outside_a_trace() -> None:
    x, w, b = torch.randn(3, 5, 16), torch.randn(24, 16), torch.randn(24)
    assert torch.equal(linear._traceable_onednn(15)(x, w, b), torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("rows, first", [(64, "onednn"), (8, "mkl")])
def test_a_busy_machine_takes_onednn_first_for_a_projection(monkeypatch, rows: int,
                                                            first: str) -> None:
    """2^17 weights or more over 16 rows or more (``ONEDNN_FIRST_FROM``): oneDNN is the route a
    busy machine takes unmeasured; fewer rows keep MKL first."""
    monkeypatch.setattr(threads, "crowded", lambda: True)
    model = _head(rows, 256, 768)
    session = _session(model, **{"CpuAcc.compile": "layers"})
    (workload,) = inner_workloads(session, "Linear")
    assert workload.why.startswith(f"{first}: the default on a busy machine"), workload.why
    _matches_cpuref(session, model, _feeds(rows, 256))


def test_a_trace_holds_onednn_for_a_projection(monkeypatch) -> None:
    """oneDNN's product, which a busy machine takes for a projection unmeasured, held by the trace.
    (A quiet machine measures this size: under load either route can win, and the test flipped.)"""
    monkeypatch.setattr(threads, "crowded", lambda: True)
    model = _head(64, 256, 768, tail=True)
    session = _session(model, **{"CpuAcc.compile": "onednn_graph"})
    (workload,) = inner_workloads(session, "Traced")
    assert "mkldnn::_linear_pointwise" in str(workload.module.graph)
    _matches_cpuref(session, model, _feeds(64, 256))
