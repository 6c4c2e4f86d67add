"""The natively planned corpus CNNs on this tree against another (its ``src/``): thread CPU time of
a session.run at one thread, the trees alternating in fresh processes, several rounds.

    python bench/cnn_trees.py --src /tmp/old/src [--models a,b] [--rounds 4] [--runs 400]
                              [--tier small|full] [--threads N [--fixed]]

``--threads N`` (N > 1) runs the sessions at torch's N threads (``CpuAcc.threads`` auto: the
governor's count, fewer while other processes hold the CPUs; ``--fixed``: exactly N) and times
each run's wall clock instead (what a second thread is for); a process's figure is then its best
run and its median, and the table gives the best over processes of each.

Why: on a 2-vCPU machine shared by other jobs a wall time says more about the neighbours than
about a kernel; a process's thread CPU time at one thread (``time.thread_time_ns``) is what a
loaded machine inflates least, and alternating the trees spreads what it still inflates over both.
Each process loads the model with its sample's static shapes (``CpuAcc.native`` auto: the route
the plan takes), runs it 50 times untimed, then ``--runs`` times; its figure is the median. The
table gives each tree's best and median process figure over the rounds and their ratio (best over
best), with the load average. Each tree builds its own cnn library (keyed by its source).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "corpus"
FULL = Path(os.environ.get("BACKPLANE_CORPUS_FULL", Path.home() / ".cache/backplane/corpus-full"))
MODELS = ("resnet_basic_ts16,resnet_basic_dyn21,unet_resize_ts13,unet_resize_dyn20,"
          "mobilenet_dw_ts13,mobilenet_dw_dyn18,detect_nms_dyn21")
FULL_MODELS = ("resnet_basic_dyn21,unet_resize_dyn20,yolo_v8_ts17,mobilenet_dw_ts13,"
               "layout_hswish_ts11")


def worker(path: str, runs: int, threads: int, fixed: bool) -> dict:
    import numpy as np
    import torch

    from backplane import InferenceSession

    torch.set_num_threads(threads)
    feeds = dict(np.load(path.replace(".onnx", ".s0.npz")))
    options = {"CpuAcc.threads": threads} if fixed else {}
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                               input_shapes={k: list(v.shape) for k, v in feeds.items()},
                               provider_options=[options, {}])
    loaded = session.runtime.network(session.network_id)
    routes = [getattr(s.workload, "route", "?") for s, lay in zip(loaded.steps, loaded.layers)
              if lay.op_type in ("OneDnnGraph", "Traced")]
    warm = time.perf_counter()
    for _ in range(50):
        session.run(None, feeds)
        if time.perf_counter() - warm > 2.0:
            break
    cpu, wall = [], []
    for _ in range(runs):
        start, clock = time.thread_time_ns(), time.perf_counter_ns()
        session.run(None, feeds)
        cpu.append(time.thread_time_ns() - start)
        wall.append(time.perf_counter_ns() - clock)
    if threads > 1:
        return {"us": min(wall) / 1e3, "median": statistics.median(wall) / 1e3, "routes": routes}
    return {"us": statistics.median(cpu) / 1e3, "routes": routes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True, help="the other tree's src/ folder")
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--tier", choices=("small", "full"), default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fixed", action="store_true", help="CpuAcc.threads=N, not the governor")
    parser.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.runs, args.threads, args.fixed)))
        return
    trees = {"this": str(ROOT / "src"), "other": args.src}
    folder, models = (CORPUS, args.models) if args.tier == "small" else (
        FULL, FULL_MODELS if args.models == MODELS else args.models)
    kind = "thread CPU us a run" if args.threads == 1 else (
        f"wall us at {args.threads} threads{' (fixed)' if args.fixed else ''}, best run / median")
    print(f"this tree {ROOT}, other {args.src}; load average {os.getloadavg()[0]:.1f} at start; "
          f"{kind}")
    print("| model | this best / median | other best / median | this / other | routes | load |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for model in models.split(","):
        path = str(folder / f"{model}.onnx")
        found: dict[str, list[dict]] = {name: [] for name in trees}
        loads = []
        for _ in range(args.rounds):
            for name, src in trees.items():
                env = dict(os.environ, PYTHONPATH=src)
                command = [sys.executable, __file__, "--src", args.src, "--runs", str(args.runs),
                           "--threads", str(args.threads), *(["--fixed"] if args.fixed else []),
                           "--worker", path]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                found[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
                loads.append(os.getloadavg()[0])
        best = {n: min(r["us"] for r in rs) for n, rs in found.items()}
        middle = {n: statistics.median(r.get("median", r["us"]) for r in rs)
                  for n, rs in found.items()}
        routes = " / ".join(",".join(found[n][0]["routes"]) for n in trees)
        print(f"| {model} | {best['this']:.1f} / {middle['this']:.1f} | "
              f"{best['other']:.1f} / {middle['other']:.1f} | {best['this'] / best['other']:.2f} "
              f"| {routes} | {min(loads):.1f}-{max(loads):.1f} |", flush=True)


if __name__ == "__main__":
    main()
