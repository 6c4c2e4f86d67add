"""Peak resident memory of a model's runs: backplane against ONNX Runtime, one process each.

Each runtime runs in a process of its own, in alternating order, batch 1: the process imports its
libraries, loads the model, runs it ``--runs`` times; the table shows the peak resident set of the
process (VmHWM: libraries, model, weights and the runs' tensors together), the resident set once the
model is loaded, and the growth from there to the peak (what the runs' tensors took), with
backplane's planned peak for comparison (``PlacementReport.peak_bytes``, intermediates only).

Usage:
    python bench/memory.py MODEL.onnx [MODEL.onnx ...] [--backends CpuAcc,CpuRef] [--runs 20]
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


def child(model: str, runtime: str, backends: list[str], runs: int, threads: int) -> dict:
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
        session = InferenceSession(model, backends, options)
        inputs = [(i.name, i.shape, i.type) for i in session.get_inputs()]
        run = session.run
        planned = sum(session.report.peak_bytes.values())
    values = feeds(inputs)
    loaded = status("VmRSS")
    for _ in range(runs):
        run(None, values)
    return {"peak": status("VmHWM"), "loaded": loaded, "planned": planned}


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
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    backends = args.backends.split(",")
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], backends, args.runs, args.threads)))
        return 0
    if not args.models:
        parser.error("give at least one model")
    print(machine())
    print(f"{args.threads} threads, batch 1, {args.runs} runs a process, backplane on "
          f"{','.join(backends)}; MiB")
    print(f"{'model':<28} {'runtime':<12} {'peak':>8} {'loaded':>8} {'growth':>8} {'planned':>8}")
    runtimes = ("backplane", "onnxruntime")
    for model in args.models:
        found: dict[str, list[dict]] = {r: [] for r in runtimes}
        for round_ in range(args.rounds):
            for runtime in (runtimes if round_ % 2 == 0 else runtimes[::-1]):
                done = subprocess.run(
                    [sys.executable, __file__, "--backends", args.backends, "--runs",
                     str(args.runs), "--threads", str(args.threads), "--child", model, runtime],
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
            print(f"{Path(model).stem:<28} {runtime:<12} {best['peak'] / 2**20:8.1f} "
                  f"{best['loaded'] / 2**20:8.1f} {(best['peak'] - best['loaded']) / 2**20:8.1f} "
                  f"{planned:>8}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
