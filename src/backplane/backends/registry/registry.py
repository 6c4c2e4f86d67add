"""BackendRegistry: backend ids to factories (Arm NN's BackendRegistry, onert's loadBackend by id)."""

from __future__ import annotations

import difflib
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from backplane.backends.api.backend import BACKEND_API_VERSION, Backend
from backplane.backends.registry import dynamic, entry_points
from backplane.backends.registry.dynamic import DynamicBackend, Skipped

BackendFactory = Callable[[], Backend]
log = logging.getLogger("backplane.backends")


class UnknownBackendError(KeyError):
    """An id that no registered backend has."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


@dataclass(frozen=True)
class Registration:
    id: str
    factory: BackendFactory
    origin: str  # "built in", "entry point pkg:obj", "file /path/x_y_backend.py", "user"
    destroy: Callable[[], None] | None = None
    """Called when the last Runtime holding the backend goes (onert's onert_backend_destroy)."""
    path: str = ""
    """The file a Runtime loaded the backend from: it is unregistered with the last such Runtime."""


class BackendRegistry:
    """Holds a factory per backend id. ``create`` makes a new backend each time (Arm NN's factory):
    each optimized network has backends of its own, which hold that network's options."""

    def __init__(self, api_version: tuple[int, int] = BACKEND_API_VERSION) -> None:
        self.api_version = api_version
        self._entries: dict[str, Registration] = {}
        self.skipped: list[Skipped] = []
        self._loaded_paths: set[str] = set()
        self._holds: dict[str, int] = {}  # backend id -> how many Runtimes hold it
        self._holding = threading.RLock()  # finalizers let go from any thread
        from backplane.backends.builtin.backend import Builtin  # always registered (onert's builtin)

        self.register(Builtin.id, Builtin, origin="built in")

    def register(self, backend_id: str, factory: BackendFactory, origin: str = "user",
                 destroy: Callable[[], None] | None = None) -> None:
        """Register ``factory`` under ``backend_id``; ``destroy`` (optional) is called each time
        the last Runtime holding the backend goes."""
        if not backend_id:
            raise ValueError("a backend id must not be empty")
        if backend_id in self._entries:
            raise ValueError(f"backend id '{backend_id}' is already registered "
                             f"(from {self._entries[backend_id].origin}); cannot register it again "
                             f"from {origin}")
        self._entries[backend_id] = Registration(backend_id, factory, origin, destroy)

    def deregister(self, backend_id: str) -> None:
        if backend_id == "builtin":
            raise ValueError("the builtin backend is always registered; it cannot be deregistered")
        self._entries.pop(self._known(backend_id).id)

    def ids(self) -> list[str]:
        return list(self._entries)

    def is_registered(self, backend_id: str) -> bool:
        return backend_id in self._entries

    def origin(self, backend_id: str) -> str:
        return self._known(backend_id).origin

    def create(self, backend_id: str) -> Backend:
        """A new backend for an id."""
        backend = self._known(backend_id).factory()
        if not isinstance(backend, Backend):
            raise TypeError(f"the factory of backend '{backend_id}' returned {backend!r}, "
                            f"not a backplane Backend")
        return backend

    def _known(self, backend_id: str) -> Registration:
        entry = self._entries.get(backend_id) or self._load_by_id(backend_id)
        if entry is None:
            skipped = f" ({len(self.skipped)} candidates skipped: see `backplane backends`)" \
                if self.skipped else ""
            choices = [b for b in self._entries if b != "builtin"]  # always there, never chosen
            hint = _did_you_mean(backend_id, choices)
            raise UnknownBackendError(f"unknown backend '{backend_id}'{hint}. Known backends are: "
                                      f"{', '.join(choices) or '(none)'}{skipped}")
        return entry

    # -- backends from outside ---------------------------------------------------------------------
    def _load_by_id(self, backend_id: str) -> Registration | None:
        """Look for an id on the entry points, then on the backend paths (onert's load by id)."""
        point = entry_points.declared().get(backend_id)
        if point is not None:
            self._add(entry_points.load(point, self.skipped, self.api_version))
        if backend_id not in self._entries:
            self.load_dynamic_backends(dynamic.backend_paths())
        return self._entries.get(backend_id)

    def load_entry_points(self) -> list[str]:
        """Load every declared entry point not yet registered (for listings); returns the new ids."""
        added = []
        for name, point in entry_points.declared().items():
            if name not in self._entries and self._add(entry_points.load(point, self.skipped,
                                                                         self.api_version)):
                added.append(name)
        return added

    def load_dynamic_backends(self, paths: Sequence[str]) -> list[str]:
        """Register every valid dynamic backend file on ``paths`` for the whole process; returns
        the ids added.

        An installed entry point comes before a file with the same id (built-ins, entry points,
        files: the first found wins), even where the files are read first, as a Runtime does when
        it starts: the entry point is loaded then, and the file skipped with the reason."""
        return self._load_files(paths, by_runtime=False)[0]

    def hold_dynamic_backends(self, paths: Sequence[str]) -> list[str]:
        """What a Runtime does as it is created: register every valid dynamic backend file on
        ``paths`` and hold each backend a Runtime loaded from them (new ones, and those an earlier
        Runtime loaded from the same files); returns their ids. ``let_go`` ends the hold."""
        added, again = self._load_files(paths, by_runtime=True)
        for backend_id in (*added, *again):
            self.hold(backend_id)
        return [*added, *again]

    def hold(self, backend_id: str) -> None:
        """One Runtime more holds ``backend_id`` (see ``let_go``)."""
        with self._holding:
            self._holds[backend_id] = self._holds.get(backend_id, 0) + 1

    def held(self, backend_id: str) -> int:
        """How many Runtimes hold ``backend_id``."""
        return self._holds.get(backend_id, 0)

    def let_go(self, backend_ids: Iterable[str]) -> None:
        """One Runtime fewer holds each of ``backend_ids``. A backend that none holds any more has
        its ``destroy`` hook called; one a Runtime loaded from a file is unregistered and its
        module dropped. Called from a Runtime's finalizer: a failing hook is logged, not raised."""
        for backend_id in list(backend_ids):
            with self._holding:
                count = self._holds.get(backend_id, 0) - 1
                if count > 0:
                    self._holds[backend_id] = count
                    continue
                self._holds.pop(backend_id, None)
                entry = self._entries.get(backend_id)
            if entry is None:
                continue
            if entry.destroy is not None:
                try:
                    entry.destroy()
                except Exception as exc:  # noqa: BLE001  # a plugin's bug must not stop the rest
                    log.warning("backend %s: its destroy hook raised %s: %s", backend_id,
                                type(exc).__name__, exc)
            if entry.path:
                del self._entries[backend_id]
                self._loaded_paths.discard(os.path.realpath(entry.path))
                dynamic.forget_module(entry.path)

    def _load_files(self, paths: Sequence[str], by_runtime: bool) -> tuple[list[str], list[str]]:
        """The ids registered from the files on ``paths``, and (``by_runtime``) those a Runtime
        registered from them before."""
        added, again = [], []
        by_path = {os.path.realpath(e.path): e.id for e in self._entries.values() if e.path}
        for path in dynamic.backend_files(dynamic.valid_paths(paths, self.skipped), self.skipped):
            real = os.path.realpath(path)
            if real in self._loaded_paths:
                if by_runtime and real in by_path:
                    again.append(by_path[real])
                continue
            self._loaded_paths.add(real)
            found = dynamic.load_backend_file(path, self.skipped, self.api_version)
            if found is None:
                continue
            point = entry_points.declared().get(found.id)
            if point is not None and found.id not in self._entries:
                self._add(entry_points.load(point, self.skipped, self.api_version))
            if self._add(found, by_runtime):
                added.append(found.id)
        return added, again

    def _add(self, found: DynamicBackend | None, by_runtime: bool = False) -> bool:
        if found is None:
            return False
        if found.id in self._entries:
            return _refuse(self, found, f"backend id '{found.id}' is already registered from "
                                        f"{self._entries[found.id].origin}")
        try:
            backend = found.factory()
        except Exception as exc:
            return _refuse(self, found, f"backend_factory() raised {type(exc).__name__}: {exc}")
        if not isinstance(backend, Backend):
            return _refuse(self, found, f"backend_factory() returned {backend!r}, not a Backend")
        if backend.id != found.id:
            return _refuse(self, found, f"backend_factory() made a backend with id '{backend.id}', "
                                        f"not '{found.id}'")
        point = found.path.startswith("entry point")
        origin = found.path if point else f"file {found.path}"
        self._entries[found.id] = Registration(found.id, found.factory, origin, found.destroy,
                                               found.path if by_runtime and not point else "")
        return True

    @contextmanager
    def temporarily(self, backend_id: str, factory: BackendFactory) -> Iterator[None]:
        """Register a backend for the duration of a ``with`` block (tests, experiments)."""
        self.register(backend_id, factory)
        try:
            yield
        finally:
            self.deregister(backend_id)


def _refuse(registry: BackendRegistry, found: DynamicBackend, reason: str) -> bool:
    dynamic._skip(registry.skipped, found.path, reason)
    return False


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    """" (did you mean 'CpuRef'?)" for a name that differs in case or by a typo; else ""."""
    same = [c for c in choices if c.lower() == name.lower()]
    close = same or difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""
