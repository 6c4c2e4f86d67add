"""The call every native plan's executor makes (cnn.py, qcnn.py, recurrent_net.py): one C entry
``fn(records, count, params, arena, edges)`` over records and parameters planned at load and an
arena of the plan's own. Why one place: the three executors had grown the same locked call, and
its Python frames are the hot path's cost (each line here runs every call).

``host`` is that call on NumPy arrays, fresh NumPy outputs: what a session's run hands a plan
that is the whole model (``runtime/host_route.py``). Through torch the same call paid a
``torch.empty`` per output, its ``data_ptr``, a ``from_numpy`` per input and a ``.numpy()``
per output (resnet_basic_ts16, 1 thread: 9.6 us of a 27 us run around a 17.6 us C call)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

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
        self.edge_types: tuple[Any, Any] | None = None  # ``host``'s, read from the plan once

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

    def host(self, *values: np.ndarray) -> list[np.ndarray]:
        """The plan run on NumPy arrays of its input shapes (ValueError for another shape): an
        input of another dtype, or not C-contiguous, is copied to the plan's first; the outputs
        are fresh arrays, the caller's alone. Plain loops (a comprehension is a frame of its own
        on 3.11), each address read from the array object in line (``DIRECT``)."""
        inputs, outputs = self.edge_types or self._edge_types()
        if len(values) != len(inputs):
            raise ValueError(f"native plan: {len(values)} inputs given, {len(inputs)} planned")
        pointers, held, made = [], [], []
        for v, (shape, kind) in zip(values, inputs):
            if type(v) is not ndarray or v.dtype is not kind or not v.flags.c_contiguous:
                v = np.ascontiguousarray(v, kind)
                held.append(v)  # alive through the call
            if v.shape != shape:
                raise ValueError(f"native plan: an input of shape {v.shape}, planned for {shape}")
            pointers.append(at(id(v) + HEADER).value if DIRECT else v.ctypes.data)  # no frame
        for shape, kind in outputs:
            o = empty(shape, kind)
            made.append(o)
            pointers.append(at(id(o) + HEADER).value if DIRECT else o.ctypes.data)
        self.run(pointers)
        return made

    def _edge_types(self) -> tuple[Any, Any]:
        """((shape, dtype) of each input, of each output) from ``self.plan`` (float32 where it
        names no dtypes)."""
        plan: Any = getattr(self, "plan")

        def typed(shapes: Sequence[Any], dtypes: Sequence[Any] | None) -> tuple[Any, ...]:
            return tuple((tuple(int(d) for d in shape), np.dtype(t)) for shape, t in
                         zip(shapes, dtypes or [np.float32] * len(shapes)))
        self.edge_types = (typed(plan.input_shapes, getattr(plan, "input_dtypes", None)),
                           typed(plan.output_shapes, getattr(plan, "output_dtypes", None)))
        return self.edge_types


def _direct() -> bool:
    """Whether an ndarray's data address is the first field after its object's header
    (``PyArrayObject.data``), read there in 0.08 us (numpy's ``.ctypes.data``: 0.8, an object
    made a read), in line in ``host``: a call of a function for it was a Python frame an edge."""
    probe = np.empty(3, np.float32)
    return at(id(probe) + HEADER).value == probe.ctypes.data  # type: ignore[no-any-return]


def address(array: np.ndarray) -> int:
    """An ndarray's data address (``host`` reads it in line)."""
    return (at(id(array) + HEADER).value or 0) if DIRECT else array.ctypes.data  # type: ignore


at, HEADER = ctypes.c_void_p.from_address, object.__basicsize__
DIRECT = _direct()
ndarray, empty = np.ndarray, np.empty
