"""What a session is given: ``SessionOptions``, ``RunOptions`` and the backend list.

``SessionOptions`` holds the session-wide settings and ``RunOptions`` those of one run (ONNX
Runtime's names where it has one); each checks a value as it is set and names the valid ones for a
name it does not know. A backend list is ids or ``(id, {option: value})`` pairs, options named
without the id ("threads" for "CpuAcc.threads"), with ONNX Runtime's parallel ``provider_options``.
While a session works, ``log_scope`` applies its log severity (and a run's logid) to backplane's
messages and ``cache_scope`` its folder of CpuAcc's measured routes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

from backplane.backends.api.backend import OptionError
from backplane.optimizer.measured import PLACEMENTS
from backplane.optimizer.optimize import OptimizerOptions
from backplane.runtime.loaded_network import STOP, RunTerminated

SEVERITIES = {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR,
              4: logging.CRITICAL}
"""ONNX Runtime's log severity levels (0 verbose, 1 info, 2 warning, 3 error, 4 fatal) as Python's."""
CACHE_VARIABLE = "BACKPLANE_CACHE_DIR"  # backplane.backends.torch.route_cache.CACHE_VARIABLE

BackendSpec = str | tuple[str, Mapping[str, Any]]


# -- options ----------------------------------------------------------------------------------------------
class _Options:
    """Attributes from a fixed list, each checked as it is set; any other name is an error that lists
    the valid ones (a misspelled option would otherwise do nothing, unseen)."""

    FIELDS: ClassVar[dict[str, tuple[Any, Callable[[Any], Any], str]]] = {}
    """name -> (default, check returning the value to keep, what it does)."""

    def __init__(self, **values: Any) -> None:
        for name, (default, _, _) in self.FIELDS.items():
            object.__setattr__(self, name, default() if callable(default) else default)
        for name, value in values.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.FIELDS:
            raise AttributeError(self._unknown(name))
        object.__setattr__(self, name, self.FIELDS[name][1](value))

    def __getattr__(self, name: str) -> Any:  # only for names that are not set: unknown ones
        raise AttributeError(self._unknown(name))

    def _unknown(self, name: str) -> str:
        kind = type(self).__name__
        close = difflib.get_close_matches(name, self.FIELDS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return (f"{kind} has no option '{name}'{hint}; its options are: "
                + ", ".join(self.FIELDS))

    def __repr__(self) -> str:
        values = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.FIELDS)
        return f"{type(self).__name__}({values})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in self.FIELDS)


def _count(name: str) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        return value
    return check


def _seconds(name: str) -> Callable[[Any], float | None]:
    def check(value: Any) -> float | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number of seconds > 0 or None, got {value!r}")
        return float(value)
    return check


def _flag(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        return value
    return check


def _severity(name: str, none_ok: bool = False) -> Callable[[Any], int | None]:
    def check(value: Any) -> int | None:
        if value is None and none_ok:
            return None
        if isinstance(value, bool) or value not in SEVERITIES:
            raise ValueError(f"{name} must be 0 (verbose), 1 (info), 2 (warning), 3 (error) or "
                             f"4 (fatal){' or None' if none_ok else ''}, got {value!r}")
        return int(value)
    return check


def _pins(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"pins must map layer names or op types to backend ids, got {value!r}")
    return dict(value)


def _placement(value: Any) -> str:
    if value not in PLACEMENTS:
        choices = "; ".join(f"{name}: {what}" for name, what in PLACEMENTS.items())
        raise ValueError(f"placement must be one of the choices ({choices}), got {value!r}")
    return str(value)


def optimizer_options_for(options: SessionOptions,
                          given: OptimizerOptions | None) -> OptimizerOptions | None:
    """``given`` with the session's ``strict`` and ``placement`` where they are not the defaults."""
    if options.strict:
        given = dataclasses.replace(given or OptimizerOptions(), strict=True)
    if options.placement != "preference":
        given = dataclasses.replace(given or OptimizerOptions(), placement=options.placement)
    return given


