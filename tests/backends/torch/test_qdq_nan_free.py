"""A QDQ convolution's ReLU or clamp in a oneDNN Graph trace, where its input is a round trip's
result (finite) and its weights finite: spelled as the ops oneDNN fuses (``quantized.fusable``'s
``nan_free``, ``kernels.common.nan_free_trace``), not the NaN-keeping ones, so a Conv -> Clip
(ReLU6) -> QuantizeLinear -> DequantizeLinear is one partition, not two with torch's clamp_min and
clamp_max between them; a NaN or an infinity in the model's input still gives CpuRef's values
within one step (the input's round trip maps them before any convolution reads them)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_qdq_compiled import (  # noqa: E402
    _graph_layer,
    within_a_step_with_specials,
)
from tests.backends.torch.test_quantized_fusion import qdq_conv_model  # noqa: E402


def _outside_partitions(session: InferenceSession, x: np.ndarray) -> list[str]:
    """The aten calls the compiled module's last run made outside oneDNN Graph's partitions."""
    session.run(None, {"x": x})
    graph = torch.jit.last_executed_optimized_graph()
    return [node.kind() for node in graph.nodes() if node.kind().startswith("aten::")]


@pytest.mark.parametrize("activation", ["Clip", "Relu"])
def test_a_qdq_convolutions_activation_is_fused_and_values_stay(
        activation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from backplane.backends.torch.fusion import qdq_chain

    monkeypatch.setattr(qdq_chain, "CHAIN_MACS", 1 << 20)  # QuantDequant layers, not chained
    model, step = qdq_conv_model(activation, np.random.default_rng(7))
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "onednn_graph",
                                                            "int8": "exact"})])
    layer = _graph_layer(session)
    assert layer.op_type == "OneDnnGraph", layer
    trips = [lay for lay in layer.attrs["layers"] if lay.op_type == "QuantDequant"]
    # the input's round trip holds no layer; the convolution's and the Gemm's read round trips
    assert [lay.attrs["nan_free"] for lay in trips] == [False, True, True]
    x = np.random.default_rng(0).standard_normal((1, 4, 6, 6)).astype(np.float32)
    outside = _outside_partitions(session, x)
    assert "aten::clamp_min" not in outside and "aten::clamp_max" not in outside \
        and "aten::clamp_max_" not in outside, outside
    within_a_step_with_specials(session, InferenceSession(model, backends=["CpuRef"]), step, 3)
