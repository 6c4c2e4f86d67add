"""builtin's stacking of a sequence or a Loop's scan outputs (``sequence.stacked``): one
concatenation viewed with the new axis split off, np.stack's values and errors in every case."""

from __future__ import annotations

import numpy as np
import pytest

from backplane.backends.builtin.sequence import concat_from_sequence, stacked


@pytest.mark.parametrize("shape", [(1, 4), (2, 3, 5), (3,), (0, 2), ()])
@pytest.mark.parametrize("count", [1, 3, 8])
def test_stacked_is_np_stack_on_every_axis(shape, count) -> None:
    rng = np.random.default_rng(count)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(count)]
    if arrays[0].size:
        arrays[-1].reshape(-1)[0] = np.nan  # NaN where it was
    for axis in range(-len(shape) - 1, len(shape) + 1):
        got, want = stacked(arrays, axis), np.stack(arrays, axis=axis)
        assert got.dtype == want.dtype and got.shape == want.shape, axis
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(concat_from_sequence(arrays, axis, new_axis=1)[0], want)


def test_stacked_refuses_what_np_stack_refuses() -> None:
    """Rows of different lengths whose sum happens to fill the stacked shape (2 + 1 + 3 = 3 x 2)
    are an error, as np.stack's, not a concatenation reshaped; nothing to stack is one too."""
    rows = [np.zeros((1, width), np.float32) for width in (2, 1, 3)]
    with pytest.raises(ValueError, match="same shape"):
        stacked(rows, 1)
    with pytest.raises(ValueError):
        stacked([], 0)


def test_stacked_results_are_their_own() -> None:
    """The stack is a new array: writing to it leaves the sequence's arrays as they were."""
    arrays = [np.full((2, 3), k, np.float32) for k in range(4)]
    result = stacked(arrays, 1)
    result[...] = -1
    assert all((a == k).all() for k, a in enumerate(arrays))