def _folder(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"cache_dir must be a folder's path or None, got {value!r}")
    return os.fspath(value)


def _artifact_key(value: Any) -> Any:
    from backplane.artifact.signing import signing_key

    try:
        return signing_key(value)
    except TypeError as exc:
        raise ValueError(f"artifact_key must be bytes, a SigningKey or None: {exc}") from exc


def _text(name: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a str, got {value!r}")
        return value
    return check


class SessionOptions(_Options):
    """The session-wide settings (ONNX Runtime's names where it has one). Set them as attributes or
    as keywords: ``SessionOptions(intra_op_num_threads=2, enable_profiling=True)``.

    - ``intra_op_num_threads``: CpuAcc's threads (torch's intra-op pool, process-wide; the option
      ``CpuAcc.threads``); 0 leaves CpuAcc's policy, "auto": fewer threads while other processes
      hold CPUs (docs/torch-backends.md).
    - ``strict``: the optimizer's strict mode: fail instead of falling back (an unavailable backend,
      a refused layer, a workload a backend cannot create).
    - ``pins``: layer name or op type -> backend id, tried before the preferences.
    - ``placement``: "preference" (each layer on the first backend of the list that supports it) or
      "measured" (each partition on the capable backend timed fastest at load, its copies included:
      ``OptimizerOptions.placement``).
    - ``cache_dir``: the folder of CpuAcc's measured routes (``$BACKPLANE_CACHE_DIR`` while this
      session loads, and while it runs a network whose layers build at run time); None: as set.
    - ``enable_profiling``: every run is profiled; ``end_profiling()`` writes the Chrome trace, at
      ``profile_file_prefix`` + the date and time + ".json".
    - ``log_severity_level``: the lowest severity of backplane's messages logged while this session
      works: 0 verbose, 1 info, 2 warning (the default), 3 error, 4 fatal.
    - ``keep_initializers``: keep the model's weights in ``session.graph`` and
      ``session.optimized`` after the load. By default a model loaded from its file leaves each
      weight to the workloads that read it, as ONNX Runtime removes the initializers from its
      graph once its session state holds them: a graph's constant is then the array a backend
      holds, or read from the file again where none does; a fused layer's weight is a
      ``Released`` placeholder; loading ``session.optimized`` again imports the file anew
      (``backplane.optimizer.release``).
    - ``artifact_key``: a signing key (bytes, or ``backplane.artifact.SigningKey.from_file``):
      an artifact, or a compile-cache entry, loads only where signed with it (an unsigned or
      otherwise signed one is an ``ArtifactError``; a cache entry is compiled again, signed);
      ``backplane.compile`` signs with it (docs/artifact.md).
    """

    FIELDS = {
        "intra_op_num_threads": (0, _count("intra_op_num_threads"), "CpuAcc's threads; 0: auto"),
        "strict": (False, _flag("strict"), "fail instead of falling back"),
        "pins": (dict, _pins, "layer name or op type -> backend id"),
        "placement": ("preference", _placement, "preference (the list's order) or measured"),
        "cache_dir": (None, _folder, "folder of CpuAcc's measured routes"),
        "enable_profiling": (False, _flag("enable_profiling"), "profile every run"),
        "profile_file_prefix": ("backplane_profile", _text("profile_file_prefix"),
                                "the profile's file name before its date"),
        "log_severity_level": (2, _severity("log_severity_level"), "0 verbose .. 4 fatal"),
        "keep_initializers": (False, _flag("keep_initializers"),
                              "keep the model's weights in the graphs after the load"),
        "artifact_key": (None, _artifact_key, "load only artifacts signed with this key"),
    }


class RunOptions(_Options):
    """The settings of one run: ``log_severity_level`` (None: the session's) and ``logid``, a tag
    put before the messages logged during the run and on the run's event in the profile.

    ``terminate`` set to True, from another thread while the run goes on or before it starts,
    stops it before its next layer (inside If, Loop and Scan bodies too) with ``RunTerminated``,
    as ONNX Runtime's flag does; set it back to False to run again with these options.
    ``timeout_s`` stops a run the same way once it has run that many seconds. A layer that has
    begun runs to its end: a single long kernel is not interrupted."""

    FIELDS = {
        "log_severity_level": (None, _severity("log_severity_level", none_ok=True),
                               "0 verbose .. 4 fatal; None: the session's"),
        "logid": ("", _text("logid"), "the run's tag in messages and the profile"),
        "terminate": (False, _flag("terminate"), "stop the run before its next layer"),
        "timeout_s": (None, _seconds("timeout_s"), "stop the run after this many seconds"),
    }


def stopper(options: RunOptions) -> Callable[[], None]:
    """The check a run with ``options`` makes before each layer (``loaded_network.STOP``)."""
    limit = options.timeout_s
    deadline = None if limit is None else time.perf_counter() + limit

    def check() -> None:
        if options.terminate:
            raise RunTerminated("the run was stopped: RunOptions.terminate is set")
        if deadline is not None and time.perf_counter() > deadline:
            raise RunTerminated(f"the run was stopped after RunOptions.timeout_s = {limit} s")

    return check


@contextlib.contextmanager
def stop_scope(options: RunOptions | None) -> Iterator[None]:
    """Runs inside check ``options``' terminate flag and time limit before each layer."""
    if options is None:
        yield
        return
    token = STOP.set(stopper(options))
    try:
        yield
    finally:
        STOP.reset(token)


# -- logging and the cache folder, per session --------------------------------------------------------------
_LOG_SCOPE: contextvars.ContextVar[tuple[int, str] | None] = contextvars.ContextVar(
    "backplane_log_scope", default=None)


class _ScopeFilter(logging.Filter):
    """Drops backplane's messages below the working session's severity and tags them with its run's
    logid; outside a session's work (no scope set) it passes everything as it is."""

    def filter(self, record: logging.LogRecord) -> bool:
        scope = _LOG_SCOPE.get()
        if scope is None:
            return True
        level, tag = scope
        if record.levelno < level:
            return False
        if tag and not getattr(record, "backplane_logid", None):
            record.msg = f"[{tag}] {record.msg}"
            record.backplane_logid = tag
        return True


_FILTER = _ScopeFilter()
_known_loggers = -1


def _install_filter() -> None:
    """The filter on every logger of backplane's (a filter of a logger sees only its own records)."""
    global _known_loggers
    loggers = logging.root.manager.loggerDict
    if len(loggers) == _known_loggers:
        return
    _known_loggers = len(loggers)
    for name in [n for n in list(loggers) if n == "backplane" or n.startswith("backplane.")]:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


@contextlib.contextmanager
def log_scope(severity: int, tag: str = "") -> Iterator[None]:
    _install_filter()
    token = _LOG_SCOPE.set((SEVERITIES[severity], tag))
    try:
        yield
    finally:
        _LOG_SCOPE.reset(token)


_CACHE_LOCK = threading.RLock()


@contextlib.contextmanager
def cache_scope(folder: str | None) -> Iterator[None]:
    """``$BACKPLANE_CACHE_DIR`` set to ``folder`` meanwhile (one scope at a time in the process:
    the route cache reads the variable as it measures)."""
    if folder is None:
        yield
        return
    with _CACHE_LOCK:
        before = os.environ.get(CACHE_VARIABLE)
        os.environ[CACHE_VARIABLE] = folder
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(CACHE_VARIABLE, None)
            else:
                os.environ[CACHE_VARIABLE] = before


# -- backends and their options ----------------------------------------------------------------------------
@functools.cache
def default_backends() -> tuple[str, ...]:
    """The backends a session takes when given none: the fastest this machine has. GpuAcc where
    torch sees a CUDA device, then CpuAcc where torch is installed, then CpuRef (which runs every
    op the others refuse)."""
    from backplane.backends.registry import registry

    found = [b for b in ("GpuAcc", "CpuAcc") if registry.create(b).availability().ok]
    return (*found, "CpuRef")


ORT_PROVIDERS = {
    "CPUExecutionProvider": ("CpuAcc", "CpuRef"),
    "CUDAExecutionProvider": ("GpuAcc",),
    "TensorrtExecutionProvider": ("GpuAcc",),
    "OpenVINOExecutionProvider": ("OpenVINO",),
}
"""ONNX Runtime's execution providers and the backends that run what each runs (CpuAcc only where
it is available: CpuRef runs every op), so that code written for ONNX Runtime runs unchanged."""
_said: set[str] = set()


def _from_ort(provider: str, given: Mapping[str, Any]) -> list[str]:
    """``provider``'s backends, said once in the log; its ONNX Runtime options have no meaning
    here and are dropped, with a warning naming them."""
    from backplane.backends.registry import registry

    mapped = [b for b in ORT_PROVIDERS[provider]
              if b != "CpuAcc" or registry.create(b).availability().ok]
    if provider not in _said:
        _said.add(provider)
        logging.getLogger("backplane.session").info(
            "%s is ONNX Runtime's name: backplane runs it on %s", provider, ", ".join(mapped))
    if given:
        logging.getLogger("backplane.session").warning(
            "%s's options %s are ONNX Runtime's and mean nothing to %s: ignored (backplane's "
            "options: `backplane backends`)", provider, sorted(given), ", ".join(mapped))
    return mapped


def backend_list(backends: Sequence[BackendSpec], provider_options: Sequence[Mapping[str, Any]]
                 | None = None) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Backend ids and each one's options (named without its id) from ``backends=`` /
    ``providers=`` (ids or (id, options) pairs) and ONNX Runtime's parallel ``provider_options``."""
    if isinstance(backends, (str, bytes)) or not isinstance(backends, Sequence):
        hint = f" (a list: [{backends!r}])" if isinstance(backends, str) else ""
        raise TypeError(f"backends (providers) must be a list of backend ids or (id, {{option: "
                        f"value}}) pairs, got {backends!r}{hint}")
    if provider_options is not None and len(provider_options) != len(backends):
        raise ValueError(f"provider_options has {len(provider_options)} entries for "
                         f"{len(backends)} backends: give one mapping per backend")
    ids: list[str] = []
    options: dict[str, dict[str, Any]] = {}
    for index, item in enumerate(backends):
        if isinstance(item, str):
            backend_id, given = item, {}
        elif (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], Mapping)):
            backend_id, given = item[0], dict(item[1])
        else:
            raise TypeError(f"backends[{index}] must be a backend id or an (id, {{option: value}}) "
                            f"pair, got {item!r}")
        if backend_id in ORT_PROVIDERS:
            for mapped in _from_ort(backend_id, given):
                if mapped not in ids:
                    ids.append(mapped)
            continue
        if backend_id == "builtin":
            raise ValueError("'builtin' is backplane's own backend (control flow, copies between "
                             "backends): it is always there; leave it out of the backend list")
        if provider_options is not None:
            given.update(provider_options[index])
        ids.append(backend_id)
        mine = options.setdefault(backend_id, {})
        for key, value in given.items():
            if not isinstance(key, str):
                raise OptionError(f"{backend_id}: option names are str, got {key!r}")
            name = key.removeprefix(f"{backend_id}.")
            if "." in name:
                raise OptionError(f"{key!r} given for {backend_id} is not one of its options: name "
                                  f"them without the id ('threads' for '{backend_id}.threads') and "
                                  f"give another backend's with that backend")
            mine[name] = value
    return ids, {b: o for b, o in options.items() if o}


def qualified(options: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """{"CpuAcc": {"threads": 2}} as backend options: {"CpuAcc.threads": 2}."""
    return {f"{backend}.{name}": value for backend, mine in options.items()
            for name, value in mine.items()}


def merge(*layers: tuple[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Options from several places; one option given two different values is an error."""
    merged: dict[str, Any] = {}
    where: dict[str, str] = {}
    for place, values in layers:
        for key, value in values.items():
            if key in merged and merged[key] != value:
                raise OptionError(f"{key} is {merged[key]!r} in {where[key]} but {value!r} in {place}")
            merged[key], where[key] = value, place
    return merged
