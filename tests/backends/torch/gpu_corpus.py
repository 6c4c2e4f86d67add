"""A corpus model (tests/data/corpus) on GpuAcc against CpuRef at each of its samples: the check
the GPU tests of whole corpus models share (test_gpu_capture, test_gpu_layernorm)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from backplane import InferenceSession

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"


def gpuacc_matches_cpuref(name: str, tol: float) -> InferenceSession:
    """GpuAcc's session of ``name`` (its CPU comparison off, CpuRef behind it) after its outputs
    matched CpuRef's in shape, dtype and values within ``tol`` at every sample."""
    session = InferenceSession(str(CORPUS / f"{name}.onnx"),
                               providers=[("GpuAcc", {"against_cpu": "off"}), "CpuRef"])
    reference = InferenceSession(str(CORPUS / f"{name}.onnx"), providers=["CpuRef"])
    for sample in sorted(CORPUS.glob(f"{name}.s*.npz")):
        feeds = dict(np.load(sample))
        for got, want in zip(session.run(None, feeds), reference.run(None, feeds)):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    return session
