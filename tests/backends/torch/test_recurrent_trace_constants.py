"""A recurrent layer's gate reorder is computed once where its weights are constants of a trace
(recurrent_fused.trace_constants): a frozen graph did not fold it, and the VAD's traced partition
reordered its LSTM's W, R and biases at every run (to, index and flatten each)."""

from __future__ import annotations

import collections
import warnings

import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch.fusion import onednn_graph  # noqa: E402
from backplane.backends.torch.kernels import recurrent  # noqa: E402

HIDDEN, INPUT = 16, 24


def _weights(seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=generator) for shape in
                 ((1, 4 * HIDDEN, INPUT), (1, 4 * HIDDEN, HIDDEN), (1, 8 * HIDDEN)))


def _frozen(function, inputs):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings
        return onednn_graph._freeze(onednn_graph._trace(function, inputs, fusion=False),
                                    fusion=False)


def _kinds(module) -> collections.Counter:
    return collections.Counter(node.kind() for node in module.graph.nodes())


@pytest.mark.parametrize("steps", [1, 5])
def test_constant_weights_are_reordered_once_outside_the_trace(steps) -> None:
    W, R, B = _weights(0)
    x, h, c = torch.randn(steps, 1, INPUT), torch.randn(1, 1, HIDDEN), torch.randn(1, 1, HIDDEN)

    def step(x, h, c):
        return recurrent.lstm(x, W, R, B, None, h, c)

    module = _frozen(step, [x, h, c])
    assert _kinds(module)["aten::index"] == 0  # 4 before: W, R and the two biases
    with torch.no_grad():
        for got, want in zip(module(x, h, c), step(x, h, c)):
            # one step traced is recurrent_fused.lstm_step's single product, eager torch's cell
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        nan = x.clone()
        nan[0, 0, 3] = float("nan")
        assert all(torch.isnan(out).any() for out in module(nan, h, c))  # NaN in, NaN out


def test_weights_given_to_the_trace_are_still_reordered_in_it() -> None:
    """Weights that are inputs of the trace may change between calls: not constants."""
    x, h, c = torch.randn(1, 1, INPUT), torch.randn(1, 1, HIDDEN), torch.randn(1, 1, HIDDEN)

    def step(x, h, c, W, R, B):
        return recurrent.lstm(x, W, R, B, None, h, c)

    module = _frozen(step, [x, h, c, *_weights(0)])
    other = _weights(1)
    with torch.no_grad():
        for got, want in zip(module(x, h, c, *other), step(x, h, c, *other)):
            assert torch.allclose(got, want, atol=1e-6)
