"""Time a model on backplane, ONNX Runtime and eager PyTorch side by side: the engine of
``backplane bench`` (and ``bench/bench_torch.py``); each process it starts is
``backplane.bench_worker``'s.

Each runtime runs in processes of its own, one process per round, alternating A, B, C, A, B, C, ...:
ONNX Runtime's worker threads keep spinning after a call and would slow whatever ran next in the same
process on a 2-core machine, and a slow drift of the machine touches every runtime alike. A process
loads the model, makes ``--warmup`` untimed calls and ``--runs`` timed ones, and reports. Every runtime
gets the same seeded inputs and returns host arrays (a GPU runtime uploads and downloads in each call).

Columns: backplane for each ``--backends`` list; ``onnxruntime`` (CPU, ``--threads`` intra-op
threads); ``torch-eager``, the PyTorch module the model was exported from (rebuilt by
``scripts/export_models.py``'s builders with the same seed, so the same weights; skipped, with the
reason in one line, where the model is not one of theirs or its builder's torchvision /
transformers is missing); on ``--device cuda``, ``torch-cudagraph``, that
module captured as a CUDA graph and replayed. The table gives the median of all timed calls, the
spread (min-max of each process's median), the ratio to ONNX Runtime (ORT time / this time: above 1
is faster than ORT), GFLOP/s from the model's Conv / MatMul / Gemm multiply-adds, that against the
measured matmul peak of the device, the load time, and backplane's plan: its partitions and its
crossings (tensors a run hands from one backend to another), so that a placement that regresses shows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backplane.bench_worker import (CUDA_GRAPH, EAGER, NO_MODULE, ORT, option_value,  # noqa: F401
                                    peak_worker, timed_runs, worker)

WORKER = [sys.executable, "-m", "backplane.bench_engine", "--worker"]
"""The command of one bench process (its runtime and options follow)."""


def worker_report(command: Sequence[str], threads: int, timeout: float) -> dict[str, Any]:
    """Run one worker process (``OMP_NUM_THREADS`` at ``threads``) and return the JSON report of its
    last stdout line, or an error naming its exit status and the end of its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(list(command), capture_output=True, text=True, env=env, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return {"error": f"worker exited {done.returncode} without a report: {tail}"}
    return json.loads(lines[-1])


def feeds_for(model: Path) -> dict[str, np.ndarray]:
    """The inputs saved beside the model (``MODEL.npz``), else seeded ones (``make_feeds``)."""
    beside = model.with_suffix(".npz")
    if beside.exists():
        return dict(np.load(beside))
    return make_feeds(model)


@dataclass
class Result:
    times: list[float] = field(default_factory=list)
    medians: list[float] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    error: str | None = None
    outputs: list[np.ndarray] | None = None
    plan: dict[str, int] = field(default_factory=dict)
    """backplane's plan: ``partitions`` and ``crossings`` (tensors a run hands between backends)."""


def measure_peak(threads: int, device: str) -> float | None:
    """The device's fp32 matmul peak in GFLOP/s, measured in a process of its own, or None where
    that process failed."""
    reply = subprocess.run([*WORKER, "peak", "--threads", str(threads), "--device", device],
                           capture_output=True, text=True)
    if reply.returncode != 0 or not reply.stdout.strip():
        return None
    return float(json.loads(reply.stdout.strip().splitlines()[-1])["gflops"])


def is_skip(runtime: str, error: str | None) -> bool:
    """A torch column whose module could not be rebuilt: skipped, not failed."""
    return runtime in (EAGER, CUDA_GRAPH) and f"{NO_MODULE}: " in (error or "")


def skip_line(runtime: str, error: str | None) -> str:
    """"torch-eager skipped: rebuilding m in PyTorch needs torchvision, ...": why, in one line."""
    return f"{runtime} skipped: {(error or '').partition(f'{NO_MODULE}: ')[2]}"


def _spawn(args: argparse.Namespace, runtime: str, model: Path, feeds: Path,
           save: Path | None) -> dict[str, Any]:
    command = [*WORKER, runtime, "--model", str(model), "--feeds", str(feeds),
               "--runs", str(args.runs), "--warmup", str(args.warmup),
               "--threads", str(args.threads), "--device", args.device]
    command += ["--save", str(save)] if save else []
    return worker_report(command, args.threads, args.timeout)


def bench_model(args: argparse.Namespace, model: Path, runtimes: list[str], tmp: Path,
                advance: Callable[[str], None]) -> dict[str, Result]:
    feeds = tmp / f"{model.stem}.feeds.npz"
    np.savez(feeds, **make_feeds(model))  # type: ignore[arg-type]
    results = {rt: Result() for rt in runtimes}
    for round_ in range(args.rounds):
        for rt in runtimes:
            advance(f"{model.stem}: {rt} (round {round_ + 1}/{args.rounds})")
            result = results[rt]
            if result.error:
                continue
            save = tmp / f"{model.stem}.{len(result.medians)}.{runtimes.index(rt)}.npz"
            reply = _spawn(args, rt, model, feeds, save if round_ == 0 else None)
            if "error" in reply:
                result.error = reply["error"]
                continue
            result.times += reply["times"]
            result.medians.append(statistics.median(reply["times"]))
            result.loads.append(reply["load_s"])
            result.plan = reply.get("plan") or {}
            if round_ == 0:
                with np.load(save) as saved:
                    result.outputs = [saved[k] for k in saved.files]
    return results


def make_feeds(model: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: floats standard normal; ``*mask*`` ones, ``*token_type*`` zeros, other integer
    inputs (ids) uniform below the rows of the embedding table they index (as bench_reference)."""
    import onnx
    import onnx.helper

    graph = onnx.load(str(model), load_external_data=False).graph
    inits = {t.name for t in graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in graph.input:
        if value.name in inits:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif "mask" in value.name or "token_type" in value.name:
            feeds[value.name] = np.full(shape, "mask" in value.name, dtype)
        else:
            feeds[value.name] = rng.integers(0, _rows(graph, value.name), shape).astype(dtype)
    return feeds


def _rows(graph: Any, name: str) -> int:
    """Rows of the embedding table that the ids in ``name`` index (through shape-only ops)."""
    rows = {t.name: t.dims[0] for t in graph.initializer if t.dims}
    names = {name}
    for node in graph.node:
        if not names.intersection(node.input):
            continue
        if node.op_type in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast"):
            names.update(node.output)
        elif node.op_type == "Gather" and node.input[1] in names and node.input[0] in rows:
            return int(rows[node.input[0]])
    return 2  # no embedding found: small valid ids


def output_diff(outputs: list[np.ndarray] | None, reference: list[np.ndarray] | None) -> str:
    if outputs is None or reference is None:
        return "-"
    if len(outputs) != len(reference) or any(a.shape != b.shape for a, b in zip(outputs, reference)):
        return "shapes differ"
    worst = max(float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-12))
                for a, b in zip(outputs, reference) if b.size)
    return f"{worst:.1e}"


def model_flops(model: Path) -> float:
    """2 x the multiply-adds of the model's Conv, ConvTranspose, MatMul and Gemm layers."""
    from backplane.frontends.onnx import import_onnx

    graph = import_onnx(str(model))

    def static(name: str) -> tuple[int, ...] | None:
        info = graph.info(name)
        return tuple(int(d) for d in info.shape) if info.is_static and info.shape else None  # type: ignore[arg-type]

    total = 0
    for layer in graph.layers:
        out = static(layer.outputs[0]) if layer.outputs else None
        if out is None or layer.op_type not in ("Conv", "MatMul", "Gemm"):
            continue
        operand = static(layer.inputs[1] if layer.op_type == "Conv" else layer.inputs[0])
        if operand is None:
            continue
        if layer.op_type == "Conv":
            total += math.prod(out) * math.prod(operand[1:])
        else:
            k = operand[0] if layer.op_type == "Gemm" and layer.attrs.get("transA") else operand[-1]
            total += math.prod(out) * k
    return 2.0 * total


def table(model: str, results: dict[str, Result], flops: float, peak: float | None,
          args: argparse.Namespace) -> Any:
    from rich.markup import escape
    from rich.table import Table

    ort = results.get(ORT)
    ort_ms = statistics.median(ort.times) * 1e3 if ort and ort.times else None
    t = Table(title=f"{model}: {args.device}, {args.threads} threads, {args.rounds} rounds x "
                    f"{args.runs} runs ({flops / 1e9:.2f} GFLOP per run)",
              caption="ms: median of all timed calls; spread: min-max of the per-process medians; "
                      "vs ORT = ORT ms / ms (above 1: faster than ORT); plan: backplane's partitions "
                      "and the tensors a run hands between backends; diff = max|out - ORT| / "
                      "max|ORT|")
    for column in ("runtime", "ms", "spread", "vs ORT", "GFLOP/s", "% peak", "load s", "plan",
                   "diff"):
        t.add_column(column, justify="left" if column == "runtime" else "right",
                     no_wrap=column != "diff")
    for rt, r in results.items():
        name = rt if rt in (ORT, EAGER, CUDA_GRAPH) else f"backplane[{rt}]"
        if r.error or not r.times:
            skipped = is_skip(rt, r.error)
            t.add_row(escape(name), "skipped" if skipped else "failed", "", "", "", "", "", "",
                      "(below)" if skipped else escape(r.error or ""))
            continue
        ms = statistics.median(r.times) * 1e3
        rate = flops / (ms / 1e3) / 1e9
        t.add_row(escape(name), f"{ms:.2f}", f"{min(r.medians) * 1e3:.2f}-{max(r.medians) * 1e3:.2f}",
                  f"{ort_ms / ms:.2f}" if ort_ms else "-", f"{rate:.1f}",
                  f"{rate / peak:.0%}" if peak else "-", f"{statistics.median(r.loads):.2f}",
                  plan_text(r.plan), output_diff(r.outputs, ort.outputs if ort else None) if rt != ORT else "")
    return t


def plan_text(plan: dict[str, int]) -> str:
    """"2 parts, 1 crossing": how many partitions a run goes through and how many tensors it hands
    from one backend to another (a regression in placement shows here first); "" if not backplane."""
    if not plan:
        return ""
    parts, crossings = plan["partitions"], plan["crossings"]
    return (f"{parts} part{'s' if parts != 1 else ''}, "
            f"{crossings} crossing{'s' if crossings != 1 else ''}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_torch", description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", type=Path, help="ONNX model files")
    ap.add_argument("--backends", action="append", default=[],
                    help="a backplane backend list, most preferred first, and backend options after "
                         "@ signs (GpuAcc,CpuAcc,CpuRef@GpuAcc.precision=fp16); repeat for more "
                         "columns; default: CpuAcc,CpuRef, or GpuAcc,CpuAcc,CpuRef with --device cuda")
    ap.add_argument("--no-ort", action="store_true", help="leave ONNX Runtime out")
    ap.add_argument("--no-torch", action="store_true", help="leave the PyTorch columns out")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=5, help="processes per runtime (default: 5)")
    ap.add_argument("--runs", type=int, default=20, help="timed calls per process (default: 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls per process (default: 3)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds for one process")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--feeds", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def runtimes_of(args: argparse.Namespace) -> list[str]:
    """The columns: each ``--backends`` list (default CpuAcc,CpuRef, GpuAcc first on cuda), ONNX
    Runtime and the torch columns unless left out."""
    default = "GpuAcc,CpuAcc,CpuRef" if args.device == "cuda" else "CpuAcc,CpuRef"
    runtimes = [b.replace(" ", "") for b in args.backends] or [default]
    runtimes += [] if args.no_ort else [ORT]
    runtimes += [] if args.no_torch else [EAGER] + ([CUDA_GRAPH] if args.device == "cuda" else [])
    return runtimes


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "peak":
        peak_worker(args)
        return 0
    if args.worker:
        worker(args)
        return 0
    from rich.console import Console

    from backplane import progress

    missing = [str(m) for m in args.models if not m.is_file()]
    if missing or not args.models:
        print(f"no such model file(s): {', '.join(missing) or '(none given)'}", file=sys.stderr)
        return 2
    runtimes = runtimes_of(args)
    console = Console(width=None if sys.stdout.isatty() else 160)
    peak = measure_peak(args.threads, args.device)
    console.print(f"matmul peak ({args.device}, fp32, {args.threads} threads): "
                  f"{peak:.0f} GFLOP/s" if peak else "matmul peak: not measured")
    failed = False
    with tempfile.TemporaryDirectory(prefix="bench_torch.") as tmp, progress.shown(), \
            progress.task("starting", total=len(args.models) * len(runtimes) * args.rounds) as step:
        started = False

        def advance(text: str) -> None:
            nonlocal started
            step(f"{text:<40}", advance=1 if started else 0)
            started = True

        for model in args.models:
            results = bench_model(args, model, runtimes, Path(tmp), advance)
            console.print(table(model.stem, results, model_flops(model), peak, args))  # as it ends
            for rt, r in results.items():
                if is_skip(rt, r.error):
                    console.print(skip_line(rt, r.error), highlight=False, soft_wrap=True)
            failed |= any(r.error for rt, r in results.items() if rt not in (EAGER, CUDA_GRAPH))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
