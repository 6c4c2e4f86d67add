"""Where a corpus model's GpuAcc run goes (issue 28): the layers that left the GPU and why, the
copies between backends, and per run the CUDA kernels, copies and launches torch's profiler sees.

Usage (on a machine with a CUDA GPU):
    python bench/gpu_profile.py --tier small --models detect_nms_dyn21,gpt_dynquant_ort15

Each model in a process of its own, ``providers=[("GpuAcc", {"against_cpu": "off"}), "CpuAcc",
"CpuRef"]`` (GpuAcc's own placement: the timing against the CPU would hide it), NumPy in and out
on the model's ``.s0.npz``. After the background's settling and a warm-up it prints: layers per
backend; each layer GpuAcc did not take, folded by op type and reason; the copies the plan inserts
(``report.copies``); the median ms of ``--runs`` runs; then, over ``--profiled`` runs under
torch.profiler, per run: CUDA kernels (by count, and the names of the most GPU time), memcpy
by direction, memsets, the host's launch calls
(cudaLaunchKernel, cudaGraphLaunch, cudaMemcpyAsync, synchronizations), and the host operators with
the most self CPU time; and ``run_profiled``'s slowest layers (each a host-side span: a captured
partition's is its replay and wait).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

LAUNCHES = ("cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize",
            "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemsetAsync",
            "cudaLaunchKernelExC", "cuLaunchKernel", "cudaHostAlloc", "cudaMalloc")


def refusals(report: Any) -> list[str]:
    """The layers GpuAcc did not take, folded: op type, backend, reason, count."""
    folded: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for p in report.layers.values():
        if p.backend == "GpuAcc":
            continue
        reason = next((r for b, r in p.refusals if b == "GpuAcc"), "not refused: placed so")
        folded[(p.op_type, p.backend, " ".join(reason.split())[:140])] += 1
    return [f"{n} x {op} on {backend}: {reason}" for (op, backend, reason), n in folded.items()]


WRAPPERS = ("OneThread", "AtThreads")


def routes(session: Any) -> list[str]:
    """The routes (``route``: native, native int8, traced, ...) and thread wrappers (OneThread,
    AtThreads(n)) found in a session's workloads, through closures and attributes, in order:
    two sessions of one placement whose CPU partitions chose other routes or thread counts at
    their builds (a measurement each) show it here (issue 28's side-by-side rows, session 19)."""
    loaded = session.runtime.network(session.network_id)
    found: list[str] = []
    for step in loaded.steps:
        _walk(step.workload, set(), found, 0)
    return found


def _walk(obj: Any, seen: set[int], found: list[str], depth: int) -> None:
    if depth > 7 or id(obj) in seen or isinstance(obj, (str, bytes, int, float, np.ndarray)):
        return
    seen.add(id(obj))
    kind = type(obj).__name__
    if kind in WRAPPERS:
        found.append(f"{kind}({getattr(obj, 'count', '?')})")
    route = getattr(obj, "route", None)
    if isinstance(route, str):
        found.append(route)
    if isinstance(obj, (list, tuple, dict)):
        inner = list(obj.values() if isinstance(obj, dict) else obj)[:50]
    elif callable(obj) and getattr(obj, "__closure__", None):
        inner = [_contents(cell) for cell in obj.__closure__]
    elif type(obj).__module__.startswith("backplane") or kind == "OrderedDict":
        slots = [getattr(obj, a) for a in getattr(type(obj), "__slots__", ()) if hasattr(obj, a)]
        inner = slots + list(getattr(obj, "__dict__", {}).values()) \
            + (list(obj.values()) if kind == "OrderedDict" else [])
    else:
        return
    for each in inner:
        _walk(each, seen, found, depth + 1)


def _contents(cell: Any) -> Any:
    """A closure cell's value; None for a cell not yet filled (reading it raises)."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def profiled(run: Any, runs: int) -> dict[str, Any]:
    """Per run: kernels, copies, memsets and launch calls; the top host operators."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
    counts: collections.Counter[str] = collections.Counter()
    kernels: collections.Counter[str] = collections.Counter()
    spent: collections.Counter[str] = collections.Counter()  # us by kernel name
    host: collections.Counter[str] = collections.Counter()
    gpu_us = 0.0
    for event in prof.events():
        name = event.name
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = ("memcpy " + name.split()[1] if name.startswith("Memcpy") and " " in name
                    else "memset" if name.startswith("Memset") else "kernel")
            counts[kind] += 1
            if kind == "kernel":
                gpu_us += event.device_time_total
                kernels[name[:70]] += 1
                spent[name[:70]] += event.device_time_total
        elif name in LAUNCHES:
            counts[name] += 1
        elif not name.startswith(("ProfilerStep", "cuda")):
            host[name] += event.self_cpu_time_total
    return {"per_run": {k: round(v / runs, 1) for k, v in sorted(counts.items())},
            "kernel_us_per_run": round(gpu_us / runs, 1),
            "kernels_per_run": [f"{n / runs:g} x {k}" for k, n in kernels.most_common(10)],
            "kernel_us_by_name": [f"{us / runs:.1f} us {kernels[k] / runs:g} x {k}"
                                  for k, us in spent.most_common(14)],
            "host_us_per_run": [f"{n} {us / runs:.1f}" for n, us in host.most_common(8)]}


def worker(model: str, feeds_file: str, runs: int, profiled_runs: int) -> dict[str, Any]:
    from backplane import InferenceSession
    from backplane.backends.torch import background

    feeds = dict(np.load(feeds_file))
    session = InferenceSession(model, providers=[("GpuAcc", {"against_cpu": "off"}),
                                                 "CpuAcc", "CpuRef"])
    run = lambda: session.run(None, feeds)  # noqa: E731
    run()
    background.settle(run, 60.0)
    for _ in range(20):
        run()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    report = session.report
    layers: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(10):
        for t in session.run_profiled(None, feeds)[1]:
            layers[f"{t.op_type} {t.layer[:60]} ({t.backend})"].append(t.seconds * 1e3)
    slowest = sorted(((statistics.median(v), k) for k, v in layers.items()), reverse=True)[:8]
    return {"ms": round(statistics.median(times) * 1e3, 4), "counts": report.counts(),
            "off_gpu": refusals(report), "copies": len(report.copies),
            "crossings": report.crossing_summary(), "warnings": report.warnings[:3],
            "profile": profiled(run, profiled_runs),
            "layers_ms": [f"{ms:.3f} {k}" for ms, k in slowest]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True, help="comma-separated corpus model names")
    ap.add_argument("--tier", choices=("small", "full"), default="small")
    ap.add_argument("--corpus", type=Path)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--profiled", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        out = worker(*args.worker, args.runs, args.profiled)
        print("RESULT " + json.dumps(out))
        return 0
    import wild

    corpus = args.corpus or (wild.FULL_CORPUS if args.tier == "full" else wild.CORPUS)
    manifest = json.loads((corpus / "manifest.json").read_text())

    def one(name: str) -> str:
        entry = manifest[name]
        command = [sys.executable, __file__, "--models", name, "--runs", str(args.runs),
                   "--profiled", str(args.profiled), "--worker", str(corpus / entry["file"]),
                   str(corpus / entry["inputs_files"][0])]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            return f"## {name}: failed\n{done.stderr[-1500:]}"
        out = json.loads(line[7:])
        return f"## {name}\n" + "\n".join(f"{k}: {v}" for k, v in out.items())

    print(f"load average {os.getloadavg()[0]:.1f}")
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for text in pool.map(one, args.models.split(",")):
            print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
