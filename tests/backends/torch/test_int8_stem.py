"""The stem of an int8 CNN on CpuAcc (issue 29): the model's QuantizeLinear that the first int8
convolution takes gives its quint8 tensor by torch's ``quantize_per_tensor`` of the values CpuRef
rounds (five passes where CpuRef's steps and the copies to channels-last and into a quint8 tensor
were eight): CpuRef's integers, ties and NaN included, for uint8 and int8 activations; the model
within one step of CpuRef."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime.quantization")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_qdq_chain import feeds, output_step, quantized  # noqa: E402
from tests.backends.torch.int8_cpu import torch_int8_exact  # noqa: E402
from tests.conftest import inner_workloads  # noqa: E402


@pytest.mark.parametrize("activations", ["QUInt8", "QInt8"])
def test_the_stem_quantizes_its_input_in_one_pass(activations: str, tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    path = quantized(tmp_path, activations)
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "layers"}), "CpuRef"])
    stems = [w for w in inner_workloads(session, "QLinearConv")
             if getattr(w, "route", None) == "int8"][:1]
    if not torch_int8_exact():  # they saturate (no VNNI): "auto" is "exact", no int8 route
        assert not stems, stems
    else:
        assert stems, "no int8 QLinearConv"
        x = torch.from_numpy(feeds(1)["x"])
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            stems[0](x)
        ops = {event.key for event in prof.key_averages()}
        assert "aten::quantize_per_tensor" in ops, sorted(ops)
        assert "aten::_make_per_tensor_quantized_tensor" not in ops, sorted(ops)
    reference = InferenceSession(path, backends=["CpuRef"])
    for seed, nan in ((0, False), (2, True)):
        given = feeds(seed)
        if nan:  # NaN quantizes to 0 (uint8) or 0 (int8: quint8's 128), as CpuRef's cast
            given["x"][0, :, 10:20, 5:9] = np.nan
        got, want = session.run(None, given)[0], reference.run(None, given)[0]
        assert np.isfinite(want).all()
        assert float(np.max(np.abs(got - want))) <= output_step(path) * 1.001


@pytest.mark.parametrize(("zero", "low"), [(3, 0), (114, 0), (-5, -128), (0, -128)])
def test_the_stems_quantization_is_cpurefs(zero: int, low: int) -> None:
    """Values at half a step (either parity of the zero point), NaN, infinities and values far
    outside the range quantize to CpuRef's integers (its division and half-to-even rounding; torch's
    own quantize_per_tensor multiplies by 1 / s and rounds after adding z)."""
    from backplane.backends.reference.kernels.quant import quantize_linear
    from backplane.backends.torch.fusion.int8_qlinear import _quantizer

    scale = np.float32(0.0183)
    halves = (np.arange(-300, 300, dtype=np.float32) + np.float32(0.5)) * scale
    rng = np.random.default_rng(7)
    special = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0], np.float32)
    values = np.concatenate([special, halves, rng.standard_normal(2000).astype(np.float32) * 3])
    x = values[: 3 * 16 * 54].reshape(1, 3, 16, 54)
    dtype = np.uint8 if low == 0 else np.int8
    want = quantize_linear(x, np.array(scale), np.array(zero, dtype))[0].astype(int)
    into = {"scale": np.array(scale), "zero": np.array(zero, np.float32), "low": low,
            "high": low + 255}
    shift = -low
    got = _quantizer(into, shift, float(scale), zero + shift)(torch.from_numpy(x))
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(got.int_repr().numpy().astype(int) - shift, want)
