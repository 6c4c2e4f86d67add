"""Mul, Add, Sub and Div of one tensor by constants, three or more in a row, as one AffineChain on
CpuAcc (``fusion/affine_chain.py``): a detector's box decode exported by torch, CpuRef's values
within a rounding or two, NaN and infinities where CpuRef has them, and the patterns that start at
such a step (GELU, hard-swish) left to their own matchers.

    python -m pytest tests/backends/torch/test_affine_chain.py -q -p no:cacheprovider
"""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion.gelu import _one_kernel  # noqa: E402
from tests.backends.torch.test_group_norm_fusion import _layers  # noqa: E402


class Decode(torch.nn.Module):
    """A YOLO-style decode of a convolution's sigmoid: centres, sizes, and a reversed scale."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 1)
        self.register_buffer("grid", torch.arange(16.0).reshape(1, 1, 4, 4) / 4)
        self.register_buffer("anchor", torch.tensor([1.5, 2.5]).reshape(1, 2, 1, 1))

    def forward(self, x):
        y = torch.sigmoid(self.conv(x))
        centre = (y[:, :2] * 2 - 0.5 + self.grid) * 8.0
        size = (y[:, 2:4] * 2) ** 2 * self.anchor / 2
        rest = (10.0 - x / 4) * 3.0  # constant first
        return torch.cat([centre - size, centre + size], 1), y[:, 4:] * 3.0, rest


def _exported(module: torch.nn.Module, shape: tuple[int, ...]) -> bytes:
    buffer = io.BytesIO()
    torch.onnx.export(module.eval(), (torch.zeros(shape),), buffer, opset_version=17,
                      input_names=["x"], dynamo=False)
    return buffer.getvalue()


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, e in zip(got, want):
        assert np.array_equal(np.isnan(g), np.isnan(e))
        assert np.array_equal(g[np.isinf(e)], e[np.isinf(e)])
        finite = np.isfinite(e)
        np.testing.assert_allclose(g[finite], e[finite], rtol=1e-5, atol=1e-5)


def test_a_box_decode_is_affine_chains_with_cpurefs_values() -> None:
    model = _exported(Decode(), (1, 3, 4, 4))
    x = np.random.default_rng(0).normal(size=(1, 3, 4, 4)).astype(np.float32) * 3
    x[0, 0, 0, :3] = [np.nan, np.inf, -np.inf]
    session = InferenceSession(model, ["CpuAcc", "CpuRef"])
    got = session.run(None, {"x": x})
    _same(got, InferenceSession(model, ["CpuRef"]).run(None, {"x": x}))
    assert _layers(session, "AffineChain") == 2  # centre's four, (10 - x / 4) * 3
    assert _layers(session, "Div") == 1  # size's * anchor / 2: two steps, left as they are


class Guarded(torch.nn.Module):
    """Steps by constants before a GELU (x / sqrt(2) starts it) and a hard-swish (x + 3)."""

    def forward(self, x):
        y = (x * 2.0 - 1.0) * 0.5
        gelu = torch.nn.functional.gelu(y * 3.0)
        z = x * 0.25
        return gelu, z * torch.clamp(z + 3.0, 0.0, 6.0) / 6.0


def test_a_chain_ends_where_another_pattern_starts() -> None:
    model = _exported(Guarded(), (1, 4, 8))
    x = np.random.default_rng(1).normal(size=(1, 4, 8)).astype(np.float32)
    session = InferenceSession(model, ["CpuAcc", "CpuRef"])
    _same(session.run(None, {"x": x}), InferenceSession(model, ["CpuRef"]).run(None, {"x": x}))
    assert _layers(session, "HardSwishChain") == 1
    assert _layers(session, "GeluChain") == (1 if _one_kernel() else 0)
    assert _layers(session, "AffineChain") == 1  # (x * 2 - 1) * 0.5 * 3, not the GELU's / sqrt(2)
