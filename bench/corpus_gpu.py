"""GpuAcc on the corpus against ONNX Runtime on 2 CPU cores and torch.compile (issue 28, item 4).

Usage (on a machine with a CUDA GPU):
    python bench/corpus_gpu.py --tier full                        # every model of the full tier
    python bench/corpus_gpu.py --tier full --models vad_lstm_if_ts16,yolo_v8_ts17 --rounds 2
    python bench/corpus_gpu.py --runtimes ort,gpuacc              # some of the columns only

Per model of the corpus's manifest (``--tier full``: ~/.cache/backplane/corpus-full or ``--corpus``,
built by scripts/export_corpus.py --tier full), at its first size (``.s0.npz``), NumPy in and NumPy
out, each runtime in a process of its own, alternating over the models and runtimes in each round:

- ``ort``: ONNX Runtime's CPUExecutionProvider, ORT_ENABLE_ALL, 2 intra-op threads, the process
  pinned to CPUs 0 and 1 (``os.sched_setaffinity``, as ``taskset -c 0,1``);
- ``gpuacc``: backplane with ``providers=["GpuAcc", "CpuAcc", "CpuRef"]``, every option at its
  default (``GpuAcc.against_cpu`` auto: a model timed against its placement without GpuAcc);
- ``inductor``: the same with ``GpuAcc.compile`` "inductor" (each captured subgraph compiled by
  TorchInductor at load);
- ``torch_compile``: the model's source module (scripts/export_corpus.py's spec, its weights as
  the export's), on the GPU, ``torch.compile(mode="reduce-overhead")``, its inputs uploaded and its
  outputs downloaded at each call; "-" for a model without one (a quantized export);
- ``cpuacc``: backplane with ``providers=["CpuAcc", "CpuRef"]`` on the CPUs the GPU runtimes
  have (issue 28: no model slower with GpuAcc first than on these alone).

A process loads, calls once (the first call, timed apart), calls for ``--warmup-seconds``, then
times calls for ``--seconds``; a figure is the best of the rounds' medians. ``--beside``: each
``gpuacc`` process then also loads the model on CpuAcc,CpuRef and times the two sessions in
alternating blocks (``side_by_side``): issue 28's "no model slower with GpuAcc first than on
CpuAcc,CpuRef" read in one process at one time, where the ``cpuacc`` column is another process at
another time; a row slower there names each session's routes and thread wrappers where they
differ (``gpu_profile.routes``: a CPU partition's route and thread count are measured at its
build, so two sessions of one placement may run different ones). Each process also reports a
speed probe (``speed_probe``: a Python loop's us a step, just before its timed calls): the GPU
machine's CPUs ran the same loop 1.7x slower in one stretch than seconds later in one process
(session 18, an H200 host just started), so a row's processes timed at different probes compare
loosely. ``--budget S`` starts no process after S seconds and
prints the table of what ran (a device call's time limit cut the small tier at 27 of 32 models,
and its table with it). ``--jobs N`` runs N
processes at a time (their loads and compiles overlap: TorchInductor takes tens of seconds a
model), each one's warm-up and timed calls alone (a lock file), the GPU runtimes' processes on
the CPUs ONNX Runtime's is not pinned to. A backplane session's timing against the CPU
(``GpuAcc.against_cpu``: at load, or in the first call) runs beside the other processes' loads
there: its CPU placement's median moved with them on the H100 machine (gpt_causal_ts15's 0.153,
0.293 and 0.179 ms at ``--jobs`` 4, 2 and 1), so its placements are the bench's own at
``--jobs 1`` only. The table gives the
milliseconds, ORT / GpuAcc (above 1: GpuAcc faster) and GpuAcc's placement; then the geometric mean
of ORT / GpuAcc and the models where GpuAcc is slower. The header names the GPU, the CPU and the
versions.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))

import wild  # noqa: E402
from gpu_profile import routes  # noqa: E402  # before bench_openvino: it takes bench/ off the path
from bench_openvino import environment  # noqa: E402

from backplane.backends.torch.bench import timed_runs, worker_report  # noqa: E402

RUNTIMES = ("ort", "gpuacc", "inductor", "torch_compile", "cpuacc")
BLOCKS = 6
"""Blocks of each session in ``side_by_side``, alternating (A B B A A B ...)."""
ORT_CPUS = {0, 1}
PROVIDERS: dict[str, list[Any]] = {
    "gpuacc": ["GpuAcc", "CpuAcc", "CpuRef"],
    "inductor": [("GpuAcc", {"compile": "inductor"}), "CpuAcc", "CpuRef"],
    "cpuacc": ["CpuAcc", "CpuRef"]}


# -- the worker side ------------------------------------------------------------------------------
def load(runtime: str, model: str, name: str, tier: str,
         feeds: dict[str, np.ndarray]) -> tuple[Callable[[], Any], Callable[[], dict[str, Any]]]:
    """A call that runs the model once on ``runtime``, NumPy in and out, and one that gives its
    placement, read after the calls: a model free in more than its batch is timed against the CPU
    at its first run, which may place it again (read at load, the table showed GpuAcc's)."""
    if runtime == "ort":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads, options.inter_op_num_threads = len(ORT_CPUS), 1
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        return (lambda: session.run(None, feeds)), dict
    if runtime == "torch_compile":
        return compiled_module(name, tier, feeds), dict
    from backplane import InferenceSession

    bp = InferenceSession(model, providers=PROVIDERS[runtime])
    return (lambda: bp.run(None, feeds)), lambda: {**placement(bp.report), "routes": routes(bp)}


def placement(report: Any) -> dict[str, Any]:
    """Layers per backend, and the medians against_cpu timed the placements at ("timed": each
    placement's backends, ms, "kept" where chosen), or why it did not time them."""
    plan: dict[str, Any] = dict(sorted(report.counts().items()))
    timed = [f"{m.backend}: {'-' if m.ms is None else f'{m.ms:.3f}'}"
             + (f" ({m.note.split(': ', 1)[1]})" if "not timed" in m.note else "")
             + (" kept" if m.chosen else "")
             for m in report.measurements if m.partition == "(whole model)"]
    if timed:
        plan["timed"] = "; ".join(timed)
    return plan


def source_module(name: str, tier: str) -> tuple[Any, list[str]]:
    """The model's torch module as scripts/export_corpus.py builds it (not scripted: torch.compile
    takes Python modules) and its input names in order."""
    import torch
    from export_corpus import full_specs, specs

    spec = (full_specs() if tier == "full" else specs())[name]
    if spec.quantize:
        raise LookupError(f"{name} is ONNX Runtime's quantization of its module, not the module")
    scripted = torch.jit.script
    torch.jit.script = lambda module, *a, **k: module  # type: ignore[assignment]
    try:
        module = spec.build()
    finally:
        torch.jit.script = scripted
    return module.eval(), list(spec.inputs)


def compiled_module(name: str, tier: str, feeds: dict[str, np.ndarray]) -> Callable[[], Any]:
    """The source module on the GPU under torch.compile (reduce-overhead: CUDA graphs), a call
    uploading the inputs and downloading the outputs."""
    import torch

    module, names = source_module(name, tier)
    module = module.cuda()
    function = torch.compile(module, mode="reduce-overhead")
    host = [torch.from_numpy(feeds[n]) for n in names]

    def call() -> list[np.ndarray]:
        with torch.inference_mode():
            out = function(*[t.cuda(non_blocking=False) for t in host])
        flat = out if isinstance(out, (tuple, list)) else (out,)
        return [o.cpu().numpy() for o in flat]

    return call


def worker(args: argparse.Namespace) -> None:
    """One process of one runtime on one model: one JSON line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the runtime prints goes to stderr
    wild.empty_caches()
    # A plain session, as a user's: with a compile cache every load is an artifact's, placed when
    # compiled, which GpuAcc.against_cpu does not time (cond_nested_dyn18 then stayed on GpuAcc).
    os.environ.pop("BACKPLANE_COMPILE_CACHE", None)
    cpus = ORT_CPUS if args.worker == "ort" else set(os.sched_getaffinity(0)) - ORT_CPUS
    os.sched_setaffinity(0, cpus or ORT_CPUS)
    feeds = dict(np.load(args.feeds))
    try:
        start = time.perf_counter()
        run, plan = load(args.worker, args.model, args.name, args.tier, feeds)
        load_s = time.perf_counter() - start
        with open(args.lock, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process's calls at a time (--jobs)
            probe = speed_probe()
            first, times = calls(args, run)
            beside = (side_by_side(args, run, feeds, statistics.median(times))
                      if args.beside and args.worker == "gpuacc" else None)
        replies.write(json.dumps({"ms": statistics.median(times) * 1e3, "load_s": load_s,
                                  "first_ms": first[0] * 1e3, "plan": plan(), "probe_us": probe,
                                  **({"beside": beside} if beside else {})}) + "\n")
    except Exception as exc:  # noqa: BLE001 - a runtime that cannot run a model is a result
        text = " ".join(str(exc).split())
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {text}"[:300]}) + "\n")


def calls(args: argparse.Namespace, run: Callable[[], Any]) -> tuple[list[float], list[float]]:
    """The first call's seconds, then (after the background's settling and the warm-up) the
    timed calls' seconds."""
    _, first = timed_runs(run, 0, 1)
    if args.worker in PROVIDERS:
        from backplane.backends.torch import background

        background.settle(run, 60.0)
    warm, end = [], time.perf_counter() + args.warmup_seconds
    while len(warm) < 5 or time.perf_counter() < end:
        warm += timed_runs(run, 0, 1)[1]
    runs = int(min(20000, max(20, args.seconds / max(statistics.median(warm), 1e-6))))
    return first, timed_runs(run, 0, runs)[1]


