"""A frozen trace's Relu of a product is the product's ``_addmm_activation``, and a mean read by a
product with a constant weight is a sum with ``1 / n`` in that weight (``fusion/trace_epilogues``):
fewer ops a run, the values of the ops they replace (NaN in, NaN out), and the full-tier VAD's
trace with both, against ONNX Runtime at both sample rates (both branches of its If)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import onednn_graph, traced  # noqa: E402
from backplane.backends.torch.fusion.static_sizes import fold_sizes, fold_views  # noqa: E402
from backplane.backends.torch.fusion.trace_epilogues import fold_means, fold_relus  # noqa: E402
from backplane.backends.torch.fusion.traceable import TRACEABLE_KERNELS  # noqa: E402
from backplane.backends.torch.kernels.common import relu  # noqa: E402

RNG = np.random.default_rng(27)
SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def _tensor(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(RNG.standard_normal(shape).astype(np.float32) * scale)


def _frozen(function, sample, fold=None):
    """``function`` traced as ``traced`` traces, ``fold`` run on its graph, then frozen."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings
        trace = onednn_graph._trace(function, sample, fusion=False)
        fold_sizes(trace.graph)
        fold_views(trace.graph)
        count = fold(trace.graph) if fold else 0
        return onednn_graph._freeze(trace, fusion=False), count


def _kinds(module) -> list[str]:
    return [node.kind() for node in module.graph.nodes() if node.kind() != "prim::Constant"]


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(
        got.nan_to_num(0.0), want.nan_to_num(0.0))


