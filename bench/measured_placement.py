"""Measured placement against preference order, over OpenVINO, CpuAcc and CpuRef (issue 12, item 3).

Usage:
    python bench/measured_placement.py                          # the tiny models of tests/data
    python bench/measured_placement.py /tmp/anchors/models/*.onnx --rounds 5

One backplane session per process, one process per round, alternating preference, measured,
preference, measured, ... (drift of a shared machine touches both alike). Both use the backend list
``OpenVINO,CpuAcc,CpuRef`` with 2 threads each (``--threads``); ``preference`` places each layer
on the first backend that takes it, ``measured`` is ``OptimizerOptions(placement="measured")``. A
process loads the model (the load seconds include the measuring), makes ``--warmup`` untimed calls
and ``--runs`` timed ones at batch 1, all on the same seeded inputs (a tiny model's own ``.npz``
where there is one beside it). The table: median ms of all timed calls, the spread (min-max of each
process's median), preference's median over this one, the worst relative difference of the outputs
from preference's (max |diff| / max |reference|), the load seconds, the partitions of a run and the
layers per backend. Then, for measured, the first process's measurements table (the report's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# run as a script, this file's folder comes first on sys.path, where a bench file named like a library
# would shadow it (bench/openvino.py did, now bench_openvino.py)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402

from backplane.backends.torch.bench import feeds_for, timed_runs, worker_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = [ROOT / "tests" / "data" / f"{name}.onnx"
        for name in ("tiny_mobilenet_v3", "tiny_bert", "tiny_gpt2")]
BACKENDS = ["OpenVINO", "CpuAcc", "CpuRef"]
PLACEMENTS = ["preference", "measured"]


# -- the worker side ------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    """One process of one placement: load, warm up, time, report one JSON line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the runtime prints goes to stderr
    from backplane import InferenceSession, OptimizerOptions

    feeds = dict(np.load(args.feeds))
    try:
        start = time.perf_counter()
        options = {"OpenVINO.threads": args.threads, "CpuAcc.threads": args.threads}
        providers = [(b, {k: v for k, v in options.items() if k.startswith(f"{b}.")})
                     for b in BACKENDS]
        session = InferenceSession(str(args.model[0]), providers=providers,
                                   optimizer_options=OptimizerOptions(placement=args.worker))
        load_s = time.perf_counter() - start
        outputs, times = timed_runs(lambda: session.run(None, feeds), args.warmup, args.runs)
        if args.save:
            np.savez(args.save, *[np.asarray(o) for o in outputs])
        report = session.report
        table = str(report).split("Measured placement", 1)[-1].split("\n", 1)[-1] \
            if report.measurements else ""
        table = table.split(f"{len(report.layers)} layers", 1)[0].rstrip()
        replies.write(json.dumps({"load_s": load_s, "times": times, "counts": report.counts(),
                                  "partitions": len(report.partitions), "table": table}) + "\n")
    except Exception as exc:  # noqa: BLE001 - a placement that cannot run a model is a result
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}) + "\n")


# -- the parent side ------------------------------------------------------------------------------
def spawn(args: argparse.Namespace, placement: str, model: Path, feeds: Path,
          save: Path | None) -> dict[str, Any]:
    command = [sys.executable, __file__, str(model), "--worker", placement, "--feeds", str(feeds),
               "--runs", str(args.runs), "--warmup", str(args.warmup), "--threads",
               str(args.threads)] + (["--save", str(save)] if save else [])
    return worker_report(command, args.threads, args.timeout)


def bench_model(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, dict[str, Any]]:
    feeds = tmp / f"{model.stem}.feeds.npz"
    np.savez(feeds, **feeds_for(model))  # type: ignore[arg-type]
    rows = {p: {"medians": [], "times": [], "loads": [], "outputs": None, "error": None,
                "counts": {}, "partitions": 0, "table": ""} for p in PLACEMENTS}
    for round_ in range(args.rounds):
        for placement, row in rows.items():
            if row["error"]:
                continue
            print(f"{model.stem}: {placement} (round {round_ + 1}/{args.rounds})", file=sys.stderr)
            save = tmp / f"{model.stem}.{placement}.npz" if round_ == 0 else None
            reply = spawn(args, placement, model, feeds, save)
            if "error" in reply:
                row["error"] = reply["error"]
                continue
            row["times"] += reply["times"]
            row["medians"].append(statistics.median(reply["times"]))
            row["loads"].append(reply["load_s"])
            row["counts"], row["partitions"] = reply["counts"], reply["partitions"]
            row["table"] = row["table"] or reply["table"]
            if save:
                with np.load(save) as saved:
                    row["outputs"] = [saved[k] for k in saved.files]
    return rows


def difference(outputs: list[np.ndarray] | None, reference: list[np.ndarray] | None) -> str:
    if outputs is None or reference is None:
        return "-"
    if len(outputs) != len(reference) \
            or any(a.shape != b.shape for a, b in zip(outputs, reference)):
        return "shapes differ"
    worst = max((float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-12))
                 for a, b in zip(outputs, reference) if b.size), default=0.0)
    return f"{worst:.1e}"


def table(model: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    reference = rows["preference"]
    base = statistics.median(reference["times"]) if reference["times"] else None
    lines = []
    for placement, row in rows.items():
        if row["error"]:
            lines.append(f"| {model:18s} | {placement:10s} | failed: {row['error'][:90]} |")
            continue
        median = statistics.median(row["times"]) * 1e3
        spread = f"{min(row['medians']) * 1e3:.2f}-{max(row['medians']) * 1e3:.2f}"
        ratio = f"{base * 1e3 / median:.2f}x" if base else "-"
        counts = ", ".join(f"{b}: {n}" for b, n in row["counts"].items())
        lines.append(f"| {model:18s} | {placement:10s} | {median:8.2f} | {spread:>13s} | "
                     f"{ratio:>7s} | {difference(row['outputs'], reference['outputs']):>8s} | "
                     f"{statistics.median(row['loads']):6.2f} | {row['partitions']} "
                     f"({counts}) |")
    return lines


def environment(threads: int) -> list[str]:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    versions = []
    for package in ("numpy", "onnx", "onnxruntime", "openvino", "torch", "backplane"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} absent")
    load1, load5, _ = os.getloadavg()
    return [f"CPU: {cpu}, {os.cpu_count()} logical CPUs",
            f"python {platform.python_version()}, {', '.join(versions)}",
            f"backends {','.join(BACKENDS)}; {threads} threads, batch 1; load average "
            f"{load1:.2f} / {load5:.2f} (1 / 5 min) at start"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="*", type=Path,
                        help="ONNX models (the tiny ones by default)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per placement, alternating")
    parser.add_argument("--runs", type=int, default=50, help="timed calls per process")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--worker", choices=PLACEMENTS, help=argparse.SUPPRESS)
    parser.add_argument("--feeds", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    lines = environment(args.threads)
    lines += ["| model              | placement  |   median | spread ms     | vs pref | rel diff "
              "| load s | partitions (layers per backend) |"]
    tables: list[str] = []
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.model or TINY:
            rows = bench_model(args, model, Path(tmp))
            failed |= any(row["error"] for row in rows.values())
            lines += table(model.stem, rows)
            if rows["measured"]["table"]:
                tables += [f"{model.stem}, measured (first process):", rows["measured"]["table"]]
    load1, load5, _ = os.getloadavg()
    lines.append(f"load average {load1:.2f} / {load5:.2f} (1 / 5 min) at the end")
    print("\n".join(lines + tables))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
