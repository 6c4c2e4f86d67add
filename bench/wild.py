"""backplane against ONNX Runtime and OpenVINO over the whole corpus of exports (issue 27).

Usage:
    python bench/wild.py                                  # every model of tests/data/corpus
    python bench/wild.py --models yolo_v8_ts17,vad_lstm_if_ts16 --rounds 3
    python bench/wild.py --neighbour                      # the same beside a CPU-burning process
    python bench/wild.py --neighbour torch --bp-threads auto  # beside a 2-thread torch process
    python bench/wild.py --profile --json wild.json       # where backplane's time goes on the slow ones
    python bench/wild.py --tier full                      # the models at users' sizes (see --tier)

For every model of tests/data/corpus/manifest.json (``--tier full``: the full tier's manifest, in
~/.cache/backplane/corpus-full or ``--corpus DIR``, the models at the sizes users run), at batch 1
and the model's first size (its ``.s0.npz``), three runtimes, each in processes of its own,
alternating A B C A B C over ``--rounds`` rounds (ONNX Runtime's spinning threads slow whatever
shares its process; drift of a shared machine touches all three alike):

- ``onnxruntime``: CPUExecutionProvider, ORT_ENABLE_ALL, intra_op ``--threads``, inter_op 1;
- ``openvino``: OpenVINO's own runtime, ``Core().compile_model`` on the ONNX file for the CPU,
  INFERENCE_NUM_THREADS ``--threads``, f32, LATENCY hint (bench/bench_openvino.py's loader);
  "-" where it does not load;
- ``backplane``: ``InferenceSession(path, SessionOptions(intra_op_num_threads=threads))``, its
  default backends (CpuAcc, CpuRef here), with empty caches: each process points
  ``$BACKPLANE_CACHE_DIR`` (CpuAcc's routes), ``$BACKPLANE_COMPILE_CACHE`` and ``$XDG_CACHE_HOME``
  at a new temporary folder.

A process imports its runtime, creates the session (the load time: cold, a fresh process), makes
one first call (timed apart: a runtime that compiles at its first run pays there), warm-up calls,
then warm-up calls for ``--warmup-seconds`` (5 at the least: with empty caches backplane's first
calls of a model still measure and build), then timed calls for about ``--seconds`` (10 at the least). A runtime's figure is the best of
its rounds' medians. The table per model: the three times, ORT / backplane and OpenVINO / backplane
(above 1: backplane is faster), the load seconds of each (import and session; in brackets the part
of backplane's that is importing backplane; torch is imported by its session, or in the background
and waited for by its first call where the session defers CpuAcc: not here, where
``$BACKPLANE_COMPILE_CACHE`` is set, but with ``--plain``, which leaves it unset: a user's
default session, deferred, or never importing torch where CpuAcc runs the model whole in C,
``backplane.torch_free``), the seconds from the runtime's import to its first call's
outputs ("1st output s": import, load and first call; the bench's own modules, which import
backplane, are imported in a worker after that call, or before its clock in OpenVINO's), the
seconds from backplane's session until
its background is done ("bp done s": its builds swapped in and their routes chosen by runs of the
model, which the worker makes, the first call included; inf where not within 60 s;
``--background off`` measures at load instead), backplane's first call, its placement
(layers per backend) and the worst difference of its outputs from ONNX Runtime's (relative to the
output's scale). Then the geometric mean of ORT / backplane over the models and the models below
0.8. ``--profile`` runs backplane's ``run_profiled`` on each model below 0.8 and prints where its
time goes (the layers that take most, by median, and the torch operators that take most inside
them). ``--json FILE`` writes the whole document.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

# bench_openvino and backplane's bench helpers are imported where used, not here: a worker
# imports this file before it times its runtime's import, and they import backplane

CORPUS = ROOT / "tests" / "data" / "corpus"
FULL_CORPUS = Path.home() / ".cache" / "backplane" / "corpus-full"  # scripts/export_corpus.py --tier full
# The tables and the closing verdict (wild_report.py); RUNTIMES and LOW are its, named here too:
from wild_report import LOW, RUNTIMES, cell, geomean, profile_lines, table, verdict  # noqa: E402,F401
BURN = "while True: pass"
TORCH = ("import torch\ntorch.set_num_threads({threads})\n"
         "net = torch.nn.Sequential(*[torch.nn.Conv2d(32, 32, 3, padding=1) for _ in range(4)]).eval()\n"
         "x = torch.randn(1, 32, 64, 64)\nwith torch.no_grad():\n    while True:\n        net(x)")
"""``--neighbour torch``: another multithreaded OpenMP process (a user's torch job beside the session)."""
Run = Callable[[], list[Any]]
NEIGHBOURS = {None: "none", "burn": "one CPU-burning process (" + BURN + ")",
              "torch": "a torch process at {threads} threads looping over 4 convolutions 32x64x64"}


# -- the worker side ------------------------------------------------------------------------------
def load(runtime: str, model: str, feeds: dict[str, np.ndarray], threads: int) -> tuple[Run, Any]:
    """A call that runs the model once, and what the runtime tells of its plan (backplane: a call
    that reads it)."""
    if runtime == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        return (lambda: session.run(None, feeds)), {}
    if runtime == "openvino":
        from bench_openvino import load as load_peer  # imported by the worker before its clock

        run, _ = load_peer("openvino", model, feeds, threads, "fp32")
        return run, {}
    from backplane import InferenceSession, SessionOptions

    session = InferenceSession(model, SessionOptions(intra_op_num_threads=threads))

    def plan() -> dict[str, Any]:  # read after the runs: a first run may place the model again
        report = session.report  # (against_cpu's timing of a model free in more than its batch)
        return {"placement": dict(sorted(report.counts().items())),
                "partitions": len(report.partitions)}

    return (lambda: session.run(None, feeds)), plan


def imported(runtime: str) -> None:
    """The runtime's module imported (timed apart from its session). Not torch: backplane imports it
    where a user's script would pay it, in the session or, where the session defers CpuAcc
    (``backplane.deferred_load``), in the background and the first run (``first_s``)."""
    if runtime == "onnxruntime":
        import onnxruntime  # noqa: F401
    elif runtime == "openvino":
        import openvino  # noqa: F401
    else:
        import backplane  # noqa: F401


def until_settled(runtime: str, run: Run, loaded: float, most: float = 60.0) -> float | None:
    """Seconds from the session's return until backplane's background (CpuAcc.background) is done:
    its builds swapped in (``background.wait``) and their routes chosen by runs of the model, made
    here (``background.settle``); None where not within ``most`` seconds; 0 for the others."""
    if runtime in ("onnxruntime", "openvino"):
        return 0.0
    from backplane.backends.torch import background

    done = background.settle(run, loaded + most - time.perf_counter())
    return time.perf_counter() - loaded if done else None


def background_setting(value: str, inductor: str = "default") -> None:
    """``--background``: CpuAcc.background's default in this worker ("default": as it is), and
    ``--inductor``: CpuAcc.inductor's."""
    if value != "default":
        from backplane.backends.torch import background

        background.DEFAULT = value == "on"
    if inductor != "default":
        from backplane.backends.torch import inductor_background

        inductor_background.DEFAULT = inductor


def empty_caches(plain: bool = False) -> None:
    """backplane's cache folders pointed at a new temporary folder (set before it is imported)."""
    # the native kernels built once per machine stay (an install's, like torch's own code): a
    # fresh folder would time their compile (4-6 s) in every process's load. Their folder named
    # without importing backplane (its import is timed): backplane.native.build.cache_folder's
    root = os.environ.get("BACKPLANE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "backplane")
    os.environ.setdefault("BACKPLANE_NATIVE_CACHE", os.path.join(root, "native"))
    folder = tempfile.mkdtemp(prefix="wild-cache.")
    for variable in ("BACKPLANE_CACHE_DIR", "BACKPLANE_COMPILE_CACHE", "XDG_CACHE_HOME"):
        os.environ[variable] = folder
    if plain:  # a user's plain session: deferred, or without torch (``backplane.torch_free``)
        del os.environ["BACKPLANE_COMPILE_CACHE"]


def worker(args: argparse.Namespace) -> None:
    """One process of one runtime: load, first call, warm up, time; one JSON line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the runtime prints goes to stderr
    empty_caches(args.plain)
    feeds = dict(np.load(args.feeds))
    if args.worker == "openvino":
        import bench_openvino  # noqa: F401  # its loader's module (it imports backplane): untimed
    try:
        start = time.perf_counter()
        imported(args.worker)
        import_s = time.perf_counter() - start
        background_setting(args.background, args.inductor)
        run, plan = load(args.worker, args.model, feeds, args.threads)
        load_s = time.perf_counter() - start
        run()
        first = [time.perf_counter() - start - load_s]
        from backplane.bench_worker import timed_runs  # after the first output: backplane's
        # import is the runtime's own in its worker, and untimed in the others'

        ready_s = until_settled(args.worker, run, start + load_s, args.settle)
        warm, end = [], time.perf_counter() + args.warmup_seconds
        while len(warm) < 5 or time.perf_counter() < end:  # past a runtime's settling runs
            warm += timed_runs(run, 0, 1)[1]
        runs = int(min(5000, max(10, args.seconds / max(statistics.median(warm), 1e-6))))
        outputs, times = timed_runs(run, 0, runs)
        if args.save:
            np.savez(args.save, *[np.asarray(o) for o in outputs])
        plan = plan() if callable(plan) else plan
        replies.write(json.dumps({"load_s": load_s, "import_s": import_s, "first_s": first[0], "ready_s": ready_s, "times": times, "plan": plan}) + "\n")
    except Exception as exc:  # noqa: BLE001 - a runtime that cannot run a model is a result
        # OpenVINO's reports run over many lines, each behind the source file that threw it
        text = re.sub(r"(Exception from|Check '\w+' failed at) \S+:\d+:\s*", "", " ".join(str(exc).split()))
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {text}"[:400]}) + "\n")


def profile_worker(args: argparse.Namespace) -> None:
    """backplane's run_profiled on one model: median seconds per layer over the runs, largest first."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    empty_caches()
    from backplane import InferenceSession, SessionOptions

    feeds = dict(np.load(args.feeds))
    background_setting(args.background, args.inductor)
    session = InferenceSession(args.model, SessionOptions(intra_op_num_threads=args.threads))
    session.run(None, feeds)
    run = lambda: session.run(None, feeds)  # noqa: E731
    until_settled("backplane", run, time.perf_counter(), args.settle)  # what the background chose
    for _ in range(3):
        session.run(None, feeds)
    per_layer: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    totals = []
    for _ in range(args.profile_runs):
        _, timings = session.run_profiled(None, feeds)
        totals.append(sum(t.seconds for t in timings))
        for t in timings:
            per_layer[(t.layer, t.op_type, t.backend)].append(t.seconds)
    layers = sorted(((statistics.median(v), *k) for k, v in per_layer.items()), reverse=True)
    replies.write(json.dumps({"total_s": statistics.median(totals), "layers": len(layers),
                              "top": [{"s": s, "layer": n[:90], "op": o, "backend": b}
                                      for s, n, o, b in layers[:8]],
                              "torch_ops": torch_ops(lambda: session.run(None, feeds), args.profile_runs)}) + "\n")


def torch_ops(run: Run, runs: int) -> list[dict[str, Any]]:
    """The torch operators of `runs` runs by self CPU time, per run (torch.profiler): run_profiled
    times a compiled or Specialized partition as one layer, which says nothing of what costs in it."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(runs):
            run()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
    return [{"op": e.key, "ms": e.self_cpu_time_total / 1e3 / runs, "calls": e.count / runs} for e in ops]


# -- the parent side ------------------------------------------------------------------------------
def environment(threads: int) -> list[str]:
    """bench_openvino's header lines (the machine, the versions): imported here, not at the top."""
    from bench_openvino import environment as lines

    return lines(threads)


def difference(outputs: list[np.ndarray] | None, reference: list[np.ndarray] | None) -> str:
    from bench_openvino import difference as worst

    return worst(outputs, reference)


def spawn(args: argparse.Namespace, runtime: str, model: Path, feeds: Path, save: Path | None,
          mode: str = "--worker") -> dict[str, Any]:
    command = [sys.executable, __file__, mode, runtime, "--model", str(model), "--feeds", str(feeds),
               "--threads", str(0 if runtime == "backplane" and getattr(args, "bp_threads", "") == "auto"
                                else args.threads), "--seconds", str(args.seconds),
               "--warmup-seconds", str(args.warmup_seconds),
               "--profile-runs", str(args.profile_runs),
               "--background", getattr(args, "background", "default"),  # int8.py's args: none
               "--inductor", getattr(args, "inductor", "default"),
               "--settle", str(getattr(args, "settle", 60.0))]
    command += ["--save", str(save)] if save else []
    command += ["--plain"] if getattr(args, "plain", False) else []
    from backplane.bench_engine import worker_report

    try:
        return worker_report(command, args.threads, args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:.0f} s"}


def corpus_files(args: argparse.Namespace, name: str) -> tuple[dict[str, Any], Path, Path]:
    """A model's manifest entry, its file and its first size's inputs, beside the manifest."""
    entry = json.loads((args.corpus / "manifest.json").read_text())[name]
    return entry, args.corpus / entry["file"], args.corpus / entry["inputs_files"][0]


def new_rows(skipped: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """A model's rows, one per runtime (those ``skipped`` names, with that reason as their error)."""
    return {rt: {"medians": [], "loads": [], "imports": [], "firsts": [], "readies": [],
                 "error": (skipped or {}).get(rt), "outputs": None, "plan": {}} for rt in RUNTIMES}


def run_round(args: argparse.Namespace, name: str, rows: dict[str, dict[str, Any]], round_: int,
              tmp: Path) -> None:
    """One round of a model: each runtime that has not failed in a process of its own, in turn;
    outputs saved in round 1."""
    _, model, feeds = corpus_files(args, name)
    for rt, row in rows.items():
        if row["error"]:
            continue
        print(f"{name}: {rt} (round {round_ + 1}/{args.rounds}), load average "
              f"{os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        save = tmp / f"{name}.{rt}.npz" if round_ == 0 else None
        record(row, spawn(args, rt, model, feeds, save), save)


def bench_model(args: argparse.Namespace, name: str, tmp: Path) -> dict[str, Any]:
    """The three runtimes on one model, alternating over the rounds; outputs saved in round 1."""
    rows = new_rows()
    for round_ in range(args.rounds):
        run_round(args, name, rows, round_, tmp)
    return summarize(name, corpus_files(args, name)[0], rows)


def bench_models(args: argparse.Namespace, names: list[str], tmp: Path,
                 skipped: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Every model on each runtime, alternating over all of them in each round (bench/int8.py's
    and bench/ort_optimized.py's pairs of files timed in the same rounds)."""
    rows = {name: new_rows(skipped) for name in names}
    for round_ in range(args.rounds):
        for name in names:
            run_round(args, name, rows[name], round_, tmp)
    return {name: summarize(name, corpus_files(args, name)[0], rows[name]) for name in names}


def record(row: dict[str, Any], reply: dict[str, Any], save: Path | None) -> None:
    """One worker's reply added to its runtime's row (its error instead, where it failed; the
    outputs it saved, where it saved them)."""
    if "error" in reply:
        row["error"] = reply["error"]
        return
    row["medians"].append(statistics.median(reply["times"]))
    row["loads"].append(reply["load_s"])
    row["imports"].append(reply["import_s"])
    row["firsts"].append(reply["first_s"])
    row.setdefault("outputs_s", []).append(reply["load_s"] + reply["first_s"])
    ready = reply.get("ready_s", 0.0)  # None: the background not done within 60 s
    row.setdefault("readies", []).append(math.inf if ready is None else ready)
    row["plan"] = reply["plan"] or row["plan"]
    if save:
        with np.load(save) as saved:
            row["outputs"] = [saved[k] for k in saved.files]


def summarize(name: str, entry: dict[str, Any], rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One model's figures: best-of-rounds median ms, median load s, ratios, the output difference."""
    result: dict[str, Any] = {"model": name, "exporter": entry["exporter"], "opset": entry["opset"],
                              "size": entry["sizes"][0]}
    for rt, row in rows.items():
        result[rt] = {"error": row["error"]} if row["error"] else {
            "ms": min(row["medians"]) * 1e3, "round_ms": [m * 1e3 for m in row["medians"]],
            "load_s": statistics.median(row["loads"]),
            "import_s": statistics.median(row["imports"]), "first_ms": statistics.median(row["firsts"]) * 1e3,
            "output_s": statistics.median(row.get("outputs_s") or [math.nan]),
            "ready_s": statistics.median(row.get("readies") or [0.0])}
    result["backplane_plan"] = rows["backplane"]["plan"]
    result["diff"] = difference(rows["backplane"]["outputs"], rows["onnxruntime"]["outputs"])
    bp = result["backplane"].get("ms")
    for peer, key in (("onnxruntime", "ort_over_bp"), ("openvino", "ov_over_bp")):
        peer_ms = result[peer].get("ms")
        result[key] = peer_ms / bp if peer_ms and bp else None
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated corpus model names (default: all of them)")
    ap.add_argument("--tier", choices=("small", "full"), default="small",
                    help="small: tests/data/corpus (default); full: the models at users' sizes, in "
                         f"{FULL_CORPUS} (scripts/export_corpus.py --tier full)")
    ap.add_argument("--corpus", type=Path, help="the folder of the corpus's manifest.json (default: the tier's)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per runtime, alternating (default 2)")
    ap.add_argument("--seconds", type=float, default=0.5, help="timed calls per process, in seconds (0.5)")
    ap.add_argument("--warmup-seconds", type=float, default=1.0, help="untimed calls first, in seconds (1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--neighbour", nargs="?", const="burn", choices=("burn", "torch"),
                    help="run beside a CPU-burning process (burn) or a torch process at --threads "
                         "threads looping over convolutions (torch: two OpenMP pools contending)")
    ap.add_argument("--bp-threads", choices=("count", "auto"), default="count",
                    help="backplane's threads: --threads (count, the default) or its default session's "
                         "(auto: CpuAcc.threads 'auto', at most --threads)")
    ap.add_argument("--background", choices=("default", "on", "off"), default="default",
                    help="backplane's CpuAcc.background: its default, or on or off (default: default)")
    ap.add_argument("--inductor", choices=("default", "auto", "off", "swap"), default="default",
                    help="backplane's CpuAcc.inductor: its default (off), or auto, off or swap")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds backplane's background may take before the runs are timed (60; "
                         "an inductor compile takes 20-95 s here)")
    ap.add_argument("--plain", action="store_true",
                    help="backplane's session without the compile cache: a user's default session "
                         "(its CpuAcc load deferred, or no torch where it runs whole in C)")
    ap.add_argument("--profile", action="store_true", help="profile backplane on the models below 0.8")
    ap.add_argument("--profile-runs", type=int, default=20, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="write the results as a JSON document to this file")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for one process (600)")
    ap.add_argument("--worker", choices=RUNTIMES, help=argparse.SUPPRESS)
    ap.add_argument("--profile-worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--feeds", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def backplane_version() -> str:
    """backplane's version and the checkout's commit (with '+changes' where the tree differs)."""
    import backplane

    def git(*command: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *command], capture_output=True, text=True)
        return done.stdout.strip()

    dirty = "+changes" if git("status", "--porcelain", "--untracked-files=no", "src") else ""
    return f"{getattr(backplane, '__version__', '?')} at {git('rev-parse', '--short', 'HEAD')}{dirty}"


def run_all(args: argparse.Namespace, names: list[str]) -> tuple[list[str], dict[str, Any]]:
    header = [f"command: python bench/wild.py {' '.join(sys.argv[1:])}".rstrip(),
              f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
              *(line.replace(", backplane absent", "") for line in environment(args.threads)),
              f"backplane {backplane_version()}",
              f"corpus: {args.tier} tier, {args.corpus}",
              f"CpuAcc.background: {args.background}, CpuAcc.inductor: {args.inductor}"
              + ("; backplane's plain session (--plain: no compile cache)" if args.plain else ""),
              f"neighbour: {NEIGHBOURS[args.neighbour].format(threads=args.threads)}; backplane's "
              f"threads: {args.threads if args.bp_threads == 'count' else 'auto'}; "
              f"{args.rounds} rounds, best of the rounds' medians, batch 1 at each model's .s0.npz"]
    code = {"burn": BURN, "torch": TORCH.format(threads=args.threads)}.get(args.neighbour)
    burner = subprocess.Popen([sys.executable, "-c", code]) if code else None
    try:
        with tempfile.TemporaryDirectory(prefix="wild.") as tmp:
            results = [bench_model(args, name, Path(tmp)) for name in names]
            closing, summary = verdict(results)
            profiles = {}
            if args.profile:
                for below in summary["below"]:
                    _, model, feeds = corpus_files(args, below["model"])
                    profiles[below["model"]] = spawn(args, "backplane", model, feeds, None, "--profile-worker")
    finally:
        if burner is not None:
            burner.kill()
            burner.wait()
    load1, load5, _ = os.getloadavg()
    lines = header + [""] + table(results) + [""] + closing
    lines += [line for name, reply in profiles.items() for line in profile_lines(name, reply)]
    lines.append(f"load average {load1:.2f} / {load5:.2f} (1 / 5 min) at the end")
    return lines, {"header": header, "models": results, "summary": summary, "profiles": profiles,
                   "load_average_end": [load1, load5]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.profile_worker:
        profile_worker(args)
        return 0
    args.corpus = (args.corpus or (FULL_CORPUS if args.tier == "full" else CORPUS)).expanduser()
    if not (args.corpus / "manifest.json").exists():
        build = " (python scripts/export_corpus.py --tier full builds it)" if args.tier == "full" else ""
        print(f"no manifest.json in {args.corpus}{build}", file=sys.stderr)
        return 2
    manifest = json.loads((args.corpus / "manifest.json").read_text())
    names = args.models.split(",") if args.models else list(manifest)
    unknown = [n for n in names if n not in manifest]
    if unknown:
        print(f"unknown models {unknown}; the corpus has: {', '.join(manifest)}", file=sys.stderr)
        return 2
    lines, document = run_all(args, names)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(document, indent=1, default=str) + "\n")
    return 1 if document["summary"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
