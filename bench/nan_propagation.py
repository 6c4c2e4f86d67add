"""What keeping NaN costs CpuAcc: the same models on this source tree and on an earlier one, side by
side, each setting in processes of its own, alternating.

Usage:
    git archive <commit before the change> src | tar -x -C /tmp/before
    python bench/nan_propagation.py --before /tmp/before/src --rounds 5 --runs 200

The earlier tree's ``backplane`` is put first on the path of its processes (``--after`` names
another tree for the later side; by default this one's). Each process loads one
model on CpuAcc (``--threads``, ``CpuAcc.compile`` as the mode says, routes measured, not cached),
warms up and reports the median of ``--runs`` runs on the model's sample inputs. Prints the CPU,
torch's version and, per model and mode, the median over rounds of the processes' medians (ms) and
after / before.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["tests/data/tiny_mobilenet_v3.onnx", "tests/data/corpus/mobilenet_dw_ts13.onnx",
          "tests/data/corpus/mobilenet_dw_dyn18.onnx", "tests/data/corpus/resnet_basic_ts16.onnx",
          "tests/data/corpus/resnet_basic_dyn21.onnx", "tests/data/corpus/unet_resize_ts13.onnx"]
MODES = {"compiled": "auto", "layers": "layers"}


def worker(args: argparse.Namespace) -> None:
    import numpy as np

    from backplane import InferenceSession

    model = ROOT / args.model
    arrays = model.with_suffix(".npz") if model.parent.name == "data" else \
        model.with_name(model.stem + ".s0.npz")
    with np.load(arrays) as data:
        feeds = {name: data[name] for name in data.files}
    session = InferenceSession(str(model), backends=[
        ("CpuAcc", {"threads": args.threads, "compile": MODES[args.mode], "route_cache": False}),
        "CpuRef"])
    names = {arg.name for arg in session.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    for _ in range(20):
        session.run(None, feeds)
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": statistics.median(times) * 1e3}))


def measure(args: argparse.Namespace, tree: str, model: str, mode: str) -> float:
    env = dict(os.environ)
    source = args.before if tree == "before" else args.after
    if source:
        env["PYTHONPATH"] = os.pathsep.join([source, env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, "--worker", "--model", model, "--mode", mode,
               "--runs", str(args.runs), "--threads", str(args.threads)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the earlier source tree (its src folder)")
    parser.add_argument("--after", help="the later one (default: this tree's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.before:
        parser.error("--before names the earlier tree's src folder")
    import torch

    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, torch {torch.__version__}, CpuAcc.threads "
          f"{args.threads}, {args.rounds} rounds of {args.runs} runs")
    results: dict[tuple[str, str, str], list[float]] = {}
    for _ in range(args.rounds):
        for model in args.models:
            for mode in MODES:
                for tree in ("before", "after"):  # alternating, in the same round
                    ms = measure(args, tree, model, mode)
                    results.setdefault((model, mode, tree), []).append(ms)
                    print(f"  {Path(model).stem} {mode} {tree}: {ms:.3f} ms", file=sys.stderr,
                          flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    print("| model | mode | before ms | after ms | after / before |")
    print("| --- | --- | --- | --- | --- |")
    for model in args.models:
        for mode in MODES:
            before = statistics.median(results[(model, mode, "before")])
            after = statistics.median(results[(model, mode, "after")])
            print(f"| {Path(model).stem} | {mode} | {before:.3f} | {after:.3f} | "
                  f"{after / before:.3f} |")


if __name__ == "__main__":
    main()
