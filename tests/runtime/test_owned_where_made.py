"""A run's outputs made the caller's where they are handed over (runtime/fresh_outputs.py,
steps.owning_call, LoadedNetwork.execute_owned): a CpuAcc partition's fresh tensors go to the
caller without ``ownership.owned``'s search of the inputs and constants, through a decided If's
version too; anything else still gets that search, and the outputs stay the caller's alone."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper, numpy_helper

from backplane import InferenceSession
from backplane.runtime import fresh_outputs, ownership
from backplane.runtime import runtime as runtime_module
from tests.backends.test_decided_if import sr_model
from tests.conftest import float_input, make_model

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(3)
W = RNG.standard_normal((8, 6)).astype(np.float32)


def _counted(monkeypatch: pytest.MonkeyPatch, name: str, *modules: object) -> list[int]:
    """Counts each call of ``ownership``'s function ``name``, wherever ``modules`` call it."""
    calls: list[int] = []
    real = getattr(ownership, name)

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return real(*args, **kwargs)

    for module in (ownership, *modules):
        monkeypatch.setattr(module, name, counted)
    return calls


def _searches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts each call of ``ownership.owned`` (the search), wherever the runtime calls it."""
    return _counted(monkeypatch, "owned", runtime_module)


def _partition_model() -> bytes:
    """x [2, 8] -> MatMul -> Relu -> Sigmoid -> Tanh -> Neg: one CpuAcc partition, traced."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]),
             helper.make_node("Relu", ["m"], ["r"]),
             helper.make_node("Sigmoid", ["r"], ["s"]),
             helper.make_node("Tanh", ["s"], ["t"]),
             helper.make_node("Neg", ["t"], ["y"])]
    model = make_model(nodes, [float_input("x", [2, 8])], [float_input("y", [2, 6])],
                       [numpy_helper.from_array(W, "w")])
    return model.SerializeToString()


def test_fresh_tensors_are_handed_over_without_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    session = InferenceSession(_partition_model(), providers=["CpuAcc", "CpuRef"])
    reference = InferenceSession(_partition_model(), providers=["CpuRef"])
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    session.run(None, {"x": x})
    searches = _searches(monkeypatch)
    (y,) = session.run(None, {"x": x})
    assert searches == []  # fails before: every run searched
    np.testing.assert_allclose(y, reference.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    expected = y.copy()
    (again,) = session.run(None, {"x": x})
    assert not np.shares_memory(y, again) and not np.shares_memory(y, x)
    np.testing.assert_array_equal(y, expected)  # not written by the next run


def test_a_decided_ifs_version_hands_its_outputs_over(monkeypatch: pytest.MonkeyPatch) -> None:
    model = sr_model().SerializeToString()
    session = InferenceSession(model, providers=["CpuAcc", "CpuRef"])
    reference = InferenceSession(model, providers=["CpuRef"])
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    for rate in (16000, 8000):
        feeds = {"x": x, "sr": np.array([rate], np.int64)}
        session.run(None, feeds)
        searches = _searches(monkeypatch)
        got = session.run(None, feeds)
        assert searches == []  # fails before
        for value, wanted in zip(got, reference.run(None, feeds)):
            np.testing.assert_allclose(value, wanted, rtol=1e-5, atol=1e-5)
            assert not np.shares_memory(value, x)
        monkeypatch.undo()


def test_only_a_tensor_no_one_else_holds_is_fresh() -> None:
    def first(results: tuple) -> bool:  # as steps.owning_call holds a step's results
        value = results[0]
        return fresh_outputs.fresh(value)

    assert first((torch.ones(3),))
    twice = torch.ones(3)
    assert not first((twice, twice))
    kept = torch.ones(3)  # a workload that keeps what it returns
    assert not first((kept,))
    del kept
    over_input = np.ones(3, np.float32)
    assert not first((torch.from_numpy(over_input),))  # memory of a NumPy array
    base = torch.ones(4)
    assert not first((base[1:],))  # its storage held by another tensor too
    exported = torch.ones(3)
    exported.numpy()
    assert not first((exported,)) and not first((np.ones(3),))


def test_an_output_over_an_input_is_still_copied() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Sigmoid", ["r"], ["y"]),
             helper.make_node("Reshape", ["x", "shape"], ["v"])]
    model = make_model(nodes, [float_input("x", [2, 8])],
                       [float_input("y", [2, 8]), float_input("v", [4, 4])],
                       [numpy_helper.from_array(np.array([4, 4], np.int64), "shape")])
    session = InferenceSession(model.SerializeToString(), providers=["CpuAcc", "CpuRef"])
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    y, v = session.run(None, {"x": x})
    assert not np.shares_memory(v, x) and not np.shares_memory(y, x)
    expected = x.reshape(4, 4).copy()
    np.testing.assert_array_equal(v, expected)
    x[...] = 0.0  # the caller refills its input
    np.testing.assert_array_equal(v, expected)


