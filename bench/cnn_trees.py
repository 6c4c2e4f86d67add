"""The natively planned corpus CNNs on this tree against another (its ``src/``): thread CPU time of
a session.run at one thread, the trees alternating in fresh processes, several rounds.

    python bench/cnn_trees.py --src /tmp/old/src [--models a,b] [--rounds 4] [--runs 400]

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
MODELS = ("resnet_basic_ts16,resnet_basic_dyn21,unet_resize_ts13,unet_resize_dyn20,"
          "mobilenet_dw_ts13,mobilenet_dw_dyn18,detect_nms_dyn21")


def worker(path: str, runs: int) -> dict:
    import numpy as np
    import torch

    from backplane import InferenceSession

    torch.set_num_threads(1)
    feeds = dict(np.load(path.replace(".onnx", ".s0.npz")))
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                               input_shapes={k: list(v.shape) for k, v in feeds.items()})
    for _ in range(50):
        session.run(None, feeds)
    cpu = []
    for _ in range(runs):
        start = time.thread_time_ns()
        session.run(None, feeds)
        cpu.append(time.thread_time_ns() - start)
    return {"us": statistics.median(cpu) / 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", required=True, help="the other tree's src/ folder")
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.runs)))
        return
    trees = {"this": str(ROOT / "src"), "other": args.src}
    print(f"this tree {ROOT}, other {args.src}; load average {os.getloadavg()[0]:.1f} at start")
    print("| model | this us best / median | other us best / median | this / other | load |")
    print("| --- | ---: | ---: | ---: | --- |")
    for model in args.models.split(","):
        path = str(CORPUS / f"{model}.onnx")
        found: dict[str, list[float]] = {name: [] for name in trees}
        loads = []
        for _ in range(args.rounds):
            for name, src in trees.items():
                env = dict(os.environ, PYTHONPATH=src)
                done = subprocess.run([sys.executable, __file__, "--src", args.src, "--runs",
                                       str(args.runs), "--worker", path], env=env,
                                      capture_output=True, text=True, check=True)
                found[name].append(json.loads(done.stdout.strip().splitlines()[-1])["us"])
                loads.append(os.getloadavg()[0])
        this, other = found["this"], found["other"]
        print(f"| {model} | {min(this):.1f} / {statistics.median(this):.1f} | "
              f"{min(other):.1f} / {statistics.median(other):.1f} | "
              f"{min(this) / min(other):.2f} | {min(loads):.1f}-{max(loads):.1f} |", flush=True)


if __name__ == "__main__":
    main()
