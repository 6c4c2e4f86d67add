"""Real models (exported from torchvision / transformers architectures, and onnx's light CNNs) match
ONNX Runtime on CpuRef alone and on CpuRef behind a partial backend."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest

from backplane import InferenceSession

ort = pytest.importorskip("onnxruntime")

DATA = Path(__file__).resolve().parent.parent / "data"
TINY = ["tiny_mobilenet_v3", "tiny_bert", "tiny_gpt2"]
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
LIGHT = sorted(p.stem for p in LIGHT_DIR.glob("light_*.onnx"))
TOLERANCE = 1e-4  # max |diff| relative to the output's max |value|
BACKEND_LISTS = {"cpuref": ["CpuRef"], "partial+cpuref": ["TestPartial", "CpuRef"]}


def ort_outputs(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_close(actual: list[np.ndarray], expected: list[np.ndarray],
                 tolerance: float = TOLERANCE) -> None:
    """Same shapes and types; the max |difference| within ``tolerance`` of the max |value|."""
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.shape == want.shape and got.dtype == want.dtype
        scale = max(float(np.max(np.abs(want))), 1e-12)
        assert float(np.max(np.abs(got.astype(np.float64) - want))) / scale <= tolerance


@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("name", TINY)
def test_tiny_models_match_onnx_runtime(name: str, backends: list[str], partial_backends) -> None:
    path = DATA / f"{name}.onnx"
    feeds = dict(np.load(DATA / f"{name}.npz"))
    session = InferenceSession(path, backends=backends)
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))
    if backends[0] == "TestPartial":
        assert "TestPartial" in session.report.counts()


def light_inputs(path: Path) -> dict[str, np.ndarray]:
    """As onnx's runner feeds the light models: arange(n) / n, float32."""
    model = onnx.load(str(path))
    initializers = {init.name for init in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        n = int(np.prod(shape))
        feeds[vi.name] = (np.arange(n, dtype=np.float32) / n).reshape(shape)
    return feeds


# light_squeezenet's logits are 1000 equal values near 9.5e9 (its weights are constants), so its
# softmax output hangs on the last bit of each (one ulp there is 1024): compare the logits instead.
COMPARE_INSTEAD = {"light_squeezenet": "r65"}


@pytest.mark.skipif(not LIGHT, reason="the installed onnx ships no light models")
@pytest.mark.parametrize("name", LIGHT)
def test_onnx_light_models_match_onnx_runtime(name: str, tmp_path: Path) -> None:
    path = LIGHT_DIR / f"{name}.onnx"
    feeds = light_inputs(path)
    if name in COMPARE_INSTEAD:
        model = onnx.load(str(path))
        del model.graph.output[:]
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(COMPARE_INSTEAD[name]))
        path = tmp_path / f"{name}.onnx"
        onnx.save(model, str(path))
    session = InferenceSession(path, backends=["CpuRef"])
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))


ANCHORS = Path(os.environ.get("BACKPLANE_ANCHORS", "/nonexistent"))


@pytest.mark.skipif(not ANCHORS.is_dir(), reason="set BACKPLANE_ANCHORS to the exported anchor models")
@pytest.mark.parametrize("backends", BACKEND_LISTS.values(), ids=BACKEND_LISTS.keys())
@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v3_large", "efficientnet_b0",
                                  "bert_base_s128", "gpt2_6l_512_s128"])
def test_anchor_models_match_onnx_runtime(name: str, backends: list[str], partial_backends) -> None:
    from backplane.cli import random_input

    path = ANCHORS / f"{name}.onnx"
    session = InferenceSession(path, backends=backends)
    rng = np.random.default_rng(0)
    feeds = {arg.name: random_input(session.graph.info(arg.name), rng) for arg in session.get_inputs()}
    if "attention_mask" in feeds:
        feeds["attention_mask"][:] = 1
    assert_close(session.run(None, feeds), ort_outputs(path, feeds))
