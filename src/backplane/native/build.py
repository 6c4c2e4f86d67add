"""backplane's own C kernels, compiled on first use for the CPU they run on.

torch's kernels cost 1-12 us a call before any arithmetic (the dispatcher, a oneDNN partition's own
execute, a binding's conversions), and the corpus's small models are hundreds of such calls, each
doing less than a microsecond of work: a loop of C over planned buffers runs them at the cost of
the arithmetic (a recurrent step auto-vectorized for AVX2 took 7.2 us where torch's ops took 14;
docs/torch-backends.md). So the package ships plain C sources (no Python or torch headers: a
compile takes a second, not inductor's minute) and builds each, once per machine, into a shared
library loaded with ``ctypes``.

- **What is compiled** is only the package's own source, never anything a model file holds:
  loading a model never runs code from it. The library's name is the SHA-256 of everything that
  went into it (the source, the compiler and its version, the flags, the CPU's instruction sets),
  so a changed source (or a header beside it), compiler or machine builds again and never loads
  a stale library.
- **Where**: ``$BACKPLANE_NATIVE_CACHE``, else ``native`` beside CpuAcc's route cache
  (``$BACKPLANE_CACHE_DIR``, else ``~/.cache/backplane``), written to a temporary name and renamed into place, so that processes
  building the same library at once (pytest-xdist's workers) each load a whole one.
- **For this CPU**: ``-march=native`` (AVX2 and FMA where the CPU has them), ``-O3``; never
  ``-ffast-math``, which lets the compiler assume no NaN, where a NaN in must come out.
- **Without a compiler** (``$CC``, else ``cc``, ``gcc`` or ``clang`` on the PATH), or with
  ``BACKPLANE_NATIVE=0``, :func:`library` raises :class:`NativeUnavailable` naming why, and the
  callers keep their torch routes: nothing native is ever required.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("backplane.native")

SOURCES = Path(__file__).parent
"""The C sources shipped with the package: ``<name>.c`` builds the library ``<name>``."""
SWITCH = "BACKPLANE_NATIVE"
"""``BACKPLANE_NATIVE=0`` turns every native kernel off (the torch routes run instead)."""
FLAGS = ("-O3", "-march=native", "-std=c11", "-fPIC", "-shared", "-fno-math-errno")
"""No ``-ffast-math``: it lets the compiler assume no NaN and no infinity, where a NaN in must come
out; ``-fno-math-errno`` only drops ``errno`` from ``sqrtf`` and ``expf``."""
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "neon", "asimd", "sve")
"""The instruction sets a ``-march=native`` build may use: part of the library's key."""
COMPILE_SECONDS = 120.0
OPTION = "CpuAcc.native"
MODES = ("auto", "off")


def mode(options: Any) -> str:
    """``CpuAcc.native`` of ``options``: "auto" (the default: a native kernel where one is built for
    the layer and its route takes it) or "off" (torch's kernels only); an unknown value is an error
    at the load (``CpuAcc.create_backend_context``)."""
    from backplane.backends.api.backend import OptionError

    chosen = str(options.get(OPTION, "auto")).strip().lower()
    if chosen not in MODES:
        raise OptionError(f"{OPTION} {chosen!r} is not one of {', '.join(MODES)}")
    return chosen


class NativeUnavailable(RuntimeError):
    """No native library here: no compiler, turned off, or its build failed (the message says)."""


_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | NativeUnavailable] = {}


def library(name: str, version: int | None = None) -> ctypes.CDLL:
    """The library built from ``<name>.c``, built first where this machine has not built it yet.
    Raises :class:`NativeUnavailable` (the same one at every call of the process) where it cannot
    be had, or, given ``version``, where its ``backplane_<name>_version()`` says another (a
    source and a library of two trees: the caller's signatures would not be the library's)."""
    found = _library(name)
    if version is not None:
        said = getattr(found, f"backplane_{name}_version")()
        if said != version:
            raise NativeUnavailable(f"the {name} library is version {said}, not {version}")
    return found


def _library(name: str) -> ctypes.CDLL:
    with _lock:
        found = _loaded.get(name)
        if found is None:
            try:
                found = ctypes.CDLL(str(_built(name)))
            except NativeUnavailable as error:
                found = error
                log.info("native %s: not available (%s); the torch routes run instead", name, error)
            except OSError as error:
                found = NativeUnavailable(f"the built library {name!r} does not load: {error}")
            _loaded[name] = found
    if isinstance(found, NativeUnavailable):
        raise found
    return found


def available(name: str) -> bool:
    try:
        library(name)
    except NativeUnavailable:
        return False
    return True


def compiler() -> str | None:
    """The C compiler: ``$CC`` where set, else the first of ``cc``, ``gcc``, ``clang`` found."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named.split()[0])
    return next((found for found in map(shutil.which, ("cc", "gcc", "clang")) if found), None)


CACHE_VARIABLE = "BACKPLANE_NATIVE_CACHE"
"""The libraries' folder where set (a bench that empties the route cache for each process keeps
the machine's built libraries: they are the install's, not a measurement)."""


def cache_folder() -> Path:
    from backplane.backends.torch.route_cache import cache_file

    return Path(os.environ.get(CACHE_VARIABLE) or cache_file().parent / "native")


def _built(name: str) -> Path:
    if os.environ.get(SWITCH, "1").strip().lower() in ("0", "off", "false", "no"):
        raise NativeUnavailable(f"turned off by {SWITCH}={os.environ[SWITCH]}")
    source = SOURCES / f"{name}.c"
    if not source.is_file():
        known = sorted(path.stem for path in SOURCES.glob("*.c"))
        raise NativeUnavailable(f"no native source {name!r} (the package has: {', '.join(known)})")
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler (set CC, or install cc, gcc or clang)")
    key = _key(source.read_bytes() + _headers(), cc)
    target = cache_folder() / f"{name}-{key[:24]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(handle)
    command = [cc, *FLAGS, "-o", scratch, str(source), "-lm"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_SECONDS)
        if done.returncode != 0:
            raise NativeUnavailable(f"{' '.join(command)} failed ({done.returncode}): "
                                    f"{done.stderr.strip()[-2000:]}")
        os.replace(scratch, target)
    except subprocess.TimeoutExpired as error:
        raise NativeUnavailable(f"{' '.join(command)} ran past {COMPILE_SECONDS:.0f} s") from error
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    log.info("native %s: built %s", name, target)
    return target


def _headers() -> bytes:
    """Every header shipped beside the sources, names and contents: a source split into headers
    it includes (cnn.c's) builds again when one of them changes, never loading a stale library."""
    return b"".join(b"\0" + path.name.encode() + b"\0" + path.read_bytes()
                    for path in sorted(SOURCES.glob("*.h")))


def _key(source: bytes, cc: str) -> str:
    digest = hashlib.sha256(source)
    for part in (cc, _version(cc), " ".join(FLAGS), " ".join(_cpu_flags()), os.uname().machine):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.split("\n", 1)[0]
    except (OSError, subprocess.SubprocessError):
        return "?"


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as info:
            words = set(next((line for line in info if line.startswith(("flags", "Features"))),
                             "").split())
    except OSError:
        return []
    return [flag for flag in CPU_FLAGS if flag in words]
