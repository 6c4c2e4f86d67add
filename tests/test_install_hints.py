"""Install hints work from wherever the user is (issue 31, item 2): none names an extra of
backplane-nn (not on the package index), each names the packages pyproject.toml's extra adds, with
its versions, and torch's is PyTorch's CPU command (the index alone brings the CUDA build)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backplane.install_hints import HINTS, TORCH_CPU

ROOT = Path(__file__).resolve().parents[1]


def _extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]


@pytest.mark.parametrize("extra", sorted(HINTS))
def test_each_hint_installs_what_its_extra_adds(extra: str) -> None:
    wanted = _extras()[extra]
    for requirement in wanted:
        assert requirement in HINTS[extra] or (extra == "torch" and requirement.startswith("torch")), \
            f"{extra}: the hint {HINTS[extra]!r} does not install {requirement!r}"


def test_torchs_hint_is_the_cpu_wheel_command() -> None:
    assert HINTS["torch"].startswith(TORCH_CPU)
    assert "download.pytorch.org/whl/cpu" in TORCH_CPU


def test_no_message_or_page_tells_to_install_an_extra_from_the_package_index() -> None:
    """`pip install 'backplane-nn[x]'` fails: backplane-nn is not on the index. From a checkout,
    `pip install -e ".[x]"` is right, and README's commands say so."""
    files = [*ROOT.joinpath("src").rglob("*.py"), *ROOT.joinpath("docs").glob("*.md"),
             ROOT / "README.md"]
    found = [f"{path.relative_to(ROOT)}: {line.strip()}" for path in files
             for line in path.read_text().splitlines()
             if re.search(r"pip install\s+['\"]?backplane-nn\[", line)]
    assert not found, found


def test_cpuaccs_unavailable_reason_gives_the_cpu_command(monkeypatch) -> None:
    import importlib.util

    from backplane.backends.torch.backend import CpuAcc

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torch" else real(name, *a))
    reason = CpuAcc().availability().reason
    assert "torch is not installed" in reason and TORCH_CPU in reason, reason
