"""Time backplane's CpuRef against onnx.reference.ReferenceEvaluator on the anchor models.

Usage:
    python bench/bench_reference.py
    python bench/bench_reference.py --models-dir /tmp/anchors/models --models resnet50,bert_base_s128
    python bench/bench_reference.py --repeat 20 --warmup 2
    python bench/bench_reference.py --models-dir tests/data --models tiny_bert,tiny_gpt2

Each runtime runs in its own worker subprocess, one per model; the parent asks them for runs in
blocks, alternating (a block of CpuRef, a block of ReferenceEvaluator, ...), so a slow drift of the
machine touches both alike. Between blocks it waits a moment: NumPy's BLAS threads keep spinning
after a call, and asking the other worker at once measured it on a machine still busy with them
(run by run alternation had CpuRef's mobilenet_v3_large at 103 ms, against 35 ms in a process alone).
Each block starts with one untimed run. Both get the same seeded
inputs (float: standard normal; int: `*mask*` ones, `*token_type*` zeros, other ids uniform below the
size of the embedding table they index, found in the graph). Warm-up runs are not timed. The table
gives per runtime the median and the min-max of the timed runs, the ratio of the medians
(ReferenceEvaluator / CpuRef: above 1 means CpuRef is faster), and how far the outputs agree: the
worst over outputs of max|CpuRef - ReferenceEvaluator| / max|ReferenceEvaluator|.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from rich.markup import escape

ANCHORS = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "bert_base_s128", "gpt2_6l_512_s128"]
RUNTIMES = ["CpuRef", "ReferenceEvaluator"]
SEED = 0
BLOCK_PAUSE_S = 0.5  # longer than OpenBLAS keeps its threads spinning after a call
# Ops an id can flow through, unchanged in value, on its way to the embedding Gather.

Run = Callable[[dict[str, np.ndarray]], tuple[list[str], list[np.ndarray]]]


# ---------------------------------------------------------------- the two runtimes (worker side)

def load_cpuref(path: str) -> Run:
    import backplane
    sess = backplane.InferenceSession(path, backends=["CpuRef"])
    names = [o.name for o in sess.get_outputs()]
    return lambda feeds: (names, sess.run(None, feeds))


def load_reference_evaluator(path: str) -> Run:
    from onnx.reference import ReferenceEvaluator
    ref = ReferenceEvaluator(path)
    return lambda feeds: (list(ref.output_names), ref.run(None, feeds))


LOADERS: dict[str, Callable[[str], Run]] = {
    "CpuRef": load_cpuref,
    "ReferenceEvaluator": load_reference_evaluator,
}


def worker(runtime: str, model: str, feeds_path: str) -> None:
    """Serve one runtime on one model: a JSON reply line per command line read from stdin.

    Commands: `run` (one timed run), `save PATH` (the last run's outputs to an .npz), `quit`.
    Anything the runtime prints goes to stderr, so stdout carries only the replies.
    """
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    feeds = dict(np.load(feeds_path))
    try:
        t0 = time.perf_counter()
        run = LOADERS[runtime](model)
        reply(replies, ready=time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - a model a runtime cannot load is a result, not a crash
        reply(replies, error=f"load: {type(exc).__name__}: {exc}")
        return
    names: list[str] = []
    outputs: list[np.ndarray] = []
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        try:
            if command == "run":
                t0 = time.perf_counter()
                names, outputs = run(feeds)
                reply(replies, seconds=time.perf_counter() - t0)
            elif command == "save":
                np.savez(arg, **{n: np.asarray(o) for n, o in zip(names, outputs)})
                reply(replies, saved=arg)
            else:
                return
        except Exception as exc:  # noqa: BLE001 - report it; the parent stops asking
            reply(replies, error=f"{command}: {type(exc).__name__}: {exc}")


def reply(out: TextIO, **fields: Any) -> None:
    out.write(json.dumps(fields) + "\n")


# ---------------------------------------------------------------- inputs

def make_feeds(path: Path, seed: int = SEED) -> dict[str, np.ndarray]:
    """Seeded inputs for every graph input that is not an initializer: ``backplane bench``'s own
    (floats normal, masks ones, token types zeros, ids below their embedding table's rows)."""
    from backplane.bench_engine import make_feeds as seeded

    return seeded(path, seed)


# ---------------------------------------------------------------- the parent side

class Worker:
    """A worker subprocess for one runtime on one model."""

    def __init__(self, runtime: str, model: Path, feeds_path: Path, log_dir: Path, timeout: float):
        self.runtime = runtime
        self.timeout = timeout
        self.failed = False
        self.log = open(log_dir / f"{model.stem}.{runtime}.log", "w+")
        cmd = [sys.executable, __file__, "--worker", runtime, "--model", str(model),
               "--feeds", str(feeds_path)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)

    def ask(self, command: str | None) -> dict[str, Any] | None:
        """Send a command (None: just read the next reply) and return the reply; after an error
        the worker is not asked again (None)."""
        if self.failed:
            return None
        reply = self._ask(command)
        self.failed = "error" in reply
        return reply

    def _ask(self, command: str | None) -> dict[str, Any]:
        if command is not None:
            try:
                self.proc.stdin.write(command + "\n")
                self.proc.stdin.flush()
            except OSError as exc:
                return {"error": f"{command}: worker gone ({exc}) {self.stderr_tail()}".strip()}
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if line:
            return json.loads(line)
        why = f"no reply in {self.timeout:.0f}s" if not ready else "worker died"
        tail = self.stderr_tail()
        return {"error": f"{command or 'load'}: {why}" + (f": {tail}" if tail else "")}

    def stderr_tail(self, lines: int = 3) -> str:
        self.log.flush()
        self.log.seek(0)
        return " | ".join(self.log.read().strip().splitlines()[-lines:])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@dataclass
class Result:
    load_s: float | None = None
    times: list[float] = field(default_factory=list)
    error: str | None = None
    outputs: dict[str, np.ndarray] | None = None


def bench_model(model: Path, args: argparse.Namespace, tmp: Path,
                tick: Callable[[str], None]) -> dict[str, Result]:
    """Load both runtimes on one model, time them alternately, fetch their outputs."""
    feeds_path = tmp / f"{model.stem}.feeds.npz"
    np.savez(feeds_path, **make_feeds(model))
    results = {rt: Result() for rt in RUNTIMES}
    workers: dict[str, Worker] = {}
    try:
        for rt in RUNTIMES:  # one load at a time, so loads do not overlap either
            tick(f"{model.stem}: loading {rt}")
            workers[rt] = Worker(rt, model, feeds_path, tmp, args.timeout)
            results[rt].load_s = record(results[rt], workers[rt].ask(None), "ready")
        for rt in RUNTIMES:
            for _ in range(args.warmup):
                tick(f"{model.stem}: {rt} warm-up")
                record(results[rt], workers[rt].ask("run"), "seconds")
        for block in range(args.blocks):
            runs = args.repeat // args.blocks + (block < args.repeat % args.blocks)
            for rt in RUNTIMES:
                time.sleep(BLOCK_PAUSE_S)  # the other worker's BLAS threads stop spinning
                record(results[rt], workers[rt].ask("run"), "seconds")  # untimed: caches
                for _ in range(runs):
                    tick(f"{model.stem}: {rt} run {len(results[rt].times) + 1}/{args.repeat}")
                    seconds = record(results[rt], workers[rt].ask("run"), "seconds")
                    if seconds is not None:
                        results[rt].times.append(seconds)
        for rt in RUNTIMES:
            out_path = tmp / f"{model.stem}.{rt}.out.npz"
            if record(results[rt], workers[rt].ask(f"save {out_path}"), "saved"):
                results[rt].outputs = dict(np.load(out_path))
    finally:
        for w in workers.values():
            w.close()
    return results


def record(result: Result, answer: dict[str, Any] | None, key: str) -> Any:
    """Keep a worker's error on the result; return the answer's value for key (None on error)."""
    if answer is None:
        return None
    if "error" in answer:
        result.error = answer["error"]
        return None
    return answer[key]


def agreement(results: dict[str, Result]) -> tuple[float | None, str]:
    """Worst over outputs of max|a - b| / max|b|, b the ReferenceEvaluator output; and a note."""
    a, b = results["CpuRef"].outputs, results["ReferenceEvaluator"].outputs
    if a is None or b is None:
        return None, ""
    if set(a) != set(b):
        return None, f"output names differ: {sorted(a)} vs {sorted(b)}"
    worst = 0.0
    for name in b:
        x, y = a[name].astype(np.float64), b[name].astype(np.float64)
        if x.shape != y.shape:
            return None, f"{name}: shape {x.shape} vs {y.shape}"
        scale = np.abs(y).max() if y.size else 0.0
        worst = max(worst, float(np.abs(x - y).max() / scale) if scale else float(np.abs(x - y).max()))
    return worst, ""


# ---------------------------------------------------------------- the table

def timing_cell(r: Result) -> str:
    if r.error is not None:
        return "[red]failed[/]"
    med = statistics.median(r.times) * 1e3
    return f"{med:,.1f}  [dim]({min(r.times) * 1e3:,.1f}-{max(r.times) * 1e3:,.1f})[/]"


def diff_cell(diff: float | None, note: str) -> str:
    if note:
        return f"[red]{escape(note)}[/]"
    if diff is None:
        return "-"
    color = "green" if diff < 1e-4 else "yellow" if diff < 1e-2 else "red"
    return f"[{color}]{diff:.1e}[/]"


def table(all_results: dict[str, dict[str, Result]], args: argparse.Namespace) -> Any:
    from rich.table import Table
    t = Table(title="backplane CpuRef vs onnx.reference.ReferenceEvaluator",
              caption=f"ms per run: median (min-max) of {args.repeat} timed runs after {args.warmup} "
                      "warm-up; ratio of medians; rel diff = max|CpuRef - RefEval| / max|RefEval|")
    t.add_column("model")
    t.add_column("CpuRef ms", justify="right")
    t.add_column("RefEval ms", justify="right")
    t.add_column("RefEval / CpuRef", justify="right")
    t.add_column("rel diff", justify="right")
    t.add_column("load s CpuRef / RefEval", justify="right")
    for model, res in all_results.items():
        ok = all(res[rt].error is None and res[rt].times for rt in RUNTIMES)
        ratio = (statistics.median(res["ReferenceEvaluator"].times) / statistics.median(res["CpuRef"].times)
                 if ok else None)
        loads = " / ".join(f"{res[rt].load_s:.1f}" if res[rt].load_s is not None else "-" for rt in RUNTIMES)
        t.add_row(model, *(timing_cell(res[rt]) for rt in RUNTIMES),
                  f"{ratio:.2f}x" if ratio is not None else "-", diff_cell(*agreement(res)), loads)
    return t


def errors(all_results: dict[str, dict[str, Result]]) -> list[str]:
    return [f"{model} / {rt}: {r.error}" for model, res in all_results.items()
            for rt, r in res.items() if r.error is not None]


def environment() -> str:
    import onnx
    try:
        import backplane
        bp = backplane.__version__
    except Exception as exc:  # noqa: BLE001 - show it, the CpuRef column will fail anyway
        bp = f"not importable ({type(exc).__name__})"
    return (f"python {sys.version.split()[0]}, numpy {np.__version__}, onnx {onnx.__version__}, "
            f"backplane {bp}, {os.cpu_count()} CPUs")


# ---------------------------------------------------------------- command line

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/anchors/models"),
                    help="where <model>.onnx files are (default: %(default)s)")
    ap.add_argument("--models", default=",".join(ANCHORS),
                    help="comma-separated model names (default: the five anchors)")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per runtime (default: 10)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (default: 1)")
    ap.add_argument("--blocks", type=int, default=5,
                    help="blocks the timed runs are split into, alternating runtimes (default: 5)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds to wait for one load or run before giving up (default: 600)")
    ap.add_argument("--worker", choices=RUNTIMES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--feeds", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.warmup < 0 or not 1 <= args.blocks <= args.repeat:
        ap.error(f"--repeat must be >= 1, --warmup >= 0 and --blocks in 1..repeat, got {args.repeat}, "
                 f"{args.warmup} and {args.blocks}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.model, args.feeds)
        return 0
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    paths = [args.models_dir / f"{n}.onnx" for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"Missing model file(s): {', '.join(missing)}. Make them with "
              "`python scripts/export_models.py --anchors DIR` or pass --models-dir.", file=sys.stderr)
        return 2
    console = Console(width=None if sys.stdout.isatty() else 150)  # a log file gets the full table
    console.print(environment())
    steps = len(paths) * len(RUNTIMES) * (1 + args.warmup + args.repeat)
    all_results: dict[str, dict[str, Result]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_reference.") as tmp, Progress(
            TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("starting", total=steps)

        started = False

        def tick(text: str) -> None:  # called as each step starts, so the step before it is done
            nonlocal started
            progress.update(task, description=text, advance=1 if started else 0)
            started = True

        for path in paths:
            all_results[path.stem] = bench_model(path, args, Path(tmp), tick)
    console.print(table(all_results, args))
    for line in errors(all_results):
        console.print(f"[red]{escape(line)}[/]", highlight=False)
    return 1 if errors(all_results) else 0


if __name__ == "__main__":
    sys.exit(main())
