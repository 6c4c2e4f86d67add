"""A Traced layer's frozen graph runs below autograd and ADInplaceOrView (``traced.below_autograd``):
the same values as under ``no_grad``, NaN included, its views untracked, and a run's outputs still
the caller's alone where the graph returns a view of its input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion import traced  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

RNG = np.random.default_rng(3)


def _model() -> onnx.ModelProto:
    """x (1, 4, 6) -> MatMul -> Relu -> Mul 2 -> Reshape (4, 6) = y, and Squeeze(x) = z: a view
    of the input among the trace's outputs (oneDNN Graph takes no Squeeze of an input: Traced)."""
    inits = [numpy_helper.from_array(RNG.standard_normal((6, 6)).astype(np.float32), "w"),
             numpy_helper.from_array(np.float32(2), "two"),
             numpy_helper.from_array(np.array([4, 6], np.int64), "shape"),
             numpy_helper.from_array(np.array([0], np.int64), "axis")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Mul", ["r", "two"], ["d"]),
             helper.make_node("Reshape", ["d", "shape"], ["y"]),
             helper.make_node("Squeeze", ["x", "axis"], ["z"])]
    return make_model(nodes, [float_input("x", [1, 4, 6])],
                      [float_input("y", [4, 6]), float_input("z", [4, 6])], inits)


MODEL = _model()


def _traced_workload(session: InferenceSession):
    loaded = session.runtime.network(session.network_id)
    (workload,) = [getattr(step.workload, "work", step.workload)
                   for step, layer in zip(loaded.steps, loaded.layers) if layer.op_type == "Traced"]
    return workload


@pytest.fixture
def session(monkeypatch) -> InferenceSession:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    return InferenceSession(MODEL, backends=["CpuAcc"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.compile": "onednn_graph", "CpuAcc.route_cache": False})))


def test_the_run_is_below_autograd_with_no_grad_s_values(session) -> None:
    workload = _traced_workload(session)
    x = torch.from_numpy(RNG.standard_normal((1, 4, 6)).astype(np.float32))
    x[0, 2, 3] = float("nan")
    y, z = workload(x)
    assert not y._is_view() and not z._is_view()  # under no_grad, both are tracked views
    with torch.no_grad():
        want = workload.module(x)
    for got, expected in zip((y, z), want):
        assert expected._is_view()
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3]]).any()


def test_a_view_of_the_input_is_still_the_caller_s_alone(session) -> None:
    x = RNG.standard_normal((1, 4, 6)).astype(np.float32)
    kept = x.copy()
    y, z = session.run(None, {"x": x})
    z[:] = 7.0  # the caller's own: neither the input nor the next run's outputs change
    np.testing.assert_array_equal(x, kept)
    y2, z2 = session.run(None, {"x": x})
    np.testing.assert_array_equal(z2, kept[0])
    want = InferenceSession(MODEL, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(y2, want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y, y2)


def test_a_torch_without_the_guard_runs_under_no_grad(monkeypatch) -> None:
    monkeypatch.delattr(torch._C, "_AutoDispatchBelowADInplaceOrView")
    with traced.below_autograd():
        assert not torch.is_grad_enabled()
