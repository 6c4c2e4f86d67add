"""A default session that never imports torch where CpuAcc runs the whole model in backplane's C
(``backplane.torch_free``, issue 27 item 5).

In a fresh process (this one has imported torch, and a default session defers only where torch is
not imported): the session loads and runs the corpus's natively planned CNNs with torch never in
``sys.modules``, and its outputs are, bit for bit, those of a session given CpuAcc, CpuRef here
(torch's path: the same plan run from torch's tensors). A model the plan takes above its size rule
(the demo: 33.6e6 multiply-adds) runs the plan until torch's load is done, then torch's route.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession, deferred_load, torch_free
from backplane.frontends.onnx import import_onnx
from backplane.frontends.onnx_file import read_model

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "corpus"
DEMO = ROOT / "models" / "mobilenet_v2_w020_c10.onnx"
NATIVE = ("resnet_basic_ts16", "mobilenet_dw_ts13", "unet_resize_dyn20", "resnet_qlinear_ort15",
          "mobilenet_fp16_ts17")  # float16 at its edges, converted by the C

_FRESH = """
import json, sys
import numpy as np
import backplane
out, seen = sys.argv[1], {}
for path in sys.argv[2:]:
    static = path.startswith("static:")  # the inputs' shapes given: planned at load, in a thread
    path = path.removeprefix("static:")
    shapes = {"input": [1, 3, 32, 32]} if static else None
    session = backplane.InferenceSession(path, input_shapes=shapes)
    if path.endswith("mobilenet_v2_w020_c10.onnx"):
        feeds = {"input": np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)}
    else:
        sample = np.load(path[:-5] + ".s0.npz")
        feeds = {i.name: sample[i.name] for i in session.get_inputs()}
    providers = session.get_providers()  # the default list, not waiting for torch's load
    first = session.run(None, feeds)
    again = session.run(None, feeds)
    seen[path] = {"torch": "torch" in sys.modules, "kind": type(session._later).__name__,
                  "providers": providers}
    np.savez(f"{out}/{len(seen)}.npz", *first, *again)
print(json.dumps(seen))
"""


def _native_available() -> None:
    from backplane import native

    if not (native.available("cnn") and native.available("qcnn")):
        pytest.skip("no C compiler: the native plans (and this route) are not built here")


def _fresh(paths: Sequence[Path | str], out: Path) -> dict:
    if any(map(os.path.exists, deferred_load._GPU_DEVICES)):
        pytest.skip("a GPU device here: a default session is torch's from its load (GpuAcc may "
                    "come first), so no default session defers torch's import")
    done = subprocess.run([sys.executable, "-c", _FRESH, str(out), *map(str, paths)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_static_inputs_are_planned_at_load_without_torch(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _native_available()
    path = CORPUS / "resnet_basic_ts16.onnx"
    seen = _fresh([f"static:{path}"], tmp_path)
    assert seen[str(path)] == {"torch": False, "kind": "TorchFree",
                               "providers": ["CpuAcc", "CpuRef"]}
    wanted = _torch_path(path, 8)
    got = np.load(tmp_path / "1.npz")
    for i, theirs in enumerate(wanted + wanted):
        np.testing.assert_array_equal(got[f"arr_{i}"], theirs)


def _torch_path(path: Path, count: int) -> list[np.ndarray]:
    session = InferenceSession(path, providers=["CpuAcc", "CpuRef"])
    sample = np.load(str(path)[:-5] + ".s0.npz")
    return session.run(None, {i.name: sample[i.name] for i in session.get_inputs()})[:count]


def test_native_models_load_and_run_without_torch_and_give_its_outputs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _native_available()
    from backplane.native import library

    half = library("cnn").backplane_cnn_half()  # else torch converts the float16 edges
    paths = [CORPUS / f"{name}.onnx" for name in NATIVE if half or "fp16" not in name]
    seen = _fresh(paths, tmp_path)
    for index, path in enumerate(paths, 1):
        assert seen[str(path)] == {"torch": False, "kind": "TorchFree",
                                   "providers": ["CpuAcc", "CpuRef"]}, path.name
        wanted = _torch_path(path, 8)
        got = np.load(tmp_path / f"{index}.npz")
        arrays = [got[f"arr_{i}"] for i in range(len(got.files))]
        assert len(arrays) == 2 * len(wanted)
        for mine, theirs in zip(arrays, wanted + wanted):  # the first run and the next
            np.testing.assert_array_equal(mine, theirs, err_msg=path.name)


def test_a_model_above_the_native_rule_imports_torch_and_runs_as_before(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    _native_available()
    seen = _fresh([DEMO], tmp_path)
    assert seen[str(DEMO)] == {"torch": True, "kind": "NoneType",  # taken over: torch's session
                               "providers": ["CpuAcc", "CpuRef"]}
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    wanted = InferenceSession(DEMO, providers=["CpuAcc", "CpuRef"]).run(None, {"input": x})[0]
    got = np.load(tmp_path / "1.npz")
    np.testing.assert_allclose(got["arr_0"], wanted, rtol=1e-5, atol=1e-6)  # oneDNN's threads


_BRIDGE = """
import json, sys
import numpy as np
import backplane
x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
session = backplane.InferenceSession(sys.argv[1])
first = session.run(None, {"input": x})[0]
free = session._later
seen = {"kind": type(free).__name__, "bridge": free.bridge is not None,
        "warmed": free.later is not None and free.later.feeds is not None}
