"""A one-step LSTM traced with constant weights (the corpus VAD's, in its Traced partition) runs
``recurrent_fused.lstm_step``: one product of ``[x, h]`` by weights packed once outside the trace
(no transpose, bias sum or gate split of them at each run), the gates' activations in place, the
values CpuRef computes in every direction and layout, with and without B, NaN in, NaN out; the
weights given to the trace as inputs keep torch's cell."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.kernels import rnn as reference  # noqa: E402
from backplane.backends.torch.kernels import recurrent  # noqa: E402

BATCH, WIDTH, HIDDEN = 3, 5, 4
RNG = np.random.default_rng(2)


def _weights(dirs: int, bias: bool) -> list[np.ndarray | None]:
    def draw(*shape: int) -> np.ndarray:
        return (RNG.standard_normal(shape) * 0.4).astype(np.float32)
    return [draw(dirs, 4 * HIDDEN, WIDTH), draw(dirs, 4 * HIDDEN, HIDDEN),
            draw(dirs, 8 * HIDDEN) if bias else None]


def _inputs(dirs: int, layout: int) -> list[np.ndarray]:
    x_shape = (BATCH, 1, WIDTH) if layout else (1, BATCH, WIDTH)
    s_shape = (BATCH, dirs, HIDDEN) if layout else (dirs, BATCH, HIDDEN)
    return [RNG.standard_normal(shape).astype(np.float32) for shape in (x_shape, s_shape, s_shape)]


def _counts(graph) -> Counter:
    return Counter(node.kind() for node in graph.nodes())


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("bias", [True, False])
def test_a_traced_step_is_one_product_a_direction(direction: str, layout: int, bias: bool) -> None:
    dirs = 2 if direction == "bidirectional" else 1
    W, R, B = _weights(dirs, bias)
    weights = [torch.from_numpy(w) if w is not None else None for w in (W, R, B)]

    def layer(x, h, c):
        return recurrent.lstm(x, *weights, None, h, c, direction=direction, layout=layout)

    traced = torch.jit.trace(layer, tuple(map(torch.from_numpy, _inputs(dirs, layout))))
    counts = _counts(traced.graph)
    assert counts["aten::addmm" if bias else "aten::mm"] == dirs
    assert not counts["aten::linear"] and not counts["aten::unsafe_chunk"] and not counts["aten::t"]
    # the gates' activations in place, in the product's buffer, split once (no narrow a gate)
    assert counts["aten::sigmoid_"] == counts["aten::tanh_"] == dirs
    assert not counts["aten::narrow"] and not counts["aten::sigmoid"]
    x, h, c = _inputs(dirs, layout)  # not the values it was traced with
    x[(1, 0, 2) if layout else (0, 1, 2)] = np.nan  # batch row 1: NaN in every output
    got = [t.numpy() for t in traced(*map(torch.from_numpy, (x, h, c)))]
    want = reference.lstm(x, W, R, B, None, h, c, direction=direction, layout=layout)
    for g, w in zip(got, want):
        assert np.array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    y_h = got[1]  # (dirs, batch, hidden), or batch first
    row = y_h[1] if layout else y_h[:, 1]
    assert np.isnan(row).all() and np.isnan(y_h).sum() == row.size


def test_weights_given_to_the_trace_keep_torch_s_cell() -> None:
    W, R, B = (torch.from_numpy(w) for w in _weights(1, True))
    x, h, c = map(torch.from_numpy, _inputs(1, 0))
    traced = torch.jit.trace(lambda x, h, c, w: recurrent.lstm(x, w, R, B, None, h, c),
                             (x, h, c, W))
    assert not _counts(traced.graph)["aten::cat"]  # no stacked weight: computed from W each run
    other = W * 0.5
    want = recurrent.lstm(x, other, R, B, None, h, c)
    for g, w in zip(traced(x, h, c, other), want):
        torch.testing.assert_close(g, w)
