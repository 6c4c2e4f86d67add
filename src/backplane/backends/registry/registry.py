"""BackendRegistry: backend ids to factories (Arm NN's BackendRegistry, onert's loadBackend by id)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from backplane.backends.api.backend import Backend

BackendFactory = Callable[[], Backend]


class UnknownBackendError(KeyError):
    """An id that no registered backend has."""

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


@dataclass(frozen=True)
class Registration:
    id: str
    factory: BackendFactory
    origin: str  # "built in", "entry point pkg:obj", "file /path/x_y_backend.py", "user"


class BackendRegistry:
    """Holds a factory per backend id; backends are created when needed and are cheap, stateless."""

    def __init__(self) -> None:
        self._entries: dict[str, Registration] = {}
        self._instances: dict[str, Backend] = {}

    def register(self, backend_id: str, factory: BackendFactory, origin: str = "user") -> None:
        if not backend_id:
            raise ValueError("a backend id must not be empty")
        if backend_id in self._entries:
            raise ValueError(f"backend id '{backend_id}' is already registered "
                             f"(from {self._entries[backend_id].origin}); cannot register it again "
                             f"from {origin}")
        self._entries[backend_id] = Registration(backend_id, factory, origin)

    def deregister(self, backend_id: str) -> None:
        self._entries.pop(self._known(backend_id).id)
        self._instances.pop(backend_id, None)

    def ids(self) -> list[str]:
        return list(self._entries)

    def is_registered(self, backend_id: str) -> bool:
        return backend_id in self._entries

    def origin(self, backend_id: str) -> str:
        return self._known(backend_id).origin

    def create(self, backend_id: str) -> Backend:
        """The backend for an id (one shared instance per id)."""
        backend = self._instances.get(backend_id)
        if backend is None:
            backend = self._known(backend_id).factory()
            if not isinstance(backend, Backend):
                raise TypeError(f"the factory of backend '{backend_id}' returned {backend!r}, "
                                f"not a backplane Backend")
            self._instances[backend_id] = backend
        return backend

    def _known(self, backend_id: str) -> Registration:
        entry = self._entries.get(backend_id)
        if entry is None:
            raise UnknownBackendError(f"unknown backend '{backend_id}'. Known backends are: "
                                      f"{', '.join(self._entries) or '(none)'}")
        return entry

    @contextmanager
    def temporarily(self, backend_id: str, factory: BackendFactory) -> Iterator[None]:
        """Register a backend for the duration of a ``with`` block (tests, experiments)."""
        self.register(backend_id, factory)
        try:
            yield
        finally:
            self.deregister(backend_id)
