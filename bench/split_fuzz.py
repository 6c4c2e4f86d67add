"""Split fuzzing: many random splits of each model between CpuAcc (or GpuAcc) and CpuRef, each held to
CpuRef alone. The long run of tests/runtime/test_split_fuzz.py (which runs a small slice in CI).

Usage:
    python bench/split_fuzz.py            # the small test models and every light model, 30 splits each
    python bench/split_fuzz.py --splits 40 --modes auto,onednn_graph,layers
    python bench/split_fuzz.py --models tests/data/tiny_mobilenet_v3.onnx --splits 100 --seed 3
    python bench/split_fuzz.py --backends GpuAcc,CpuAcc,CpuRef --option GpuAcc.cuda_graphs=false
    python bench/split_fuzz.py --models M.onnx --pins '{"HardSigmoid": "CpuRef"}' --modes layers

A split pins layer names or op types of the imported graph to CpuRef (``pins``), which cuts the
accelerated part of the model into partitions; the generator (tests/runtime/split_fuzz.py, shared with
the test) makes, per model, one split for each op type found inside a fused group (the middle layer
of that type alone: the batch norm, Relu or Add after a Conv, the HardSigmoid or Mul of a
squeeze-and-excitation block, the GELU after a MatMul), then ``--splits`` random ones, drawn with
``random.Random(f"{seed}:{model}")`` by five strategies in turn: one or two op types, one to three
layers, every k-th layer, one layer inside a fused group, and a run of consecutive layers. Each split
runs with ``CpuAcc.compile`` at each of
``--modes``, twice (the second run reuses what the first built), and its outputs must be within
``--tolerance`` of CpuRef's, relative to the largest magnitude of CpuRef's output. The light models are
compared on their logits (their softmax of 1000 equal logits hangs on the last bit of each).

Each model runs in a worker process of its own, which reports each split before running it: an
exception is reported and counted; a crash (oneDNN Graph's fuser can abort the process) or a split
running past ``--split-timeout`` is reported with the split it stopped in, and a new worker goes on
from the next one. One line per model (splits, runs, worst difference, then each split that is off or
failed, with a command that repeats it), a summary, and exit status 1 if any split was off or failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.runtime.split_fuzz: the generator the test shares

from backplane.backends.torch.bench import option_value  # noqa: E402
from tests.runtime import split_fuzz as fuzz  # noqa: E402

Job = tuple[fuzz.Split, str | None]  # a split and its CpuAcc.compile mode


# -- the worker side: one model, its splits in turn, one JSON line before and after each -------------

def worker(args: argparse.Namespace) -> None:
    logging.getLogger("backplane").setLevel(logging.ERROR)  # fallback warnings: one per layer
    out = sys.stdout

    def say(**fields: Any) -> None:
        out.write(json.dumps(fields) + "\n")
        out.flush()

    try:
        subject = fuzz.load_subject(args.worker)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        say(load_error=f"{type(exc).__name__}: {exc}")
        return
    jobs = _jobs(subject, args)
    say(jobs=len(jobs), layers=len(subject.layers))
    for index in range(args.start, len(jobs)):
        split, mode = jobs[index]
        say(job=index, start=True)
        began = time.perf_counter()
        try:
            diff, session = fuzz.run_split(subject, args.backends, split.pins,
                                           fuzz.options_for(mode, args.option))
            counts = session.report.counts()
            error = None
        except Exception as exc:  # noqa: BLE001 - one split's error is reported and counted
            diff, counts, error = math.nan, {}, f"{type(exc).__name__}: {exc}"
        say(job=index, diff=diff if math.isfinite(diff) else str(diff), error=error, counts=counts,
            seconds=round(time.perf_counter() - began, 3))


def _jobs(subject: fuzz.Subject, args: argparse.Namespace) -> list[Job]:
    """Every split with every mode, in the order the worker runs them."""
    if args.pins is not None:
        chosen = [fuzz.Split("given", json.loads(args.pins))]
    else:
        chosen = fuzz.splits(subject.layers, fuzz.model_rng(args.seed, subject), args.splits)
    return [(split, mode) for split in chosen for mode in args.modes]


# -- the parent side ----------------------------------------------------------------------------------

@dataclass
class ModelResult:
    name: str
    path: Path
    layers: int = 0
    runs: int = 0
    splits: set[str] = field(default_factory=set)
    worst: float = 0.0
    worst_at: str = ""
    problems: list[str] = field(default_factory=list)  # off, error, crash, timeout: one line each
    load_error: str | None = None


def run_model(path: Path, args: argparse.Namespace, passthrough: list[str]) -> ModelResult:
    result = ModelResult(Path(path).stem, Path(path))
    try:  # the worker's jobs, made here too (CpuRef alone) to name the split a worker died in
        jobs = _jobs(fuzz.load_subject(path), args)
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        result.load_error = f"{type(exc).__name__}: {exc}"
        return result
    start = 0
    while start < len(jobs):
        stopped = _run_worker(path, start, jobs, args, passthrough, result)
        if stopped is None:
            break
        start = stopped + 1
    return result


def _run_worker(path: Path, start: int, jobs: list[Job], args: argparse.Namespace,
                passthrough: list[str], result: ModelResult) -> int | None:
    """Runs the jobs from ``start``; the job it died or hung in, or None once it has run them all
    (or could not load the model)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path), "--start",
               str(start), *passthrough]
    with tempfile.TemporaryFile(mode="w+") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True,
                                   cwd=ROOT)
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        running: int | None = None
        hung = False
        while True:
            limit = args.split_timeout if running is not None else args.load_timeout
            try:
                line = lines.get(timeout=limit)
            except queue.Empty:
                process.kill()
                hung = True
                break
            if line is None:
                break
            message = json.loads(line)
            if "load_error" in message:
                result.load_error = message["load_error"]
            elif "jobs" in message:
                result.layers = message["layers"]
                if message["jobs"] != len(jobs):
                    result.load_error = f"the worker made {message['jobs']} jobs, not {len(jobs)}"
                    process.kill()
                    break
            elif message.get("start"):
                running = message["job"]
                if sys.stderr.isatty():
                    print(f"\r{result.name} {running + 1}/{len(jobs)} ", end="", file=sys.stderr,
                          flush=True)
            else:
                running = None
                _record(result, jobs, message, args)
        code = process.wait()
        if running is None:
            if hung:
                result.load_error = f"TIMEOUT loading the model after {args.load_timeout:.0f} s"
            elif code != 0 and result.load_error is None:
                result.load_error = f"worker ended with {_how(code)}: {_tail(errors)}"
            return None
        what = (f"TIMEOUT after {args.split_timeout:.0f} s" if hung else
                f"CRASH ({_how(code)}): {_tail(errors)}")
        split, _ = jobs[running]
        result.runs += 1
        result.splits.add(json.dumps(split.pins, sort_keys=True))
        result.problems.append(_problem(what, result, jobs[running], args))
        return running


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit status {code}"


