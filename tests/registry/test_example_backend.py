"""The out-of-tree example: found as an installed entry point and as a dynamic backend path, with
the same placement; the tutorial's code runs as written."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession, Runtime, RuntimeOptions
from backplane.backends.registry import BackendRegistry
from backplane.backends.registry import registry as default_registry
from backplane.backends.registry.dynamic import PATHS_VARIABLE

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_SRC = ROOT / "examples" / "acme_tiny" / "src"
MODEL = ROOT / "models" / "mobilenet_v2_w020_c10.onnx"
TUTORIAL = ROOT / "docs" / "backend-in-one-screen.md"


def fresh_registry() -> BackendRegistry:
    registry = BackendRegistry()
    for backend_id in default_registry.ids():
        if default_registry.origin(backend_id) == "built in" and backend_id not in registry.ids():
            registry.register(backend_id, type(default_registry.create(backend_id)), "built in")
    return registry


def install_entry_point(site: Path, monkeypatch, target: str = "acme_tiny_backend") -> None:
    """What pip writes for the example: its package on the path and a dist-info with the entry point."""
    info = site / "acme_tiny_backend-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tiny-backend\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[backplane.backends]\nAcmeTiny = {target}\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(EXAMPLE_SRC))
    importlib.invalidate_caches()


def placements(session: InferenceSession) -> dict[str, str]:
    return {name: p.backend for name, p in session.report.layers.items()}


def test_entry_point_and_path_give_the_same_placement(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(PATHS_VARIABLE, raising=False)
    feeds = {"input": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    by_path = fresh_registry()
    runtime = Runtime(RuntimeOptions(dynamic_backends_path=str(EXAMPLE_SRC)), registry=by_path)
    from_path = InferenceSession(MODEL, backends=["AcmeTiny", "CpuRef"], runtime=runtime)
    assert by_path.origin("AcmeTiny").startswith(f"file {EXAMPLE_SRC}")

    install_entry_point(tmp_path, monkeypatch)
    by_entry_point = fresh_registry()
    installed = InferenceSession(MODEL, backends=["AcmeTiny", "CpuRef"],
                                 runtime=Runtime(registry=by_entry_point))
    assert by_entry_point.origin("AcmeTiny") == "entry point acme-tiny-backend acme_tiny_backend"

    assert placements(from_path) == placements(installed)
    assert set(placements(installed).values()) == {"AcmeTiny", "CpuRef"}
    assert {p.op_type for p in installed.report.layers.values() if p.backend == "AcmeTiny"} == {"Add"}
    clip = next(p for p in installed.report.layers.values() if p.op_type == "Clip")
    assert clip.refusals == [("AcmeTiny", "no kernel for Clip")]
    reference = InferenceSession(MODEL, backends=["CpuRef"]).run(None, feeds)[0]
    np.testing.assert_array_equal(installed.run(None, feeds)[0], reference)
    np.testing.assert_array_equal(from_path.run(None, feeds)[0], reference)


def test_an_entry_point_comes_before_a_file_with_the_same_id(tmp_path: Path, monkeypatch) -> None:
    """Built-ins, entry points, then files: a Runtime reads the backend paths when it starts, and
    the file on them must not take the id from the installed package."""
    install_entry_point(tmp_path / "site", monkeypatch)
    registry = fresh_registry()
    Runtime(RuntimeOptions(dynamic_backends_path=str(EXAMPLE_SRC)), registry=registry)
    assert registry.origin("AcmeTiny") == "entry point acme-tiny-backend acme_tiny_backend"
    (skip,) = [s for s in registry.skipped if s.candidate.startswith(str(EXAMPLE_SRC))]
    assert "already registered from entry point" in skip.reason


def test_a_broken_entry_point_is_skipped_with_its_reason(tmp_path: Path, monkeypatch) -> None:
    install_entry_point(tmp_path, monkeypatch, target="acme_missing_module")
    registry = fresh_registry()
    assert registry.load_entry_points() == []
    (skip,) = registry.skipped
    assert "acme_missing_module" in skip.candidate
    assert "it failed to import: ModuleNotFoundError" in skip.reason


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_tutorial_shows_the_example_and_its_code_runs(monkeypatch) -> None:
    backend_code, usage = python_blocks(TUTORIAL.read_text())
    assert backend_code == (EXAMPLE_SRC / "acme_tiny_backend" / "__init__.py").read_text()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv(PATHS_VARIABLE, str(EXAMPLE_SRC))
    namespace: dict = {}
    try:
        exec(compile(usage, str(TUTORIAL), "exec"), namespace)  # noqa: S102 - the tutorial's code
    finally:
        if "AcmeTiny" in default_registry.ids():
            default_registry.deregister("AcmeTiny")
    assert namespace["logits"].shape == (1, 10)
    assert namespace["session"].report.counts()["AcmeTiny"] > 0


@pytest.fixture(autouse=True)
def _forget_example_modules():
    yield
    for name in [n for n in sys.modules if n.startswith("acme_tiny_backend")]:
        del sys.modules[name]
