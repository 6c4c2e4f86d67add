"""A decoder with its key / value cache (tests/data/tiny_gpt2_decode.onnx, one GPT-2 decoding step
with a free past length): decoding several tokens, each step's presents fed back as the next step's
pasts, matches ONNX Runtime on every backend list, and CpuAcc takes the whole model as one partition
(the shape arithmetic on the free length included: no hop to CpuRef between steps)."""

from __future__ import annotations

import numpy as np
import pytest

from backplane import InferenceSession
from tests.models.test_models import DATA, assert_close, ort

PATH = DATA / "tiny_gpt2_decode.onnx"
STEPS = 4


def _decode(run, feeds: dict[str, np.ndarray]) -> list[list[np.ndarray]]:
    """STEPS greedy decoding steps through ``run`` (feeds -> outputs): each step's outputs."""
    feeds = dict(feeds)
    layers = sum(1 for name in feeds if name.startswith("past_key_"))
    every = []
    for _ in range(STEPS):
        outputs = run(feeds)
        every.append(outputs)
        logits, presents = outputs[0], outputs[1:]
        feeds["input_ids"] = logits[:, -1:].argmax(-1).astype(np.int64)
        feeds["attention_mask"] = np.ones((1, feeds["attention_mask"].shape[1] + 1), np.int64)
        for i in range(layers):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = presents[2 * i], presents[2 * i + 1]
    return every


@pytest.mark.parametrize("backends", [["CpuRef"], ["CpuAcc", "CpuRef"]], ids=["cpuref", "cpuacc"])
def test_decoding_with_a_cache_matches_onnx_runtime(backends: list[str]) -> None:
    if "CpuAcc" in backends:
        pytest.importorskip("torch")
    feeds = dict(np.load(DATA / "tiny_gpt2_decode.npz"))
    session = InferenceSession(PATH, backends=backends)
    reference = ort.InferenceSession(str(PATH), providers=["CPUExecutionProvider"])
    ours = _decode(lambda f: session.run(None, f), feeds)
    theirs = _decode(lambda f: reference.run(None, f), feeds)
    for step, (got, want) in enumerate(zip(ours, theirs)):
        assert got[1].shape[2] == 6 + step + 1  # the cache grew by one position per step
        assert_close(got, want)
    if "CpuAcc" in backends:
        report = session.report
        assert report.partitions == ["CpuAcc"], report.partitions
        assert report.crossings().get("copy", 0) == 0
