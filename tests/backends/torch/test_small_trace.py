"""A transformer's embedding Gather no longer keeps its partition layer by layer (issue 27, item 4):
CpuAcc's Gather reads the smallest index on the host, which a trace would keep, so a trace takes a
Gather that reads nothing there (``onednn_graph.TRACEABLE_KERNELS``); and a trace whose sample
makes NaN (an all-padding mask) is checked NaN for NaN instead of refused."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import onednn_graph  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

from tests.backends.torch.test_traced import _inner_layers  # noqa: E402

VOCAB, D = 30, 16


def embedded_tokens() -> bytes:
    """Token ids (free batch and length) -> Gather of an embedding table -> MatMul, Add, Relu,
    MatMul -> Softmax: how exporters write a transformer's first layers."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((VOCAB, D)).astype(np.float32), "table"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32) * 0.3, "w1"),
             numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32) * 0.3, "w2")]
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"], axis=0),
             helper.make_node("MatMul", ["e", "w1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h1"]), helper.make_node("Relu", ["h1"], ["h2"]),
             helper.make_node("MatMul", ["h2", "w2"], ["s"]),
             helper.make_node("Softmax", ["s"], ["y"], axis=-1)]
    graph = helper.make_graph(
        nodes, "embedded", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "L"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "L", D])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("shape", [(1, 8), (3, 5)])
def test_an_embedding_gather_is_traced_and_counts_negative_ids_from_the_end(shape) -> None:
    model = embedded_tokens()
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.compile": "onednn_graph"})))  # the trace whenever it traces
    ids = np.random.default_rng(sum(shape)).integers(-VOCAB, VOCAB, shape).astype(np.int64)
    ids.flat[0] = -1  # the last row of the table
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"ids": ids})
    for _ in range(2):
        (got,) = session.run(None, {"ids": ids})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    routes = [(lay.op_type, getattr(work, "route", None)) for lay, work in _inner_layers(session)]
    assert routes == [("Traced", "traced")]  # ("Traced", "layers") before: the Gather's host read


def test_a_traced_check_takes_nan_and_infinities_in_the_same_places() -> None:
    expected = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    assert onednn_graph._close(expected.clone(), expected)
    assert onednn_graph._close(expected + torch.tensor([1e-6, 0, 0, 0]), expected)
    assert not onednn_graph._close(torch.tensor([1.0, 0.0, float("inf"), -2.0]), expected)
    assert not onednn_graph._close(torch.tensor([1.0, float("nan"), 3.0, -2.0]), expected)
    assert not onednn_graph._close(torch.tensor([1.0, float("nan"), float("inf"), float("nan")]),
                                   expected)
    assert not onednn_graph._close(torch.tensor([1.5, float("nan"), float("inf"), -2.0]), expected)
    assert onednn_graph._close(torch.full((3,), float("nan")), torch.full((3,), float("nan")))
