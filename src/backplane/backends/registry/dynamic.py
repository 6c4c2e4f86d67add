"""Dynamic backends: Python files found on the backend paths (as Arm NN's dynamic backends
documentation describes them).

A dynamic backend is a file ``<vendor>_<name>_backend.py`` (vendor and name alphanumeric), optionally
followed by a version suffix of dot-separated numbers (``Acme_Npu_backend.py.1.2.3``), or a package
directory ``<vendor>_<name>_backend/`` with an ``__init__.py``. It exposes::

    def get_backend_id() -> str: ...
    def get_version() -> tuple[int, int]: ...       # the backend API version it was written against
    def backend_factory() -> Backend: ...
    def backend_destroy() -> None: ...              # optional: onert's onert_backend_destroy

Paths come from ``BACKPLANE_DYNAMIC_BACKEND_PATHS`` (os.pathsep-separated, processed in order), or
from one path given to the Runtime that replaces that list. No path: no dynamic backends, and nothing
is ever loaded from the working directory. Every failure is a warning and a skip, never a crash.

A Runtime that reads the paths as it is created holds the backends it found there (one count per
Runtime, in the registry); when the last Runtime holding one goes (``Runtime.close``, or its
finalizer), the backend's ``backend_destroy()`` is called, the backend is unregistered and its
module dropped (Arm NN: "the dynamic backend instance is automatically destroyed, and the handle to
the shared object is closed"), so a later Runtime without the path no longer sees it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from backplane.backends.api.backend import BACKEND_API_VERSION, Backend

log = logging.getLogger("backplane.backends")

PATHS_VARIABLE = "BACKPLANE_DYNAMIC_BACKEND_PATHS"
FILE_NAME = re.compile(r"^[A-Za-z0-9]+_[A-Za-z0-9]+_backend\.py(\.[0-9]+)*$")
PACKAGE_NAME = re.compile(r"^[A-Za-z0-9]+_[A-Za-z0-9]+_backend$")
RESERVED_IDS = frozenset({"builtin", "user"})


@dataclass(frozen=True)
class Skipped:
    """A backend candidate that was not loaded, and why."""

    candidate: str
    reason: str


@dataclass(frozen=True)
class DynamicBackend:
    """A loaded dynamic backend file: its id, declared API version and factory."""

    id: str
    version: tuple[int, int]
    factory: Callable[[], Backend]
    path: str
    destroy: Callable[[], None] | None = None
    """The file's ``backend_destroy``, called when the last Runtime holding the backend goes."""


def is_compatible(backend: tuple[int, int], api: tuple[int, int] = BACKEND_API_VERSION) -> bool:
    """Same major version, and the backend's minor not above the API's (Arm NN's rule)."""
    return backend[0] == api[0] and backend[1] <= api[1]


def is_backend_file_name(name: str) -> bool:
    return bool(FILE_NAME.match(name))


def backend_paths(override: str | None = None, environ: Any = None) -> list[str]:
    """The paths to search: the override alone if given, else the environment variable's list."""
    if override is not None:
        return [override]
    value = (os.environ if environ is None else environ).get(PATHS_VARIABLE, "")
    return value.split(os.pathsep) if value else []


def valid_paths(paths: Sequence[str], skipped: list[Skipped]) -> list[str]:
    """Keep the paths that are absolute existing directories; warn about and skip the others."""
    kept = []
    for path in paths:
        problem = _path_problem(path)
        if problem:
            _skip(skipped, path or "''", problem)
        else:
            kept.append(path)
    return kept


def _path_problem(path: str) -> str | None:
    if not path:
        return "an empty path in the backend path list"
    if not os.path.isabs(path):
        return f"backend path '{path}' is not absolute"
    if not os.path.exists(path):
        return f"backend path '{path}' does not exist"
    if not os.path.isdir(path):
        return f"backend path '{path}' is not a directory"
    return None


