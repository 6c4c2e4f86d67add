"""CpuAcc keeps freed tensor memory for the next run (``memory.py``, ``CpuAcc.keep_memory``): a
U-Net-like model at 256x256 whose megabyte tensors glibc's malloc mapped afresh every run (a page
fault per 4 KB page at its first touch) runs with almost no page fault once warm, and gives CpuRef's
values. Each session runs in a child process of its own: the setting is process-wide."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")
if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
    pytest.skip("malloc's thresholds are glibc's", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]
CHILD = """
import json, resource, sys
import numpy as np
from backplane import InferenceSession

path, keep = sys.argv[1], sys.argv[2] == "1"
if not keep:  # glibc's first threshold, held: its dynamic one rises to the largest block freed
    import ctypes, ctypes.util  # (up to 32 MB), or not, by the history of the process's frees
    ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt(-3, 128 * 1024)
x = np.random.default_rng(0).standard_normal((1, 3, 256, 256)).astype(np.float32)
session = InferenceSession(path, backends=[("CpuAcc", {"keep_memory": keep, "threads": 1}), "CpuRef"])
for _ in range(5):
    got = session.run(None, {"x": x})[0]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    got = session.run(None, {"x": x})[0]
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
want = InferenceSession(path, backends=["CpuRef"]).run(None, {"x": x})[0]
print(json.dumps({"faults": faults, "diff": float(np.abs(got - want).max()), "mb": got.nbytes / 2**20}))
"""


def unet_like(path: Path) -> Path:
    """Conv -> Relu -> MaxPool -> Conv -> Relu -> Resize x2 -> Concat with the first Relu -> Conv:
    16-32 channels at 256x256, tensors of 2-8 MB."""
    rng = np.random.default_rng(1)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)

    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], **conv),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], **conv),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Resize", ["r2", "", "scales"], ["up"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Concat", ["up", "r1"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", "w3", "b3"], ["y"], **conv),
    ]
    inits = [weight("w1", 16, 3, 3, 3), weight("b1", 16), weight("w2", 32, 16, 3, 3),
             weight("b2", 32), weight("w3", 8, 48, 3, 3), weight("b3", 8),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    graph = helper.make_graph(
        nodes, "unet_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 256, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 256, 256])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    onnx.checker.check_model(model)
    onnx.save(model, path / "unet_like.onnx")
    return path / "unet_like.onnx"


def _child(model: Path, keep: bool) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(model), "1" if keep else "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_warm_run_reuses_the_memory_of_the_last(tmp_path: Path) -> None:
    model = unet_like(tmp_path)
    kept, mapped = _child(model, True), _child(model, False)
    # the output alone is 2 MB, 512 pages: at glibc's first threshold its tensors' memory is mapped
    # again every run (6,368 faults a run here); whether glibc's own threshold rises past them
    # depends on the process's earlier frees (0-100 faults in some runs of this child, 2,950 a run
    # for unet_resize_dyn20 at 256x256); kept, a run faults only where malloc's heap grows once
    assert mapped["faults"] > 2000, mapped
    assert kept["faults"] < mapped["faults"] / 20, (kept, mapped)
    assert kept["diff"] < 1e-4 and mapped["diff"] < 1e-4, (kept, mapped)


def test_a_setting_that_is_not_a_boolean_is_an_error_naming_it() -> None:
    from backplane.backends.torch import memory

    with pytest.raises(ValueError, match="CpuAcc.keep_memory must be True or False, not 'maybe'"):
        memory.keep_freed_memory("maybe")
