"""The corpus's recurrent models with their LSTM / GRU layers in C (``CpuAcc.native`` "auto",
``backplane/native/recurrent.py``) against torch's routes ("off", or another tree), one process
per session, alternating, at one thread: thread CPU a run (the honest figure on a shared machine).

Usage:
    python bench/recurrent_native.py                           # small tier, auto against off
    python bench/recurrent_native.py --tier full --blocks 5
    python bench/recurrent_native.py --base /tmp/wt-base      # this tree's auto against that
                                                               # tree's default, same models

Each block runs every model once per side in a fresh process (load, warm-up runs, then ``--runs``
timed runs); the table gives each side's median over the blocks of the per-process median thread
CPU us a run, the median of the per-block ratios (below 1: the native side is faster), and the
load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = "lstm_bi2_ts14,lstm_bi2_dyn18,gru_bi2_dyn19,crnn_paddle_ts12,vad_lstm_if_ts16,gru_tm3_ts13"
FULL = "lstm_bi2_ts14,crnn_paddle_ts12,vad_lstm_if_ts16"
CHILD = r"""
import glob, json, os, sys, time
import numpy as np
from backplane import InferenceSession
from backplane.runtime.runtime import Runtime, RuntimeOptions
path, mode, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = {"CpuAcc.threads": 1}
if mode != "default":
    options["CpuAcc.native"] = mode
session = InferenceSession(path, runtime=Runtime(RuntimeOptions(backend_options=options)))
stem = path[:-len(".onnx")]
feeds = dict(np.load(sorted(glob.glob(stem + ".s0.npz") + glob.glob(stem + "*.npz"))[0]))
for _ in range(max(10, runs // 5)):
    session.run(None, feeds)
spent = []
for _ in range(runs):
    start = time.thread_time()
    session.run(None, feeds)
    spent.append(time.thread_time() - start)
print(json.dumps(float(np.median(spent)) * 1e6))
"""


def _once(tree: Path, model: str, mode: str, runs: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, model, mode, str(runs)], env=env,
                          capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tier", choices=["small", "full"], default="small")
    parser.add_argument("--models", default=None)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--base", type=Path, default=None,
                        help="a tree whose default route is the other side (else this tree, off)")
    args = parser.parse_args()
    folder = ROOT / "tests" / "data" / "corpus" if args.tier == "small" else \
        Path.home() / ".cache" / "backplane" / "corpus-full"
    models = (args.models or (SMALL if args.tier == "small" else FULL)).split(",")
    runs = args.runs if args.tier == "small" else max(20, args.runs // 10)
    sides = [(args.base or ROOT, "default" if args.base else "off"), (ROOT, "auto")]
    print(f"load at start {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'model':22} {'torch us':>10} {'native us':>10} {'ratio':>7}")
    for model in models:
        path = str(folder / f"{model}.onnx")
        times: list[list[float]] = [[], []]
        for _ in range(args.blocks):
            for side, (tree, mode) in enumerate(sides):
                times[side].append(_once(tree, path, mode, runs))
        ratio = statistics.median(n / t for t, n in zip(*times))
        print(f"{model:22} {statistics.median(times[0]):10.0f} {statistics.median(times[1]):10.0f}"
              f" {ratio:7.3f}", flush=True)
    print(f"load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
