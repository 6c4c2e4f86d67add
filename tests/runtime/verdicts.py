"""A model run on one backend list in a forked child, and its verdict against CpuRef's run.

Shared by bench/hostile.py (fuzzed mutants and hostile graphs on every backend list, with ONNX
Runtime beside them) and tests/runtime/test_hostile_graphs.py. The child is
tests/frontends/fuzz_cases.py's ``_in_child``: forked from a parent that has imported
everything, under an address-space limit, killed past its time limit, so a crash or a hang is seen
as one and never takes the caller with it.

A verdict is one of ``VERDICTS``; those in ``FINDINGS`` are wrong whatever the model is: a crash
(the process died: a signal, or no result), a hang (no answer within the time limit although the
run had ``RunOptions(timeout_s=...)``), a foreign exception (a class that is not backplane's own,
``own_errors``), an own error with an empty message, an output that shares memory with an input or
another output, and a run whose outputs differ from CpuRef's without a word.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tests.frontends.fuzz_cases import MAX_SENT_BYTES, _in_child, _nbytes, _ort_work, feeds_for

Feeds = dict[str, np.ndarray]
BACKEND_LISTS: dict[str, list[str]] = {
    "CpuRef": ["CpuRef"], "CpuAcc": ["CpuAcc", "CpuRef"], "OpenVINO": ["OpenVINO", "CpuRef"],
    "GpuAcc": ["GpuAcc", "CpuRef"],
}
MEMORY = 3 << 30  # address space a child may add to its parent's (none on GpuAcc: under such a
# limit CUDA's start fails, "cudaGetDeviceCount(): out of memory", as on the H100 machine)
TENSOR_LIMIT = 1 << 30  # $BACKPLANE_MAX_TENSOR_BYTES in the child: refusals come before MEMORY runs out
TOLERANCE, ABS_FLOOR = 1e-4, 1e-6  # as tests/models/test_corpus.py: of the output's scale, and a floor

CRASH, HANG, FOREIGN, EMPTY = "crash", "hang", "foreign exception", "empty message"
SHARED, DIFFERS, AS_ORT = "output shares memory", "differs silently", "differs from CpuRef as ORT"
REFUSED, REFUSED_REF_RAN = "refused", "refused, CpuRef ran"
RAN, MATCHES, RAN_REF_NOT, NOT_RUN = "ran", "matches CpuRef", "ran, CpuRef did not", "loaded, not run"
VERDICTS = (CRASH, HANG, FOREIGN, EMPTY, SHARED, DIFFERS, AS_ORT, REFUSED, REFUSED_REF_RAN, RAN,
            MATCHES, RAN_REF_NOT, NOT_RUN)
FINDINGS = frozenset({CRASH, HANG, FOREIGN, EMPTY, SHARED, DIFFERS})


def own_errors() -> tuple[type, ...]:
    """backplane's own exception classes: what a clean refusal raises (subclasses count)."""
    from backplane import (ArtifactError, ExecutionError, InvalidInputError, ModelError,
                           OptimizationError)
    from backplane.backends.api.backend import OptionError
    from backplane.backends.api.kernels import UnsupportedError
    from backplane.backends.api.memory import AllocationError
    from backplane.backends.registry import UnknownBackendError
    from backplane.runtime.edge_checks import KernelContractError
    return (ModelError, OptimizationError, ExecutionError, InvalidInputError, ArtifactError,
            AllocationError, UnsupportedError, UnknownBackendError, OptionError, KernelContractError)


def available_lists() -> dict[str, list[str]]:
    """The backend lists this machine can run: GpuAcc only where CUDA is."""
    from backplane import registry
    lists = {k: v for k, v in BACKEND_LISTS.items() if v[0] in registry.ids()}
    try:
        import torch
        if not torch.cuda.is_available():
            lists.pop("GpuAcc", None)
    except ImportError:
        lists.pop("GpuAcc", None)
    return lists