def _conv_relu(x: torch.Tensor, W: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """A VAD's strided front Conv1d and its Relu, as a trace holds them."""
    (y,) = TRACEABLE_KERNELS["Conv"](x, W, B, strides=[32], pads=[16, 16])
    return relu(y)[0]


def test_a_products_relu_is_its_activation() -> None:
    W, B = _tensor(64, 1, 64, scale=0.1), _tensor(64)
    sample = [_tensor(1, 1, 256)]
    plain, _ = _frozen(lambda x: _conv_relu(x, W, B), sample)
    folded, count = _frozen(lambda x: _conv_relu(x, W, B), sample, fold_relus)
    assert count == 1 and "aten::relu" in _kinds(plain) and "aten::addmm" in _kinds(plain)
    assert "aten::relu" not in _kinds(folded) and "aten::addmm" not in _kinds(folded)
    assert _kinds(folded).count("aten::_addmm_activation") == 1
    with torch.no_grad():
        for _ in range(3):  # the frozen graphs' first calls and their optimized ones
            x = _tensor(1, 1, 256)
            x[0, 0, 40] = float("nan")  # the windows over it: NaN in every channel
            got, want = folded(x), plain(x)
            assert torch.isnan(got).any() and _same(got, want)


def test_a_product_read_twice_keeps_its_relu() -> None:
    W, B = _tensor(64, 1, 64, scale=0.1), _tensor(64)

    def both(x):
        (y,) = TRACEABLE_KERNELS["Conv"](x, W, B, strides=[32], pads=[16, 16])
        return relu(y)[0], y  # the product's own values leave the graph too

    folded, count = _frozen(both, [_tensor(1, 1, 256)], fold_relus)
    assert count == 0 and "aten::relu" in _kinds(folded)


def _pooled_step(X: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor) -> torch.Tensor:
    """A VAD's pooled encoder output beside its state, by one weight (its LSTM step's product)."""
    return torch.addmm(bias, torch.cat([X.mean(2), h], 1), weight)


@pytest.mark.parametrize("length", [4, 5])
def test_a_mean_read_by_a_product_is_a_sum_in_its_weight(length: int) -> None:
    weight, bias = _tensor(48 + 32, 64, scale=0.1), _tensor(64)
    sample = [_tensor(1, 48, length), _tensor(1, 32)]
    plain, _ = _frozen(lambda X, h: _pooled_step(X, h, weight, bias), sample)
    folded, count = _frozen(lambda X, h: _pooled_step(X, h, weight, bias), sample, fold_means)
    assert count == 1 and "aten::mean" not in _kinds(folded) and "aten::sum" in _kinds(folded)
    (scaled,) = [n.output().toIValue() for n in folded.graph.nodes()
                 if n.kind() == "prim::Constant" and n.output().type().kind() == "TensorType"
                 and tuple(n.output().toIValue().shape) == tuple(weight.shape)]
    assert torch.equal(scaled[:48], weight[:48] * (1.0 / length))
    assert torch.equal(scaled[48:], weight[48:])  # the state's rows as they were
    with torch.no_grad():
        for _ in range(3):
            X, h = _tensor(1, 48, length), _tensor(1, 32)
            X[0, 5, 1] = float("nan")  # every output of the product
            got, want = folded(X, h), plain(X, h)
            assert torch.isnan(got).all() and torch.isnan(want).all()
            X[0, 5, 1] = 0.5
            torch.testing.assert_close(folded(X, h), plain(X, h), rtol=1e-5, atol=1e-6)


def test_a_mean_read_elsewhere_stays_a_mean() -> None:
    weight, bias = _tensor(80, 64, scale=0.1), _tensor(64)

    def returned(X, h):
        pooled = X.mean(2)
        return torch.addmm(bias, torch.cat([pooled, h], 1), weight), pooled

    folded, count = _frozen(returned, [_tensor(1, 48, 4), _tensor(1, 32)], fold_means)
    assert count == 0 and "aten::mean" in _kinds(folded)


@pytest.fixture(scope="module")
def full_vad(tmp_path_factory: pytest.TempPathFactory):
    """The full tier's VAD (Silero's widths) built by the corpus script, about a second."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import export_corpus
    finally:
        sys.path.remove(str(SCRIPTS))
    folder = tmp_path_factory.mktemp("full_vad")
    entry = export_corpus.export(export_corpus.full_specs()["vad_lstm_if_ts16"], folder,
                                 export_corpus.FULL_MAX_FILE_BYTES, "full")
    return folder / entry["file"], [dict(np.load(folder / f)) for f in entry["inputs_files"]]


def test_the_full_vads_trace_folds_both(full_vad, monkeypatch: pytest.MonkeyPatch) -> None:
    ort = pytest.importorskip("onnxruntime")
    path, samples = full_vad
    modules = []
    made = traced._traced_run

    def recorded(module, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        modules.append(module)
        return made(module, *args, **kwargs)

    monkeypatch.setattr(traced, "_traced_run", recorded)
    # the whole partition traced (its convolutions native would leave the epilogues a shorter
    # trace of their own: CpuAcc.native off pins the route this test reads)
    session = InferenceSession(path, providers=["CpuAcc", "CpuRef"],
                               provider_options=[{"CpuAcc.native": "off"}, {}])
    reference = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cpu_ref = InferenceSession(path, providers=["CpuRef"])  # NaN in, NaN out (ORT's Relu: 0)
    for feeds in samples:  # 16 kHz and 8 kHz: each branch's version traced
        nan = dict(feeds, x=feeds["x"].copy())
        nan["x"][0, 300] = np.nan
        for values, outside in ((feeds, reference), (nan, cpu_ref)):
            got, want = session.run(None, values), outside.run(None, values)
            for g, w in zip(got, want):
                assert np.array_equal(np.isnan(g), np.isnan(w))
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert np.isnan(session.run(None, nan)[0][0]).all()  # the first sample's
    assert len(modules) == 2
    kinds = _kinds(modules[0])  # 16 kHz, batch 1: both convolutions products of a few outputs
    assert kinds.count("aten::_addmm_activation") == 2 and kinds.count("aten::sum") == 1
    assert not {"aten::relu", "aten::mean", "aten::im2col"} & set(kinds), kinds
    kinds = _kinds(modules[1])  # 8 kHz, batch 2: 18 outputs a convolution, oneDNN's
    assert kinds.count("aten::sum") == 1 and "aten::mean" not in kinds, kinds