def speed_probe() -> float:
    """The best of three timings of a plain Python loop, us a step: the host CPU's speed as this
    process times (the same loop on the GPU machine: 0.085 us a step, then 0.046 seconds later in
    the same process, session 18)."""
    def step(x: int) -> int:
        return x + 1

    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(50000):
            step(i)
        best = min(best, time.perf_counter() - start)
    return best / 50000 * 1e6


def side_by_side(args: argparse.Namespace, run: Callable[[], Any], feeds: dict[str, np.ndarray],
                 seconds: float) -> dict[str, Any]:
    """The default list's session (``run``, a run taking about ``seconds``) and the model on
    CpuAcc,CpuRef in this process, timed in BLOCKS alternating blocks each (the order turning,
    each block after an untimed run): the medians of their blocks' medians, ms, and the CPU
    session's placement. Both see the host at the same speed, which two processes do not."""
    from backplane import InferenceSession
    from backplane.backends.torch import background

    cpu = InferenceSession(args.model, providers=PROVIDERS["cpuacc"])
    cpu_run = lambda: cpu.run(None, feeds)  # noqa: E731
    cpu_run()
    background.settle(cpu_run, 60.0)
    cpu_s = statistics.median(timed_runs(cpu_run, 2, 5)[1])
    share = args.seconds / (2 * BLOCKS)
    sessions = {"gpuacc": (run, seconds), "cpuacc": (cpu_run, cpu_s)}
    blocks: dict[str, list[float]] = {name: [] for name in sessions}
    order = list(sessions)
    for _ in range(BLOCKS):
        for name in order:
            call, each = sessions[name]
            count = int(min(2000, max(5, share / max(each, 1e-6))))
            blocks[name].append(statistics.median(timed_runs(call, 1, count)[1]) * 1e3)
        order.reverse()
    return {"gpuacc_ms": statistics.median(blocks["gpuacc"]),
            "cpuacc_ms": statistics.median(blocks["cpuacc"]),
            "cpu_plan": dict(sorted(cpu.report.counts().items())), "cpu_routes": routes(cpu)}


