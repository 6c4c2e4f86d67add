"""CpuAcc's Slice is one view per axis it narrows, none for an axis it takes whole: traced (a
Traced layer, a OneDnnGraph's trace), indexing by a tuple of slices was an ``aten::slice`` of every
axis, each an op of TorchScript's interpreter at every run (a YOLO's channel split: 4 where 1 does
the work). The values are NumPy's slicing's, negative steps and empty results included."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch.kernels.shape import slice_  # noqa: E402

I64_MAX = 2**63 - 1


def _view_ops(function, x) -> list[str]:
    trace = torch.jit.trace(function, (x,), check_trace=False)
    return [n.kind() for n in trace.graph.nodes()
            if n.kind() in ("aten::slice", "aten::narrow", "aten::select", "aten::flip")]


def test_a_channel_split_is_one_op_traced() -> None:
    x = torch.randn(1, 48, 8, 8).contiguous(memory_format=torch.channels_last)
    ops = _view_ops(lambda t: slice_(t, [16], [32], [1])[0], x)
    assert ops == ["aten::narrow"]
    ops = _view_ops(lambda t: slice_(t, [0, 2], [I64_MAX, 6], [0, -1], [1, 2])[0], x)
    assert ops == ["aten::slice"]  # the whole batch axis: no op; a step: one slice


def test_a_slice_of_whole_axes_is_its_input() -> None:
    x = torch.randn(2, 3, 4)
    assert slice_(x, [0, -10], [I64_MAX, 4], [0, 2])[0] is x
    assert _view_ops(lambda t: slice_(t, [0], [3], [1])[0], x) == []


@pytest.mark.parametrize("starts, ends, axes, steps", [
    ([1], [4], [1], [1]), ([-1], [-I64_MAX], [2], [-1]), ([0, 3], [I64_MAX, 0], [0, 1], [1, -2]),
    ([5], [2], [2], [1]), ([0], [I64_MAX], [-1], [3]), ([-20, 1], [I64_MAX, -1], [0, -1], [1, 1])])
def test_values_are_numpys(starts, ends, axes, steps) -> None:
    data = np.arange(2 * 5 * 6, dtype=np.float32).reshape(2, 5, 6)
    data[0, 1, 2] = np.nan
    index = [slice(None)] * 3
    for start, end, axis, step in zip(starts, ends, axes, steps):
        index[axis] = slice(start, end, step)
    (got,) = slice_(torch.from_numpy(data), starts, ends, axes, steps)
    want = data[tuple(index)]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want)
