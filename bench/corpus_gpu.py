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
times calls for ``--seconds``; a figure is the best of the rounds' medians. ``--jobs N`` runs N
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
from bench_openvino import environment  # noqa: E402

from backplane.backends.torch.bench import timed_runs, worker_report  # noqa: E402

RUNTIMES = ("ort", "gpuacc", "inductor", "torch_compile", "cpuacc")
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
    return (lambda: bp.run(None, feeds)), lambda: placement(bp.report)


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
            first, times = calls(args, run)
        replies.write(json.dumps({"ms": statistics.median(times) * 1e3, "load_s": load_s,
                                  "first_ms": first[0] * 1e3, "plan": plan()}) + "\n")
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


# -- the parent side ------------------------------------------------------------------------------
def spawn(args: argparse.Namespace, runtime: str, name: str) -> dict[str, Any]:
    entry = json.loads((args.corpus / "manifest.json").read_text())[name]
    command = [sys.executable, __file__, "--worker", runtime, "--name", name, "--tier", args.tier,
               "--model", str(args.corpus / entry["file"]),
               "--feeds", str(args.corpus / entry["inputs_files"][0]),
               "--seconds", str(args.seconds), "--warmup-seconds", str(args.warmup_seconds),
               "--lock", args.lock]
    try:
        return worker_report(command, len(ORT_CPUS), args.timeout)
    except Exception as exc:  # noqa: BLE001  # a timeout: the row says so
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


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
    row.setdefault("first_ms", reply["first_ms"])
    row.setdefault("load_s", reply["load_s"])
    row["plan"] = reply["plan"] or row.get("plan", {})


def table(rows: dict[str, dict[str, Any]], runtimes: Sequence[str]) -> tuple[list[str], list[str]]:
    """The table's lines and the closing lines (geomean ORT / GpuAcc, GpuAcc's slower models)."""
    def ms(row: dict[str, Any]) -> str:
        return "-" if "error" in row or not row["ms"] else f"{min(row['ms']):.3f}"

    def described(plan: dict[str, Any]) -> str:
        text = " ".join(f"{b}:{n}" for b, n in plan.items() if b != "timed")
        return (text + (f" (timed {plan['timed']})" if "timed" in plan else "")) or "-"

    cpu_plans = "cpuacc" in runtimes
    lines = ["| model | " + " | ".join(f"{rt} ms" for rt in runtimes)
             + " | ORT / GpuAcc | GpuAcc load s (first call ms) | GpuAcc placement |"
             + (" CpuAcc placement |" if cpu_plans else ""),
             "| --- |" + " ---: |" * (len(runtimes) + 2) + " --- |" * (1 + cpu_plans)]
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
                     + (f" {described(row['cpuacc'].get('plan', {}))} |" if cpu_plans else ""))
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
               *(f"not timed: {e}" for e in errors)]
    return lines, closing


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