# -- the parent side ------------------------------------------------------------------------------
def spawn(args: argparse.Namespace, runtime: str, name: str) -> dict[str, Any]:
    if args.deadline is not None and time.perf_counter() > args.deadline:
        return {"error": f"not run: --budget {args.budget:g} s spent"}
    entry = json.loads((args.corpus / "manifest.json").read_text())[name]
    command = [sys.executable, __file__, "--worker", runtime, "--name", name, "--tier", args.tier,
               "--model", str(args.corpus / entry["file"]),
               "--feeds", str(args.corpus / entry["inputs_files"][0]),
               "--seconds", str(args.seconds), "--warmup-seconds", str(args.warmup_seconds),
               "--lock", args.lock, *(["--beside"] if args.beside else [])]
    try:
        return worker_report(command, len(ORT_CPUS), args.timeout)
    except Exception as exc:  # noqa: BLE001  # a timeout: the row says so
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def prebuilt() -> str:
    """Every native library built before the processes start, into the folder they read
    (``$BACKPLANE_NATIVE_CACHE``, set for them): a build is the install's, once per machine, not
    a model's first call. On a fresh device machine the first process that needs one compiles it,
    and where that is the CPU placement's first run inside ``GpuAcc.against_cpu``'s timing, its
    5 s stop (``against_cpu.FIRST_RUN_S``) left the model untimed on the GPU (vad_lstm_if_ts16,
    an H200 at 12:03 UTC in session 20: first call 6.2 s, GpuAcc kept at 0.054 ms against
    CpuAcc,CpuRef's 0.037 side by side)."""
    from backplane.native import build

    os.environ.setdefault(build.CACHE_VARIABLE, str(build.cache_folder()))
    names = sorted(path.stem for path in build.SOURCES.glob("*.c"))
    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:
        built = dict(zip(names, pool.map(build.available, names)))
    missing = [name for name, ok in built.items() if not ok]
    return (f"native libraries built before the processes ({time.perf_counter() - start:.1f} s):"
            f" {len(built) - len(missing)} of {len(built)}"
            + (f", not available: {', '.join(missing)}" if missing else ""))


