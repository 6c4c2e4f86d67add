"""CpuAcc's attention fusion (``fusion/attention.py``): each spelling the exporters write becomes
one ScaledDotAttention layer, layer by layer and in a trace, with CpuRef's and ONNX Runtime's
values, NaN where a row is masked throughout (ONNX's softmax of -inf)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
RNG = np.random.default_rng(5)
H, L, E = 2, 6, 8  # heads, length, head size


def _f(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, np.float32), name)


def _model(nodes, inputs, inits, opset: int = 17) -> onnx.ModelProto:
    """q (1, H, L, E), kt (1, H, E, L), v (1, H, L, E) [, mask] -> nodes -> p -> MatMul v ->
    Transpose -> Reshape -> Tanh -> y (1, L, H * E): four layers once fused, a trace's worth."""
    nodes = [*nodes, helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"]),
             helper.make_node("Transpose", ["o"], ["t"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["t", "joined"], ["r"]),
             helper.make_node("Tanh", ["r"], ["y"])]
    inits = [*inits, numpy_helper.from_array(np.array([1, L, H * E], np.int64), "joined")]
    graph = helper.make_graph(nodes, "attention", [_f("q", [1, H, L, E]), _f("kt", [1, H, E, L]),
                                                   _f("v", [1, H, L, E]), *inputs],
                              [_f("y", [1, L, H * E])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                             ir_version=8)  # one every ONNX Runtime reads (1.30 reads up to 13)


def div_add_mask() -> onnx.ModelProto:
    """TorchScript exporter's: MatMul -> Div(sqrt E) -> Add(a mask made from the inputs)."""
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["m"]),
             helper.make_node("Div", ["m", "root"], ["d"]),
             helper.make_node("Add", ["d", "mask"], ["s"])]
    return _model(nodes, [_f("mask", [1, 1, L, L])], [_const("root", np.sqrt(E))])


def mul_where_causal() -> onnx.ModelProto:
    """GPT's: MatMul -> Mul(1 / sqrt E) -> Where(not causal, -inf, scores)."""
    future = np.triu(np.ones((1, 1, L, L), bool), 1)
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["m"]),
             helper.make_node("Mul", ["m", "scale"], ["d"]),
             helper.make_node("Where", ["future", "fill", "d"], ["s"])]
    inits = [_const("scale", 1 / np.sqrt(E)), _const("fill", -np.inf),
             numpy_helper.from_array(future, "future")]
    return _model(nodes, [], inits)


def scaled_q_and_k() -> onnx.ModelProto:
    """dynamo's: Q and Kt each times E^-1/4 -> MatMul -> Add(a constant mask)."""
    mask = np.where(np.triu(np.ones((L, L), bool), 1), -np.inf, 0).astype(np.float32)
    nodes = [helper.make_node("Mul", ["q", "quarter"], ["qs"]),
             helper.make_node("Mul", ["kt", "quarter"], ["ks"]),
             helper.make_node("MatMul", ["qs", "ks"], ["m"]),
             helper.make_node("Add", ["m", "mask"], ["s"])]
    return _model(nodes, [], [_const("quarter", E ** -0.25), _const("mask", mask)], opset=18)