def warm_imports() -> None:
    """Import what the backends import when made (torch, OpenVINO, ONNX Runtime and backplane's
    modules), once in the parent: each forked child would otherwise import them again (CpuAcc's
    first session in a child: 4.7 s, 0.3 s after this). Importing starts no thread pool, so forking
    after it is safe; making a session in the parent would not be."""
    import importlib
    import pkgutil

    import backplane
    for name in ("torch", "openvino", "onnxruntime"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for module in pkgutil.walk_packages(backplane.__path__, "backplane."):
        if module.name.startswith(("backplane.backends", "backplane.runtime", "backplane.optimizer")):
            try:
                importlib.import_module(module.name)
            except Exception:  # noqa: BLE001 - a module needing what is absent (CUDA): not warmed
                pass


@dataclasses.dataclass
class Run:
    """What one backend list (or ONNX Runtime) did with a model: ``status`` 'ran', 'error' (``error``
    its class, ``own`` whether backplane's), 'loaded' (no inputs to run it on), 'crash' or 'hang'."""

    status: str
    error: str = ""
    own: bool = False
    message: str = ""
    detail: str = ""  # a traceback, a signal, where memory is shared
    outputs: list[Any] | None = None
    feeds: Feeds | None = None


def _shared(outputs: Sequence[Any], feeds: Feeds) -> str:
    """Which output shares memory with an input or another output ('' if none)."""
    arrays = [(f"output {k}", o) for k, o in enumerate(outputs) if isinstance(o, np.ndarray)]
    for k, (name, out) in enumerate(arrays):
        others = arrays[k + 1:] + [(f"input '{n}'", v) for n, v in feeds.items()]
        for other, value in others:
            if isinstance(value, np.ndarray) and out.size and np.shares_memory(out, value):
                return f"{name} shares memory with {other}"
    return ""


def _backplane_work(blob: bytes, feeds: Feeds | None, backends: list[str],
                    run_timeout: float) -> Callable[[Callable[[Any], None]], dict[str, Any]]:
    def work(post: Callable[[Any], None]) -> dict[str, Any]:
        os.environ.setdefault("BACKPLANE_MAX_TENSOR_BYTES", str(TENSOR_LIMIT))
        import backplane
        given, stage = feeds, "load"
        try:
            session = backplane.InferenceSession(blob, backends=backends)
            if given is None:
                given, why = feeds_for(session)
                if given is None:
                    return {"status": "loaded", "detail": why}
            stage = "run"
            post(given)
            outputs = session.run(None, given, backplane.RunOptions(timeout_s=run_timeout))
        except Exception as exc:  # noqa: BLE001 - classified here
            return {"status": "error", "error": type(exc).__name__,
                    "own": isinstance(exc, own_errors()), "message": str(exc)[:2000], "feeds": given,
                    "detail": f"at {stage}:\n{traceback.format_exc()[-6000:]}"}
        sent = [o if _nbytes(o) <= MAX_SENT_BYTES else None for o in outputs]
        return {"status": "ran", "outputs": sent, "feeds": given, "detail": _shared(outputs, given)}
    return work


def run_backend(blob: bytes, feeds: Feeds | None, backends: list[str], timeout: float = 60.0,
                run_timeout: float = 5.0) -> Run:
    """``blob`` loaded on ``backends`` and run on ``feeds`` (zeros of the declared shapes if None)
    with ``RunOptions(timeout_s=run_timeout)``, in a child killed after ``timeout`` seconds."""
    memory = None if "GpuAcc" in backends else MEMORY  # CUDA's start reserves far more
    status, result, _, posted = _in_child(_backplane_work(blob, feeds, backends, run_timeout),
                                          timeout, memory)
    if status == "hang":
        return Run("hang", detail=f"no answer within {timeout} s "
                                  f"({'running' if posted is not None else 'loading'})", feeds=posted)
    if status == "crash":
        return Run("crash", detail=str(result), feeds=posted)
    return Run(result["status"], result.get("error", ""), result.get("own", False),
               result.get("message", ""), result.get("detail", ""), result.get("outputs"),
               result.get("feeds"))


def run_ort(blob: bytes, feeds: Feeds | None, timeout: float = 60.0) -> Run:
    """ONNX Runtime's run of the same model (its exceptions are its refusals)."""
    status, result, _, _ = _in_child(_ort_work(blob, feeds), timeout, MEMORY)
    if status == "hang":
        return Run(status, detail=f"no answer within {timeout} s")
    if status != "ok":
        return Run(status, detail=str(result))
    if "refused" in result:
        return Run("error", result["refused"].split(":")[0], True, result["refused"])
    return Run("ran", outputs=result["outputs"]) if result["ran"] else Run("loaded")


def difference(got: Any, want: Any) -> str:
    """'' where ``got`` is ``want`` as tests/models/test_corpus.py compares (same type, dtype and
    shape; integers, booleans and strings equal; floats within TOLERANCE of the output's scale,
    NaN where NaN, infinities equal), else what differs."""
    if isinstance(want, list) or isinstance(got, list):
        if not (isinstance(want, list) and isinstance(got, list)) or len(got) != len(want):
            return f"{type(got).__name__} of {_len(got)}, CpuRef {type(want).__name__} of {_len(want)}"
        return next((f"[{k}]: {d}" for k, (g, w) in enumerate(zip(got, want))
                     if (d := difference(g, w))), "")
    if got is None or want is None:
        return ""  # too large to send back: not compared
    got, want = np.asarray(got), np.asarray(want)
    if (got.dtype, got.shape) != (want.dtype, want.shape):
        return f"{got.dtype}{list(got.shape)}, CpuRef {want.dtype}{list(want.shape)}"
    if want.dtype.kind not in "fciub" and "float" in want.dtype.name:  # ml_dtypes: bfloat16, float8s
        got, want = got.astype(np.float32), want.astype(np.float32)
    if want.dtype.kind not in "fc":
        wrong = np.flatnonzero(got.ravel() != want.ravel())
        return f"{wrong.size} of {want.size} differ, first at {wrong[0]}: " \
               f"{got.ravel()[wrong[0]]!r} vs {want.ravel()[wrong[0]]!r}" if wrong.size else ""
    g, w = got.astype(np.complex128).ravel(), want.astype(np.complex128).ravel()
    if (np.isnan(g) != np.isnan(w)).any():
        return f"NaN at {int((np.isnan(g) & ~np.isnan(w)).sum())} places CpuRef has none, none at " \
               f"{int((np.isnan(w) & ~np.isnan(g)).sum())} where it has NaN"
    finite = np.isfinite(w)
    infinite = ~finite & ~np.isnan(w)
    if (g[infinite] != w[infinite]).any() or not np.isfinite(g[finite]).all():
        return "infinities differ"
    scale = float(np.max(np.abs(w[finite]), initial=0.0))
    worst = float(np.max(np.abs(g[finite] - w[finite]), initial=0.0))
    allowed = max(TOLERANCE * scale, ABS_FLOOR)
    if worst > allowed:
        return f"max |diff| {worst:.3g} at scale {scale:.3g} (allowed {allowed:.3g})"
    return ""


def _len(value: Any) -> int:
    return len(value) if isinstance(value, list) else 1


def verdict(run: Run, reference: Run | None, ort: Run | None = None) -> tuple[str, str]:
    """(the verdict on ``run``, what it is about) against CpuRef's ``reference`` (None: the run is
    CpuRef's own). A run that differs from CpuRef where ONNX Runtime's ``ort`` gives the same as
    it is told apart (AS_ORT: NaN through MaxPool, ArgMax of NaN), not taken for a silent error."""
    if run.status in ("crash", "hang"):
        return run.status, run.detail
    if run.status == "error":
        if not run.own:
            return FOREIGN, f"{run.error}: {run.message}\n{run.detail}"
        if not run.message.strip():
            return EMPTY, f"{run.error} with no message\n{run.detail}"
        ran = reference is not None and reference.status == "ran"
        return (REFUSED_REF_RAN if ran else REFUSED), f"{run.error}: {run.message}"
    if run.status == "loaded":
        return NOT_RUN, run.detail
    if run.detail:  # a run whose output shares memory
        return SHARED, run.detail
    if reference is None:
        return RAN, ""
    if reference.status != "ran":
        return RAN_REF_NOT, (f"gave {describe(run.outputs)}; CpuRef: {reference.status} "
                             f"{reference.error} {reference.message[:300]}")
    problem = compare(run.outputs or [], reference.outputs or [])
    if not problem:
        return MATCHES, ""
    if ort is not None and ort.status == "ran" and not compare(run.outputs or [], ort.outputs or []):
        return AS_ORT, problem
    return DIFFERS, f"{problem}\ngave {describe(run.outputs)}\nCpuRef {describe(reference.outputs)}"


def compare(outputs: Sequence[Any], expected: Sequence[Any]) -> str:
    """'' where every output is as expected, else the first difference."""
    if len(outputs) != len(expected):
        return f"{len(outputs)} outputs, CpuRef {len(expected)}"
    return next((f"output {k}: {d}" for k, (g, w) in enumerate(zip(outputs, expected))
                 if (d := difference(g, w))), "")


def describe(outputs: Sequence[Any] | None) -> str:
    """Outputs as dtype[shape] and a few values."""
    return ", ".join(f"{o.dtype}{list(o.shape)} {o.ravel()[:4]}" if isinstance(o, np.ndarray)
                     else type(o).__name__ for o in outputs or [])
