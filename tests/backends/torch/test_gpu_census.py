"""GpuAcc's build of a corpus model read without a GPU (``bench/gpu_census.py``): the graph passes
and fusions a capture would replay run on any machine, so CI checks what the GPU machine's
profiles count (issue 28: a small model's GPU time is its kernel count, about 1.1 us each)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[3]
CORPUS = ROOT / "tests" / "data" / "corpus"
sys.path.insert(0, str(ROOT / "bench"))

from gpu_census import census  # noqa: E402


def _census(name: str) -> dict:
    return census(CORPUS / f"{name}.onnx", dict(np.load(CORPUS / f"{name}.s0.npz")))


def test_each_exported_gelu_is_one_fused_step() -> None:
    """audio_conv1d_dyn19's three GELUs, exported as Div, Erf, Add, Mul, Mul after each Conv, are
    one CUDA function each with the Conv's bias (gpu_chains), and no layer of theirs is a step of
    its own: 29 layers, 15 steps."""
    found = _census("audio_conv1d_dyn19")
    assert "error" not in found and not found["outside"]
    gelus = [step for step in found["each"] if step.startswith("Mul backplane_ew_")]
    assert len(gelus) >= 3
    assert not any(step.split()[0] in ("Erf", "Div") for step in found["each"])
    assert found["steps"] <= 15, found["each"]


def test_a_detectors_graph_leaves_only_its_host_chain_outside() -> None:
    """detect_nms_dyn21 at 32x32: one CudaGraph layer up to the NonMaxSuppression's boxes, the rest
    on the host (``HostChain``), its conv -> SiLU pairs as convolutions and a fused chain each."""
    found = _census("detect_nms_dyn21")
    assert found["outside"] == ["HostChain"]
    convs = [i for i, step in enumerate(found["each"]) if step == "Conv"]
    silu = [found["each"][i + 1].startswith("Mul backplane_ew_") for i in convs[:3]]
    assert len(convs) == 4 and all(silu), found["each"]
