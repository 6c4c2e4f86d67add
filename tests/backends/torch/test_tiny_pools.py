"""A small average pool traced for oneDNN Graph is torch's adaptive average pool, which the fuser
leaves to ATen, not a partition of its own (``kernels/nn.TINY_POOL``)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion.compiled import fusion_switch  # noqa: E402
from backplane.backends.torch.kernels import nn  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.models.test_models import DATA, assert_close, ort_outputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # sizes read in a trace
RESNET = DATA / "corpus" / "resnet_basic_ts16.onnx"  # AveragePool 2x2 on 4x4, then a global one


def _traced(pool, x):
    with fusion_switch(True), torch.no_grad():
        return torch.jit.trace(lambda t: pool(t), x, check_trace=False)


@pytest.mark.parametrize("shape, pool", [
    ((1, 32, 4, 4), lambda t: nn.average_pool(t, kernel_shape=[2, 2], strides=[2, 2])[0]),
    ((1, 32, 8, 8), lambda t: nn.global_average_pool(t)[0]),
    ((1, 64, 16, 16), lambda t: nn.global_average_pool(t)[0])])
def test_a_small_average_pool_is_left_to_aten(shape, pool) -> None:
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    x[0, 3, 1, 1], x[0, 5, 0, 1] = float("nan"), float("inf")
    traced = _traced(pool, x)
    ops = str(traced.graph)
    assert "aten::_adaptive_avg_pool2d" in ops and "aten::avg_pool2d" not in ops
    window = [shape[2] // 2] * 2 if shape[2] == 4 else list(shape[2:])
    want = F.avg_pool2d(x, window, window)
    got = traced(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got).any()
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)


def test_a_larger_or_uneven_pool_stays_onednn_graphs() -> None:
    large = torch.randn(1, 64, 32, 32)
    assert "aten::avg_pool2d" in str(_traced(lambda t: nn.global_average_pool(t)[0], large).graph)
    overlapping = torch.randn(1, 8, 6, 6)  # a 3x3 window at stride 1: no adaptive pool is it
    traced = _traced(lambda t: nn.average_pool(t, kernel_shape=[3, 3], strides=[1, 1])[0],
                     overlapping)
    assert "aten::avg_pool2d" in str(traced.graph)


def test_resnet_pools_run_between_partitions_and_match_onnx_runtime() -> None:
    feeds = dict(np.load(str(RESNET).replace(".onnx", ".s0.npz")))
    session = InferenceSession(RESNET, backends=["CpuAcc", "CpuRef"], runtime=Runtime(
        RuntimeOptions(backend_options={"CpuAcc.compile": "onednn_graph"})))
    session.run(None, feeds)
    outputs = session.run(None, feeds)
    ran = str(torch.jit.last_executed_optimized_graph())
    assert ran.count("aten::_adaptive_avg_pool2d") == 2 and "aten::avg_pool2d" not in ran
    assert_close(outputs, ort_outputs(RESNET, feeds))
