"""Backends declared by installed packages in the entry point group ``backplane.backends``.

The entry point's name is the backend id; its object is either a Backend subclass or a module with
the dynamic-backend functions (get_backend_id, get_version, backend_factory). Entry points are only
listed (package metadata) until a backend is asked for by id; then that one is imported, under the
same version and failure rules as a dynamic backend file.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

from backplane.backends.api.backend import BACKEND_API_VERSION, Backend
from backplane.backends.registry.dynamic import DynamicBackend, Skipped, _skip, id_problem, version_problem

GROUP = "backplane.backends"


def declared() -> dict[str, EntryPoint]:
    """Entry points of the group by name (the first installed wins for a name)."""
    found: dict[str, EntryPoint] = {}
    for point in entry_points(group=GROUP):
        found.setdefault(point.name, point)
    return found


def describe(point: EntryPoint) -> str:
    dist = getattr(point, "dist", None)
    package = f"{dist.name} " if dist is not None else ""
    return f"entry point {package}{point.value}"


def load(point: EntryPoint, skipped: list[Skipped],
         api_version: tuple[int, int] = BACKEND_API_VERSION) -> DynamicBackend | None:
    where = describe(point)
    try:
        target = point.load()
    except BaseException as exc:
        return _skip(skipped, where, f"it failed to import: {type(exc).__name__}: {exc}")
    try:
        if isinstance(target, type) and issubclass(target, Backend):
            backend_id, version, factory = target.id, target.api_version, target
        else:
            backend_id, version = target.get_backend_id(), target.get_version()
            factory = target.backend_factory
    except Exception as exc:
        return _skip(skipped, where, f"it is neither a Backend class nor a module with "
                                     f"get_backend_id/get_version/backend_factory: "
                                     f"{type(exc).__name__}: {exc}")
    problem = id_problem(backend_id) or version_problem(tuple(version), api_version)
    if not problem and backend_id != point.name:
        problem = f"the entry point is named '{point.name}' but its backend id is '{backend_id}'"
    if problem:
        return _skip(skipped, where, problem)
    return DynamicBackend(backend_id, (int(version[0]), int(version[1])), factory, where)
