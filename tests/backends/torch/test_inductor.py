"""``CpuAcc.compile`` "inductor" (backends/torch/inductor.py): a subgraph without convolutions
compiled by TorchInductor's C++ backend gives CpuRef's values, NaN where CpuRef has it (a run with
NaN in its inputs takes CpuAcc's own route: inductor's fused ReLU drops it); one with
convolutions keeps oneDNN Graph; a machine without a C++ compiler gets an error that says so at
load."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import inductor  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_graph_rule import _inner_layers  # noqa: E402


def _compiler() -> bool:
    try:
        inductor.compiler()
    except inductor.CompilerMissing:
        return False
    return True


needs_compiler = pytest.mark.skipif(not _compiler(), reason="no C++ compiler for TorchInductor")


class SmallCnn(torch.nn.Module):
    """Conv -> ReLU -> MaxPool -> Conv -> ReLU -> Flatten -> Linear: one OneDnnGraph partition."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(8 * 4 * 4, 5))

    def forward(self, x):
        return self.body(x)


class SmallBlock(torch.nn.Module):
    """A transformer's feed-forward half and a softmax over the tokens' features: one Traced
    partition without convolutions."""

    def __init__(self, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.up = torch.nn.LayerNorm(width), torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        y = x + self.down(torch.relu(self.up(self.norm(x))))
        return torch.softmax(y, dim=-1)


def _exported(module: torch.nn.Module, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    torch.onnx.export(module.eval(), (torch.zeros(shape),), buffer, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamo=False)
    return buffer.getvalue()


def _session(model: bytes, tmp_path, monkeypatch: pytest.MonkeyPatch,
             **options: object) -> InferenceSession:
    """An "inductor" session without the route cache, inductor's code compiled into ``tmp_path``
    (not the user's cache folder); ``options`` more CpuAcc options (``threads=2``)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    options = {"CpuAcc.route_cache": False, "CpuAcc.compile": "inductor",
               **{f"CpuAcc.{k}": v for k, v in options.items()}}
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _partition_work(session: InferenceSession) -> object:
    (work,) = [w for layer, w in _inner_layers(session) if layer.op_type in inductor.PARTITIONS]
    while hasattr(work, "work"):
        work = work.work
    return work


@pytest.mark.slow  # a minute of g++ on a busy 2-core machine
@needs_compiler
def test_a_subgraph_compiled_by_inductor_gives_cpurefs_values_and_keeps_nan(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _exported(SmallBlock(), (1, 8, 16))
    session = _session(model, tmp_path, monkeypatch)
    assert _partition_work(session).route == "inductor"
    reference = InferenceSession(model, backends=["CpuRef"])
    x = np.random.default_rng(1).standard_normal((1, 8, 16)).astype(np.float32)
    (got,), (want,) = session.run(None, {"x": x}), reference.run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    x[0, 3, 5] = np.nan  # the fourth token's row only
    (got,), (want,) = session.run(None, {"x": x}), reference.run(None, {"x": x})
    assert np.isnan(want[0, 3]).all() and not np.isnan(np.delete(want, 3, axis=1)).any()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)  # NaN where CpuRef has it


@pytest.mark.slow  # a minute of g++ on a busy 2-core machine
@needs_compiler
def test_small_loops_compiled_for_two_threads_are_no_openmp_regions(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At 2 threads inductor's fused loops over 64 x 64 and 64 x 128 values (a norm, a ReLU, a
    softmax) are plain loops, not OpenMP regions that wait for a second thread on a busy machine
    (``inductor.CONFIG``'s ``cpp.min_chunk_size``; inductor's default of 512 values a thread made
    them regions)."""
    model = _exported(SmallBlock(64, 128), (1, 64, 64))
    session = _session(model, tmp_path, monkeypatch, threads=2)
    x = np.random.default_rng(1).standard_normal((1, 64, 64)).astype(np.float32)
    (got,) = session.run(None, {"x": x})
    assert _partition_work(session).route == "inductor"
    sources = [path.read_text() for path in tmp_path.rglob("*.cpp")]
    assert any("cpp_fused" in text for text in sources)  # its fused loops are there
    assert not any("omp parallel" in text for text in sources)
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@needs_compiler
def test_a_subgraph_with_convolutions_keeps_onednn_graph(tmp_path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's convolutions lost at every size measured (``inductor.CONVOLUTIONS``)."""
    model = _exported(SmallCnn(), (1, 3, 8, 8))
    session = _session(model, tmp_path, monkeypatch)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (got,) = session.run(None, {"x": x})
    # CpuAcc's own route, whichever its measurement at load chose (oneDNN Graph or the trace),
    # or backplane's C where a compiler is (CpuAcc.native auto): a busy machine can flip that
    # choice, never make it inductor's
    assert str(_partition_work(session).route).split("+")[0] in ("onednn_graph", "traced",
                                                                  "native")
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


class SmallTagger(torch.nn.Module):
    """A bidirectional LSTM and a Linear over its states: one Traced partition with an LSTM."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn = torch.nn.LSTM(8, 16, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return torch.relu(self.head(self.rnn(x)[0]))


@needs_compiler
def test_a_subgraph_with_an_lstm_keeps_cpuaccs_own_route(tmp_path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled, the corpus's bidirectional LSTM ran 1.5 times slower (``inductor.RECURRENT``)."""
    model = _exported(SmallTagger(), (1, 6, 8))
    session = _session(model, tmp_path, monkeypatch)
    x = np.random.default_rng(1).standard_normal((1, 6, 8)).astype(np.float32)
    (got,) = session.run(None, {"x": x})
    assert _partition_work(session).route != "inductor"
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a minute of g++ on a busy 2-core machine
@needs_compiler
def test_a_subgraph_whose_kernels_make_meta_tensors_compiles(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """encoder_padmask_dyn17's trace composes views on meta tensors: make_fx's graph held values
    of two fake modes, which inductor refused until they were dropped (``_with_buffers``)."""
    corpus = Path(__file__).parent.parent.parent / "data" / "corpus"
    model = (corpus / "encoder_padmask_dyn17.onnx").read_bytes()
    feeds = dict(np.load(corpus / "encoder_padmask_dyn17.s0.npz"))
    session = _session(model, tmp_path, monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "could not compile it" fails the test
        got = session.run(None, feeds)
    assert _partition_work(session).route == "inductor"
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))


def test_no_cpp_compiler_is_an_error_that_says_so(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path) -> None:
    from torch._inductor import config

    inductor.compiler.cache_clear()
    monkeypatch.setattr(config.cpp, "cxx", ("no-such-c++-compiler",))
    try:
        with pytest.raises(inductor.CompilerMissing, match="needs a C.. compiler") as raised:
            _session(_exported(SmallCnn(), (1, 3, 8, 8)), tmp_path, monkeypatch)
        assert "no-such-c++-compiler" in str(raised.value)
    finally:
        inductor.compiler.cache_clear()


def test_a_run_with_nan_or_an_infinity_in_a_float_input_takes_cpuaccs_own_route() -> None:
    """Inductor's oneDNN post-ops dropped NaN (a convolution's fused ReLU: resnet_basic_ts16's 10
    NaN outputs -> 0); the route's input check hands such a run to CpuAcc's own, made once."""
    made: list[int] = []

    def own() -> object:
        made.append(1)
        return lambda *values: ("own",)

    run = inductor._finite_or(lambda *values: ("inductor",), own)
    ids, x = torch.zeros(2, dtype=torch.int64), torch.ones(3)
    assert run(ids, x) == ("inductor",) and made == []
    for bad in (float("nan"), float("inf"), -float("inf")):
        x[1] = bad
        assert run(ids, x) == ("own",)
    assert made == [1]
    assert run(ids, torch.ones(3)) == ("inductor",) and run(ids, torch.ones(0)) == ("inductor",)
