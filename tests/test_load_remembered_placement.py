"""A default session remembers, per model file and machine, that its placement ran on no backend
of torch's (``deferred_load.remember``, the route cache); the next one loads on CpuRef alone and
never imports torch (issue 27 item 5: cond_nested_dyn18's sessions imported torch only to time
CpuAcc against CpuRef and drop it).

Fresh processes (a default session defers only where torch is not imported), one cache folder:
a model CpuAcc claims no layer of (StringNormalizer: strings) imports torch in the first process
and not in the second, its outputs the same; a model with CpuAcc's layers (an LSTM) is not
remembered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from backplane import deferred_load
from backplane.backends.torch import route_cache

ROOT = Path(__file__).resolve().parent.parent

_FRESH = """
import json, sys
import numpy as np
import backplane
session = backplane.InferenceSession(sys.argv[1])
if sys.argv[1].endswith("strings.onnx"):
    feeds = {"text": np.array(["Hello", "WORLD"], dtype=object)}
else:
    sample = np.load(sys.argv[1][:-5] + ".s0.npz")
    feeds = {i.name: sample[i.name] for i in session.get_inputs()}
first = session.run(None, feeds)[0]  # on CpuRef where it bridges the background load
counts = session.report.counts()  # waits for that load
waited = "torch" in sys.modules
print(json.dumps({"torch": waited, "counts": counts, "first": first.tolist()}))
"""


def _strings(path: Path) -> Path:
    node = helper.make_node("StringNormalizer", ["text"], ["normalized"],
                            case_change_action="LOWER")
    graph = helper.make_graph([node], "strings",
                              [helper.make_tensor_value_info("text", TensorProto.STRING, [2])],
                              [helper.make_tensor_value_info("normalized", TensorProto.STRING,
                                                             [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.save(model, path)
    return path


def _fresh(model: Path, cache: Path) -> dict:
    if any(map(os.path.exists, deferred_load._GPU_DEVICES)):
        pytest.skip("a GPU device here: a default session is torch's from its load (GpuAcc may "
                    "come first), so no default session defers torch's import")
    env = {**os.environ, route_cache.CACHE_VARIABLE: str(cache)}
    done = subprocess.run([sys.executable, "-c", _FRESH, str(model)], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _entries(cache: Path) -> dict:
    path = cache / route_cache.FILE_NAME
    return json.loads(path.read_text()) if path.exists() else {}


def test_a_placement_without_torch_is_remembered_and_the_next_session_skips_the_import(
        tmp_path: Path) -> None:
    pytest.importorskip("torch")
    model, cache = _strings(tmp_path / "strings.onnx"), tmp_path / "cache"
    first = _fresh(model, cache)
    assert first["torch"] and set(first["counts"]) == {"CpuRef"}
    key = route_cache.placement_key(model, {})
    assert _entries(cache) == {key: route_cache.WITHOUT_TORCH}
    second = _fresh(model, cache)
    assert second == {**first, "torch": False}
    assert second["first"] == ["hello", "world"]


def test_a_placement_with_cpuacc_is_not_remembered(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    cache = tmp_path / "cache"
    seen = _fresh(ROOT / "tests" / "data" / "corpus" / "lstm_bi2_ts14.onnx", cache)
    assert seen["torch"] and "CpuAcc" in seen["counts"]
    assert route_cache.WITHOUT_TORCH not in _entries(cache).values()
    np.testing.assert_array_equal(np.isfinite(np.array(seen["first"])), True)


def test_the_key_is_the_model_and_its_options(tmp_path: Path) -> None:
    model = _strings(tmp_path / "strings.onnx")
    key = route_cache.placement_key(model, {})
    assert key == route_cache.placement_key(model, {})
    assert key != route_cache.placement_key(model, {"CpuAcc.threads": 1})
    other = tmp_path / "other.onnx"
    other.write_bytes(model.read_bytes() + b"\0")
    assert key != route_cache.placement_key(other, {})
    assert route_cache.placement_key(tmp_path / "missing.onnx", {}) is None


def test_torchs_version_is_read_from_its_package_without_importing_it() -> None:
    """Where torch has no distribution metadata (the GPU machine's), the key reads torch's
    version.py as text: the same version torch says when imported."""
    torch = pytest.importorskip("torch")
    assert route_cache._torch_version_file() == str(torch.__version__)
