"""A one-step recurrent layer (a streaming model's chunk: the corpus's VAD runs its LSTM one step a
call) on CpuAcc runs torch's cell (``recurrent.STEP_CELLS``: lstm_cell, gru_cell, rnn_*_cell), not
the fused sequence kernel: the values CpuRef and ONNX Runtime give in every direction and layout,
with and without initial states, NaN in, NaN out."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from backplane.backends.torch.kernels import recurrent  # noqa: E402
from tests.backends.torch.test_recurrent_native import (  # noqa: E402
    ACC,
    DIRECTIONS,
    GATES,
    check,
    recurrent_model,
    run,
)


def one_step(op: str, direction: str, layout: int, states: bool, attrs: dict[str, Any]) \
        -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``recurrent_model``'s layer fed the first step of its sequence alone."""
    model, feeds = recurrent_model(op, direction, layout, states, None, attrs)
    feeds["X"] = np.ascontiguousarray(feeds["X"][:, :1] if layout else feeds["X"][:1])
    x = next(i for i in model.graph.input if i.name == "X")
    x.type.tensor_type.shape.dim[layout].dim_value = 1
    return model, feeds


@pytest.fixture
def cells(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How many times each of torch's cells ran (they still run)."""
    calls: Counter = Counter()

    def spy(name: str, cell: Any) -> Any:
        def counted(*args: Any) -> Any:
            calls[name] += 1
            return cell(*args)
        return counted

    monkeypatch.setattr(recurrent, "STEP_CELLS",
                        {name: spy(name, cell) for name, cell in recurrent.STEP_CELLS.items()})
    return calls


def _cases() -> list[Any]:
    ops = [("RNN", {}), ("GRU", {"linear_before_reset": 1}), ("LSTM", {}),
           ("RNN", {"activations": ["Relu"]})]
    return [pytest.param(op, attrs, d, layout, states,
                         id=f"{op}{'-relu' if attrs.get('activations') else ''}-{d}-layout{layout}"
                            f"-{'states' if states else 'zeros'}")
            for op, attrs in ops for d in DIRECTIONS for layout in (0, 1)
            for states in (True, False)]


@pytest.mark.parametrize("op, attrs, direction, layout, states", _cases())
def test_one_step_by_the_cell(op: str, attrs: dict[str, Any], direction: str, layout: int,
                              states: bool, cells: Counter) -> None:
    if attrs.get("activations"):  # one per direction
        attrs = {"activations": attrs["activations"] * (2 if direction == "bidirectional" else 1)}
    model, feeds = one_step(op, direction, layout, states, attrs)
    paths: Counter = Counter({"native": 1})  # check()'s path assertion: the cell is inside _native
    got = check(model, feeds, paths, native=True)
    dirs = 2 if direction == "bidirectional" else 1
    assert sum(cells.values()) == dirs, dict(cells)
    assert not np.shares_memory(got[0], got[1])  # Y is not a view of Y_h


def test_nan_in_nan_out(cells: Counter) -> None:
    model, feeds = one_step("LSTM", "forward", 0, True, {})
    feeds["X"][0, 1, 2] = np.nan  # batch row 1
    got, want = run(model, feeds, ACC), run(model, feeds, ["CpuRef"])
    assert cells["lstm"] == 1
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        assert np.isnan(g[..., 1, :]).all() and not np.isnan(g[..., 0, :]).any()


def test_every_fused_kernel_has_a_cell() -> None:
    assert set(recurrent.STEP_CELLS) == {"lstm", "gru", "rnn_tanh", "rnn_relu"}
    assert set(GATES) == {"RNN", "GRU", "LSTM"}


@pytest.mark.parametrize("name, gates", [("gru", 3), ("rnn_tanh", 1)])
@pytest.mark.parametrize("dirs", [1, 2])
def test_a_traced_cell_on_a_constant_state(name: str, gates: int, dirs: int) -> None:
    """A one-step layer traced and frozen whose initial state the freeze folds (absent in the
    model: zeros): TorchScript's optimized graph of ``gru_cell`` updated the state's folded
    product in place, and from the second call on the cell computed from other values (so the
    trace's check sent the partition layer by layer)."""
    import torch

    from backplane.backends.torch.kernels import recurrent_fused

    rng = torch.Generator().manual_seed(3)
    hidden, width = 20, 12
    params = []
    for _ in range(dirs):
        params += [torch.randn(gates * hidden, width, generator=rng) * 0.3,
                   torch.randn(gates * hidden, hidden, generator=rng) * 0.3,
                   torch.randn(gates * hidden, generator=rng) * 0.3,
                   torch.randn(gates * hidden, generator=rng) * 0.3]
    cell = recurrent.STEP_CELLS[name]

    def step(x: Any) -> Any:
        zeros = torch.zeros(dirs, 1, hidden)  # a constant of the trace
        y, (h,) = recurrent_fused.one_step(cell, x, params, True, [zeros], 0)
        return y, h

    x = torch.randn(1, 1, width, generator=rng)
    with torch.no_grad():
        frozen = torch.jit.freeze(_traced(step, x))
        want = step(x)
        for _ in range(4):
            got = frozen(x)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def _traced(function: Any, x: Any) -> Any:
    import torch

    class Step(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return function(x)

    return torch.jit.trace(Step().eval(), [x])
