"""A group norm as torch exports ``nn.GroupNorm`` (Reshape -> InstanceNormalization -> Reshape
[-> Mul] [-> Add]): one ``GroupNorm`` layer on CpuAcc (``fusion/group_norm.py``), CpuRef's values
within a rounding or two, NaN kept to its group, a constant group exactly its bias.

    python -m pytest tests/backends/torch/test_group_norm_fusion.py -q -p no:cacheprovider
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_attention_sdpa import _built  # noqa: E402


def _layers(session, op_type: str) -> int:
    """``op_type`` layers in the session's loaded network, inside Traced and OneDnnGraph layers
    too, and in each signature's build of its Specialized layers."""
    loaded = session.runtime.network(session.network_id)
    count = _built(session, op_type)
    for layer in loaded.layers:
        count += sum(lay.op_type == op_type for lay in layer.attrs.get("layers", [layer]))
    return count

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "data", "corpus")


class Normed(torch.nn.Module):
    """A convolution, then a group norm of ``groups`` (its own affine or none), then a ReLU."""

    def __init__(self, rank: int, groups: int, affine: bool) -> None:
        super().__init__()
        conv = torch.nn.Conv1d if rank == 3 else torch.nn.Conv2d
        self.conv = conv(3, 8, 3, padding=1)
        self.norm = torch.nn.GroupNorm(groups, 8, affine=affine)
        if affine:
            with torch.no_grad():
                self.norm.weight.uniform_(0.5, 2.0)
                self.norm.bias.uniform_(-1.0, 1.0)

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


def _exported(rank: int, groups: int, affine: bool) -> tuple[bytes, tuple[int, ...]]:
    shape = (1, 3, 12) if rank == 3 else (1, 3, 6, 5)
    buffer = io.BytesIO()
    torch.manual_seed(0)
    torch.onnx.export(Normed(rank, groups, affine).eval(), (torch.zeros(shape),), buffer,
                      opset_version=17, input_names=["x"], output_names=["y"], dynamo=False)
    return buffer.getvalue(), shape


def _compare(got: np.ndarray, want: np.ndarray) -> None:
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank,groups,affine", [(3, 8, True), (3, 2, True), (4, 4, True),
                                                (4, 1, False)])
def test_an_exported_group_norm_is_one_layer_with_cpurefs_values(rank: int, groups: int,
                                                                affine: bool) -> None:
    model, shape = _exported(rank, groups, affine)
    session = InferenceSession(model, ["CpuAcc", "CpuRef"])
    reference = InferenceSession(model, ["CpuRef"])
    x = np.random.default_rng(rank + groups).normal(size=shape).astype(np.float32)
    _compare(session.run(None, {"x": x})[0], reference.run(None, {"x": x})[0])
    assert _layers(session, "GroupNorm") == 1
    assert _layers(session, "InstanceNormalization") == 0


def test_nan_stays_in_its_group() -> None:
    model, shape = _exported(3, 2, True)
    session = InferenceSession(model, ["CpuAcc", "CpuRef"])
    x = np.random.default_rng(3).normal(size=shape).astype(np.float32)
    x[0, 1, 6] = np.nan  # spreads through the convolution's window to every channel there
    got = session.run(None, {"x": x})[0]
    want = InferenceSession(model, ["CpuRef"]).run(None, {"x": x})[0]
    assert np.isnan(got).all()  # every channel's window holds it: each group has a NaN
    _compare(got, want)


def test_a_constant_group_is_its_bias() -> None:
    """A zero input: each channel is its convolution's bias, and with a group a channel, a
    constant group, whose normalization is exactly 0: the output is the ReLU of the group norm's
    own bias, exactly (torch's group_norm with its affine folded in made 1.5 -> 1.5e-5)."""
    model, shape = _exported(4, 8, True)
    session = InferenceSession(model, ["CpuAcc", "CpuRef"])
    got = session.run(None, {"x": np.zeros(shape, np.float32)})[0]
    torch.manual_seed(0)
    bias = Normed(4, 8, True).norm.bias.detach().numpy()
    assert _layers(session, "GroupNorm") == 1
    want = np.broadcast_to(np.maximum(bias, 0)[:, None, None], got.shape[1:])[None]
    assert np.array_equal(got, want)


def test_the_corpus_audio_frontend_takes_its_group_norm_and_matches_onnx_runtime() -> None:
    """audio_conv1d_dyn19 (dynamo's export: the shape of the Reshape back read by a Shape)."""
    ort = pytest.importorskip("onnxruntime")
    path = os.path.join(CORPUS, "audio_conv1d_dyn19.onnx")
    session = InferenceSession(path, ["CpuAcc", "CpuRef"])
    reference = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for size in ("s0", "s1"):
        feeds = dict(np.load(os.path.join(CORPUS, f"audio_conv1d_dyn19.{size}.npz")))
        for g, e in zip(session.run(None, feeds), reference.run(None, feeds)):
            assert np.abs(g - e).max() <= 1e-4 * np.abs(e).max()
    assert _built(session, "GroupNorm") == 2  # a build for each of the two samples' signatures
    assert _built(session, "InstanceNormalization") == 0