def backend_files(paths: Iterable[str], skipped: list[Skipped]) -> list[str]:
    """Candidate files in path order (names sorted within a directory), each canonical path once."""
    seen: set[str] = set()
    files: list[str] = []
    for directory in paths:
        for name in sorted(os.listdir(directory)):
            path = os.path.join(directory, name)
            if not _is_candidate(path, name):
                continue
            real = os.path.realpath(path)
            if not os.path.exists(real):
                _skip(skipped, path, "a symbolic link to a file that does not exist")
            elif real not in seen:
                seen.add(real)
                files.append(path)
    return files


def _is_candidate(path: str, name: str) -> bool:
    if os.path.isdir(path):
        return bool(PACKAGE_NAME.match(name)) and os.path.isfile(os.path.join(path, "__init__.py"))
    return is_backend_file_name(name)


def load_backend_file(path: str, skipped: list[Skipped],
                      api_version: tuple[int, int] = BACKEND_API_VERSION) -> DynamicBackend | None:
    """Import one candidate and check its entry functions; None (with a warning) if it is unusable."""
    try:
        module = _import(path)
    except BaseException as exc:  # a broken file must not take the runtime down
        return _skip(skipped, path, f"it failed to import: {type(exc).__name__}: {exc}")
    functions = {}
    for name in ("get_backend_id", "get_version", "backend_factory"):
        function = getattr(module, name, None)
        if not callable(function):
            return _skip(skipped, path, f"it has no function {name}()")
        functions[name] = function
    try:
        backend_id = functions["get_backend_id"]()
        version = functions["get_version"]()
    except Exception as exc:
        return _skip(skipped, path, f"its entry function raised {type(exc).__name__}: {exc}")
    problem = id_problem(backend_id) or version_problem(version, api_version)
    destroy = getattr(module, "backend_destroy", None)
    if not problem and destroy is not None and not callable(destroy):
        problem = f"its backend_destroy is a {type(destroy).__name__}, not a function"
    if problem:
        return _skip(skipped, path, problem)
    return DynamicBackend(backend_id, (int(version[0]), int(version[1])),
                          functions["backend_factory"], path, destroy)


def forget_module(path: str) -> None:
    """Drop the module imported from ``path`` (a later load imports the file anew)."""
    sys.modules.pop(_module_name(path), None)


def id_problem(backend_id: Any) -> str | None:
    if not isinstance(backend_id, str) or not backend_id.strip():
        return f"its backend id {backend_id!r} is empty or not a string"
    if backend_id in RESERVED_IDS:
        return f"its backend id '{backend_id}' is reserved"
    return None


def version_problem(version: Any, api_version: tuple[int, int]) -> str | None:
    if not (isinstance(version, (tuple, list)) and len(version) == 2
            and all(isinstance(v, int) and v >= 0 for v in version)):
        return f"get_version() returned {version!r}, not (major, minor)"
    if not is_compatible((version[0], version[1]), api_version):
        return (f"its backend API version {version[0]}.{version[1]} is not compatible with "
                f"backplane's backend API version {api_version[0]}.{api_version[1]}")
    return None


def _module_name(path: str) -> str:
    digest = hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:12]
    return f"backplane_dynamic_{digest}"


def _import(path: str) -> ModuleType:
    real = os.path.realpath(path)
    module_name = _module_name(path)
    if module_name in sys.modules:
        return sys.modules[module_name]
    if os.path.isdir(real):
        location, search = os.path.join(real, "__init__.py"), [real]
    else:
        location, search = real, None
    loader = importlib.machinery.SourceFileLoader(module_name, location)
    spec = importlib.util.spec_from_file_location(module_name, location, loader=loader,
                                                  submodule_search_locations=search)
    if spec is None:
        raise ImportError(f"cannot make an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _skip(skipped: list[Skipped], candidate: str, reason: str) -> DynamicBackend | None:
    skipped.append(Skipped(candidate, reason))
    log.warning("dynamic backend %s skipped: %s", candidate, reason)
    return None
