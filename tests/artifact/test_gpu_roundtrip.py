"""Round trip through the artifact on GpuAcc,CpuRef (issue 11): the artifact's session places every
layer where the ONNX file's session does, and its outputs equal the ONNX file's within 1e-5 of the
largest value (the same kernels, captured again at load; cuDNN may pick another algorithm). Skipped
without a CUDA device; on the GPU machine:

    python -m pytest tests/artifact/test_gpu_roundtrip.py -q -p no:cacheprovider
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import backplane
from backplane import InferenceSession
from backplane.backends.registry import registry
from tests.artifact.conftest import model_and_feeds

AVAILABILITY = registry.create("GpuAcc").availability()
pytestmark = pytest.mark.skipif(not AVAILABILITY.ok, reason=f"GpuAcc: {AVAILABILITY.reason}")

MODELS = ["tiny_mobilenet_v3", "tiny_bert", "tiny_gpt2", "tiny_gpt2_decode", "cond_nested_dyn18",
          "gpt_fp16_dyn19", "encoder_padmask_dyn17"]
"""Convolutions, attention, a decoder with its cache, If bodies, float16, free dimensions."""


@pytest.mark.parametrize("name", MODELS)
def test_gpuacc_cpuref_round_trip(name: str, tmp_path: Path) -> None:
    path, feeds = model_and_feeds(name)
    backends = ["GpuAcc", "CpuRef"]
    artifact = tmp_path / f"{name}.bpl"
    backplane.compile(path, backends, artifact)
    loaded = InferenceSession(artifact)
    from_onnx = InferenceSession(path, backends=backends)
    assert {n: p.backend for n, p in loaded.report.layers.items()} == \
        {n: p.backend for n, p in from_onnx.report.layers.items()}
    assert any(p.backend == "GpuAcc" for p in loaded.report.layers.values())
    for got, want in zip(loaded.run(None, feeds), from_onnx.run(None, feeds), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = max(float(np.max(np.abs(want.astype(np.float64)))), 1e-12) if want.size else 1.0
        assert float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0)) <= 1e-5 * scale
