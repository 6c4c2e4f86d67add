"""A trace's Gather by indices that are constants of the trace (a VAD's state rows) counts their
negatives from the end outside the trace, and one such index is a ``select`` (a view, no call a
run); indices that are the trace's inputs stay computed in it, for every value they take."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch.fusion.traceable import TRACEABLE_KERNELS  # noqa: E402

gather = TRACEABLE_KERNELS["Gather"]
DATA = torch.arange(24.0).reshape(4, 6)


def kinds(traced: torch.jit.ScriptFunction) -> set[str]:
    return {node.kind() for node in traced.graph.nodes()}


@pytest.mark.parametrize("index,axis", [(1, 0), (-1, 0), (-2, 1), (5, 1)])
def test_one_constant_index_is_a_select(index, axis) -> None:
    constant = torch.tensor(index)
    traced = torch.jit.trace(lambda data: gather(data, constant, axis)[0], (DATA,))
    assert "aten::select" in kinds(traced)
    assert not {"aten::index_select", "aten::where"} & kinds(traced)
    other = torch.randn(4, 6)
    torch.testing.assert_close(traced(other), other.select(axis, index), rtol=0, atol=0)


def test_constant_indices_have_their_negatives_counted_once() -> None:
    constant = torch.tensor([[0, -1], [2, -3]])
    traced = torch.jit.trace(lambda data: gather(data, constant, 0)[0], (DATA,))
    assert "aten::where" not in kinds(traced) and "aten::index_select" in kinds(traced)
    other = torch.randn(4, 6)
    torch.testing.assert_close(traced(other), other[torch.tensor([[0, 3], [2, 1]])], rtol=0, atol=0)


def test_indices_given_to_the_trace_stay_computed_in_it() -> None:
    traced = torch.jit.trace(lambda data, i: gather(data, i, 0)[0], (DATA, torch.tensor(1)))
    assert "aten::index_select" in kinds(traced) and "aten::where" in kinds(traced)
    for index in (0, 3, -1, -4):  # not the value it was traced with
        torch.testing.assert_close(traced(DATA, torch.tensor(index)), DATA[index], rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(64, 4), (64,), (5, 2, 3)])
def test_gather_nd_of_rows_by_a_column_of_indices_is_one_index_select(shape) -> None:
    from backplane.backends.reference.kernels.indexing import gather_nd as reference
    from backplane.backends.torch.kernels.indexing import gather_nd

    data, indices = torch.randn(shape), torch.tensor([[3], [0], [-1], [2], [3]])
    traced = torch.jit.trace(lambda d, i: gather_nd(d, i)[0], (data, indices))
    reshapes = [node for node in traced.graph.nodes() if node.kind() == "aten::reshape"]
    assert "aten::index_select" in kinds(traced) and len(reshapes) == 1  # the indices' flatten
    other = torch.randn(shape)
    expected = reference(other.numpy(), indices.numpy())[0]
    got = traced(other, indices)
    assert tuple(got.shape) == expected.shape
    torch.testing.assert_close(got, torch.from_numpy(expected), rtol=0, atol=0)
