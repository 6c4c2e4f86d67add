"""float16 Linears and attention fused where the CPU computes float16 in float32
(``patterns.half_in_float``): their weights widened once at load, the fused layers computing in
float32 as the float32 trace around them does (the small tier's gpt_fp16_dyn19, exported by
dynamo: MatMul, its bias, dynamo's tanh GELU and the attention as its float32 twin's), and a
float16 Linear left outside a trace computing in float32 on its float16 inputs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion.patterns import half_in_float  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_attention_sdpa import _built  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
RNG = np.random.default_rng(16)
pytestmark = pytest.mark.skipif(not half_in_float(), reason="this CPU has float16 arithmetic")


def _session(model, compile_mode: str, monkeypatch) -> InferenceSession:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    data = model if isinstance(model, (str, Path)) else model.SerializeToString()
    return InferenceSession(data, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.route_cache": False, "CpuAcc.compile": compile_mode})))


def test_the_float16_gpt_fuses_as_its_float32_twin(monkeypatch) -> None:
    """Two blocks: 4 Linears each (QKV, projection, the feed-forward's two, GELU in the first)
    and the head; 2 attentions. Outputs within float16's rounding of ONNX Runtime's."""
    path = CORPUS / "gpt_fp16_dyn19.onnx"
    session = _session(path, "onednn_graph", monkeypatch)
    feeds = dict(np.load(CORPUS / "gpt_fp16_dyn19.s0.npz"))
    (got,) = session.run(None, feeds)
    assert _built(session, "Linear") == 9 and _built(session, "ScaledDotAttention") == 2
    (want,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2,
                               atol=1e-2)


def _half(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float16), name)


def _linear_gelu() -> onnx.ModelProto:
    """x (1, 6, 16) float16 -> MatMul -> Add(bias) -> dynamo's tanh GELU -> y, float16 throughout,
    its constants float16 (0.044715 and sqrt(2 / pi) rounded)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Add", ["m", "bias"], ["a"]),
             helper.make_node("Pow", ["a", "three"], ["c"]),
             helper.make_node("Mul", ["cubic", "c"], ["cc"]),
             helper.make_node("Add", ["a", "cc"], ["i"]),
             helper.make_node("Mul", ["root", "i"], ["s"]),
             helper.make_node("Tanh", ["s"], ["t"]),
             helper.make_node("Add", ["t", "one"], ["p"]),
             helper.make_node("Mul", ["half", "p"], ["hp"]),
             helper.make_node("Mul", ["a", "hp"], ["y"])]
    inits = [_half("w", RNG.standard_normal((16, 24)) * 0.3), _half("bias", RNG.standard_normal(24)),
             _half("three", 3.0), _half("cubic", 0.044715), _half("root", math.sqrt(2 / math.pi)),
             _half("one", 1.0), _half("half", 0.5)]
    graph = helper.make_graph(nodes, "half", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT16, [1, 6, 16])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT16, [1, 6, 24])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("mode", ["layers", "onednn_graph"])
def test_a_float16_linear_computes_in_float32_traced_or_not(mode: str, monkeypatch) -> None:
    """One Linear with its GELU; layer by layer it takes float16 and gives float16 (widened
    inside), NaN where x has one; ONNX Runtime's values within float16's rounding."""
    model = _linear_gelu()
    session = _session(model, mode, monkeypatch)
    layers = [lay for top in session.optimized.graph.layers
              for lay in (top.attrs.get("layers", []) if top.op_type == "Traced" else [top])
              if lay.op_type not in ("MemCopy", "MemImport")]
    assert [lay.op_type for lay in layers] == ["Linear"]
    assert layers[0].attrs["unary"] == ("gelu", [], "tanh")
    x = RNG.standard_normal((1, 6, 16)).astype(np.float16)
    x[0, 2, 5] = np.nan
    (got,) = session.run(None, {"x": x})
    data = model.SerializeToString()
    (want,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (ref,) = InferenceSession(data, backends=["CpuRef"]).run(None, {"x": x})
    assert got.dtype == np.float16 and np.isnan(got[0, 2]).all()
    for expected in (want, ref):
        assert np.array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_a_float16_input_is_converted_once_to_the_weights_type(compute: str) -> None:
    """A float16 Linear marked to compute in bfloat16 (``CpuAcc.precision`` bf16) takes its input
    in its weight's type, not float32 then float32 again: one conversion each way."""
    from backplane.backends.torch.fusion.linear import _mkl_linear

    attrs = {"weight": (RNG.standard_normal((24, 16)) * 0.3).astype(np.float16),
             "bias": RNG.standard_normal(24).astype(np.float32), "input_shape": [1, 6, 16],
             "unary": None, "binary": False, "output_shape": None, "compute": compute}
    x = torch.from_numpy(RNG.standard_normal((1, 6, 16)).astype(np.float16))
    (y,) = _mkl_linear(attrs)(x)
    want = x.float() @ torch.from_numpy(attrs["weight"]).float().t() + torch.from_numpy(
        attrs["bias"])
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), want, rtol=3e-2, atol=3e-2)