class _Causal(torch.nn.Module):
    """A GPT block's attention as people write it, exported by torch.onnx's TorchScript exporter."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads
        self.register_buffer("causal", torch.tril(torch.ones(16, 16, dtype=torch.bool)))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(~self.causal[:t, :t], float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def _exported(tmp_path) -> onnx.ModelProto:
    path = tmp_path / "causal.onnx"
    torch.onnx.export(_Causal().eval(), (torch.randn(1, 10, 32),), str(path), opset_version=14,
                      input_names=["x"], output_names=["y"], dynamo=False)
    return onnx.load(str(path))


def _session(model, compile_mode: str, monkeypatch) -> InferenceSession:
    monkeypatch.setattr(threads, "crowded", lambda: False)
    data = model if isinstance(model, (str, Path)) else model.SerializeToString()
    return InferenceSession(data, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.route_cache": False, "CpuAcc.compile": compile_mode})))


def _fused(session: InferenceSession, traced: bool | None = None) -> int:
    """ScaledDotAttention layers in the session's graph, those inside a Traced layer too (only
    those where ``traced``, none of those where False)."""
    count = 0
    for layer in session.optimized.graph.layers:
        inside = layer.op_type == "Traced"
        inner = layer.attrs.get("layers", []) if inside else [layer]
        if traced is None or traced == inside:
            count += sum(lay.op_type == "ScaledDotAttention" for lay in inner)
    return count


def _feeds(model: onnx.ModelProto, masked_row: bool = False) -> dict[str, np.ndarray]:
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = RNG.standard_normal(shape).astype(np.float32)
    if "mask" in feeds:
        feeds["mask"] = np.where(RNG.random((1, 1, L, L)) < 0.3, -np.inf, 0).astype(np.float32)
        feeds["mask"][..., 0] = 0  # every row keeps one key...
        if masked_row:
            feeds["mask"][..., 2, :] = -np.inf  # ...but this one: softmax of -inf, NaN
    if "q" in feeds:
        feeds["q"][0, 1, 4, 3] = np.nan  # NaN in, NaN out (that query's row)
    return feeds


def _against_references(session, model, feeds) -> None:
    data = model if isinstance(model, (str, Path)) else model.SerializeToString()
    (got,), (want,) = session.run(None, feeds), InferenceSession(data, backends=["CpuRef"]).run(
        None, feeds)
    (peer,) = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    for expected in (want, peer):
        assert np.array_equal(np.isnan(got), np.isnan(expected))
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


SPELLINGS = {"div_add_mask": div_add_mask, "mul_where_causal": mul_where_causal,
             "scaled_q_and_k": scaled_q_and_k}


@pytest.mark.parametrize("mode", ["layers", "onednn_graph"])
@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_each_spelling_is_one_attention(spelling: str, mode: str, monkeypatch) -> None:
    model = SPELLINGS[spelling]()
    session = _session(model, mode, monkeypatch)
    assert _fused(session, traced=mode == "onednn_graph") == 1
    _against_references(session, model, _feeds(model))


@pytest.mark.parametrize("mode", ["layers", "onednn_graph"])
def test_dynamos_scales_on_q_and_k_are_the_products_alpha(mode: str, monkeypatch) -> None:
    """Q and Kt each times E^-1/4: both Muls inside the one layer, E^-1/2 its scale."""
    model = scaled_q_and_k()
    session = _session(model, mode, monkeypatch)
    layers = [lay for top in session.optimized.graph.layers
              for lay in (top.attrs.get("layers", []) if top.op_type == "Traced" else [top])]
    (fused,) = [lay for lay in layers if lay.op_type == "ScaledDotAttention"]
    assert not [lay for lay in layers if lay.op_type == "Mul"]
    assert [n.split("@")[0] for n in fused.inputs[:2]] == ["q", "kt"]  # "@CpuAcc": an import
    assert fused.attrs["scale"][0] == "Mul"
    assert fused.attrs["scale"][1] == pytest.approx(E ** -0.5, rel=1e-6)
    _against_references(session, model, _feeds(model))


@pytest.mark.parametrize("mode", ["layers", "onednn_graph"])
def test_a_mask_of_the_scores_batch_is_added_by_the_product(mode: str, monkeypatch) -> None:
    """A mask with Q's batch (1, H, L, L), not broadcast over the heads: baddbmm's input."""
    model = div_add_mask()
    model.graph.input[3].type.tensor_type.shape.dim[1].dim_value = H
    session = _session(model, mode, monkeypatch)
    feeds = _feeds(model)
    feeds["mask"] = np.where(RNG.random((1, H, L, L)) < 0.3, -np.inf, 0).astype(np.float32)
    feeds["mask"][..., 0] = 0
    assert _fused(session, traced=mode == "onednn_graph") == 1
    _against_references(session, model, feeds)


@pytest.mark.parametrize("mode", ["layers", "onednn_graph"])
def test_a_row_masked_throughout_is_nan(mode: str, monkeypatch) -> None:
    """ONNX Runtime and CpuRef give NaN there (torch's scaled_dot_product_attention gives zeros)."""
    model = div_add_mask()
    session = _session(model, mode, monkeypatch)
    feeds = _feeds(model, masked_row=True)
    (got,) = session.run(None, feeds)
    assert np.isnan(got[0, 2]).all() and _fused(session, traced=mode == "onednn_graph") == 1
    _against_references(session, model, feeds)


def test_torch_onnx_export_of_a_causal_block(tmp_path, monkeypatch) -> None:
    model = _exported(tmp_path)
    session = _session(model, "onednn_graph", monkeypatch)
    assert _fused(session) == 1
    x = RNG.standard_normal((1, 10, 32)).astype(np.float32)
    _against_references(session, model, {"x": x})


@pytest.mark.parametrize("name, blocks", [("gpt_sdpa_dyn18", 2), ("encoder_padmask_dyn17", 2),
                                          ("char_tagger_ts14", 4), ("gpt_causal_ts15", 2)])
def test_the_corpus_exports(name: str, blocks: int, monkeypatch) -> None:
    """Real exports (dynamo's and TorchScript's), free dimensions: each signature's build fuses."""
    path = CORPUS / f"{name}.onnx"
    session = _session(path, "onednn_graph", monkeypatch)
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    session.run(None, feeds)
    built = [lay for lay in session.optimized.graph.layers if lay.op_type == "Specialized"]
    assert built, "the corpus's transformers have free dimensions"
    found = _built(session, "ScaledDotAttention")
    assert found == blocks, found
    _against_references(session, path, feeds)


def _built(session, op_type: str) -> int:
    """``op_type`` layers in each signature's build of the session's Specialized layers (inside
    Traced layers too)."""
    loaded = session.runtime.network(session.network_id)
    count = 0
    for step, layer in zip(loaded.steps, loaded.layers):
        work = getattr(step.workload, "work", step.workload)
        for runner in getattr(work, "built", {}).values():
            (inner,) = [c.cell_contents for c in runner.__closure__
                        if type(c.cell_contents).__name__ == "LoadedNetwork"]
            for lay in inner.layers:
                lays = lay.attrs.get("layers", []) if lay.op_type == "Traced" else [lay]
                count += sum(x.op_type == op_type for x in lays)
    return count


def test_left_alone_where_it_is_not_attention(monkeypatch) -> None:
    """A softmax over another axis, or probabilities read by another layer too, stay as they are."""
    other_axis = div_add_mask()
    other_axis.graph.node[3].attribute[0].i = 2  # the Softmax
    read_twice = div_add_mask()
    read_twice.graph.output.append(_f("p", [1, H, L, L]))
    for model in (other_axis, read_twice):
        session = _session(model, "layers", monkeypatch)
        assert _fused(session) == 0
        feeds = _feeds(model)
        got, want = session.run(None, feeds), InferenceSession(
            model.SerializeToString(), backends=["CpuRef"]).run(None, feeds)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
