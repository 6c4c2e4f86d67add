"""CpuAcc packs weights (oneDNN's reorders) at one thread: on a busy 2-core machine each reorder
of the demo model's 52 convolution weights waited at a two-thread barrier for a preempted
partner (0.71 s of a 1.3 s load at load average 8)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch import prepacked  # noqa: E402


def test_a_weight_is_packed_at_one_thread_and_the_count_put_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = []
        weight = torch.randn(16, 8, 3, 3)
        packed = prepacked.packed("conv", lambda: seen.append(torch.get_num_threads()) or
                                  torch.ops.mkldnn._reorder_convolution_weight(
                                      weight, [1, 1], [1, 1], [1, 1], 1))
        assert seen == [1] and torch.get_num_threads() == 2
        assert packed.is_mkldnn and torch.equal(packed.to_dense().reshape(weight.shape), weight)
    finally:
        torch.set_num_threads(before)


def test_a_failing_pack_puts_the_count_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="no reorder"):
            prepacked.packed("bad", lambda: (_ for _ in ()).throw(RuntimeError("no reorder")))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
