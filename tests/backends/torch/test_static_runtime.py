"""A Traced layer run by TorchScript's Static Runtime (``static_runtime``): chosen where it builds and
reproduces the trace's checked outputs, pinned here by option (``CpuAcc.compile=onednn_graph``
keeps the trace, ``CpuAcc.static_runtime`` says on or off); the corpus's transformers against ONNX
Runtime and CpuRef, NaN in and out, each run's outputs the caller's own although Static Runtime
keeps buffers between calls, runs from several threads, and a graph it computes wrongly (torch
2.13's ``sort`` out variant) left to the interpreter."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.api.backend import OptionError  # noqa: E402
from backplane.backends.torch import static_runtime, threads  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.models.test_corpus import CORPUS, MANIFEST, compare_outputs, feeds, ort_outputs  # noqa: E402

RNG = np.random.default_rng(16)


def _path(name: str):
    return CORPUS / MANIFEST[name]["file"]


def _session(name: str, mode: str = "auto") -> InferenceSession:
    return InferenceSession(_path(name), backends=["CpuAcc", "CpuRef"], runtime=Runtime(
        RuntimeOptions(backend_options={"CpuAcc.compile": "onednn_graph",
                                        "CpuAcc.route_cache": False,
                                        "CpuAcc.static_runtime": mode})))


def _traced(session: InferenceSession, name: str) -> list:
    """The Traced layers' runs, after one run of the model (a Specialized layer, for the corpus's
    free dimensions, builds its signature's at the first run and keeps it inside its own)."""
    session.run(None, feeds(name, 0))
    loaded = session.runtime.network(session.network_id)
    found = []
    for step, layer in zip(loaded.steps, loaded.layers):
        work = getattr(step.workload, "work", step.workload)
        if layer.op_type == "Specialized":
            found += [getattr(r, "alone", None) for r in step.workload.built.values()]
        elif layer.op_type == "Traced":
            found.append(work)
    return [run for run in found if getattr(run, "route", None) == "traced"]


@pytest.fixture(autouse=True)
def _idle(monkeypatch) -> None:
    monkeypatch.setattr(threads, "crowded", lambda: False)


@pytest.mark.parametrize("name", ["gpt_causal_ts15", "encoder_padmask_ts17", "gru_tm3_ts13"])
def test_a_corpus_trace_runs_on_static_runtime_and_matches_ort_and_cpuref(name) -> None:
    session = _session(name)
    (work,) = _traced(session, name)
    assert work.route == "traced" and work.static is not None
    feed = feeds(name, 0)
    got = session.run(None, feed)
    names = [o.name for o in session.get_outputs()]
    worst, problems = compare_outputs(got, ort_outputs(_path(name), feed), names)
    assert not problems, problems
    reference = InferenceSession(_path(name), backends=["CpuRef"]).run(None, feed)
    worst, problems = compare_outputs(got, reference, names)
    assert not problems, problems


def test_off_keeps_the_interpreter_with_the_same_outputs() -> None:
    name = "gpt_causal_ts15"
    on, off = _session(name), _session(name, "off")
    assert _traced(off, name)[0].static is None and _traced(on, name)[0].static is not None
    feed = feeds(name, 0)
    for a, b in zip(on.run(None, feed), off.run(None, feed)):
        np.testing.assert_array_equal(a, b)  # the same kernels: bit for bit on this model


def test_an_unknown_setting_is_an_error_naming_the_choices() -> None:
    with pytest.raises(OptionError, match="auto, off"):
        _session("gpt_causal_ts15", "sometimes")


def test_outputs_are_the_caller_s_own_across_calls() -> None:
    """Static Runtime keeps its planned buffers from call to call: a returned tensor must not be
    one of them, at the workload (its tensors) and at the session (NumPy)."""
    name = "encoder4_plain_dyn18"
    session = _session(name)
    (work,) = _traced(session, name)
    assert work.static is not None
    x = torch.from_numpy(RNG.standard_normal((1, 32, 64)).astype(np.float32))
    first = work(x)
    kept = [t.clone() for t in first]
    second = work(x + 1.0)
    for a, k, b in zip(first, kept, second):
        torch.testing.assert_close(a, k, rtol=0, atol=0)
        assert a.data_ptr() != b.data_ptr() and not torch.equal(a, b)
    feed = {session.get_inputs()[0].name: x.numpy()}
    (y,) = session.run(None, feed)
    y_kept = y.copy()
    y[...] = 7.0  # the caller's to write: the next run's outputs are their own values
    (y2,) = session.run(None, feed)
    np.testing.assert_array_equal(y2, y_kept)


