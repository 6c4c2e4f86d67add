"""A short small bidirectional LSTM traced by TorchScript on the CPU steps in a few ops, both
directions at once as a batch of products (``recurrent._lstm_steps``), not by oneDNN's LSTM (a
call a direction): CpuRef's values, NaN only where CpuRef has it (its batch row and direction),
both layouts, with and without bias and states; eager, forward-only, longer or wider layers keep
torch's kernel.

    python -m pytest tests/backends/torch/test_recurrent_lstm_steps.py -q -p no:cacheprovider
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from onnx import helper, numpy_helper  # noqa: E402

from backplane.backends.torch.kernels import recurrent  # noqa: E402
from tests.backends.torch.test_recurrent_native import (  # noqa: E402
    ACC,
    DIRECTIONS,
    recurrent_model,
    run,
)

STATES = ("X", "initial_h", "initial_c")


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The directions of each layer ``_lstm_steps`` ran; the general step loop refused."""
    calls: list[str] = []
    inner = recurrent._lstm_steps

    def spy(*args: Any) -> Any:
        calls.append(args[6])
        return inner(*args)

    def general(*args: Any) -> Any:
        raise AssertionError("the LSTM ran by the general step loop")

    monkeypatch.setattr(recurrent, "_lstm_steps", spy)
    monkeypatch.setattr(recurrent, "_run", general)
    return calls


def traced_lstm(model: Any, feeds: dict[str, np.ndarray], threads: int | None = None) -> Any:
    """The one LSTM node of ``model`` as CpuAcc traces it (at ``threads``, where given): its
    weights constants, X and the initial states (where fed) the trace's inputs."""
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy())
               for t in model.graph.initializer}
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    names = [n for n in STATES if n in feeds]

    def layer(*values: Any) -> Any:
        fed = dict(zip(names, values))
        return recurrent.lstm(fed["X"], weights["W"], weights["R"], weights.get("B"),
                              initial_h=fed.get("initial_h"), initial_c=fed.get("initial_c"),
                              **attrs)

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TorchScript's deprecation and tracer warnings
            traced = torch.jit.trace(layer, [torch.from_numpy(feeds[n]) for n in names],
                                     check_trace=False)
    finally:
        torch.set_num_threads(before)

    def call(values: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            return [t.numpy() for t in traced(*(torch.from_numpy(values[n]) for n in names))]

    return call


@pytest.mark.parametrize("layout", [0, 1])
def test_nan_stays_in_its_row_and_direction(layout: int, steps: list[str]) -> None:
    model, feeds = recurrent_model("LSTM", "bidirectional", layout)
    call = traced_lstm(model, feeds)
    assert steps == ["bidirectional"]
    feeds["X"][(1, 2, 0) if layout else (2, 1, 0)] = np.nan  # step 2 of sequence 1
    got, want = call(feeds), run(model, feeds, ["CpuRef"])
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"output {index}'s NaN")
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    y = got[0] if not layout else got[0].transpose(1, 2, 0, 3)  # (seq, dirs, batch, hidden)
    assert np.isnan(y[:, :, 1]).any() and np.isfinite(np.delete(y, 1, axis=2)).all()
    assert np.isfinite(y[:2, 0, 1]).all() and np.isfinite(y[3:, 1, 1]).all()


def test_no_bias_no_initial_state(steps: list[str]) -> None:
    model, feeds = recurrent_model("LSTM", "bidirectional", states=False)
    del model.graph.initializer[2]  # B
    model.graph.node[0].input[3] = ""
    got = traced_lstm(model, feeds)(feeds)
    assert steps == ["bidirectional"]
    for g, w in zip(got, run(model, feeds, ["CpuRef"])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("direction", [d for d in DIRECTIONS if d != "bidirectional"])
def test_one_direction_eager_long_or_wide_keep_torch(direction: str, steps: list[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """One direction (a fused call costs less than the steps' ops there), eager (each op's
    Python call costs more), more steps or wider than ``STEPPED_LSTM``: torch's LSTM."""
    model, feeds = recurrent_model("LSTM", direction)
    traced_lstm(model, feeds)
    model, feeds = recurrent_model("LSTM", "bidirectional")
    for g, w in zip(run(model, feeds, ACC), run(model, feeds, ["CpuRef"])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    for narrower in ((4, 6, 6), (5, 5, 5)):  # the model's 5 steps, hidden 6
        monkeypatch.setattr(recurrent, "STEPPED_LSTM", narrower)
        traced_lstm(model, feeds)
    assert steps == []


@pytest.mark.parametrize(("threads", "stepped"), [(1, True), (2, False)])
def test_wider_at_one_thread(threads: int, stepped: bool, steps: list[str],
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Hidden 80, wider than ``STEPPED_LSTM``'s 32 at any thread count, within its 96 at one
    thread (measured faster stepped there up to 96 at 8 steps): a trace at one thread steps it, at
    two oneDNN's LSTM runs it; CpuRef's values either way."""
    from tests.backends.torch import test_recurrent_native as native

    monkeypatch.setattr(native, "HIDDEN", 80)
    model, feeds = recurrent_model("LSTM", "bidirectional")
    got = traced_lstm(model, feeds, threads)(feeds)
    assert steps == (["bidirectional"] if stepped else [])
    for g, w in zip(got, run(model, feeds, ["CpuRef"])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
