"""A Lookup in a trace (``fusion/lookup.traced_gather``): the values of the gather run outside a
trace, for every memory layout and table, by int32 indices (a trace of ``table[x.long()]`` made
an int64 copy of x, 6x slower)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch.backend import FUSED_DOMAIN  # noqa: E402
from backplane.backends.torch.fusion.lookup import lookup_workload  # noqa: E402
from backplane.backends.torch.kernels.quantization import (  # noqa: E402
    dequantize_linear,
    quantize_linear,
)
from backplane.ir.graph import Layer  # noqa: E402


class Backend:
    @staticmethod
    def kernel_for(layer: Layer):
        if layer.op_type == "DequantizeLinear":
            return dequantize_linear
        return lambda x, s, z: quantize_linear(x.float() * 3 - 40, s, z)


def _lookup(signed: bool, wide: bool):
    """x -> a quantization of 3x - 40 (a byte table), or x dequantized (a float32 table)."""
    dtype, zero = (np.int8, -5) if signed else (np.uint8, 7)
    constants = {"s": np.array(0.37, np.float32), "z": np.array(zero, dtype)}
    op = "DequantizeLinear" if wide else "QuantizeLinear"
    layer = Layer("q", op, ["x", "s", "z"], ["y"], {}, "", 13)
    attrs = {"layers": [layer], "x": "x", "y": "y", "signed": signed, "constants": constants}
    return lookup_workload(Layer("q", "Lookup", ["x"], ["y"], attrs, FUSED_DOMAIN, 1), Backend())


def _cases(signed: bool) -> list:
    low = -128 if signed else 0
    x = torch.randint(low, low + 256, (2, 6, 5, 4), dtype=torch.int8 if signed else torch.uint8)
    odd = x[:1, :1, :, :1].contiguous()
    return [x, x.contiguous(memory_format=torch.channels_last), odd, x[:, 1:4], x.view(-1)[1:]]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("signed", [False, True])
def test_a_traced_lookup_gives_the_untraced_values(signed: bool, wide: bool) -> None:
    run = _lookup(signed, wide)
    for case in _cases(signed):
        traced = torch.jit.trace(lambda v: run(v)[0], case, check_trace=False)
        (want,) = run(case)
        got = traced(case)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        other = torch.empty_like(case)  # the layout traced: a trace keeps strides
        other.view(-1).copy_(torch.randint(0, 256, (case.numel(),), dtype=torch.uint8)
                             .view(case.dtype)) if other.is_contiguous() else other.copy_(
            torch.randint(0, 256, case.shape, dtype=torch.uint8).view(case.dtype))
        assert torch.equal(traced(other), run(other)[0])

def test_a_traced_lookup_indexes_by_int32() -> None:
    run = _lookup(False, False)
    x = torch.randint(0, 256, (1, 8, 6, 6), dtype=torch.uint8)
    graph = torch.jit.trace(lambda v: run(v)[0], x, check_trace=False).graph
    kinds = [node.kind() for node in graph.nodes()]
    assert "aten::index_select" in kinds and "aten::index" not in kinds, kinds
    assert "Long(" not in str(graph), str(graph)  # no int64 copy of x
