"""libgomp's spin before an idle OpenMP thread sleeps (``backends/torch/spin.py``): backplane sets
``GOMP_SPINCOUNT`` before it imports torch itself, only where no one has set an OpenMP wait, and
leaves the environment alone where torch was imported first (libgomp read it then)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from backplane.backends.torch import spin

PROBE = """
import json, os, sys
{before}
import numpy as np
from onnx import TensorProto, helper
import backplane
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
model.ir_version = 9
after_import = os.environ.get("GOMP_SPINCOUNT")
session = backplane.InferenceSession(model.SerializeToString(), ["CpuAcc", "CpuRef"])
(y,) = session.run(None, {{"x": np.array([[-1, 2, -3, 4]], np.float32)}})
print(json.dumps([after_import, os.environ.get("GOMP_SPINCOUNT"),
                  os.environ.get("OMP_WAIT_POLICY"), y.tolist()]))
"""


def _probe(env: dict[str, str], before: str = "") -> list:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", PROBE.format(before=before)],
                          env={**clean, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_cpuacc_session_sets_the_short_spin_where_none_is_given() -> None:
    pytest.importorskip("torch")
    after_import, after_load, policy, y = _probe({})
    assert after_import is None  # importing backplane changes nothing
    assert (after_load, policy) == (spin.SPINCOUNT, None)  # the backend's torch import did
    assert y == [[0.0, 2.0, 0.0, 4.0]]


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "300000"}, {"OMP_WAIT_POLICY": "ACTIVE"}])
def test_a_users_openmp_setting_is_left_as_it_is(env) -> None:
    pytest.importorskip("torch")
    _, after_load, policy, _ = _probe(env)
    assert (after_load, policy) == (env.get("GOMP_SPINCOUNT"), env.get("OMP_WAIT_POLICY"))


def test_nothing_changes_where_torch_was_imported_first() -> None:
    pytest.importorskip("torch")
    _, after_load, policy, _ = _probe({}, before="import torch")
    assert (after_load, policy) == (None, None)


def test_the_rule_itself() -> None:
    imported = "torch" in sys.modules
    environ: dict[str, str] = {}
    assert spin.prefer_short_spins(environ) is not imported
    assert environ == ({} if imported else {"GOMP_SPINCOUNT": spin.SPINCOUNT})
    for given in ({"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        environ = dict(given)
        assert spin.prefer_short_spins(environ) is False and environ == given
