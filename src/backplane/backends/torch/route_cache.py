"""CpuAcc's measured routes, kept on disk.

Which kernel route is fastest for a layer (oneDNN, MKL, torch's own) is measured at load; that is most
of CpuAcc's load time (BERT-base: several seconds). The answer depends on the layer's shape and
attributes, the library doing the work, the thread count and the processor, so those are the key; a
changed key measures again by itself. The cache is one JSON file in ``$BACKPLANE_CACHE_DIR`` (default
``$XDG_CACHE_HOME/backplane`` or ``~/.cache/backplane``); the option ``CpuAcc.route_cache`` (default
True) turns it off. A missing, unreadable or corrupt file is an empty cache, never an error.

A route is kept for good, so one measured under noise must not be: a busy machine (the load
average, ``threads.crowded``) measures nothing, and a measurement made is kept only where it ran
alone (``watched``: the process's threads waited for a CPU less than ``QUIET_WAIT`` of its time),
since a neighbour that began within the last minute does not show in the load average.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CACHE_VARIABLE = "BACKPLANE_CACHE_DIR"
FILE_NAME = "cpuacc-routes.json"
CACHE_VERSION = 1  # bump when a route's meaning changes
KEPT: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "backplane_kept_routes", default=None)
"""Routes by key kept outside the disk cache while set: looked up first, and every route looked
up or stored is added (CpuAcc's artifact blob: ``delegate``)."""


QUIET_WAIT = 0.1
"""A measurement ran alone where this process's threads waited for a CPU (another task on it)
less than this share of its wall time: 0.0-0.01 alone, 1.4 and more beside a busy neighbour
(``threads.waited_for_cpus``)."""


@contextlib.contextmanager
def watched() -> Iterator[Callable[[], str]]:
    """A measurement's block, and after it a function that says why its result must not be kept
    ("" where it may: it ran alone, or the kernel does not say how long the threads waited)."""
    from backplane.backends.torch import threads

    if not threads.CROWDED_CHECK:  # the tests' and --quiet-path's: whatever else runs
        yield lambda: ""
        return
    before, start = threads.waited_for_cpus(), time.perf_counter()
    verdict: list[str] = []
    yield lambda: verdict[0]
    after, wall = threads.waited_for_cpus(), time.perf_counter() - start
    waited = 0.0 if before is None or after is None else max(0.0, after - before)
    verdict.append(f"measured beside other work (its threads waited {waited * 1e3:.1f} ms for a "
                   f"CPU in {wall * 1e3:.1f} ms)" if waited > QUIET_WAIT * wall else "")


def cache_file() -> Path:
    root = os.environ.get(CACHE_VARIABLE)
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "backplane")
    return Path(root) / FILE_NAME


def key(kind: str, description: dict[str, Any], threads: int | None = None) -> str:
    """The cache key of one layer's measurement: what it is, and where and with what it ran (at
    ``threads``, by default the calling thread's torch count)."""
    import torch

    from backplane.backends.torch.backend import TorchBackend

    identity = {"kind": kind, "layer": description, "cache": CACHE_VERSION,
                "backend": TorchBackend.version, "torch": torch.__version__,
                "threads": threads or torch.get_num_threads(), "cpu": _processor()}
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def lookup(cache_key: str) -> str | None:
    kept = KEPT.get()
    if kept is not None and cache_key in kept:
        return kept[cache_key]
    route = _entries(cache_file()).get(cache_key)
    if kept is not None and route is not None:
        kept[cache_key] = route
    return route


def store(cache_key: str, route: str) -> None:
    """Record a route; a cache that cannot be written is left as it is."""
    kept = KEPT.get()
    if kept is not None:
        kept[cache_key] = route
    path = cache_file()
    entries = _entries(path)
    entries[cache_key] = route
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as tmp:
            json.dump(entries, tmp)
        os.replace(tmp.name, path)  # whole or not at all, also with other processes writing
    except OSError:
        pass


def _entries(path: Path) -> dict[str, str]:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


@functools.lru_cache(maxsize=1)
def _processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


WITHOUT_TORCH = "without torch"
"""A model's remembered placement (``placement_key``): its default session ran on no backend of
torch's (CpuAcc timed slower than CpuRef by ``against_cpu``, or claiming none of its layers)."""


def _torch_version_file() -> str | None:
    """torch's version from its package's own ``version.py`` (where the GPU machine's torch has
    no distribution metadata), read as text: importing it would import torch."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or ()) if spec else ():
        try:
            text = (Path(folder) / "version.py").read_text()
        except OSError:
            continue
        found = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if found:
            return found.group(1)
    return None


def placement_key(model: str | os.PathLike[str], options: dict[str, Any]) -> str | None:
    """The key of a default session's placement of the model file ``model`` with ``options``
    (the session's backend options, its thread ceiling among them), on this machine and these
    versions; read without importing torch (its version from its package's metadata). None
    where the file cannot be read."""
    import importlib.metadata

    from backplane.backends.torch.backend import TorchBackend

    try:
        digest = hashlib.sha256(Path(model).read_bytes()).hexdigest()
    except OSError:
        return None
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = _torch_version_file()  # a torch built or copied in without its metadata
    if torch_version is None:
        return None
    identity = {"kind": "placement", "model": digest, "cache": CACHE_VERSION,
                "backend": TorchBackend.version, "torch": torch_version, "cpu": _processor(),
                "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else
                os.cpu_count(), "options": {k: repr(v) for k, v in sorted(options.items())}}
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
