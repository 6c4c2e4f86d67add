"""A ``Traced`` layer's Add, Sub, Mul and Div by a 0-d float constant (a detector's decode:
``sigmoid * 2 - 0.5``, ``* stride``) read a constant of shape (1,) in the frozen trace: TorchScript's
interpreter copies a 0-d one at every call (aten::to inside the op). The values and shapes stay
torch's eager ones; a computed 0-d operand, integers and 0-d by 0-d stay as they were."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.profiler import profile  # noqa: E402

from backplane.backends.torch.fusion import onednn_graph  # noqa: E402
from backplane.backends.torch.kernels import elementwise  # noqa: E402

KERNELS = {"add": (elementwise.add, torch.add), "sub": (elementwise.sub, torch.sub),
           "mul": (elementwise.mul, torch.mul), "div": (elementwise.div, torch.div)}


def _frozen(function, sample):
    """``function`` traced and frozen as a ``Traced`` layer is (oneDNN Graph's fuser off)."""
    trace = onednn_graph._trace(function, sample, fusion=False)
    return onednn_graph._freeze(trace, fusion=False)


def _ops(module, *values) -> list[str]:
    for _ in range(3):  # the profiling executor's first calls run its guards' checks
        module(*values)
    with profile() as prof:
        module(*values)
    return [event.name for event in prof.events()]


def _zero_d_constants(module) -> list[torch.Tensor]:
    found = [node.output().toIValue() for node in module.graph.nodes()
             if node.kind() == "prim::Constant" and node.output().type().kind() == "TensorType"]
    return [value for value in found if value.dim() == 0]


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_a_zero_d_constant_is_read_without_a_copy(name) -> None:
    kernel, eager = KERNELS[name]
    constant = torch.tensor(0.5)
    x = torch.randn(1, 3, 8, 8, 8)[..., 1:3]  # a slice, as the decode reads
    module = _frozen(lambda a: kernel(a, constant)[0], (x,))
    assert not _zero_d_constants(module)
    assert "aten::to" not in _ops(module, x)
    other = torch.randn(1, 3, 8, 8, 2)
    other[0, 0, 0, 0] = torch.tensor([float("nan"), float("inf")])
    got, expected = module(other), eager(other, constant)
    assert got.shape == expected.shape == other.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


def test_a_chain_of_constants_is_one_op_each() -> None:
    two, half, four = torch.tensor(2.0), torch.tensor(0.5), torch.tensor(4.0)

    def decode(a):
        y = elementwise.mul(a, two)[0]
        y = elementwise.sub(y, half)[0]
        return elementwise.div(elementwise.mul(y, four)[0], two)[0]

    x = torch.rand(1, 3, 8, 8, 2)
    module = _frozen(decode, (x,))
    ops = [op for op in _ops(module, x) if op.startswith("aten::")]
    assert ops == ["aten::mul", "aten::sub", "aten::mul", "aten::div"]
    torch.testing.assert_close(module(x), (x * 2 - 0.5) * 4 / 2, rtol=0, atol=0)


def test_computed_integer_and_zero_d_operands_stay_as_they_were() -> None:
    def mixed(a, s):
        largest = s.amax()  # computed 0-d: no copy, and no reshape added
        y = elementwise.mul(a, largest)[0]
        scalar = elementwise.add(largest, torch.tensor(1.0))[0]  # 0-d by 0-d: 0-d
        count = elementwise.mul(torch.arange(6).reshape(2, 3), torch.tensor(3))[0]
        return y, scalar, count

    a, s = torch.randn(2, 3), torch.randn(4)
    module = _frozen(mixed, (a, s))
    assert "aten::reshape" not in [node.kind() for node in module.graph.nodes()]
    y, scalar, count = module(a, s)
    assert scalar.shape == () and count.dtype == torch.int64
    torch.testing.assert_close(y, a * s.amax(), rtol=0, atol=0)
    torch.testing.assert_close(scalar, s.amax() + 1, rtol=0, atol=0)
    torch.testing.assert_close(count, torch.arange(6).reshape(2, 3) * 3, rtol=0, atol=0)


def test_eager_calls_keep_the_zero_d_operand() -> None:
    x, constant = torch.randn(3, 4), torch.tensor(2.0)
    for kernel, eager in KERNELS.values():
        got = kernel(x, constant)[0]
        torch.testing.assert_close(got, eager(x, constant), rtol=0, atol=0)
