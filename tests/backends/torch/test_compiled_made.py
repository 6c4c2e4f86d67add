"""A compiled OneDnnGraph's results handed over as ``fresh_outputs.Made`` (fusion/compiled.py's
``compiled_run``) where its frozen graph's every output is an op's own result: the direct run
then reads their references only, and the outputs stay the caller's alone (a returned array
written by the caller changes nothing of a later run's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession, SessionOptions
from backplane.runtime import fresh_outputs

torch = pytest.importorskip("torch")
CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
MODEL = CORPUS / "resnet_basic_ts16.onnx"  # its outputs: an average pool's and a linear's


def _session() -> InferenceSession:
    return InferenceSession(str(MODEL), SessionOptions(intra_op_num_threads=1),
                            providers=[("CpuAcc", {"background": False,
                                                   "compile": "onednn_graph"}), "CpuRef"])


def test_a_compiled_partitions_outputs_skip_the_fresh_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []
    real = fresh_outputs.fresh

    def counted(value: object) -> bool:
        checked.append(1)
        return real(value)

    monkeypatch.setattr(fresh_outputs, "fresh", counted)  # before the load: its direct run's
    session = _session()
    feeds = dict(np.load(CORPUS / "resnet_basic_ts16.s0.npz"))
    session.run(None, feeds)
    session.run(None, feeds)
    checked.clear()
    session.run(None, feeds)
    assert checked == []  # fails before: compiled_run gave a plain tuple, each output checked


def test_a_compiled_partitions_outputs_stay_the_callers() -> None:
    session = _session()
    reference = InferenceSession(str(MODEL), providers=["CpuRef"])
    feeds = dict(np.load(CORPUS / "resnet_basic_ts16.s0.npz"))
    x = {name: value.copy() for name, value in feeds.items()}
    expected = reference.run(None, feeds)
    first = session.run(None, x)
    for got, wanted in zip(first, expected):
        np.testing.assert_allclose(got, wanted, rtol=1e-4, atol=1e-4)
    for got in first:
        got[...] = 7.0  # the caller's to write
    again = session.run(None, x)
    for got, wanted, before in zip(again, expected, first):
        np.testing.assert_allclose(got, wanted, rtol=1e-4, atol=1e-4)
        assert not np.shares_memory(got, before)
        assert not any(np.shares_memory(got, v) for v in x.values())
        assert (before == 7.0).all()  # not written by the later run
    for name, value in x.items():
        np.testing.assert_array_equal(value, feeds[name])  # the inputs untouched


def test_nan_in_gives_nan_out() -> None:
    session = _session()
    feeds = dict(np.load(CORPUS / "resnet_basic_ts16.s0.npz"))
    session.run(None, feeds)
    nan = {name: np.full_like(value, np.nan) for name, value in feeds.items()}
    for got in session.run(None, nan):
        assert np.isnan(got).all()
