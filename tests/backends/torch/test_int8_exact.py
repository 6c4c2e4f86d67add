"""CpuAcc's int8 routes only where this CPU's int8 kernels are exact (``fusion/int8_exact``): on a
CPU without VNNI oneDNN adds pairs of u8 x s8 products in 16 bits and saturates, so "auto" takes
the float routes there. Such a CPU is made here by oneDNN's own switch, ``ONEDNN_MAX_CPU_ISA=AVX2``,
in a child process: an ONNX Runtime-quantized CNN's large convolutions, which take the int8 route
without timing on a CPU with VNNI (test_int8_routes.py), run on the float route and give CpuRef's
values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime.quantization")

from backplane.backends.torch.fusion import int8_exact  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
CHILD = """
import json, sys
import numpy as np
from pathlib import Path
from backplane import InferenceSession
from backplane.backends.torch.fusion import int8_exact
from tests.backends.torch.test_int8_routes import feeds, quantized
from tests.conftest import inner_workloads

path = quantized(Path(sys.argv[1]), "QDQ")
session = InferenceSession(path, backends=[("CpuAcc", {"route_cache": False}), "CpuRef"])
reference = InferenceSession(path, backends=["CpuRef"])
routes = [getattr(w, "route", None) for w in inner_workloads(session, "QLinearConv")]
equal = all(np.array_equal(g, w) for seed in range(2)
            for g, w in zip(session.run(None, feeds(seed)), reference.run(None, feeds(seed))))
print(json.dumps({"exact": int8_exact.exact_kernels(), "routes": routes, "equal": equal}))
"""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def test_the_probe_finds_exact_kernels_on_a_cpu_with_vnni() -> None:
    flags = _cpu_flags()
    if not flags & {"avx512_vnni", "avx_vnni", "amx_int8"}:
        pytest.skip("this CPU has no VNNI: its kernels may saturate (the next test covers it)")
    assert int8_exact.exact_kernels()
    assert int8_exact.mode("auto") == "auto" and int8_exact.mode("kernels") == "kernels"


def test_without_vnni_the_int8_routes_give_way_to_exact_float_ones(tmp_path: Path) -> None:
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exact"] is False  # oneDNN's AVX2 int8 convolution saturates
    assert "int8" not in result["routes"], result["routes"]  # no QLinearConv on its int8 route
    assert result["equal"]  # CpuRef's values bit for bit


@pytest.mark.parametrize("exact", [True, False], ids=["vnni", "saturating"])
def test_kernels_asked_on_a_saturating_cpu_warns(exact: bool, monkeypatch) -> None:
    """"kernels" is the caller's choice on every CPU, but where the probe finds the kernels
    saturating its answers are not CpuRef's (up to 32 steps off on a QDQ convolution on this AVX2
    EPYC): that is said, where "auto" and "exact" say nothing and take the float routes."""
    import warnings

    monkeypatch.setattr(int8_exact, "exact_kernels", lambda: exact)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert int8_exact.mode("kernels") == "kernels"
        assert int8_exact.mode("auto") == ("auto" if exact else "exact")
        assert int8_exact.mode("exact") == "exact"
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert said == ([] if exact else [int8_exact.SATURATING])
