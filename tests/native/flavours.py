"""A native library built for another CPU than this one's ``-march=native``: how the tests run
the paths a CI machine without AVX-512 or VNNI takes (the AVX2 build, plain x86-64's) on any x86
machine, beside the session's own build."""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Sequence
from pathlib import Path

from backplane.native import build


def built(name: str, march: str | Sequence[str], folder: Path) -> ctypes.CDLL:
    """``native/<name>.c`` built with build.FLAGS but ``march`` (an -march value, or flags that
    replace ``-march=native``: ``["-march=native", "-mno-avx512f"]``) into ``folder``, loaded.
    Not keyed nor cached as ``build.library``'s: each call compiles."""
    flags = [f"-march={march}"] if isinstance(march, str) else list(march)
    command = [f for f in build.FLAGS if f != "-march=native"] + flags
    suffix = "_".join(f.lstrip("-").replace("=", "-") for f in flags)
    target = folder / f"{name}_{suffix}.so"
    subprocess.run([build.compiler(), *command, "-o", str(target),
                    str(build.SOURCES / f"{name}.c"), "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(str(target))