def _frozen(function, *sample):
    traced = torch.jit.trace(function, sample)
    return traced.graph


def test_a_trace_whose_outputs_are_its_ops_results_is_known_at_its_build() -> None:
    from backplane.backends.torch.fusion.static_sizes import outputs_made

    x = torch.randn(2, 3)
    assert outputs_made(_frozen(lambda a: (torch.sigmoid(a), torch.cat([a, a])), x))
    assert not outputs_made(_frozen(lambda a: (torch.sigmoid(a), a.reshape(3, 2)), x))  # a view
    assert not outputs_made(_frozen(lambda a: (torch.sigmoid(a), a.contiguous()), x))  # itself
    assert not outputs_made(_frozen(lambda a: (torch.relu(a), a.t()), x))

    def into(a, b):
        torch.add(a, 1.0, out=b)  # written into a buffer given (out=): b itself
        return torch.sigmoid(a), b

    assert not outputs_made(_frozen(into, x, torch.empty(2, 3)))


def test_made_results_are_looked_at_by_their_references_only() -> None:
    def first(results: tuple) -> bool:  # as steps.owning_call holds a step's results
        value = results[0]
        return fresh_outputs.made(value)

    alone = first(fresh_outputs.Made((torch.ones(3),)))  # (outside the assert: pytest's
    assert alone  # rewriting keeps what a call in it returns)
    twice = torch.ones(3)
    assert not first(fresh_outputs.Made((twice, twice)))  # the same tensor given twice


def test_the_vads_trace_returns_made_results() -> None:
    """The small tier's VAD: its version's trace returns ``Made`` results (sigmoid, cat), and its
    outputs still reach the caller without the search."""
    from tests.models.test_models import DATA

    session = InferenceSession(str(DATA / "corpus" / "vad_lstm_if_ts16.onnx"),
                               providers=["CpuAcc", "CpuRef"])
    feeds = dict(np.load(DATA / "corpus" / "vad_lstm_if_ts16.s0.npz"))
    session.run(None, feeds)
    loaded = session.runtime.network(session.network_id)
    runners = [runner for step in loaded.steps
               for version in getattr(step.workload, "versions", {}).values()
               for inner in version.steps for runner in getattr(inner.workload, "built", {}).values()]
    values = [torch.from_numpy(feeds[name]) for name in ("x", "state")]
    assert runners and all(type(runner(*values)) is fresh_outputs.Made for runner in runners)


def test_a_detectors_outputs_are_not_copied_when_no_one_else_holds_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The detector's HostChain hands arrays ``owned`` must look at: the step's own names for them
    dropped first, its reference counts find them the run's own (each was copied before)."""
    from pathlib import Path

    corpus = Path(__file__).resolve().parent.parent / "data" / "corpus"
    feeds = dict(np.load(corpus / "detect_nms_ts14.s0.npz"))
    session = InferenceSession(str(corpus / "detect_nms_ts14.onnx"), providers=["CpuAcc", "CpuRef"])
    first = session.run(None, feeds)
    copies = _counted(monkeypatch, "_fresh")
    again = session.run(None, feeds)
    assert copies == []
    reference = InferenceSession(str(corpus / "detect_nms_ts14.onnx"), providers=["CpuRef"])
    for got, before, wanted in zip(again, first, reference.run(None, feeds)):
        np.testing.assert_allclose(got, wanted, rtol=1e-4, atol=1e-4)
        assert not np.shares_memory(got, before)
