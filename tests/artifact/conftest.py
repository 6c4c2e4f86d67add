"""Shared by the artifact tests: models, their inputs, and a route cache of the test's own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

DATA = Path(__file__).resolve().parent.parent / "data"
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def model_and_feeds(name: str) -> tuple[Path, dict[str, np.ndarray]]:
    """A model of tests/data, of its corpus (first input size) or onnx's light models, and inputs."""
    if name.startswith("light_"):
        from tests.models.test_models import light_inputs

        path = LIGHT_DIR / f"{name}.onnx"
        return path, light_inputs(path)
    if (DATA / f"{name}.onnx").exists():
        return DATA / f"{name}.onnx", dict(np.load(DATA / f"{name}.npz"))
    return DATA / "corpus" / f"{name}.onnx", dict(np.load(DATA / "corpus" / f"{name}.s0.npz"))


@pytest.fixture(autouse=True)
def own_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """CpuAcc's routes and the compile cache in the test's folder, not the user's."""
    monkeypatch.setenv("BACKPLANE_CACHE_DIR", str(tmp_path / "routes"))
    monkeypatch.delenv("BACKPLANE_COMPILE_CACHE", raising=False)
    return tmp_path
