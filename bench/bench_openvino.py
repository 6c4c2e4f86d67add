"""OpenVINO inside backplane against ONNX Runtime, OpenVINO alone and CpuAcc (issue 12).

Usage:
    python bench/bench_openvino.py                                   # the tiny models of tests/data
    python bench/bench_openvino.py /tmp/anchors/models/*.onnx        # the anchor models, fp32
    python bench/bench_openvino.py m.onnx --precision fp32,bf16      # and reduced precision, with accuracy

Each runtime runs in processes of its own, one process per round, alternating A, B, C, A, B, C, ...
(ONNX Runtime's spinning threads would slow whatever ran next in its process; drift of a shared
machine touches every runtime alike). A process loads the model, makes ``--warmup`` untimed calls and
``--runs`` timed ones at batch 1, ``--threads`` threads (2), and reports. Every runtime gets the same
seeded inputs (a tiny model's own ``.npz`` where there is one beside it).

fp32 runtimes: ``onnxruntime`` (CPU EP), ``openvino`` (OpenVINO's own API: read the ONNX file,
compile for the CPU with f32 inference precision and the LATENCY hint, infer with shared inputs and
outputs), ``OpenVINO,CpuRef``, ``CpuAcc,CpuRef`` and ``measured:OpenVINO,CpuAcc,CpuRef`` (backplane
sessions; ``measured:`` is ``OptimizerOptions(placement="measured")``: each partition on the backend
timed fastest for it at load, issue 12's best configuration). ``--runtime`` (repeated) picks
runtimes instead of the precision's list. bf16 runtimes:
``openvino-default`` (OpenVINO compiled with no precision hint: bf16 on a CPU with AMX or
AVX512-BF16, f32 elsewhere), ``openvino`` with bf16 asked, and the backplane sessions with
``OpenVINO.precision=bf16`` and ``CpuAcc.precision=bf16``. The table: median ms of all timed calls, the spread (min-max of each
process's median), ONNX Runtime's median over this one (above 1: faster than ONNX Runtime), the
better of ONNX Runtime's and OpenVINO's fp32 medians over this one ("vs peers", issue 12's figure,
with its geometric mean over the models for each backplane runtime at the end), the worst
relative difference of the outputs from ONNX Runtime's fp32 ones (max |diff| / max |reference|), the
precision OpenVINO computed in where it tells, and the load seconds.
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
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# run as a script, this file's folder comes first on sys.path, where "import openvino" would find
# this file instead of the library
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402

from backplane.backends.torch.bench import feeds_for, timed_runs, worker_report  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = [ROOT / "tests" / "data" / f"{name}.onnx"
        for name in ("tiny_mobilenet_v3", "tiny_bert", "tiny_gpt2")]
ORT = "onnxruntime"
MEASURED = "measured:"
RUNTIMES = {"fp32": [ORT, "openvino", "OpenVINO,CpuRef", "CpuAcc,CpuRef",
                     f"{MEASURED}OpenVINO,CpuAcc,CpuRef"],
            "bf16": ["openvino-default", "openvino", "OpenVINO,CpuRef", "CpuAcc,CpuRef",
                     f"{MEASURED}OpenVINO,CpuAcc,CpuRef"]}
Run = Callable[[], list[np.ndarray]]


# -- the worker side ------------------------------------------------------------------------------
def load(runtime: str, model: str, feeds: dict[str, np.ndarray], threads: int,
         precision: str) -> tuple[Run, str]:
    """A call that runs the model once, and the precision it computes in ("" where unknown)."""
    if runtime == ORT:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        return (lambda: session.run(None, feeds)), "f32"
    if runtime.startswith("openvino"):
        import openvino

        config = {"INFERENCE_NUM_THREADS": str(threads), "PERFORMANCE_HINT": "LATENCY"}
        if runtime == "openvino":
            config["INFERENCE_PRECISION_HINT"] = {"fp32": "f32", "bf16": "bf16"}[precision]
        compiled = openvino.Core().compile_model(model, "CPU", config)
        request = compiled.create_infer_request()

        def run() -> list[np.ndarray]:
            results = request.infer(feeds, share_inputs=True, share_outputs=True)
            return [results[port] for port in compiled.outputs]

        return run, compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    from backplane import InferenceSession, OptimizerOptions

    placement = "measured" if runtime.startswith(MEASURED) else "preference"
    backends = runtime.removeprefix(MEASURED).split(",")
    options = {"OpenVINO.threads": threads, "CpuAcc.threads": threads,
               "OpenVINO.precision": precision, "CpuAcc.precision": precision}
    session = InferenceSession(model, providers=[(b, {k: v for k, v in options.items()
                                                      if k.startswith(f"{b}.")})
                                                 for b in backends],
                               optimizer_options=OptimizerOptions(placement=placement))
    steps = session.runtime.network(session.network_id).steps
    used = sorted({w.precision for w in (s.workload for s in steps) if hasattr(w, "precision")})
    return (lambda: session.run(None, feeds)), ",".join(used)


def worker(args: argparse.Namespace) -> None:
    """One process of one runtime: load, warm up, time, report one JSON line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the runtime prints goes to stderr
    feeds = dict(np.load(args.feeds))
    try:
        start = time.perf_counter()
        run, precision = load(args.worker, args.model[0], feeds, args.threads, args.precision)
        load_s = time.perf_counter() - start
        outputs, times = timed_runs(run, args.warmup, args.runs)
        if args.save:
            np.savez(args.save, *[np.asarray(o) for o in outputs])
        replies.write(json.dumps({"load_s": load_s, "times": times, "precision": precision}) + "\n")
    except Exception as exc:  # noqa: BLE001 - a runtime that cannot run a model is a result
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}) + "\n")


