"""The loader fuzzer's cases and how one is run (tests/frontends/test_fuzz_loader.py): ``generate``
makes the mutants of the seeds, ``run_case`` loads and runs one in a forked child under an
address-space limit, ONNX Runtime in a second child, and says what it came to (``Outcome``)."""

from __future__ import annotations

import dataclasses
import faulthandler
import math
import os
import pickle
import random
import resource
import select
import signal
import struct
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from onnx import ModelProto
from tests.frontends.fuzz_mutations import FIELD_MUTATIONS, Skip, byte_mutation, data_spans
from tests.frontends.fuzz_seeds import seed_models

RTOL = 1e-4
MAX_FEED_ELEMENTS = 1 << 22  # a mutant declaring a larger input is loaded, not run (a user's choice)
MAX_SENT_BYTES = 64 << 20  # outputs larger than this are not sent back for comparison
MEMORY_BUDGET = 2 << 30  # address space a case may add to the parent's
GROWTH_LIMIT = 1 << 30  # resident memory a case may add before it counts as a blow-up

OWN_ERRORS = ("ModelError", "OptimizationError", "InvalidInputError", "ExecutionError",
              "UnsupportedError", "UnknownBackendError")


def own_error_classes() -> tuple[type, ...]:
    from backplane.backends.api.kernels import UnsupportedError
    from backplane.backends.registry import UnknownBackendError
    from backplane.frontends.onnx import ModelError
    from backplane.optimizer.optimize import OptimizationError
    from backplane.runtime.loaded_network import ExecutionError
    from backplane.runtime.runtime import InvalidInputError
    return (ModelError, OptimizationError, InvalidInputError, ExecutionError, UnsupportedError,
            UnknownBackendError)



@dataclasses.dataclass
class Case:
    index: int
    seed_name: str
    mutations: list[str]
    blob: bytes


def generate(seed: int, count: int, seeds: dict[str, ModelProto] | None = None,
             byte_share: float = 0.35) -> Iterator[Case]:
    """``count`` mutants, the same for the same ``seed``."""
    seeds = seeds or seed_models()
    names = sorted(seeds)
    blobs = {name: seeds[name].SerializeToString() for name in names}
    spans = {name: data_spans(seeds[name], blobs[name]) for name in names}
    rng = random.Random(seed)
    for index in range(count):
        name = rng.choice(names)
        if rng.random() < byte_share:
            blob, what = blobs[name], []
            for _ in range(rng.choice((1, 1, 1, 2, 3))):
                blob, description = byte_mutation(rng, blob, spans[name] if blob is blobs[name] else [])
                what.append(description)
            yield Case(index, name, what, blob)
            continue
        model = ModelProto()
        model.CopyFrom(seeds[name])
        what = []
        tries = 0
        wanted = rng.choice((1, 1, 1, 2, 3))
        while len(what) < wanted and tries < 50:
            tries += 1
            kind = rng.choice(sorted(FIELD_MUTATIONS))
            attempt = ModelProto()
            attempt.CopyFrom(model)
            try:
                description = FIELD_MUTATIONS[kind](rng, attempt)
                blob = attempt.SerializeToString()
            except Skip:
                continue
            except Exception as exc:  # noqa: BLE001 - protobuf refuses some values: not a mutant
                if isinstance(exc, (ValueError, TypeError, OverflowError)):
                    continue
                raise
            model = attempt
            what.append(f"{kind}: {description}")
        yield Case(index, name, what, model.SerializeToString())


# -- running a case ----------------------------------------------------------------------------------

@dataclasses.dataclass
class Outcome:
    """What one case came to. ``kind``: 'error' (one of backplane's, ``error`` its class), 'ran'
    (compared with ORT where it ran: 'match', 'ort-refused' or a mismatch finding), 'loaded'
    (loaded, not run: inputs that zeros cannot stand for), 'hang, ORT too' (a run that ends in
    neither runtime), or a finding: 'bad-exception', 'empty-message', 'crash', 'hang', 'blow-up',
    'mismatch'."""

    kind: str
    error: str = ""  # the class of backplane's exception
    message: str = ""
    detail: str = ""  # a traceback, a mismatch, why it was not run
    ort: str = ""  # 'ran', 'loaded' (not run: no inputs), 'refused: <why>', 'crash', 'hang' or ''
    seconds: float = 0.0
    growth: int = 0  # resident bytes the case added

    @property
    def finding(self) -> bool:
        return self.kind in FINDINGS


