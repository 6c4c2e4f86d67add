"""The install the README gives is the one CI runs (issue 19, items 1 and 2): .ci/run holds the README's
two commands word for word, the test command takes torch's CPU-only build, and the distribution's
name (free on the package index) is the one the README, the example backend and the install hints
use."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import backplane

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTION = "backplane-nn"


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Two commands on a fresh machine"):text.index("## Use\n")]
    return re.findall(r"^```bash\n(.*?)\n```", section, re.M | re.S)


def test_ci_runs_the_readmes_two_commands_word_for_word() -> None:
    commands = readme_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith("#")]
    assert commands[0] in ci and commands[1] in ci
    assert ci.index(commands[0]) < ci.index(commands[1])
    assert "pip " not in " ".join(c for c in ci if c not in commands)  # nothing else installed


def test_the_test_command_takes_torchs_cpu_build() -> None:
    test_command = readme_commands()[1]
    cpu_torch = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu_torch in test_command
    assert test_command.index(cpu_torch) < test_command.index('pip install -e ".[test]"')
    assert test_command.endswith("&& python -m pytest -n logical")


def test_ci_runs_the_slow_tests_after_the_readmes_tests() -> None:
    """The README's command leaves the tests marked slow out (tests/conftest.py); .ci/run runs them
    right after it, so that CI still runs every test (issue 31, item 3)."""
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith("#")]
    slow = "python -m pytest -n logical -m slow"
    assert ci.index(slow) == ci.index(readme_commands()[1]) + 1
    assert 'markers = ["slow: ' in (ROOT / "pyproject.toml").read_text()  # --strict-markers' list


SELECTION = """
import pytest

def test_quick():
    pass

@pytest.mark.slow
def test_sweep():
    pass
"""


def run_pytest(folder: Path, *args: str) -> str:
    """The last line of a pytest run in ``folder`` with this suite's conftest and slow marker."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=folder, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return done.stdout.strip().splitlines()[-1]


def test_the_default_run_leaves_the_slow_tests_out_and_names_or_marks_take_them(tmp_path) -> None:
    """With no path and no -m, the slow test is deselected; -m slow runs it alone; a named file,
    or -m "slow or not slow", runs both: the two selections CI runs are all the tests."""
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_two.py").write_text(SELECTION)
    (tmp_path / "suite" / "conftest.py").write_text(
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "pytest.ini").write_text('[pytest]\ntestpaths = suite\nmarkers = slow: long\n')
    assert run_pytest(tmp_path).startswith("1 passed, 1 deselected")
    assert run_pytest(tmp_path, "-m", "slow").startswith("1 passed, 1 deselected")
    assert run_pytest(tmp_path, "suite/test_two.py").startswith("2 passed")
    assert run_pytest(tmp_path, "-m", "slow or not slow").startswith("2 passed")


def test_one_distribution_name_everywhere() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(rf'^name = "{DISTRIBUTION}"', pyproject, re.M)
    assert re.search(rf'^version = "{re.escape(backplane.__version__)}"', pyproject, re.M)
    example = (ROOT / "examples" / "acme_tiny" / "pyproject.toml").read_text()
    assert f'dependencies = ["{DISTRIBUTION}", "numpy"]' in example
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"The package is `{DISTRIBUTION}`" in readme
    source = (ROOT / "src" / "backplane" / "backends" / "torch" / "backend.py").read_text()
    assert "torch is not installed ({hint('torch')})" in source  # tests/test_install_hints.py