# -- the parent side ------------------------------------------------------------------------------
def spawn(args: argparse.Namespace, runtime: str, precision: str, model: Path, feeds: Path,
          save: Path | None) -> dict[str, Any]:
    command = [sys.executable, __file__, str(model), "--worker", runtime, "--feeds", str(feeds),
               "--runs", str(args.runs), "--warmup", str(args.warmup), "--threads",
               str(args.threads), "--precision", precision] + (["--save", str(save)] if save else [])
    return worker_report(command, args.threads, args.timeout)


def bench_model(args: argparse.Namespace, model: Path, tmp: Path) -> list[dict[str, Any]]:
    feeds = tmp / f"{model.stem}.feeds.npz"
    np.savez(feeds, **feeds_for(model))  # type: ignore[arg-type]
    columns = [(precision, rt) for precision in args.precision
               for rt in (args.runtime or RUNTIMES[precision])]
    if (("fp32", ORT)) not in columns:
        columns.insert(0, ("fp32", ORT))  # the reference of every accuracy figure
    rows = {column: {"precision": column[0], "runtime": column[1], "medians": [], "times": [],
                     "loads": [], "outputs": None, "error": None, "computes": ""}
            for column in columns}
    for round_ in range(args.rounds):
        for column, row in rows.items():
            if row["error"]:
                continue
            print(f"{model.stem}: {column[1]} {column[0]} (round {round_ + 1}/{args.rounds})",
                  file=sys.stderr)
            save = tmp / f"{model.stem}.{columns.index(column)}.npz" if round_ == 0 else None
            reply = spawn(args, column[1], column[0], model, feeds, save)
            if "error" in reply:
                row["error"] = reply["error"]
                continue
            row["times"] += reply["times"]
            row["medians"].append(statistics.median(reply["times"]))
            row["loads"].append(reply["load_s"])
            row["computes"] = reply["precision"]
            if save:
                with np.load(save) as saved:
                    row["outputs"] = [saved[k] for k in saved.files]
    return list(rows.values())


def difference(outputs: list[np.ndarray] | None, reference: list[np.ndarray] | None) -> str:
    if outputs is None or reference is None:
        return "-"
    if len(outputs) != len(reference) or any(a.shape != b.shape for a, b in zip(outputs, reference)):
        return "shapes differ"
    worst = max((float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-12))
                 for a, b in zip(outputs, reference) if b.size), default=0.0)
    return f"{worst:.1e}"


