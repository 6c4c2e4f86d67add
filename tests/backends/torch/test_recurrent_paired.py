"""A small bidirectional RNN or GRU on CpuAcc runs both directions as one direction of twice the
width (``recurrent_fused.paired``: one call of torch's fused kernel on block-diagonal weights instead
of two), equal to ONNX Runtime and CpuRef; where the input, an initial state or a weight is not
finite it runs the two directions apart, so that NaN stays in its direction (a zero of the block
times NaN is NaN), in a trace too. LSTM (oneDNN's) is not paired: it was no faster.

    python -m pytest tests/backends/torch/test_recurrent_paired.py -q -p no:cacheprovider
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from backplane.backends.torch.kernels import recurrent, recurrent_fused  # noqa: E402
from tests.backends.torch.test_recurrent_native import (  # noqa: E402
    ACC,
    GATES,
    onnxruntime,
    recurrent_model,
    run,
)

ATTRS = {"RNN": {}, "GRU": {"linear_before_reset": 1}, "LSTM": {}}
KERNEL = {"RNN": recurrent.rnn, "GRU": recurrent.gru, "LSTM": recurrent.lstm}
PAIRED = ["RNN", "GRU"]


@pytest.fixture
def pairs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fused kernels that ran paired (``recurrent_fused.paired``'s calls)."""
    calls: list[str] = []
    paired = recurrent_fused.paired

    def spy(name: str, *args: Any) -> Any:
        calls.append(name)
        return paired(name, *args)

    monkeypatch.setattr(recurrent_fused, "paired", spy)
    return calls


def _nan_masks_equal(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for index, (g, w) in enumerate(zip(got, want)):
        assert np.isnan(w).any(), f"output {index}: CpuRef has no NaN (a wrong case)"
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"output {index}'s NaN")
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("op", PAIRED)
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("states", [True, False], ids=["states", "zeros"])
def test_paired_against_onnxruntime_and_cpuref(op: str, layout: int, states: bool,
                                               pairs: list[str]) -> None:
    model, feeds = recurrent_model(op, "bidirectional", layout, states, attrs=ATTRS[op])
    got = run(model, feeds, ACC)
    assert pairs, "the bidirectional layer did not run paired"
    for g, o, r in zip(got, onnxruntime(model, feeds), run(model, feeds, ["CpuRef"])):
        np.testing.assert_allclose(g, o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", PAIRED)
def test_nan_in_the_input_stays_in_its_direction(op: str, pairs: list[str]) -> None:
    model, feeds = recurrent_model(op, "bidirectional", attrs=ATTRS[op])
    feeds["X"][1, 0, 2] = np.nan  # step 1 of sequence 0
    got = run(model, feeds, ACC)
    assert pairs, "the bidirectional layer did not reach the paired kernel"
    _nan_masks_equal(got, run(model, feeds, ["CpuRef"]))
    y = got[0]  # (seq, dirs, batch, hidden): forward before step 1 and backward after it finite
    assert np.isfinite(y[:1, 0, 0]).all() and np.isfinite(y[2:, 1, 0]).all()


@pytest.mark.parametrize("value", [np.inf, np.nan])
def test_a_state_not_finite_stays_in_its_direction(value: float, pairs: list[str]) -> None:
    model, feeds = recurrent_model("GRU", "bidirectional", attrs=ATTRS["GRU"])
    feeds["initial_h"][1, 2, 0] = value  # the backward direction of sequence 2
    got = run(model, feeds, ACC)
    want = run(model, feeds, ["CpuRef"])
    assert pairs
    np.testing.assert_allclose(got[0][:, 0], want[0][:, 0], rtol=1e-5, atol=1e-5)  # forward
    np.testing.assert_array_equal(np.isnan(got[0]), np.isnan(want[0]))


@pytest.mark.parametrize("op", PAIRED)
def test_a_weight_not_finite_stays_in_its_direction(op: str, pairs: list[str]) -> None:
    """A NaN in the forward direction's R: the backward outputs stay finite, as CpuRef's."""
    X, W, R, B = _layer(op, hidden=8)
    R[0, 3, 1] = float("nan")
    got = KERNEL[op](X, W, R, B, direction="bidirectional", **ATTRS[op])
    assert pairs
    want = _unpaired(lambda: KERNEL[op](X, W, R, B, direction="bidirectional", **ATTRS[op]))
    for g, w in zip(got, want):
        assert torch.equal(torch.isnan(g), torch.isnan(w))
    assert torch.isnan(got[0][:, 0]).any() and torch.isfinite(got[0][:, 1]).all()


@pytest.mark.parametrize("op, hidden, paired", [("GRU", 64, True), ("GRU", 72, False),
                                                ("RNN", 64, True), ("RNN", 72, False),
                                                ("LSTM", 8, False)])
def test_pairing_by_width(op: str, hidden: int, paired: bool, pairs: list[str]) -> None:
    """Paired up to ``PAIRED_HIDDEN`` (the measured crossover), two directions above and LSTM's
    at any width; equal either way."""
    X, W, R, B = _layer(op, hidden)
    got = KERNEL[op](X, W, R, B, direction="bidirectional", **ATTRS[op])
    assert bool(pairs) == paired
    apart = _unpaired(lambda: KERNEL[op](X, W, R, B, direction="bidirectional", **ATTRS[op]))
    for g, w in zip(got, apart):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_trace_keeps_the_check() -> None:
    """Traced and frozen on a finite input (as CpuAcc's Traced layers are), a NaN at run time
    still runs the directions apart."""
    X, W, R, B = _layer("GRU", hidden=8)

    class Layer(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return recurrent.gru(x, W, R, B, direction="bidirectional", linear_before_reset=1)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation and tracer warnings
        traced = torch.jit.freeze(torch.jit.trace(Layer().eval(), (X,)))
    torch.testing.assert_close(traced(X), Layer()(X))
    X[2, 0, 1] = float("nan")  # off the middle step: paired, it would meet step 6 backward
    got = traced(X)
    want = _unpaired(lambda: Layer()(X))
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.isfinite(got[:2, 0]).all() and torch.isfinite(got[3:, 1]).all()


def test_no_host_read_before_a_trace(pairs: list[str]) -> None:
    """CpuAcc's Traced layers run the layers once under ``HostReads`` before tracing them: the
    paired kernel's NaN check must not read there (else gru_bi2_dyn19's partition runs layer by
    layer: "could not be traced")."""
    from backplane.backends.torch.fusion.traced import HostReads

    X, W, R, B = _layer("GRU", hidden=8)
    with HostReads([X]) as reads:
        recurrent.gru(X, W, R, B, direction="bidirectional", linear_before_reset=1)
    assert pairs and reads.found == []


def _layer(op: str, hidden: int, seq: int = 9, width: int = 5) -> list[Any]:
    gates = GATES[op] * hidden
    generator = torch.Generator().manual_seed(hidden)
    shapes = [(seq, 1, width), (2, gates, width), (2, gates, hidden), (2, 2 * gates)]
    return [torch.randn(s, generator=generator) * 0.4 for s in shapes]


def _unpaired(call: Any) -> Any:
    """``call()`` with pairing off (``PAIRED_HIDDEN`` emptied), put back after."""
    kept = dict(recurrent_fused.PAIRED_HIDDEN)
    recurrent_fused.PAIRED_HIDDEN.clear()
    try:
        return call()
    finally:
        recurrent_fused.PAIRED_HIDDEN.update(kept)
