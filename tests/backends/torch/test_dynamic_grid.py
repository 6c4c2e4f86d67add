"""DynamicQuantizeLinear's grid computed on the host (``dynamic_quant.grid_on_host``, CpuAcc's
``DynamicQuantMatMul`` layer by layer) against the tensor form a trace holds
(``kernels.contrib_quant.dynamic_grid``) and CpuRef's kernel: the same integers and scale, bit for
bit; in a trace the tensor form, so a traced run follows each input's own range."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.reference.kernels.quant import dynamic_quantize_linear  # noqa: E402
from backplane.backends.torch.fusion.dynamic_quant import grid_on_host  # noqa: E402
from backplane.backends.torch.kernels.contrib_quant import dynamic_grid, product_grid  # noqa: E402, E501


def cases() -> list[np.ndarray]:
    rng = np.random.default_rng(29)
    found = [np.zeros((2, 3), np.float32), np.full((1, 4), 3.5, np.float32),
             np.full((1, 4), -0.25, np.float32), np.array([[1e-30, -1e-30]], np.float32)]
    for k in range(60):
        x = (rng.standard_normal((3, 17)) * 10 ** rng.uniform(-4, 4)).astype(np.float32)
        found.append(np.abs(x) if k % 3 == 0 else -np.abs(x) if k % 3 == 1 else x)
    return found


def test_the_host_grid_is_cpurefs() -> None:
    for x in cases():
        centred, scale = grid_on_host(torch.from_numpy(x))
        want, want_scale = dynamic_grid(torch.from_numpy(x))
        y, ref_scale, ref_zero = dynamic_quantize_linear(x)
        assert torch.equal(centred, want) and np.float32(scale) == np.float32(want_scale)
        assert np.array_equal(centred.numpy(), y.astype(np.float32) - np.float32(ref_zero))
        assert np.float32(scale) == ref_scale


def test_a_nan_takes_the_tensor_form() -> None:
    x = np.array([[1.0, np.nan, -2.0]], np.float32)
    centred, scale = grid_on_host(torch.from_numpy(x))
    want, want_scale = dynamic_grid(torch.from_numpy(x))
    assert torch.equal(centred, want) and float(scale) == float(want_scale) == 1.0


def test_a_trace_follows_each_inputs_range() -> None:
    small = torch.linspace(-1, 1, 12).reshape(3, 4)
    traced = torch.jit.trace(lambda x: grid_on_host(x)[0] * grid_on_host(x)[1], small)
    large = small * 40 + 3
    assert torch.equal(traced(large), dynamic_grid(large)[0] * dynamic_grid(large)[1])


def test_the_check_before_a_trace_finds_no_host_read() -> None:
    """traced.HostReads runs the layers before a trace to find reads of the inputs' values on
    the host: the range read there made the quantized GPT's partition run layer by layer."""
    from backplane.backends.torch.fusion.traced import HostReads

    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    reads = HostReads([x])
    with reads:
        centred, scale = grid_on_host(x * 2.0)
    assert reads.found == []
    assert torch.equal(centred * scale, dynamic_grid(x * 2.0)[0] * dynamic_grid(x * 2.0)[1])


def edge_cases() -> list[np.ndarray]:
    """NaN, infinities, symmetric ranges (their ends at half steps) and all-zero rows."""
    rng = np.random.default_rng(7)
    found = [np.array([[1.0, np.nan, -2.0]], np.float32), np.array([[np.inf, 1, -2]], np.float32),
             np.array([[-np.inf, 1, 2]], np.float32), np.array([[np.nan, np.nan]], np.float32),
             np.array([[-0.0, 0.0]], np.float32), np.zeros((2, 3), np.float32)]
    found += [np.array([[-a, a, a / 3]], np.float32) for a in rng.uniform(0, 100, 300)]
    found += [(rng.standard_normal((4, 9)) * 10 ** rng.uniform(-6, 6)
               + rng.uniform(-3, 3) * 10 ** rng.uniform(-6, 6)).astype(np.float32)
              for _ in range(2000)]
    return found


def test_the_product_grid_is_the_tensor_grid() -> None:
    """The same integers; the same scale but for an all-zero x (0 there: its product is 0)."""
    for x in cases() + edge_cases():
        centred, scale = product_grid(torch.from_numpy(x))
        want, want_scale = dynamic_grid(torch.from_numpy(x))
        assert torch.equal(centred, want), x
        zeros = not np.any(x)
        assert float(scale) == (0.0 if zeros else float(want_scale)), x


def test_a_traced_grid_makes_few_calls() -> None:
    """A trace pays about 1.4 us a call: the grid a traced product holds is 14 of them
    (dynamic_grid's form made 25), and follows each input's range."""
    x = torch.linspace(-1, 1, 12).reshape(3, 4)
    traced = torch.jit.trace(lambda v: grid_on_host(v), x)
    calls = [n for n in traced.graph.nodes() if n.kind().startswith("aten::")]
    assert len(calls) <= 14, [n.kind() for n in calls]
    large = x * 40 + 3
    assert torch.equal(traced(large)[0], dynamic_grid(large)[0])


def test_a_frozen_grid_casts_only_to_widen_the_range() -> None:
    """In a frozen trace a Python number is an int64 0-d tensor, cast at every call where a float
    tensor meets it: the grid's constants are float tensors of their operands' type, so its only
    casts are the range's two widenings to float64 and the scale's rounding back, and it still
    follows each input's range."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.linspace(-1, 1, 12).reshape(3, 4)

    class Grid(torch.nn.Module):
        def forward(self, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return product_grid(v)

    with torch.no_grad():
        frozen = torch.jit.freeze(torch.jit.trace(Grid().eval(), (x,)))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        frozen(x)
    casts = [e for e in prof.events() if e.name == "aten::_to_copy"]
    assert len(casts) <= 3, [e.cpu_parent.cpu_parent.name for e in casts if e.cpu_parent]
    large = x * 40 + 3
    assert torch.equal(frozen(large)[0], dynamic_grid(large)[0])
