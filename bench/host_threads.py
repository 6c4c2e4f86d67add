"""CpuRef beside CpuAcc or OpenVINO in one run, with and without NumPy's BLAS on one thread for
CpuRef's layers (``runtime/host_threads.py``).

Usage:
    python bench/host_threads.py /tmp/anchors/models/resnet50.onnx                 # CpuAcc
    python bench/host_threads.py m.onnx --backend OpenVINO --pin 2 --rounds 3
    python bench/host_threads.py m.onnx --pin every3                                # a third of them

The model's convolutions are pinned to CpuRef (``--pin N``: N of them spread over the model,
``every3``: one in three, ``most``: all but the first), the rest run on ``--backend``. Each setting
runs in processes of its own, alternating ("one BLAS thread" is the runtime's behaviour; "NumPy's
threads" turns it off), plus the model all on the backend; a process loads, warms up and reports the
median of ``--runs`` runs. Prints the CPU, the library versions and a table of median ms.
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
from importlib import metadata
from pathlib import Path

import numpy as np


def pins_for(model: Path, how: str) -> dict[str, str]:
    import onnx

    convs = [n.name for n in onnx.load(str(model), load_external_data=False).graph.node
             if n.op_type == "Conv"]
    if how == "none":
        chosen: list[int] = []
    elif how == "every3":
        chosen = list(range(0, len(convs), 3))
    elif how == "most":
        chosen = list(range(1, len(convs)))
    else:
        count = min(int(how), len(convs))
        chosen = [round((i + 1) * len(convs) / (count + 1)) for i in range(count)]
    return {convs[i]: "CpuRef" for i in chosen}


def worker(args: argparse.Namespace) -> None:
    from backplane import InferenceSession
    from backplane.backends.torch.bench import feeds_for
    from backplane.runtime import host_threads

    if args.setting == "numpy-threads":
        host_threads.share = lambda layers, workloads, backends: list(workloads)
    pins = pins_for(args.model, "none" if args.setting == "all-on-backend" else args.pin)
    session = InferenceSession(args.model, pins=pins, backends=[
        (args.backend, {f"{args.backend}.threads": args.threads}), "CpuRef"])
    feeds = feeds_for(args.model)
    for _ in range(args.warmup):
        session.run(None, feeds)
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({"median": statistics.median(times), "pinned": len(pins)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--backend", default="CpuAcc", choices=["CpuAcc", "OpenVINO"])
    parser.add_argument("--pin", default="2", help="N, every3 or most (see above)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting:
        worker(args)
        return
    from backplane.artifact.facts import cpu

    facts = cpu()
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in
                         ("numpy", "onnx", "torch", "openvino", "threadpoolctl")
                         if _installed(name))
    print(f"CPU: {facts['cpu']}, {os.cpu_count()} logical CPUs ({facts['isa']}); "
          f"Python {platform.python_version()}, {versions}; load average "
          f"{os.getloadavg()[0]:.2f}; {args.threads} threads, --pin {args.pin}")
    settings = ["one-blas-thread", "numpy-threads", "all-on-backend"]
    medians: dict[str, list[float]] = {s: [] for s in settings}
    pinned = 0
    for _ in range(args.rounds):
        for setting in settings:
            done = subprocess.run(
                [sys.executable, __file__, str(args.model), "--backend", args.backend, "--pin",
                 args.pin, "--threads", str(args.threads), "--runs", str(args.runs), "--warmup",
                 str(args.warmup), "--setting", setting],
                capture_output=True, text=True, check=True)
            reply = json.loads(done.stdout.strip().splitlines()[-1])
            medians[setting].append(reply["median"])
            pinned = max(pinned, reply["pinned"])
    print(f"| {args.model.stem}, {pinned} convolutions on CpuRef | median ms | process medians |")
    print("| --- | ---: | --- |")
    for setting in settings:
        values = medians[setting]
        print(f"| {setting} | {statistics.median(values):.1f} | "
              f"{', '.join(f'{v:.1f}' for v in values)} |")


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
