"""Profiles that tools open: a session's runs as a Chrome trace (the Trace Event Format).

``SessionOptions.enable_profiling`` makes every run of a session a profiled run; ``end_profiling()``
writes what was recorded as one JSON file that chrome://tracing, Perfetto (ui.perfetto.dev) and
speedscope open, as ONNX Runtime's profiles are. In it:

- one complete event (``"ph": "X"``) per layer run, ``ts`` and ``dur`` in microseconds from the
  session's creation, ``cat`` "layer", ``args`` with the op type, the backend, the run's index and the
  bytes of its outputs;
- one track (``tid``) per backend, named with a metadata event (``"ph": "M"``, ``thread_name``) and
  sorted in the session's order of preference; runs from other threads get tracks of their own;
- copies and imports between backends (MemCopy, MemImport, FallbackImport layers, on the builtin
  backend's track) as events of their own, ``cat`` "copy" or "import", with the bytes they move or
  hand over in ``args``;
- the layers a workload runs inside itself (CpuAcc's OneDnnGraph run layer by layer) named as the
  workload times them, one after the other from its start;
- on the "session" track: the optimize and load of the model, and one "run" event around each run
  (with the RunOptions' ``logid`` where one was given).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from backplane.runtime.loaded_network import LayerTiming

SESSION_TRACK = "session"
BUILTIN = "builtin"
CATEGORIES = {"MemCopy": "copy", "MemImport": "import", "FallbackImport": "import"}


@dataclass
class Trace:
    """The events of one session's profile, collected as it runs (safe from several threads)."""

    name: str
    """The process's name in the trace (the model)."""
    preferences: Sequence[str] = ()
    origin: float = field(default_factory=time.perf_counter)
    """``perf_counter()`` of time zero: timestamps are microseconds after it."""
    pid: int = field(default_factory=os.getpid)
    events: list[dict[str, Any]] = field(default_factory=list)
    runs: int = 0
    _tracks: dict[tuple[str, int], int] = field(default_factory=dict)
    _threads: dict[int, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def span(self, name: str, start: float, end: float, category: str = "session",
             **args: Any) -> None:
        """A complete event on the session's track: ``start`` and ``end`` from perf_counter()."""
        with self._lock:
            self._event(name, category, SESSION_TRACK, start, end - start, args)

    def add_run(self, timings: Sequence[LayerTiming], start: float, end: float,
                logid: str = "") -> None:
        """One run: its span on the session's track and one event per ``LayerTiming``."""
        with self._lock:
            run = self.runs
            self.runs += 1
            args: dict[str, Any] = {"run": run, "layers": len(timings)}
            if logid:
                args["logid"] = logid
            self._event("run", "session", SESSION_TRACK, start, end - start, args)
            for t in timings:
                category = CATEGORIES.get(t.op_type, "layer")
                event_args: dict[str, Any] = {"op_type": t.op_type, "backend": t.backend,
                                              "run": run}
                if t.nbytes is not None:
                    event_args["bytes" if category != "layer" else "output_bytes"] = t.nbytes
                self._event(t.layer, category, t.backend or BUILTIN, t.start, t.seconds, event_args)

    def document(self) -> dict[str, Any]:
        """The trace as a JSON object (the Trace Event Format's object form)."""
        with self._lock:
            return {"traceEvents": self._metadata() + list(self.events), "displayTimeUnit": "ms",
                    "otherData": {"producer": "backplane", "model": self.name,
                                  "backends": list(self.preferences), "runs": self.runs}}

    def write(self, path: str | os.PathLike) -> str:
        path = os.fspath(path)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            json.dump(self.document(), out)
        return path

    # -- inside ----------------------------------------------------------------------------------------
    def _event(self, name: str, category: str, track: str, start: float, seconds: float,
               args: dict[str, Any]) -> None:
        self.events.append({"name": name, "cat": category, "ph": "X", "ts": self._us(start),
                            "dur": round(max(seconds, 0.0) * 1e6, 3), "pid": self.pid,
                            "tid": self._tid(track), "args": args})

    def _us(self, moment: float) -> float:
        return round((moment - self.origin) * 1e6, 3)

    def _tid(self, track: str) -> int:
        thread = self._threads.setdefault(threading.get_ident(), len(self._threads))
        key = (track, thread)
        if key not in self._tracks:
            self._tracks[key] = len(self._tracks) + 1
        return self._tracks[key]

    def _metadata(self) -> list[dict[str, Any]]:
        order = [SESSION_TRACK, *self.preferences]
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": self.pid, "tid": 0,
             "args": {"name": f"backplane: {self.name}"}}]
        for (track, thread), tid in self._tracks.items():
            label = track if track != BUILTIN else "builtin (copies, imports, control flow)"
            if thread:
                label += f" (thread {thread + 1})"
            rank = order.index(track) if track in order else len(order)
            events.append({"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid,
                           "args": {"name": label}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": self.pid, "tid": tid,
                           "args": {"sort_index": thread * 1000 + rank}})
        return events


def profile_file(prefix: str) -> str:
    """Where ``end_profiling`` writes: ``<prefix>_<date>_<time>.json``, as ONNX Runtime names its
    profiles (a prefix may hold a folder); a number is added where that file exists."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    path = f"{prefix}_{stamp}.json"
    count = 1
    while os.path.exists(path):
        count += 1
        path = f"{prefix}_{stamp}_{count}.json"
    return path
