"""GELU written out with Erf (as torch exports nn.GELU) after a convolution, not a Linear: one
GeluChain on CpuAcc where this CPU's GELU keeps +Inf, equal to CpuRef's five layers within a
rounding or two, NaN and infinities where CpuRef has them."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion.gelu import _one_kernel  # noqa: E402
from tests.backends.torch.test_attention_sdpa import _built  # noqa: E402

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "data", "corpus")


class ConvGelu(torch.nn.Module):
    """Depthwise 1x1 convolutions of weight 1 (each output is the input, infinities included),
    GELU on one as it is and on the other transposed (a strided tensor in a trace)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = (torch.nn.Conv1d(4, 4, 1, groups=4) for _ in range(2))
        with torch.no_grad():
            for conv in (self.first, self.second):
                conv.weight.fill_(1.0)
                conv.bias.zero_()
        self.gelu = torch.nn.GELU()

    def forward(self, x):
        return self.gelu(self.first(x)), self.gelu(self.second(x).transpose(1, 2)) * 2.0


def _exported() -> bytes:
    buffer = io.BytesIO()
    torch.onnx.export(ConvGelu().eval(), (torch.zeros(1, 4, 8),), buffer, opset_version=17,
                      input_names=["x"], output_names=["a", "b"],
                      dynamic_axes={"x": {0: "n", 2: "length"}}, dynamo=False)
    return buffer.getvalue()


needs_one_kernel = pytest.mark.skipif(not _one_kernel(), reason="this CPU's GELU needs the +Inf "
                                      "mend: the five layers stay (gelu.py)")


@needs_one_kernel
def test_a_convolutions_gelu_is_one_layer_with_cpurefs_values_nan_and_inf_included() -> None:
    model = _exported()
    x = np.random.default_rng(0).normal(size=(1, 4, 8)).astype(np.float32) * 4
    x[0, 0, :4] = [np.nan, np.inf, -np.inf, 0.0]
    x[0, 3, 5:] = [np.inf, -np.inf, np.nan]
    session = InferenceSession(model, ["CpuAcc", "CpuRef"])
    got = session.run(None, {"x": x})
    expected = InferenceSession(model, ["CpuRef"]).run(None, {"x": x})
    assert _built(session, "GeluChain") == 2
    for g, e in zip(got, expected):
        assert np.array_equal(np.isnan(g), np.isnan(e))
        assert np.array_equal(np.isinf(g), np.isinf(e)) and np.array_equal(g[np.isinf(g)],
                                                                          e[np.isinf(e)])
        finite = np.isfinite(e)
        np.testing.assert_allclose(g[finite], e[finite], rtol=1e-6, atol=1e-6)


@needs_one_kernel
def test_the_corpus_audio_frontend_takes_its_three_gelus_and_matches_onnx_runtime() -> None:
    """audio_conv1d_dyn19 (dynamo's export, x * (0.5 * (1 + erf(x / sqrt(2))))): a GELU after its
    group norm and one after each later 1-d convolution, two of them on channels-last outputs."""
    ort = pytest.importorskip("onnxruntime")
    path = os.path.join(CORPUS, "audio_conv1d_dyn19.onnx")
    session = InferenceSession(path, ["CpuAcc", "CpuRef"])
    reference = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for size in ("s0", "s1"):
        feeds = dict(np.load(os.path.join(CORPUS, f"audio_conv1d_dyn19.{size}.npz")))
        for g, e in zip(session.run(None, feeds), reference.run(None, feeds)):
            assert np.abs(g - e).max() <= 1e-4 * np.abs(e).max()
    assert _built(session, "GeluChain") == 6  # three in each size's build
