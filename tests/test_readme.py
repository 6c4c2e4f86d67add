"""The README's Python code blocks run as they are written, in order, from the repository's root
(where their relative model paths resolve), and say what they print."""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
        blocks.append((text.count("\n", 0, match.start()) + 2, match.group(1)))
    return blocks


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    blocks = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 3
    assert any("SessionOptions" in code and "end_profiling" in code for _, code in blocks)


def test_the_readmes_python_blocks_run_verbatim(monkeypatch) -> None:
    pytest.importorskip("torch")  # the ONNX Runtime-style block uses CpuAcc
    from backplane.backends.registry import registry

    monkeypatch.chdir(ROOT)
    before_ids = set(registry.ids())
    profiles_before = set(glob.glob("/tmp/mobilenet_*.json"))
    namespace: dict = {"__name__": "readme"}
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            for line, code in python_blocks((ROOT / "README.md").read_text(encoding="utf-8")):
                exec(compile("\n" * (line - 1) + code, "README.md", "exec"), namespace)  # noqa: S102
    finally:
        for backend_id in set(registry.ids()) - before_ids:  # the README registers one
            registry.deregister(backend_id)
        written = set(glob.glob("/tmp/mobilenet_*.json")) - profiles_before
        for path in written:
            os.remove(path)
    out = printed.getvalue()
    assert "NodeArg(name='input', shape=[1, 3, 224, 224], type='tensor(float)')" in out
    assert "pytorch" in out
    assert re.search(r"/tmp/mobilenet_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d(_\d+)?\.json", out)
    assert len(written) == 1
    assert "{'CpuRef': 107, 'MyRelu': 12}" in out  # what the block's comment says
    assert namespace["logits"].shape == (1, 10)
