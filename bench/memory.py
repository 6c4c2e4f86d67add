"""Peak resident memory of a model's runs: backplane against ONNX Runtime, one process each.

Each runtime runs in a process of its own, in alternating order, batch 1: the process imports its
libraries, loads the model, runs it ``--runs`` times; the table shows the peak resident set of the
process (VmHWM: libraries, model, weights and the runs' tensors together), the peak reached by the
time the model is loaded (the import's and the load's), the resident set once it is loaded, and the
growth from there to the runs' own peak (what the runs' tensors took; the peak is reset after the
load where Linux allows it), with backplane's planned peak for comparison
(``PlacementReport.peak_bytes``, intermediates only). ``--keep-initializers`` loads
backplane's sessions with ``SessionOptions.keep_initializers`` (the graphs keep the weights).

``--sessions N`` measures churn instead: one process per backend list (``--churn``, repeatable;
a backend's options after a colon, ``CpuAcc:compile=layers``) creates a session, runs it once and
drops it (``gc.collect()``), N times, and prints its resident set (VmRSS) every ``--every``
sessions, with the functions held in TorchScript's process-wide compilation unit (where each
traced module stayed before issue 32's fix). A service that reloads models needs this flat.

Usage:
    python bench/memory.py MODEL.onnx [MODEL.onnx ...] [--backends CpuAcc,CpuRef] [--runs 20]
    python bench/memory.py MODEL.onnx --sessions 500 [--every 50] [--churn CpuAcc,CpuRef ...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def status(field: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def feeds(inputs: list[tuple[str, list, str]]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    values = {}
    for name, shape, kind in inputs:
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in shape]
        if "int" in kind:
            if "mask" in name:
                values[name] = np.ones(shape, np.int64)
            elif "type" in name:
                values[name] = np.zeros(shape, np.int64)
            else:
                values[name] = rng.integers(0, 100, shape).astype(np.int64)
        elif "float16" in kind:
            values[name] = rng.standard_normal(shape).astype(np.float16)
        else:
            values[name] = rng.standard_normal(shape).astype(np.float32)
    return values


def child(model: str, runtime: str, backends: list[str], runs: int, threads: int,
          keep: bool) -> dict:
    planned = None
    if runtime == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        inputs = [(i.name, i.shape, i.type) for i in session.get_inputs()]
        run = session.run
    else:
        sys.path.insert(0, str(ROOT / "src"))
        from backplane import InferenceSession, SessionOptions

        options = SessionOptions()
        options.intra_op_num_threads = threads
        if keep:
            options.keep_initializers = True
        session = InferenceSession(model, backends, options)
        inputs = [(i.name, i.shape, i.type) for i in session.get_inputs()]
        run = session.run
        planned = sum(session.report.peak_bytes.values())
    values = feeds(inputs)
    loaded, at_load = status("VmRSS"), status("VmHWM")
    reset = reset_peak()
    for _ in range(runs):
        run(None, values)
    in_runs = status("VmHWM")
    return {"peak": max(at_load, in_runs), "at_load": at_load, "loaded": loaded,
            "in_runs": in_runs if reset else None, "planned": planned}


def providers(spec: str) -> list:
    """"CpuAcc:compile=layers,CpuRef" as providers=: ids, or (id, {option: value}) pairs."""
    found: list = []
    for item in spec.split(","):
        name, _, options = item.partition(":")
        pairs = dict(option.split("=", 1) for option in options.split(";") if option)
        found.append((name, pairs) if pairs else name)
    return found


def churn(model: str, spec: str, sessions: int, every: int, threads: int) -> None:
    """Creates, runs once and drops ``sessions`` sessions, printing a JSON line every ``every``
    (and after the first): sessions done, VmRSS, TorchScript functions held, seconds."""
    import gc
    import time

    sys.path.insert(0, str(ROOT / "src"))
    from backplane import InferenceSession, SessionOptions

    options = SessionOptions()
    options.intra_op_num_threads = threads
    values, start = None, time.perf_counter()
    for done in range(1, sessions + 1):
        session = InferenceSession(model, options, providers=providers(spec))
        if values is None:
            values = feeds([(i.name, i.shape, i.type) for i in session.get_inputs()])
        session.run(None, values)
        del session
        gc.collect()
        if done == 1 or done % max(1, every) == 0 or done == sessions:
            print(json.dumps({"sessions": done, "rss": status("VmRSS"), "jit": jit_functions(),
                              "seconds": time.perf_counter() - start}), flush=True)


def jit_functions() -> int | None:
    """How many functions torch's process-wide TorchScript compilation unit holds (None: no torch
    imported)."""
    torch = sys.modules.get("torch")
    return None if torch is None else len(torch.jit._state._python_cu.get_functions())


def churn_table(model: str, specs: list[str], args: argparse.Namespace) -> None:
    print(f"{args.threads} threads; {Path(model).stem}: {args.sessions} sessions created, run once "
          f"and dropped, one process per backend list; MiB")
    print(f"{'backends':<32} {'sessions':>8} {'rss':>8} {'growth':>8} {'MiB/sess':>8} "
          f"{'jit fns':>7} {'seconds':>8}")
    for spec in specs:
        command = [sys.executable, __file__, model, "--sessions", str(args.sessions), "--every",
                   str(args.every), "--threads", str(args.threads), "--churn-child", spec]
        first, other = None, []
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}) as child:
            assert child.stdout is not None
            for line in child.stdout:
                if not line.startswith("{"):  # warnings, a traceback
                    other.append(line)
                    continue
                row = json.loads(line)
                first = first or row
                growth = (row["rss"] - first["rss"]) / 2**20
                per = growth / max(1, row["sessions"] - first["sessions"])
                print(f"{spec:<32} {row['sessions']:>8} {row['rss'] / 2**20:8.1f} {growth:8.1f} "
                      f"{per:8.2f} {row['jit'] if row['jit'] is not None else '-':>7} "
                      f"{row['seconds']:8.1f}", flush=True)
        if child.returncode:
            print(f"{spec}: failed\n{''.join(other)[-1500:]}")


def reset_peak() -> bool:
    """VmHWM back to the resident set now (Linux's clear_refs 5), so that the runs' own peak can
    be read apart from the load's; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def machine() -> str:
    import onnx
    import onnxruntime

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    parts = [cpu, f"python {platform.python_version()}", f"numpy {np.__version__}",
             f"onnx {onnx.__version__}", f"onnxruntime {onnxruntime.__version__}"]
    try:
        import torch
        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    return "; ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--backends", default="CpuAcc,CpuRef")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keep-initializers", action="store_true")
    parser.add_argument("--sessions", type=int, default=0,
                        help="churn: create, run once and drop this many sessions per --churn list")
    parser.add_argument("--every", type=int, default=50, help="churn: print RSS every N sessions")
    parser.add_argument("--churn", action="append",
                        help="churn: a backend list (repeatable; default CpuAcc,CpuRef, "
                             "CpuAcc:compile=layers,CpuRef and CpuRef)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--churn-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    backends = args.backends.split(",")
    if args.churn_child:
        churn(args.models[0], args.churn_child, args.sessions, args.every, args.threads)
        return 0
    if args.sessions:
        if len(args.models) != 1:
            parser.error("--sessions takes one model")
        print(machine())
        churn_table(args.models[0], args.churn or ["CpuAcc,CpuRef", "CpuAcc:compile=layers,CpuRef",
                                                   "CpuRef"], args)
        return 0
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], backends, args.runs, args.threads,
                               args.keep_initializers)))
        return 0
    if not args.models:
        parser.error("give at least one model")
    print(machine())
    kept = ", keeping initializers" if args.keep_initializers else ""
    print(f"{args.threads} threads, batch 1, {args.runs} runs a process, backplane on "
          f"{','.join(backends)}{kept}; MiB")
    print(f"{'model':<28} {'runtime':<12} {'peak':>8} {'at load':>8} {'loaded':>8} {'growth':>8} "
          f"{'planned':>8}")
    runtimes = ("backplane", "onnxruntime")
    for model in args.models:
        found: dict[str, list[dict]] = {r: [] for r in runtimes}
        for round_ in range(args.rounds):
            for runtime in (runtimes if round_ % 2 == 0 else runtimes[::-1]):
                done = subprocess.run(
                    [sys.executable, __file__, "--backends", args.backends, "--runs",
                     str(args.runs), "--threads", str(args.threads), "--child", model, runtime,
                     *(["--keep-initializers"] if args.keep_initializers else [])],
                    capture_output=True, text=True,
                    env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
                if done.returncode:
                    print(f"{Path(model).stem} {runtime}: failed\n{done.stderr[-1500:]}")
                    break
                found[runtime].append(json.loads(done.stdout.strip().splitlines()[-1]))
        for runtime in runtimes:
            if not found[runtime]:
                continue
            best = min(found[runtime], key=lambda r: r["peak"])
            planned = "" if best["planned"] is None else f"{best['planned'] / 2**20:8.1f}"
            top = best["in_runs"] if best["in_runs"] is not None else best["peak"]
            print(f"{Path(model).stem:<28} {runtime:<12} {best['peak'] / 2**20:8.1f} "
                  f"{best['at_load'] / 2**20:8.1f} {best['loaded'] / 2**20:8.1f} "
                  f"{(top - best['loaded']) / 2**20:8.1f} {planned:>8}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