x[:] = 0  # the caller's array: the background load's first run holds a copy
assert free.wait(600)
then = session.run(None, {"input": np.random.default_rng(0).random((1, 3, 224, 224),
                                                                  dtype=np.float32)})[0]
seen.update({"then": type(session._later).__name__, "torch": "torch" in sys.modules,
             "providers": session.get_providers()})
np.savez(sys.argv[2], first, then)
print(json.dumps(seen))
"""


def test_a_model_above_the_native_rule_runs_its_plan_until_torchs_load_is_done(
        tmp_path: Path) -> None:
    """The demo (33.6e6 multiply-adds, above the native rule): its first run takes the native
    plan while torch's load is under way (its outputs the plan's, bit for bit), hands the feeds
    to that load for a first run of its own, and once the load is done the session is torch's
    (its outputs those of a session given CpuAcc, CpuRef)."""
    pytest.importorskip("torch")
    _native_available()
    if any(map(os.path.exists, deferred_load._GPU_DEVICES)):
        pytest.skip("a GPU device here: a default session is torch's from its load")
    done = subprocess.run([sys.executable, "-c", _BRIDGE, str(DEMO), str(tmp_path / "out.npz")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"kind": "TorchFree", "bridge": True, "warmed": True, "then": "NoneType",
                    "torch": True, "providers": ["CpuAcc", "CpuRef"]}
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    graph = import_onnx(read_model(DEMO)).private_copy()
    from backplane.optimizer.optimize import OptimizerOptions, _run_passes

    _run_passes(graph, OptimizerOptions())
    plan = torch_free.build(graph, {}, [x.shape], rule=False)
    got = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(got["arr_0"], plan(x)[0])
    wanted = InferenceSession(DEMO, providers=["CpuAcc", "CpuRef"]).run(None, {"input": x})[0]
    np.testing.assert_allclose(got["arr_1"], wanted, rtol=1e-5, atol=1e-6)  # oneDNN's threads
    np.testing.assert_allclose(got["arr_0"], wanted, rtol=1e-4, atol=1e-5)


def test_a_plan_above_the_rule_is_built_only_as_a_bridge() -> None:
    _native_available()
    graph = import_onnx(read_model(DEMO)).private_copy()
    from backplane.optimizer.optimize import OptimizerOptions, _run_passes

    _run_passes(graph, OptimizerOptions())
    assert torch_free.build(graph.private_copy(), {}, [(1, 3, 224, 224)]) is None  # the rule
    bridge = torch_free.build(graph.private_copy(), {}, [(1, 3, 224, 224)], rule=False)
    assert bridge is not None and bridge.above_rule
    small = _graph("resnet_basic_ts16")
    below = torch_free.build(small, {}, [(1, 3, 32, 32)], rule=False)
    assert below is not None and not below.above_rule


def _graph(name: str):
    from backplane.optimizer.optimize import OptimizerOptions, _run_passes

    graph = import_onnx(read_model(CORPUS / f"{name}.onnx")).private_copy()
    _run_passes(graph, OptimizerOptions())
    return graph


def test_what_the_route_takes_at_load() -> None:
    graph = _graph("resnet_basic_ts16")
    assert torch_free.candidate(graph, {})
    assert not torch_free.candidate(graph, {"CpuAcc.native": "off"})
    assert not torch_free.candidate(graph, {"CpuAcc.compile": "layers"})
    assert not torch_free.candidate(graph, {"CpuAcc.precision": "bf16"})
    assert not torch_free.candidate(_graph("lstm_bi2_ts14"), {})  # an LSTM: torch's
    assert not torch_free.candidate(_graph("cond_nested_dyn18"), {})  # control flow


def test_without_a_compiler_or_with_native_off_the_route_is_not_taken(
        monkeypatch: pytest.MonkeyPatch) -> None:
    graph = _graph("resnet_basic_ts16")
    monkeypatch.setenv("BACKPLANE_NATIVE", "0")
    assert not torch_free.candidate(graph, {})
    monkeypatch.delenv("BACKPLANE_NATIVE")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert not torch_free.candidate(graph, {})


def test_a_signature_the_plan_does_not_take_has_no_build() -> None:
    _native_available()
    graph = _graph("resnet_basic_ts16")
    assert torch_free.build(graph.private_copy(), {}, [(1, 3, 32, 32)]) is not None
    assert torch_free.build(graph.private_copy(), {}, [(4, 3, 512, 512)]) is None  # the rule