def peers_median(rows: list[dict[str, Any]]) -> float | None:
    """The better of ONNX Runtime's and OpenVINO's own fp32 medians, where either ran."""
    medians = [statistics.median(r["times"]) for r in rows if r["precision"] == "fp32"
               and r["runtime"] in (ORT, "openvino") and r["times"]]
    return min(medians) if medians else None


def table(model: str, rows: list[dict[str, Any]], ratios: dict[str, list[float]]) -> list[str]:
    reference = next(r for r in rows if r["runtime"] == ORT and r["precision"] == "fp32")
    base = statistics.median(reference["times"]) if reference["times"] else None
    peers = peers_median(rows)
    lines = []
    for row in rows:
        name = f"{row['runtime']} {row['precision']}"
        if row["error"]:
            lines.append(f"| {model:18s} | {name:37s} | failed: {row['error'][:70]} |")
            continue
        median = statistics.median(row["times"]) * 1e3
        spread = f"{min(row['medians']) * 1e3:.2f}-{max(row['medians']) * 1e3:.2f}"
        ratio = f"{base * 1e3 / median:.2f}x" if base else "-"
        versus = f"{peers * 1e3 / median:.2f}x" if peers else "-"
        if peers and row["runtime"] not in (ORT, "openvino", "openvino-default"):
            ratios.setdefault(name, []).append(peers * 1e3 / median)
        lines.append(f"| {model:18s} | {name:37s} | {median:8.2f} | {spread:>13s} | {ratio:>6s} | "
                     f"{versus:>8s} | "
                     f"{difference(row['outputs'], reference['outputs']):>8s} | "
                     f"{row['computes'] or '-':>8s} | {statistics.median(row['loads']):6.2f} |")
    return lines


def environment(threads: int) -> list[str]:
    cpu = platform.processor() or "unknown CPU"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"]
    versions = []
    for package in ("numpy", "onnx", "onnxruntime", "openvino", "torch", "backplane"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package} absent")
    load1, load5, _ = os.getloadavg()
    return [f"CPU: {cpu}, {os.cpu_count()} logical CPUs; "
            f"flags: {' '.join(f for f in wanted if f in flags) or 'none of ' + ', '.join(wanted)}",
            f"python {platform.python_version()}, {', '.join(versions)}",
            f"{threads} threads, batch 1; load average {load1:.2f} / {load5:.2f} (1 / 5 min) at start"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="*", type=Path, help="ONNX models (the tiny ones by default)")
    parser.add_argument("--precision", default="fp32",
                        help="comma-separated: fp32 and/or bf16 (default fp32)")
    parser.add_argument("--runtime", action="append", default=[],
                        help="a runtime to time (repeat; default: the precision's list)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="processes per runtime, alternating")
    parser.add_argument("--runs", type=int, default=50, help="timed calls per process")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per process")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--feeds", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        args.precision = args.precision.split(",")
        unknown = [p for p in args.precision if p not in RUNTIMES]
        if unknown:
            parser.error(f"--precision {','.join(unknown)}: the choices are {', '.join(RUNTIMES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    models = args.model or TINY
    lines = environment(args.threads)
    lines += ["| model              | runtime precision                     |   median | spread ms     | vs ORT |"
              " vs peers | rel diff | computes | load s |"]
    failed = False
    ratios: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            rows = bench_model(args, model, Path(tmp))
            failed |= any(row["error"] for row in rows)
            lines += table(model.stem, rows, ratios)
    for name, values in ratios.items():
        geomean = float(np.exp(np.mean(np.log(values))))
        lines.append(f"{name}: vs peers {', '.join(f'{v:.2f}' for v in values)}; geometric mean "
                     f"{geomean:.3f}, lowest {min(values):.2f} ({len(values)} models)")
    load1, load5, _ = os.getloadavg()
    lines.append(f"load average {load1:.2f} / {load5:.2f} (1 / 5 min) at the end")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
