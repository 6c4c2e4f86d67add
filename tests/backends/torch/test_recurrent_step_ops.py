"""The stepped recurrent layers' ops a step, in a frozen TorchScript trace as CpuAcc runs them: a
small layer's run is mostly the cost of its ops (a view costs about what an elementwise op does
on these sizes), so each step is kept to its products and activations: an LSTM
(``recurrent._lstm_steps``) 7 ops a step for both directions, a GRU (``recurrent._reset_first``)
6, or 5 with linear_before_reset=1 (its z, r and h recurrent products one product), its views made
once before the loop; around the steps, a bidirectional layer's second direction reversed in time
by one flip and one where, the input projection one linear. The values are the other recurrent
tests' (test_recurrent_lstm_steps.py, test_recurrent_reset_first.py: CpuRef's, NaN where CpuRef
has it).

    python -m pytest tests/backends/torch/test_recurrent_step_ops.py -q -p no:cacheprovider
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch.kernels import recurrent  # noqa: E402


@pytest.fixture
def one_thread() -> Any:
    """One thread, as a bidirectional GRU with linear_before_reset=1 steps only there
    (``recurrent._stepped_reset``); the count put back after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _ops(op: str, steps: int, direction: str, linear_before_reset: int = 1) -> int:
    """The aten ops of one layer (input 12, hidden 20, batch 1), traced and frozen."""
    return len(_kinds(op, steps, direction, linear_before_reset))


def _kinds(op: str, steps: int, direction: str, linear_before_reset: int = 1) -> list[str]:
    """The aten ops of ``_ops``'s layer by kind."""
    dirs, gates, hidden = 2 if direction == "bidirectional" else 1, 4 if op == "LSTM" else 3, 20
    generator = torch.Generator().manual_seed(0)
    w, r = (torch.randn(dirs, gates * hidden, n, generator=generator) for n in (12, hidden))
    b = torch.randn(dirs, 2 * gates * hidden, generator=generator)

    class Layer(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            if op == "LSTM":
                return recurrent.lstm(x, w, r, b, direction=direction, hidden_size=hidden)
            return recurrent.gru(x, w, r, b, direction=direction, hidden_size=hidden,
                                 linear_before_reset=linear_before_reset)

    x = torch.randn(steps, 1, 12, generator=generator)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's warnings
        frozen = torch.jit.freeze(torch.jit.trace(Layer().eval(), [x], check_trace=False))
    return [node.kind() for node in frozen.graph.nodes() if node.kind().startswith("aten::")]


@pytest.mark.parametrize(("op", "direction", "linear_before_reset", "most"), [
    ("LSTM", "bidirectional", 1, 7),
    ("GRU", "bidirectional", 1, 5),
    ("GRU", "forward", 1, 5),
    ("GRU", "bidirectional", 0, 6),
])
def test_ops_a_step(op: str, direction: str, linear_before_reset: int, most: int,
                    one_thread: None) -> None:
    a_step = (_ops(op, 6, direction, linear_before_reset)
              - _ops(op, 2, direction, linear_before_reset)) / 4
    assert 0 < a_step <= most, f"{op} {direction}: {a_step} ops a step"


@pytest.mark.parametrize(("op", "linear_before_reset"), [("LSTM", 1), ("GRU", 1), ("GRU", 0)])
def test_backward_direction_around_the_steps(op: str, linear_before_reset: int,
                                             one_thread: None) -> None:
    """A bidirectional layer's second direction reversed in time before and after the steps by
    one flip and one where each (not a select of each direction, a flip and a stack), and every
    step's input projection with its bias by one linear (not a matmul and an add)."""
    kinds = _kinds(op, 4, "bidirectional", linear_before_reset)
    assert kinds.count("aten::flip") == 2 and kinds.count("aten::where") == 2, kinds
    assert kinds.count("aten::stack") == 1 and "aten::select" not in kinds, kinds
    assert kinds.count("aten::linear") == 1 and "aten::matmul" not in kinds, kinds
