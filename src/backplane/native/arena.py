"""The call every native plan's executor makes (cnn.py, qcnn.py, recurrent_net.py): one C entry
``fn(records, count, params, arena, edges)`` over records and parameters planned at load and an
arena of the plan's own. Why one place: the three executors had grown the same locked call, and
its Python frames are the hot path's cost (each line here runs every call)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np


class ArenaExecutor:
    """A plan bound to the library: ``run(pointers)`` makes one call (the inputs' then the
    outputs' data). The arena is the plan's own while one thread runs it; a second thread at the
    same time gets a fresh one (a lock tried, never waited for). A subclass binds its entry
    (``_bind``), makes a fresh arena (``_fresh_arena``) and names a failed record (``_failure``)."""

    def _bind(self, entry: ctypes._CFuncPtr, records: np.ndarray, params: np.ndarray,
              arena: np.ndarray, edges: int) -> None:
        self.fn = entry
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_void_p]
        self.fn.restype = ctypes.c_int
        self.records, self.params, self.arena = records, params, arena
        self.count, self.edges = len(records), edges
        self.ext = (ctypes.c_void_p * edges)()
        self.lock = threading.Lock()
        self.pointers = (records.ctypes.data, params.ctypes.data)
        self.address = arena.ctypes.data  # read once: numpy's .ctypes costs ~1-2 us a read

    def _fresh_arena(self) -> np.ndarray:
        raise NotImplementedError

    def _failure(self, index: int) -> Exception:
        raise NotImplementedError

    def run(self, pointers: Sequence[int]) -> None:
        records, params = self.pointers
        if self.lock.acquire(blocking=False):
            try:
                self.ext[:] = pointers
                failed = self.fn(records, self.count, params, self.address, self.ext)
            finally:
                self.lock.release()
        else:  # the arena held in a name through the call: a temporary's memory would be freed
            ext = (ctypes.c_void_p * self.edges)(*pointers)  # as soon as its address was read
            arena = self._fresh_arena()
            failed = self.fn(records, self.count, params, arena.ctypes.data, ext)
            del arena
        if failed:
            raise self._failure(failed - 1)
