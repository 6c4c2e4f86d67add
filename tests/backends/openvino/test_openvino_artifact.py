"""OpenVINO in an artifact (issue 11's delegate contract): each compiled partition is exported by
OpenVINO at compile time and imported at load, so loading converts and compiles nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openvino")

import backplane  # noqa: E402
from backplane import InferenceSession  # noqa: E402
from backplane.backends.openvino import delegate, workload  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data"
MODELS = ["tiny_bert", "tiny_mobilenet_v3", "tiny_gpt2"]


def _feeds(name: str, session: InferenceSession) -> dict[str, np.ndarray]:
    data = np.load(DATA / f"{name}.npz")
    return {arg.name: data[arg.name] for arg in session.get_inputs()}


@pytest.mark.parametrize("name", MODELS)
def test_an_artifact_imports_openvinos_compiled_partitions(name: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    model = DATA / f"{name}.onnx"
    artifact = tmp_path / f"{name}.bpa"
    backplane.compile(model, ["OpenVINO", "CpuRef"], artifact)
    from_onnx = InferenceSession(model, ["OpenVINO", "CpuRef"])

    def no_compiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("an artifact's OpenVINO partition was compiled again at load")

    monkeypatch.setattr(workload, "compile_model", no_compiling)
    loaded = InferenceSession(artifact)
    delegated = [p for p in loaded.report.layers.values() if p.backend == "OpenVINO"]
    assert delegated and all(p.substituted_by and "Delegate[OpenVINO]" in p.substituted_by
                             for p in delegated)
    feeds = _feeds(name, from_onnx)
    for got, want in zip(loaded.run(None, feeds), from_onnx.run(None, feeds)):
        np.testing.assert_array_equal(got, want)  # the same compiled model, exported and imported


def test_the_blob_depends_on_openvinos_version_and_the_cpu() -> None:
    facts = delegate.machine_facts()
    assert set(facts) == {"openvino", "isa"} and facts["openvino"]
