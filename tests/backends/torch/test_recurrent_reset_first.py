"""A GRU with linear_before_reset=0 (ONNX's default; torch's kernel computes 1 only) and the
default activations runs its steps in a few ops, every direction at once as a batch of products
(``recurrent._reset_first``), not by the general step loop: CpuRef's values, NaN only where
CpuRef has it (in its batch row and direction), float64, in a trace. So does a GRU with
linear_before_reset=1 where TorchScript traces it on the CPU (torch's GRU elsewhere).

    python -m pytest tests/backends/torch/test_recurrent_reset_first.py -q -p no:cacheprovider
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from backplane.backends.torch.kernels import recurrent  # noqa: E402
from tests.backends.torch.test_recurrent_native import (  # noqa: E402
    ACC,
    DIRECTIONS,
    recurrent_model,
    run,
)


@pytest.fixture
def reset_first(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The directions of each layer ``_reset_first`` ran; the general step loop refused."""
    calls: list[str] = []
    inner = recurrent._reset_first

    def spy(*args: Any) -> Any:
        calls.append(args[5])
        return inner(*args)

    def steps(*args: Any) -> Any:
        raise AssertionError("the GRU ran by the general step loop")

    monkeypatch.setattr(recurrent, "_reset_first", spy)
    monkeypatch.setattr(recurrent, "_run", steps)
    return calls


@pytest.mark.parametrize("direction", DIRECTIONS)
def test_nan_stays_in_its_row_and_direction(direction: str, reset_first: list[str]) -> None:
    model, feeds = recurrent_model("GRU", direction)
    feeds["X"][2, 1, 0] = np.nan  # step 2 of sequence 1
    got, want = run(model, feeds, ACC), run(model, feeds, ["CpuRef"])
    assert reset_first == [direction]
    for index, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"output {index}'s NaN")
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    y = got[0]  # (seq, dirs, batch, hidden): the other sequences finite
    assert np.isnan(y[:, :, 1]).any() and np.isfinite(np.delete(y, 1, axis=2)).all()
    if direction == "bidirectional":  # forward before step 2 and backward after it finite
        assert np.isfinite(y[:2, 0, 1]).all() and np.isfinite(y[3:, 1, 1]).all()


def test_float64_against_cpuref(reset_first: list[str]) -> None:
    model, feeds = recurrent_model("GRU", "bidirectional", layout=1, dtype=np.float64)
    got = run(model, feeds, ACC)
    assert reset_first == ["bidirectional"]
    for g, w in zip(got, run(model, feeds, ["CpuRef"])):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_no_bias_no_initial_state(reset_first: list[str]) -> None:
    model, feeds = recurrent_model("GRU", "reverse", states=False)
    del model.graph.initializer[2]  # B
    model.graph.node[0].input[3] = ""
    got = run(model, feeds, ACC)
    assert reset_first == ["reverse"]
    for g, w in zip(got, run(model, feeds, ["CpuRef"])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tracer", ["jit.trace", "make_fx"])
def test_traced(tracer: str) -> None:
    """Traced (CpuAcc's Traced layers, GpuAcc's captures), with W an input of the trace."""
    from torch.fx.experimental.proxy_tensor import make_fx

    rng = np.random.default_rng(3)
    X, W, R, B = (torch.from_numpy(rng.standard_normal(s).astype(np.float32) * 0.5) for s in
                  ((5, 3, 4), (2, 18, 4), (2, 18, 6), (2, 36)))

    def layer(x: Any, w: Any, r: Any, b: Any) -> Any:
        return recurrent.gru(x, w, r, b, direction="bidirectional")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation and tracer warnings
        traced = torch.jit.trace(layer, (X, W, R, B)) if tracer == "jit.trace" else \
            make_fx(layer, tracing_mode="real")(X, W, R, B)
    other = W * -1.5
    for t, e in zip(traced(X, other, R, B), layer(X, other, R, B)):
        torch.testing.assert_close(t, e, rtol=0, atol=0)


# -- linear_before_reset=1 in a trace --------------------------------------------------------------
def _traced_gru(model: Any, feeds: dict[str, np.ndarray], threads: int = 1) -> Any:
    """The one GRU node of ``model`` (linear_before_reset=1) as CpuAcc traces it at ``threads``:
    its weights constants, X and initial_h the trace's inputs; the traced function."""
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy())
               for t in model.graph.initializer}
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}

    def layer(x: Any, h: Any) -> Any:
        return recurrent.gru(x, weights["W"], weights["R"], weights.get("B"), initial_h=h,
                             **attrs)

    sample = [torch.from_numpy(feeds[n]) for n in ("X", "initial_h")]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # TorchScript's deprecation and tracer warnings
            return torch.jit.trace(layer, sample, check_trace=False)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("layout", [0, 1])
