"""An LSTM run by ``recurrent_parallel``'s kernel (the large bidirectional layers, in a trace one
``backplane::recurrent_directions`` op) reorders its weights for oneDNN once, not at every call
(``recurrent_packed.py``): the values of torch's LSTM under no_grad bit for bit (both
directions, batch first, without bias), NaN where it has it, again after a weight changes.

    python -m pytest tests/backends/torch/test_recurrent_packed.py -q -p no:cacheprovider
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.backends.mkldnn.is_available():
    pytest.skip("torch without oneDNN", allow_module_level=True)

from backplane.backends.torch.kernels import recurrent_packed, recurrent_parallel  # noqa: E402

HIDDEN, WIDTH, STEPS = 16, 12, 9


@pytest.fixture
def reorders(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The direction (reverse or not) of each weight reorder made."""
    made: list[bool] = []
    inner = torch.ops.mkldnn._reorder_mkldnn_rnn_layer_weight

    def spy(*args: Any) -> Any:
        made.append(args[3])
        return inner(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_mkldnn_rnn_layer_weight", spy)
    return made


def _layer(bidirectional: bool, has_bias: bool, batch_first: bool) -> tuple[Any, ...]:
    """torch's weight list, an input and its states."""
    generator = torch.Generator().manual_seed(0)
    dirs = 2 if bidirectional else 1

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.4

    params = []
    for _ in range(dirs):
        params += [values(4 * HIDDEN, WIDTH), values(4 * HIDDEN, HIDDEN)]
        params += [values(4 * HIDDEN), values(4 * HIDDEN)] if has_bias else []
    x = values(*((1, STEPS, WIDTH) if batch_first else (STEPS, 1, WIDTH)))
    return params, x, [values(dirs, 1, HIDDEN), values(dirs, 1, HIDDEN)]


def _torch(x: Any, hx: Any, params: Any, has_bias: bool, bidirectional: bool,
           batch_first: bool) -> list[Any]:
    with torch.no_grad():  # oneDNN's inference primitive, as the packed calls run
        return list(torch.lstm(x, hx, params, has_bias, 1, 0.0, False, bidirectional,
                               batch_first))


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("batch_first", [False, True])
def test_torchs_values_weights_reordered_once(bidirectional: bool, has_bias: bool,
                                              batch_first: bool, reorders: list[bool]) -> None:
    params, x, hx = _layer(bidirectional, has_bias, batch_first)
    kernel = recurrent_parallel._kernel("lstm")
    want = _torch(x, hx, params, has_bias, bidirectional, batch_first)
    for _ in range(3):
        got = kernel(x, hx, params, has_bias, bidirectional, batch_first)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert reorders == ([False, True] if bidirectional else [False])


def test_nan_where_torch_has_it_and_a_changed_weight(reorders: list[bool]) -> None:
    """A NaN of the input stays where torch's LSTM puts it; a weight written in place is
    reordered again (its version counter), and its values are the new weight's."""
    params, x, hx = _layer(True, True, False)
    kernel = recurrent_parallel._kernel("lstm")
    x[4, 0, 3] = float("nan")
    for g, w in zip(kernel(x, hx, params, True, True, False),
                    _torch(x, hx, params, True, True, False), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(kernel(x, hx, params, True, True, False)[0]).any()
    with torch.no_grad():
        params[1].mul_(0.5)
    got = kernel(x, hx, params, True, True, False)
    assert reorders == [False, True, False]
    for g, w in zip(got, _torch(x, hx, params, True, True, False), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_not_where_a_gradient_is_wanted_or_not_float32() -> None:
    params, x, _ = _layer(False, True, False)
    assert recurrent_packed.packable("lstm", x, params)
    assert not recurrent_packed.packable("gru", x, params)
    assert not recurrent_packed.packable("lstm", x.double(), params)
    assert not recurrent_packed.packable("lstm", x.requires_grad_(), params)