def _tail(errors: Any) -> str:
    errors.seek(0)
    text = " | ".join(line for line in errors.read().splitlines() if line.strip())[-600:]
    return text or "nothing on stderr"


def _record(result: ModelResult, jobs: list[Job], message: dict[str, Any],
            args: argparse.Namespace) -> None:
    split, mode = jobs[message["job"]]
    result.runs += 1
    result.splits.add(json.dumps(split.pins, sort_keys=True))
    if message["error"] is not None:
        result.problems.append(_problem(f"ERROR {message['error']}", result, jobs[message["job"]], args))
        return
    diff = float(message["diff"])
    if not diff <= result.worst:
        result.worst, result.worst_at = diff, f"{split.strategy}, mode {mode}"
    if not diff <= args.tolerance:
        result.problems.append(_problem(f"OFF by {diff:.3g}", result, jobs[message["job"]], args))


def _problem(what: str, result: ModelResult, job: Job, args: argparse.Namespace) -> str:
    split, mode = job
    command = fuzz.repro(_shown(result.path), args.backends, split.pins, mode, args.option)
    return f"  {what}\n    model {result.name}, mode {mode}, {split}\n    repro: {command}"


def _shown(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def machine() -> str:
    import numpy as np
    import onnx

    import backplane

    parts = [f"python {platform.python_version()}", f"numpy {np.__version__}",
             f"onnx {onnx.__version__}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
        if torch.cuda.is_available():
            parts.append(f"GPU {torch.cuda.get_device_name(0)}")
    except ImportError:
        parts.append("no torch")
    parts.append(f"backplane {getattr(backplane, '__version__', '?')}")
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return ", ".join(parts) + f"; {cpu}, {os.cpu_count()} CPUs"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", type=Path,
                        default=[*fuzz.SMALL, *fuzz.LIGHT_MODELS],
                        help="ONNX files (default: the small test models and every light model)")
    parser.add_argument("--splits", type=int, default=30,
                        help="random splits per model, after one per op type inside a fused group "
                             "(default 30)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", type=lambda s: [m or None for m in s.split(",")],
                        default=list(fuzz.MODES),
                        help="CpuAcc.compile values, comma-separated (default auto,onednn_graph,layers)")
    parser.add_argument("--backends", type=lambda s: s.replace(" ", "").split(","),
                        default=["CpuAcc", fuzz.REFERENCE],
                        help="the preferences of the split sessions (default CpuAcc,CpuRef)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="another backend option for every split (GpuAcc.cuda_graphs=false, ...)")
    parser.add_argument("--tolerance", type=float, default=fuzz.TOLERANCE)
    parser.add_argument("--pins", help="one split as JSON instead of the generated ones (a repro)")
    parser.add_argument("--split-timeout", type=float, default=600,
                        help="seconds one split may run (load and two runs) before it counts as hung")
    parser.add_argument("--load-timeout", type=float, default=600,
                        help="seconds a worker may take to load the model and CpuRef's outputs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    passthrough = ["--splits", str(args.splits), "--seed", str(args.seed),
                   "--modes", ",".join(m or "" for m in args.modes),
                   "--backends", ",".join(args.backends)]
    passthrough += [a for o in args.option for a in ("--option", o)]
    passthrough += ["--pins", args.pins] if args.pins is not None else []
    options = {}
    for text in args.option:
        key, sep, value = text.partition("=")
        if not sep:
            parser.error(f"--option {text!r}: KEY=VALUE")
        options[key] = option_value(value)
    args.option = options
    return args, passthrough


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    missing = [str(m) for m in args.models if not Path(m).is_file()]
    if missing:
        print(f"no such model file(s): {', '.join(missing)}", file=sys.stderr)
        return 2
    print(machine())
    extra = "".join(f", {k}={v}" for k, v in args.option.items())
    made = "given pins" if args.pins else \
        f"{args.splits} random splits a model after one per op type inside a fused group"
    print(f"backends {','.join(args.backends)}, CpuAcc.compile in {','.join(map(str, args.modes))}"
          f"{extra}; seed {args.seed}, {made}; tolerance {args.tolerance:g} of CpuRef's largest "
          f"magnitude", flush=True)
    results = []
    began = time.perf_counter()
    for path in args.models:
        t0 = time.perf_counter()
        result = run_model(Path(path), args, passthrough)
        results.append(result)
        seconds = time.perf_counter() - t0
        if result.load_error is not None:
            print(f"{result.name:<24} LOAD FAILED: {result.load_error}  ({seconds:.0f} s)", flush=True)
            continue
        worst = f"{result.worst:.2e} ({result.worst_at})" if result.runs else "-"
        print(f"{result.name:<24} {result.layers:4d} layers  {len(result.splits):3d} splits  "
              f"{result.runs:4d} runs  worst {worst}  problems {len(result.problems)}  "
              f"({seconds:.0f} s)", flush=True)
        for problem in result.problems:
            print(problem, flush=True)
    problems = sum(len(r.problems) for r in results)
    failed_loads = [r.name for r in results if r.load_error is not None]
    ran = [r for r in results if r.runs]
    top = max(ran, key=lambda r: r.worst, default=None)
    print(f"summary: {len(results)} models, {sum(len(r.splits) for r in results)} splits, "
          f"{sum(r.runs for r in results)} runs; worst difference "
          f"{f'{top.worst:.2e} ({top.name}, {top.worst_at})' if top else '-'}; "
          f"{problems} splits off or failed"
          + (f"; models that failed to load: {', '.join(failed_loads)}" if failed_loads else "")
          + f"; {time.perf_counter() - began:.0f} s")
    return 1 if problems or failed_loads else 0


if __name__ == "__main__":
    sys.exit(main())
