"""The native CNN route against today's torch route: session.run of corpus CNNs with
``CpuAcc.native`` auto and off, in alternating processes, at one thread.

    python bench/native_cnn.py [--models a,b] [--tier small|full] [--rounds 4] [--runs 200]
                               [--threads 1 [--fixed]] [--side S] [--any-size] [--profile]

Each round starts one process per mode (auto, off, auto, ... in turn); a process loads the model
with static input shapes (the sample's), runs it 30 times untimed, then ``--runs`` times, and
reports the median thread CPU time (``time.thread_time``: what a loaded machine inflates least)
and wall time of one run. The table gives the medians over rounds, their ratio, the routes the
OneDnnGraph and Traced partitions took and the load average. ``--profile`` prints, per model,
each native record's thread CPU time (``Executor.profile``: the mean of 200 runs). ``--threads`` sets torch's
thread count (``CpuAcc.threads`` auto: the governor's count, fewer while other processes hold
the CPUs; ``--fixed``: exactly that many), which both routes run on (the native plan's split
records, ``native/cnn_pool.h``); at more than one thread the wall times are the figures to read
(best is the best run of the best process). A model given as a path (``models/mobilenet_v2_w020_c10.onnx``, the demo) runs on random
inputs of its declared shapes. ``--any-size`` lifts the size rule
(``native_cnn.SMALL``), and ``--side`` runs the 4-d inputs at side x side, to
measure where it should be.
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
SMALL = ROOT / "tests" / "data" / "corpus"
FULL = Path(os.environ.get("BACKPLANE_CORPUS_FULL", Path.home() / ".cache/backplane/corpus-full"))
MODELS = ("mobilenet_dw_ts13,resnet_basic_ts16,mobilenet_dw_dyn18,resnet_basic_dyn21,"
          "mobilenet_fp16_ts17,detect_nms_ts14,crnn_paddle_ts12")


def worker(path: str, mode: str, runs: int, profile: bool, any_size: bool, threads: int,
           side: int, fixed: bool) -> dict:
    import numpy as np
    import torch

    from backplane import InferenceSession
    from backplane.backends.torch.fusion import native_cnn

    if any_size:
        native_cnn.SMALL = 1 << 62
    torch.set_num_threads(threads)
    sample = path.replace(".onnx", ".s0.npz")
    feeds = dict(np.load(sample)) if os.path.exists(sample) else _random_feeds(path)
    if side:  # the images at side x side: the size rule's measurement
        rng = np.random.default_rng(0)
        feeds = {k: rng.standard_normal((*v.shape[:2], side, side)).astype(v.dtype)
                 if v.ndim == 4 else v for k, v in feeds.items()}
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                               input_shapes={k: list(v.shape) for k, v in feeds.items()},
                               provider_options=[{"CpuAcc.native": mode, **(
                                   {"CpuAcc.threads": threads} if fixed else {})}, {}])
    loaded = session.runtime.network(session.network_id)
    graphs = [s.workload for s, lay in zip(loaded.steps, loaded.layers)
              if lay.op_type in ("OneDnnGraph", "Traced")]
    for _ in range(30):
        session.run(None, feeds)
    cpu, wall = [], []
    for _ in range(runs):
        c, w = time.thread_time(), time.perf_counter()
        session.run(None, feeds)
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - w)
    result = {"cpu": statistics.median(cpu), "wall": statistics.median(wall), "best": min(wall),
              "routes": [getattr(g, "route", "?") for g in graphs]}
    if profile:
        rows = []
        for g in graphs:
            executor = getattr(g, "executor", None)
            if executor is not None:
                inputs = [feeds[k] for k in feeds]
                seconds = executor.profile(inputs, 200)
                rows += [(name, op, s) for (name, op), s in zip(executor.plan.names, seconds)]
        result["profile"] = rows
    return result


def _random_feeds(path: str) -> dict:
    """A model without a sample (the demo, models/*.onnx): standard normal float32 inputs of its
    declared shapes (a symbolic dimension 1)."""
    import numpy as np
    import onnx

    rng = np.random.default_rng(0)
    graph = onnx.load(path, load_external_data=False).graph
    known = {i.name for i in graph.initializer}
    return {i.name: rng.standard_normal([d.dim_value or 1 for d in
                                         i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in graph.input if i.name not in known}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--tier", choices=("small", "full"), default="small")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--any-size", action="store_true",
                        help="native for a partition of any size (native_cnn.SMALL lifted)")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads (off's route)")
    parser.add_argument("--fixed", action="store_true", help="CpuAcc.threads=N, not the governor")
    parser.add_argument("--side", type=int, default=0, help="4-d inputs resized to side x side")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.runs, args.profile,
                                args.any_size, args.threads, args.side, args.fixed)))
        return
    folder = SMALL if args.tier == "small" else FULL
    print("| model | native cpu us | off cpu us | native / off | native wall us | off wall us "
          "| best wall native / off | routes native / off | load |")
    for name in args.models.split(","):
        path = name if name.endswith(".onnx") else str(folder / f"{name}.onnx")
        found: dict[str, list[dict]] = {"auto": [], "off": []}
        loads = []
        for _ in range(args.rounds):
            for mode in ("auto", "off"):
                command = [sys.executable, __file__, "--worker", path, mode, "--runs", str(args.runs),
                           "--threads", str(args.threads), "--side", str(args.side),
                           *(["--fixed"] if args.fixed else []),
                           *(["--profile"] if args.profile else []),
                           *(["--any-size"] if args.any_size else [])]
                done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
                if done.returncode:
                    sys.exit(f"{name} {mode}: {done.stderr[-2000:]}")
                found[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
                loads.append(os.getloadavg()[0])
        med = {m: {k: statistics.median(r[k] for r in rs) * 1e6 for k in ("cpu", "wall")}
               for m, rs in found.items()}
        best = {m: min(r["best"] for r in rs) * 1e6 for m, rs in found.items()}
        routes = "/".join(",".join(found[m][0]["routes"]) for m in ("auto", "off"))
        print(f"| {name} | {med['auto']['cpu']:.1f} | {med['off']['cpu']:.1f} | "
              f"{med['auto']['cpu'] / med['off']['cpu']:.2f} | {med['auto']['wall']:.1f} | "
              f"{med['off']['wall']:.1f} | {best['auto']:.0f} / {best['off']:.0f} = "
              f"{best['auto'] / best['off']:.2f} | {routes} | {min(loads):.1f}-{max(loads):.1f} |",
              flush=True)
        for row in found["auto"][0].get("profile", []):
            print(f"    {row[2] * 1e6:7.2f} us  {row[1]:18s} {row[0]}")


if __name__ == "__main__":
    main()
