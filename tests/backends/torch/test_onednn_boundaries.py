"""What a OneDnnGraph's trace leaves outside oneDNN Graph's partitions, each a call of TorchScript's
interpreter and a plain layout at a partition's edge (issue 27, a small CNN's fixed cost): a mean
over the whole map is a pool partition, not torch's mean, sum and division; no ``contiguous`` is
left between partitions, nor on the model's input before a wide kernel. Values stay CpuRef's,
NaN included."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

POOLS = ["GlobalAveragePool", "ReduceMean", "ReduceMean keepdims 0"]


def _model(pool: str):
    """Conv 3x3 -> Relu -> Conv 3x3 -> Relu -> ``pool`` over the map -> Flatten -> Gemm."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)
             for name, shape in (("w1", (8, 3, 3, 3)), ("w2", (8, 8, 3, 3)), ("fc", (5, 8)))]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"])]
    if pool == "GlobalAveragePool":
        nodes.append(helper.make_node("GlobalAveragePool", ["r2"], ["m"]))
    else:  # opset 17: axes an attribute
        keep = 0 if pool.endswith("0") else 1
        nodes.append(helper.make_node("ReduceMean", ["r2"], ["m"], axes=[2, 3], keepdims=keep))
    nodes += [helper.make_node("Flatten", ["m"], ["f"]),
              helper.make_node("Gemm", ["f", "fc"], ["y"], transB=1)]
    return make_model(nodes, [float_input("x", [1, 3, 16, 16])], [float_input("y", [1, 5])],
                      inits)


def _compiled_run(pool: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    """The model's output on CpuAcc, its subgraph compiled by oneDNN Graph, and the graph that
    TorchScript ran for it (the partitions' own graphs after the first ``with``)."""
    options = RuntimeOptions(backend_options={"CpuAcc.compile": "onednn_graph"})
    session = InferenceSession(_model(pool).SerializeToString(), backends=["CpuAcc", "CpuRef"],
                               runtime=Runtime(options))
    assert "OneDnnGraph" in [layer.op_type for layer in session.optimized.graph.layers]
    for _ in range(2):  # the first run compiles it
        (y,) = session.run(None, {"x": x})
    return y, str(torch.jit.last_executed_optimized_graph())


def _cpuref(pool: str, x: np.ndarray) -> np.ndarray:
    session = InferenceSession(_model(pool).SerializeToString(), backends=["CpuRef"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("pool", POOLS)
def test_a_mean_over_the_map_is_a_pool_in_a_partition(pool: str) -> None:
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    y, graph = _compiled_run(pool, x)
    outside, _, partitions = graph.partition("\nwith prim::oneDNNFusionGroup")
    assert "aten::mean" not in outside and "aten::sum" not in outside, outside
    # a pool partition, or below nn.TINY_POOL values one ATen pool between the partitions
    assert "aten::avg_pool2d" in partitions or "aten::_adaptive_avg_pool2d" in outside
    np.testing.assert_allclose(y, _cpuref(pool, x), rtol=1e-4, atol=1e-5)


def test_no_contiguous_is_left_between_the_partitions() -> None:
    """Before: ``contiguous`` on the model's input (a copy into channels-last) and on each
    convolution's input (a no-op, but an op between two partitions)."""
    x = np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype(np.float32)
    y, graph = _compiled_run("GlobalAveragePool", x)
    outside = graph.partition("\nwith prim::oneDNNFusionGroup")[0]
    assert "aten::contiguous" not in outside, outside
    np.testing.assert_allclose(y, _cpuref("GlobalAveragePool", x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pool", POOLS)
def test_nan_in_the_input_is_nan_out_as_on_cpuref(pool: str) -> None:
    x = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype(np.float32)
    x[0, 1, 5, 9] = np.nan
    y, _ = _compiled_run(pool, x)
    want = _cpuref(pool, x)
    assert np.isnan(want).any()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
