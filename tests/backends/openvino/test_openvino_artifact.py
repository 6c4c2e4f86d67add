"""OpenVINO in an artifact (issue 11's delegate contract): each compiled partition is exported by
OpenVINO at compile time and imported at load, so loading converts and compiles nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("openvino")

import backplane  # noqa: E402
from backplane import InferenceSession  # noqa: E402
from backplane.backends.openvino import delegate, workload  # noqa: E402
from backplane.runtime.loaded_network import ExecutionError  # noqa: E402

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


def test_an_artifact_keeps_the_checks_and_the_nan_keeping_model(tmp_path: Path) -> None:
    """A Gather whose indices are an input, a Relu after it: the loaded artifact checks the indices
    and imports the NaN-keeping model at the first run given NaN."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["g"], name="g"),
         helper.make_node("Relu", ["g"], ["y"], name="relu")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = tmp_path / "gather.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    artifact = tmp_path / "gather.bpa"
    backplane.compile(model, ["OpenVINO", "CpuRef"], artifact)
    loaded = InferenceSession(artifact)
    x = np.arange(12, dtype=np.float32).reshape(4, 3) - 6
    np.testing.assert_array_equal(loaded.run(None, {"x": x, "i": np.array([0, 3])})[0],
                                  np.maximum(x[[0, 3]], 0))
    with pytest.raises(ExecutionError, match="index 4 is out of range"):
        loaded.run(None, {"x": x, "i": np.array([0, 4])})
    x[0, 1] = np.nan
    got = loaded.run(None, {"x": x, "i": np.array([0, 3])})[0]
    assert np.isnan(got[0, 1]) and np.isfinite(np.delete(got.ravel(), 1)).all()