def test_linear_before_reset_traced(direction: str, layout: int, reset_first: list[str]) -> None:
    """A TorchScript trace of a GRU with linear_before_reset=1 steps in ``_reset_first``'s ops:
    CpuRef's values, and a NaN of the input in its row and direction only."""
    model, feeds = recurrent_model("GRU", direction, layout, attrs={"linear_before_reset": 1})
    traced = _traced_gru(model, feeds)
    assert reset_first == [direction]
    feeds["X"][(1, 2, 0) if layout else (2, 1, 0)] = np.nan  # step 2 of sequence 1
    with torch.no_grad():
        got = [t.numpy() for t in traced(*(torch.from_numpy(feeds[n]) for n in ("X", "initial_h")))]
    for index, (g, w) in enumerate(zip(got, run(model, feeds, ["CpuRef"]))):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"output {index}'s NaN")
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_linear_before_reset_eager_and_wide_keep_torch(reset_first: list[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager, a GRU with linear_before_reset=1 is torch's (each op's Python call would cost more
    than its loop); so is, in a trace, one of two directions at two threads (a parallel region a
    product) and one wider than STEPPED_GRU_HIDDEN."""
    model, feeds = recurrent_model("GRU", "bidirectional", attrs={"linear_before_reset": 1})
    for g, w in zip(run(model, feeds, ACC), run(model, feeds, ["CpuRef"])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    _traced_gru(model, feeds, threads=2)
    assert reset_first == []
    _traced_gru(*recurrent_model("GRU", "forward", attrs={"linear_before_reset": 1}), threads=2)
    assert reset_first == ["forward"]
    monkeypatch.setattr(recurrent, "STEPPED_GRU_HIDDEN", {1: 5, 2: 5})  # the model's hidden is 6
    _traced_gru(model, feeds)
    assert reset_first == ["forward"]


@pytest.mark.parametrize(("direction", "hidden", "threads", "stepped"), [
    ("bidirectional", 300, 1, True), ("forward", 300, 1, True), ("forward", 400, 1, False),
    ("forward", 300, 2, False)])
def test_linear_before_reset_traced_wide(direction: str, hidden: int, threads: int,
                                         stepped: bool, reset_first: list[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Hidden 300 (wider than the 128 / 256 of before, measured faster stepped up to 384 with
    five ops a step, at one thread): a trace at one thread steps it in ``_reset_first``'s ops;
    one of 400, or a forward one wider than 128 at two threads, is left to torch's GRU; CpuRef's
    values either way."""
    from tests.backends.torch import test_recurrent_native as native

    monkeypatch.setattr(native, "HIDDEN", hidden)
    model, feeds = recurrent_model("GRU", direction, attrs={"linear_before_reset": 1})
    traced = _traced_gru(model, feeds, threads)
    assert reset_first == ([direction] if stepped else [])
    with torch.no_grad():
        got = [t.numpy() for t in traced(*(torch.from_numpy(feeds[n]) for n in ("X", "initial_h")))]
    # float32 sums of 364-464 terms in another order than CpuRef's: up to 4e-5 apart at these
    # widths, torch's GRU as well as the steps
    for g, w in zip(got, run(model, feeds, ["CpuRef"])):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
