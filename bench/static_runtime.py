"""A model's run with its Traced layers on Static Runtime against the JIT interpreter (H-D, s16).

Usage:
    python bench/static_runtime.py --models gpt_causal_ts15,char_tagger_ts14 [--tier full]
                                   [--threads 1] [--rounds 3] [--runs 300]

Each model runs in processes of its own, ``CpuAcc.static_runtime`` auto then off, alternating over
``--rounds`` rounds (a process's heap and a shared machine's drift touch both alike), with
``CpuAcc.compile=onednn_graph`` (each subgraph that traces stays traced: a busy machine's
measurement at load could otherwise keep the layers in one process and the trace in the next)
and empty route caches. A process loads the model, runs it 30 times, then ``--runs`` timed runs of
its first size (``.s0.npz``), and reports the median thread CPU and wall time of a run (the thread
CPU is the honest figure at 1 thread on a loaded machine: a preempted process's wall time is not
its own). The table gives, per mode, the median of the rounds' medians and static / interpreter,
with the load average at the start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIERS = {"small": ROOT / "tests" / "data" / "corpus",
         "full": Path.home() / ".cache" / "backplane" / "corpus-full"}


def worker(path: str, feeds: str, mode: str, threads: int, runs: int) -> None:
    import numpy as np

    from backplane import InferenceSession
    from backplane.runtime.runtime import Runtime, RuntimeOptions

    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"], runtime=Runtime(
        RuntimeOptions(backend_options={"CpuAcc.compile": "onednn_graph",
                                        "CpuAcc.threads": threads,
                                        "CpuAcc.static_runtime": mode})))
    feed = dict(np.load(feeds))
    for _ in range(30):
        session.run(None, feed)
    cpu, wall = [], []
    for _ in range(runs):
        c, w = time.thread_time(), time.perf_counter()
        session.run(None, feed)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    print(json.dumps({"cpu": statistics.median(cpu), "wall": statistics.median(wall)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", required=True)
    parser.add_argument("--tier", choices=sorted(TIERS), default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--verbose", action="store_true", help="each process's figures (at 2 "
                        "threads on a busy machine they spread by a third between processes)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.threads, args.runs)
        return
    corpus = TIERS[args.tier]
    print(f"load {os.getloadavg()[0]:.1f}, {args.threads} thread(s), {args.rounds} rounds of "
          f"{args.runs} runs, ms a run (median of the rounds' medians)")
    print("| model | static cpu | interp cpu | cpu ratio | static wall | interp wall | wall ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        found: dict[str, list[dict[str, float]]] = {"auto": [], "off": []}
        for _ in range(args.rounds):
            for mode in found:
                with tempfile.TemporaryDirectory() as cache:
                    env = {**os.environ, "BACKPLANE_CACHE_DIR": cache,
                           "BACKPLANE_COMPILE_CACHE": cache, "XDG_CACHE_HOME": cache}
                    done = subprocess.run(
                        [sys.executable, __file__, "--threads", str(args.threads), "--runs",
                         str(args.runs), "--models", name, "--worker",
                         str(corpus / f"{name}.onnx"), str(corpus / f"{name}.s0.npz"), mode],
                        capture_output=True, text=True, env=env, cwd=ROOT, check=True)
                found[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
                if args.verbose:
                    print(f"  {name} {mode}: {found[mode][-1]}", flush=True)
        med = {mode: {k: statistics.median(r[k] for r in rows) * 1e3 for k in ("cpu", "wall")}
               for mode, rows in found.items()}
        print(f"| {name} | {med['auto']['cpu']:.3f} | {med['off']['cpu']:.3f} | "
              f"{med['auto']['cpu'] / med['off']['cpu']:.2f} | {med['auto']['wall']:.3f} | "
              f"{med['off']['wall']:.3f} | {med['auto']['wall'] / med['off']['wall']:.2f} |",
              flush=True)
    print(f"load at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
