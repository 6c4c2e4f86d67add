"""What ``import backplane`` and a plain session leave unimported (issue 27, item 5: load time).

A fresh process each: the modules a cold ``import backplane`` and a CpuRef session of the demo
model bring in, against those only some paths need (the artifact's writer and reader, rich's
tables and bars, torch). Counts of modules, never wall times: the machine's load is not the code's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "mobilenet_v2_w020_c10.onnx"
NOT_ON_A_PLAIN_LOAD = ("rich", "backplane.artifact.compiler", "backplane.artifact.codec",
                       "backplane.artifact.cache", "torch", "openvino",
                       "onnx.reference", "hypothesis", "ray")


def _imported(code: str) -> set[str]:
    """The modules (and their packages' top names) a fresh interpreter holds after ``code``."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=True)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def _unwanted(modules: set[str]) -> list[str]:
    return sorted(m for m in modules
                  if any(m == name or m.startswith(name + ".") for name in NOT_ON_A_PLAIN_LOAD))


def test_import_backplane_leaves_the_heavy_paths_out() -> None:
    assert _unwanted(_imported("import backplane")) == []


def test_a_cpuref_session_of_the_demo_leaves_them_out() -> None:
    modules = _imported(f"import backplane\nbackplane.InferenceSession({str(DEMO)!r}, "
                        f"providers=['CpuRef'])")
    assert _unwanted(modules) == []


@pytest.mark.parametrize("name", ["compile", "ArtifactError"])
def test_the_lazy_names_are_the_artifacts(name: str) -> None:
    import backplane
    from backplane import artifact

    assert getattr(backplane, name) is getattr(artifact, name)
    assert name in backplane.__all__


def test_an_unknown_name_is_still_an_attribute_error() -> None:
    import backplane

    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        backplane.nothing_here  # noqa: B018