FINDINGS = ("bad-exception", "empty-message", "crash", "hang", "blow-up", "mismatch")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vsize() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _in_child(work: Callable[[Callable[[Any], None]], Any], timeout: float,
              memory: int | None) -> tuple[str, Any, int, Any]:
    """Run ``work(post)`` in a forked child under an address-space limit of ``memory`` bytes past
    the parent's (None: none), killed after ``timeout`` seconds. Returns (status, result, growth,
    posted): status 'ok' (``result`` what ``work`` returned, ``growth`` the resident bytes it
    added), 'crash' (``result`` the signal or exit status) or 'hang'; ``posted``: the last value
    ``work`` posted on the way (None if none), which survives a crash or hang."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        status = 0
        try:
            os.close(read_fd)
            faulthandler.disable()  # a crash is reported by the parent, from the signal
            warnings.simplefilter("ignore")  # NumPy's on NaNs and empty slices: not findings
            quiet = os.open(os.devnull, os.O_WRONLY)  # ORT's and protobuf's logs
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            out = os.fdopen(write_fd, "wb")

            def send(kind: bytes, value: Any) -> None:
                payload = pickle.dumps(value)
                out.write(kind + struct.pack("<Q", len(payload)) + payload)
                out.flush()

            start = _rss()
            if memory is not None:
                limit = _vsize() + memory
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            result = work(lambda value: send(b"P", value))
            growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start
            send(b"R", (result, growth))
            out.close()
        except BaseException:  # noqa: BLE001 - whatever happens, the child must not return
            status = 70
        finally:
            os._exit(status)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    data = bytearray()
    hung = False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                hung = True
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if ready:
                chunk = os.read(read_fd, 1 << 20)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_fd)
    _, status = os.waitpid(pid, 0)
    posted, result = None, None
    offset = 0
    while offset + 9 <= len(data):
        kind, size = data[offset:offset + 1], struct.unpack("<Q", data[offset + 1:offset + 9])[0]
        if offset + 9 + size > len(data):
            break
        value = pickle.loads(data[offset + 9:offset + 9 + size])
        offset += 9 + size
        if kind == b"P":
            posted = value
        else:
            result = value
    if hung:
        return "hang", None, 0, posted
    if result is None:
        if os.WIFSIGNALED(status):
            return "crash", f"killed by signal {os.WTERMSIG(status)}", 0, posted
        return "crash", f"exit status {os.waitstatus_to_exitcode(status)}", 0, posted
    return "ok", result[0], result[1], posted


def feeds_for(session: Any) -> tuple[dict[str, Any] | None, str]:
    """Zeros of each input's declared shape (free dims 1), or None and why not."""
    feeds = {}
    for name in session.optimized.input_names:
        info = session.graph.info(name)
        if info.dtype is None:
            return None, f"input '{name}' is not a tensor of a known type"
        shape = [1 if not isinstance(d, int) else d for d in (info.shape or ())]
        if math.prod(shape) > MAX_FEED_ELEMENTS:
            return None, f"input '{name}' has {math.prod(shape)} elements"
        if info.dtype == object:
            feeds[name] = np.full(shape, "", dtype=object)
        else:
            feeds[name] = np.zeros(shape, info.dtype)
    return feeds, ""


def _backplane_work(blob: bytes) -> Callable[[Callable[[Any], None]], dict[str, Any]]:
    def work(post: Callable[[Any], None]) -> dict[str, Any]:
        import backplane
        own = own_error_classes()
        stage = "load"
        try:
            session = backplane.InferenceSession(blob, backends=["CpuRef"])
            feeds, why = feeds_for(session)
            if feeds is None:
                return {"kind": "loaded", "detail": why}
            stage = "run"
            post(feeds if sum(_nbytes(v) for v in feeds.values()) <= MAX_SENT_BYTES else None)
            outputs = session.run(None, feeds)
        except Exception as exc:  # noqa: BLE001 - classified here
            kind = "error" if isinstance(exc, own) else "bad-exception"
            if kind == "error" and not str(exc).strip():
                kind = "empty-message"
            return {"kind": kind, "error": type(exc).__name__, "message": str(exc)[:2000],
                    "detail": f"at {stage}:\n{traceback.format_exc()[-6000:]}"}
        sent = [o if _nbytes(o) <= MAX_SENT_BYTES else None for o in outputs]
        return {"kind": "ran", "feeds": feeds, "outputs": sent}
    return work


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _ort_work(blob: bytes, feeds: dict[str, Any] | None) -> Callable[[Callable[[Any], None]], dict[str, Any]]:
    def work(post: Callable[[Any], None]) -> dict[str, Any]:
        import onnxruntime as ort
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.log_severity_level = 4
        try:
            session = ort.InferenceSession(blob, options, providers=["CPUExecutionProvider"])
            if feeds is None:
                return {"ran": False}
            names = [o.name for o in session.get_outputs()]
            given = {i.name for i in (*session.get_inputs(),  # and inputs' defaults, fed
                                      *session.get_overridable_initializers())}
            outputs = session.run(names, {k: v for k, v in feeds.items() if k in given})
        except Exception as exc:  # noqa: BLE001 - ORT refusing is an answer
            return {"refused": f"{type(exc).__name__}: {str(exc)[:300]}"}
        return {"ran": True, "outputs": outputs}
    return work