def bench(args: argparse.Namespace, names: list[str]) -> dict[str, dict[str, Any]]:
    """Every model on every runtime, alternating in each round: per model and runtime the best
    median, the first call and load of its first round, or its error."""
    rows: dict[str, dict[str, Any]] = {n: {rt: {"ms": []} for rt in args.runtimes} for n in names}
    for round_ in range(args.rounds):
        todo = [(name, rt) for name in names for rt in args.runtimes
                if "error" not in rows[name][rt]]
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            replies = pool.map(lambda job: spawn(args, job[1], job[0]), todo)
            for (name, rt), reply in zip(todo, replies):
                print(f"{name}: {rt} (round {round_ + 1}/{args.rounds}): {reply}, load average "
                      f"{os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
                add(rows[name][rt], reply)
    return rows


def add(row: dict[str, Any], reply: dict[str, Any]) -> None:
    """A worker's reply added to its row (its error, where it failed)."""
    if "error" in reply:
        row["error"] = reply["error"]
        return
    row["ms"].append(reply["ms"])
    row.setdefault("probe_us", []).append(reply.get("probe_us"))
    if "beside" in reply:
        row.setdefault("beside", []).append(reply["beside"])
    row.setdefault("first_ms", reply["first_ms"])
    row.setdefault("load_s", reply["load_s"])
    row["plan"] = reply["plan"] or row.get("plan", {})


def table(rows: dict[str, dict[str, Any]], runtimes: Sequence[str]) -> tuple[list[str], list[str]]:
    """The table's lines and the closing lines (geomean ORT / GpuAcc, GpuAcc's slower models)."""
    def ms(row: dict[str, Any]) -> str:
        return "-" if "error" in row or not row["ms"] else f"{min(row['ms']):.3f}"

    def described(plan: dict[str, Any]) -> str:
        text = " ".join(f"{b}:{n}" for b, n in plan.items() if b not in ("timed", "routes"))
        return (text + (f" (timed {plan['timed']})" if "timed" in plan else "")) or "-"

    cpu_plans = "cpuacc" in runtimes
    pairs = {name: beside(row.get("gpuacc", {})) for name, row in rows.items()}
    for name, pair in pairs.items():  # each session's routes and thread wrappers (gpu_profile)
        if pair is not None:
            pair["routes"] = rows[name]["gpuacc"].get("plan", {}).get("routes")
            pair["cpu_routes"] = rows[name]["gpuacc"]["beside"][0].get("cpu_routes")
    paired = any(pairs.values())
    lines = ["| model | " + " | ".join(f"{rt} ms" for rt in runtimes)
             + " | ORT / GpuAcc | GpuAcc load s (first call ms) | GpuAcc placement |"
             + (" CpuAcc placement |" if cpu_plans else "")
             + (" GpuAcc first / CpuAcc,CpuRef, one process, ms |" if paired else ""),
             "| --- |" + " ---: |" * (len(runtimes) + 2) + " --- |" * (1 + cpu_plans)
             + (" ---: |" if paired else "")]
    ratios, slower = [], []
    for name, row in rows.items():
        ort, gpu = row.get("ort", {}), row.get("gpuacc", {})
        ratio = min(ort["ms"]) / min(gpu["ms"]) if ort.get("ms") and gpu.get("ms") else None
        if ratio is not None:
            ratios.append(ratio)
            if ratio < 1:
                slower.append(f"{name} {ratio:.2f}")
        load = f"{gpu['load_s']:.2f} ({gpu['first_ms']:.1f})" if "load_s" in gpu else "-"
        lines.append(f"| {name} | " + " | ".join(ms(row[rt]) for rt in runtimes)
                     + f" | {'-' if ratio is None else f'{ratio:.2f}'} | {load} | "
                     + f"{described(gpu.get('plan', {}))} |"
                     + (f" {described(row['cpuacc'].get('plan', {}))} |" if cpu_plans else "")
                     + (f" {pair_text(pairs[name])} |" if paired else ""))
    errors = [f"{name} on {rt}: {row[rt]['error']}" for name, row in rows.items()
              for rt in runtimes if "error" in row[rt]]
    behind = [f"{name} {min(row['gpuacc']['ms']):.3f} / {min(row['cpuacc']['ms']):.3f}"
              for name, row in rows.items() if row.get("gpuacc", {}).get("ms")
              and row.get("cpuacc", {}).get("ms")
              and min(row["gpuacc"]["ms"]) > min(row["cpuacc"]["ms"])]
    closing = [f"geomean ORT / GpuAcc {wild.geomean(ratios):.2f} over {len(ratios)} models; "
               f"GpuAcc slower than ORT on {len(slower)}: {', '.join(slower) or 'none'}",
               *([f"GpuAcc,CpuAcc,CpuRef slower than CpuAcc,CpuRef on {len(behind)} (ms): "
                  f"{', '.join(behind) or 'none'}"] if "cpuacc" in runtimes else []),
               *([slower_beside(pairs)] if paired else []),
               *([probes] if (probes := probe_line(rows, runtimes)) else []),
               *(f"not timed: {e}" for e in errors)]
    return lines, closing


SAME = 0.05
"""A side-by-side ratio within this of 1 is the blocks' noise (the same placement kept by both
sessions reads 0.96-1.04)."""


def beside(gpu: dict[str, Any]) -> dict[str, float] | None:
    """A row's side-by-side medians (``--beside``), the best of its rounds: ms of the default
    list's session and of CpuAcc,CpuRef's, timed in one process; None where not measured."""
    pairs = gpu.get("beside") or []
    if not pairs or "error" in gpu:
        return None
    return {"gpuacc_ms": min(p["gpuacc_ms"] for p in pairs),
            "cpuacc_ms": min(p["cpuacc_ms"] for p in pairs)}


def pair_text(pair: dict[str, float] | None) -> str:
    if pair is None:
        return "-"
    return (f"{pair['gpuacc_ms']:.3f} / {pair['cpuacc_ms']:.3f} "
            f"({pair['gpuacc_ms'] / pair['cpuacc_ms']:.2f})")


def slower_beside(pairs: dict[str, dict[str, float] | None]) -> str:
    """Issue 28's second clause read side by side: the models whose default session ran slower
    than CpuAcc,CpuRef's in the same process by more than SAME."""
    timed = {name: p for name, p in pairs.items() if p is not None}
    slower = [f"{name} {pair_text(p)}" + (f" routes {p['routes']} / {p['cpu_routes']}"
                                          if p.get("routes") != p.get("cpu_routes") else "")
              for name, p in timed.items() if p["gpuacc_ms"] > p["cpuacc_ms"] * (1 + SAME)]
    return (f"one process each (--beside): GpuAcc,CpuAcc,CpuRef slower than CpuAcc,CpuRef by "
            f"more than {SAME:.0%} on {len(slower)} of {len(timed)}: {', '.join(slower) or 'none'}")


def probe_line(rows: dict[str, dict[str, Any]], runtimes: Sequence[str]) -> str:
    """The speed probes' range per runtime (a Python loop's us a step as each process timed):
    where it spans much, processes timed at different host speeds."""
    parts = []
    for rt in runtimes:
        probes = [p for row in rows.values() for p in row.get(rt, {}).get("probe_us", [])
                  if p is not None]
        if probes:
            parts.append(f"{rt} {min(probes):.3f}-{max(probes):.3f}")
    return ("speed probe (a Python loop, us a step, per process): " + ", ".join(parts)
            if parts else "")


def gpu_name() -> str:
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            return f"GPU: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    return "GPU: none found"


def version() -> str:
    """backplane's version and commit where this tree is a checkout's root; a tree unpacked
    elsewhere (a device call's archive inside another checkout) says so, or $BACKPLANE_REV."""
    import subprocess

    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"],
                         capture_output=True, text=True).stdout.strip()
    if top and Path(top).resolve() == ROOT.resolve():
        return wild.backplane_version()
    return f"at {os.environ.get('BACKPLANE_REV', 'an unknown commit (not a checkout)')}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help="comma-separated corpus model names (default: all of them)")
    ap.add_argument("--tier", choices=("small", "full"), default="full")
    ap.add_argument("--corpus", type=Path, help="the folder of the corpus's manifest.json")
    ap.add_argument("--runtimes", default=",".join(RUNTIMES),
                    help=f"comma-separated, of {', '.join(RUNTIMES)} (default: all)")
    ap.add_argument("--rounds", type=int, default=1, help="processes per runtime and model (1)")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed calls per process, s (1)")
    ap.add_argument("--warmup-seconds", type=float, default=0.5, help="untimed calls first (0.5)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for one process (300)")
    ap.add_argument("--jobs", type=int, default=1, help="processes at a time (1; see above)")
    ap.add_argument("--json", type=Path, help="write the rows as a JSON document to this file")
    ap.add_argument("--beside", action="store_true",
                    help="each gpuacc process also times CpuAcc,CpuRef beside it (see above)")
    ap.add_argument("--budget", type=float,
                    help="seconds after which no process is started (the table of what ran)")
    ap.add_argument("--worker", choices=RUNTIMES, help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--feeds", help=argparse.SUPPRESS)
    ap.add_argument("--lock", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.runtimes = args.runtimes.split(",")
    unknown = [rt for rt in args.runtimes if rt not in RUNTIMES]
    if unknown:
        print(f"unknown runtimes {unknown}; the known: {', '.join(RUNTIMES)}", file=sys.stderr)
        return 2
    args.corpus = (args.corpus or (wild.FULL_CORPUS if args.tier == "full" else wild.CORPUS))
    manifest = json.loads((args.corpus / "manifest.json").read_text())
    names = args.models.split(",") if args.models else list(manifest)
    missing = [n for n in names if n not in manifest]
    if missing:
        print(f"unknown models {missing}; the corpus has: {', '.join(manifest)}", file=sys.stderr)
        return 2
    header = [f"command: python bench/corpus_gpu.py {' '.join(sys.argv[1:])}".rstrip(),
              f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", gpu_name(),
              *environment(len(ORT_CPUS)), f"backplane {version()}",
              f"corpus: {args.tier} tier, {args.corpus}; {args.rounds} rounds, best of the "
              f"rounds' medians, NumPy in and out; ORT pinned to CPUs {sorted(ORT_CPUS)}"]
    header.append(prebuilt())
    args.deadline = None if args.budget is None else time.perf_counter() + args.budget
    with tempfile.NamedTemporaryFile(prefix="corpus_gpu.", suffix=".lock") as lock:
        args.lock = lock.name
        rows = bench(args, names)
    lines, closing = table(rows, args.runtimes)
    load1, load5, _ = os.getloadavg()
    print("\n".join([*header, "", *lines, "", *closing,
                     f"load average {load1:.2f} / {load5:.2f} (1 / 5 min) at the end"]))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
