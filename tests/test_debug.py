"""BACKPLANE_DEBUG: 1 prints the placement plan, 2 also every layer as it runs."""

from __future__ import annotations

import numpy as np

from backplane import InferenceSession
from tests.conftest import small_cnn_model

X = np.zeros((1, 3, 8, 8), np.float32)


def test_level_1_prints_the_plan_and_level_2_each_layer(monkeypatch, capsys) -> None:
    monkeypatch.setenv("BACKPLANE_DEBUG", "1")
    session = InferenceSession(small_cnn_model(), ["CpuRef"])
    session.run(None, {"x": X})
    err = capsys.readouterr().err
    assert "Placement" in err and "conv1" in err and "ms  " not in err
    monkeypatch.setenv("BACKPLANE_DEBUG", "2")
    InferenceSession(small_cnn_model(), ["CpuRef"]).run(None, {"x": X})
    err = capsys.readouterr().err
    assert "CpuRef  probs = Softmax[axis=1](logits) @CpuRef  # softmax" in err


def test_level_0_prints_nothing(monkeypatch, capsys) -> None:
    monkeypatch.delenv("BACKPLANE_DEBUG", raising=False)
    InferenceSession(small_cnn_model(), ["CpuRef"]).run(None, {"x": X})
    assert capsys.readouterr().err == ""