def test_nan_in_gives_cpuref_s_nan_out() -> None:
    name = "encoder4_plain_dyn18"
    session = _session(name)
    assert _traced(session, name)[0].static is not None
    feed = {k: v.copy() for k, v in feeds(name, 0).items()}
    (key,) = feed
    feed[key][0, 3, 5] = np.nan
    got = session.run(None, feed)
    want = InferenceSession(_path(name), backends=["CpuRef"]).run(None, feed)
    for g, w in zip(got, want):
        assert np.isnan(w).any()
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g[~np.isnan(w)], w[~np.isnan(w)], rtol=1e-4, atol=1e-4)


def test_runs_from_several_threads_each_get_their_own_answer() -> None:
    """One Static Runtime holds one set of buffers: concurrent runs of a session must not share
    them (a run that finds it busy takes the interpreter)."""
    name = "gpt_causal_ts15"
    session = _session(name)
    (key,) = feeds(name, 0)
    inputs = [{key: RNG.integers(0, 64, (1, 8)).astype(np.int64)} for _ in range(16)]
    alone = [session.run(None, feed) for feed in inputs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda feed: session.run(None, feed), inputs * 4))
    for i, outputs in enumerate(together):
        for got, want in zip(outputs, alone[i % len(inputs)]):
            np.testing.assert_array_equal(got, want)


class _TopValues(torch.nn.Module):
    def forward(self, x):  # noqa: ANN001, ANN201
        return torch.sort(x * 2, dim=-1, descending=True)[0].narrow(-1, 0, 4) + 1


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)

    def forward(self, x):  # noqa: ANN001, ANN201
        return self.norm(torch.nn.functional.gelu(self.linear(x)) + x)


def _frozen(module: torch.nn.Module, x: torch.Tensor):
    """The frozen trace, and the graph traced (its values' shapes recorded)."""
    with torch.no_grad():
        trace = torch.jit.trace(module.eval(), x)
        return torch.jit.freeze(trace), trace.inlined_graph


class _Options:
    options: dict = {}


def test_a_graph_static_runtime_computes_otherwise_keeps_the_interpreter() -> None:
    """torch 2.13's Static Runtime sizes ``sort``'s values wrongly for a view of them: checked
    against the trace's outputs, it is refused (the interpreter runs it), where a graph it runs
    right is taken."""
    for module, shape, taken in ((_TopValues(), (2, 12), False), (_Block(), (2, 16), True)):
        frozen, traced = _frozen(module, torch.randn(shape))
        with torch.no_grad():
            checks = [((s,), (frozen(s),)) for s in (torch.randn(shape), torch.randn(shape))]
        call = static_runtime.forward(frozen, checks, (), _Options(), traced)
        assert (call is not None) is taken
        if taken:
            x = torch.randn(shape)
            with torch.no_grad():
                torch.testing.assert_close(call(x), frozen(x), rtol=0, atol=0)


def test_larger_tensors_keep_the_interpreter() -> None:
    """The rule (``MEAN_SIZE``): the same block on 512 rows makes tensors of 8,192 values."""
    for rows, taken in ((2, True), (512, False)):
        frozen, traced = _frozen(_Block(), torch.randn(rows, 16))
        with torch.no_grad():
            x = torch.randn(rows, 16)
            size = static_runtime.mean_size(traced)
            call = static_runtime.forward(frozen, [((x,), (frozen(x),))] * 2, (), _Options(), traced)
        assert (size <= static_runtime.MEAN_SIZE) is taken and (call is not None) is taken


def test_choosing_static_runtime_leaves_torch_dynamo_unimported() -> None:
    """The size rule reads the trace's recorded shapes: counting them at a run under a
    ``TorchDispatchMode`` imported ``torch._dynamo`` (4-8 s of a session's first call). A fresh
    process, since other tests import it."""
    import subprocess
    import sys

    code = f"""
import sys
import numpy as np
from backplane import InferenceSession
from backplane.runtime.runtime import Runtime, RuntimeOptions
from tests.backends.torch.test_static_runtime import _traced
from tests.models.test_corpus import feeds
session = InferenceSession({str(_path("gpt_causal_ts15"))!r}, backends=["CpuAcc", "CpuRef"],
    runtime=Runtime(RuntimeOptions(backend_options={{"CpuAcc.compile": "onednn_graph",
                                                     "CpuAcc.route_cache": False}})))
(work,) = _traced(session, "gpt_causal_ts15")
print(work.static is not None, "torch._dynamo" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=str(CORPUS.parents[2]))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["True", "False"], done.stdout