def compare(ours: Sequence[Any], theirs: Sequence[Any]) -> str:
    """'' where the outputs agree within RTOL (relative to each output's scale), else what differs."""
    if len(ours) != len(theirs):
        return f"{len(ours)} outputs, ORT gives {len(theirs)}"
    for k, (a, b) in enumerate(zip(ours, theirs)):
        if a is None:  # too large to send back
            continue
        if isinstance(b, list) or isinstance(a, list):
            if not isinstance(a, list) or not isinstance(b, list):
                return f"output {k}: {type(a).__name__}, ORT gives {type(b).__name__}"
            problem = compare(a, b)
            if problem:
                return f"output {k}: {problem}"
            continue
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return f"output {k}: shape {a.shape}, ORT gives {b.shape}"
        if a.dtype != b.dtype:
            return f"output {k}: dtype {a.dtype}, ORT gives {b.dtype}"
        if a.dtype.kind in "OUSb" or a.dtype.kind in "iu":
            if not np.array_equal(a, b):
                return f"output {k}: values differ ({a.ravel()[:6]} vs {b.ravel()[:6]})"
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        finite = np.isfinite(b64)
        if not np.array_equal(np.isnan(a64), np.isnan(b64)) or \
                not np.array_equal(a64[~finite & ~np.isnan(b64)], b64[~finite & ~np.isnan(b64)]):
            return f"output {k}: non-finite values differ"
        scale = float(np.max(np.abs(b64[finite]))) if finite.any() else 0.0
        error = float(np.max(np.abs(a64[finite] - b64[finite]))) if finite.any() else 0.0
        if error > RTOL * max(scale, 1e-6) + 1e-7:
            return f"output {k}: max |diff| {error:.3g} at scale {scale:.3g}"
    return ""


def run_case(blob: bytes, timeout: float = 20.0, memory: int = MEMORY_BUDGET,
             ort_always: bool = False) -> Outcome:
    """One mutant through backplane, then (where backplane ran it, or always) through ORT. A run
    that does not end is a finding unless ORT's does not end either (a model that loops for ages)."""
    start = time.monotonic()
    status, result, growth, feeds = _in_child(_backplane_work(blob), timeout, memory)
    seconds = time.monotonic() - start
    if status == "hang":
        outcome = Outcome("hang", detail=f"no answer within {timeout} s "
                                         f"({'running' if feeds is not None else 'loading'})",
                          seconds=seconds)
        if feeds is not None:  # loaded: does ORT end on the same inputs?
            ort_status, theirs, _, _ = _in_child(_ort_work(blob, feeds), timeout, memory)
            outcome.ort = ort_status if ort_status != "ok" else \
                "ran" if theirs.get("ran") else f"refused: {theirs.get('refused', '')}"
            if ort_status == "hang":
                outcome.kind = "hang, ORT too"
        return outcome
    if status == "crash":
        return Outcome("crash", detail=str(result), seconds=seconds)
    outcome = Outcome(result["kind"], result.get("error", ""), result.get("message", ""),
                      result.get("detail", ""), seconds=seconds, growth=growth)
    if growth > GROWTH_LIMIT and not outcome.finding:
        outcome.kind, outcome.detail = "blow-up", f"resident memory grew by {growth >> 20} MiB"
        return outcome
    if outcome.kind != "ran" and not (ort_always and outcome.kind in ("error", "loaded")):
        return outcome
    status, theirs, _, _ = _in_child(_ort_work(blob, result.get("feeds", feeds)), timeout, memory)
    if status != "ok":
        outcome.ort = status
    elif "refused" in theirs:
        outcome.ort = f"refused: {theirs['refused']}"
    elif not theirs["ran"]:  # no inputs to run it on: backplane refused it at load
        outcome.ort = "loaded"
    else:
        outcome.ort = "ran"
        if outcome.kind == "ran" and theirs["ran"]:
            problem = compare(result["outputs"], theirs["outputs"])
            if problem:
                outcome.kind, outcome.detail = "mismatch", problem
    return outcome


def summarize(results: Sequence[tuple[Case, Outcome]]) -> Counter:
    counts: Counter = Counter()
    for _, outcome in results:
        if outcome.kind == "error":
            counts[f"error {outcome.error}"] += 1
            if outcome.ort in ("ran", "loaded"):
                counts[f"(backplane refused, ORT {outcome.ort})"] += 1
        elif outcome.kind == "ran":
            counts["ran, matches ORT" if outcome.ort == "ran" else f"ran, ORT {outcome.ort.split(':')[0]}"] += 1
        else:
            counts[outcome.kind] += 1
    return counts


def fuzz(seed: int, count: int, timeout: float = 20.0, ort_always: bool = False,
         progress: Callable[[Case, Outcome], None] | None = None) -> list[tuple[Case, Outcome]]:
    results = []
    for case in generate(seed, count):
        outcome = run_case(case.blob, timeout, ort_always=ort_always)
        results.append((case, outcome))
        if progress:
            progress(case, outcome)
    return results


def describe(case: Case, outcome: Outcome) -> str:
    return (f"case {case.index} of seed model '{case.seed_name}' ({'; '.join(case.mutations)}): "
            f"{outcome.kind} {outcome.error} {outcome.message[:300]}\n{outcome.detail[-3000:]}")

