"""A busy machine: backplane's CpuAcc against ONNX Runtime while CPU-burning neighbours run.

Each configuration runs in a process of its own, in alternating order over ``--rounds``, batch 1,
with ``--burners`` processes spinning on the CPU (none with ``--burners 0``: the quiet baseline).
A configuration is a runtime and its thread settings:

- ``cpuacc``: CpuAcc,CpuRef as a session takes them by default (torch's own thread count);
- ``cpuacc:T``: CpuAcc.threads=T;
- ``cpuacc:T:passive``: the same with OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep at once
  instead of spinning when they wait; set before torch loads);
- ``ort`` / ``ort:T``: ONNX Runtime's CPU provider, default or T intra-op threads.

The table gives, per configuration, the median, the 10th and 90th percentile and the worst run in ms
over every timed run of every round. Printed with it: the CPU model, its core count, the load
average before and after, and the library versions.

Usage:
    python bench/contention.py [MODEL.onnx] [--burners 1] [--rounds 3] [--runs 50]
                               [--configs cpuacc,cpuacc:1,cpuacc:1:passive,ort,ort:1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "mobilenet_v2_w020_c10.onnx"
BURN = "while True: pass"


def worker(model: str, config: str, runs: int, warmup: int) -> list[float]:
    """Times of ``runs`` runs of ``model`` in this process under ``config`` (seconds)."""
    kind, threads, _ = (config.split(":") + ["", ""])[:3]
    if kind == "ort":
        import onnxruntime as ort

        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = int(threads)
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        inputs = session.get_inputs()
        shapes = {i.name: [d if isinstance(d, int) else 1 for d in i.shape] for i in inputs}
    else:
        import backplane

        backends: list = ["CpuAcc", "CpuRef"]
        if threads:
            backends[0] = ("CpuAcc", {"threads": int(threads)})
        session = backplane.InferenceSession(model, backends=backends)
        shapes = {i.name: [d if isinstance(d, int) else 1 for d in i.shape]
                  for i in session.get_inputs()}
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for _ in range(warmup):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return times


def run_config(model: str, config: str, runs: int, warmup: int) -> list[float]:
    env = dict(os.environ)
    if config.endswith(":passive"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    reply = subprocess.run([sys.executable, __file__, "--worker", config, model, "--runs", str(runs),
                            "--warmup", str(warmup)], capture_output=True, text=True, env=env)
    if reply.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{reply.stderr[-2000:]}")
    return json.loads(reply.stdout.strip().splitlines()[-1])


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), platform.processor())
    versions = []
    for package in ("torch", "onnxruntime", "numpy"):
        try:
            versions.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    return (f"CPU: {model}, {os.cpu_count()} logical cores; Python {platform.python_version()}, "
            f"{', '.join(versions)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(DEMO))
    parser.add_argument("--burners", type=int, default=1, help="CPU-burning processes meanwhile")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--configs", default="cpuacc,cpuacc:1,cpuacc:1:passive,ort,ort:1")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.runs, args.warmup)))
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    print(machine())
    print(f"model {args.model}; {args.burners} burner(s); {args.rounds} rounds x {args.runs} runs; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(args.burners)]
    times: dict[str, list[float]] = {c: [] for c in configs}
    try:
        for round_ in range(args.rounds):
            order = configs if round_ % 2 == 0 else configs[::-1]
            for config in order:
                times[config] += run_config(args.model, config, args.runs, args.warmup)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"{'config':<20} {'median ms':>10} {'p10':>8} {'p90':>8} {'worst':>9}")
    for config, values in times.items():
        ms = np.array(values) * 1e3
        print(f"{config:<20} {np.median(ms):>10.2f} {np.percentile(ms, 10):>8.2f} "
              f"{np.percentile(ms, 90):>8.2f} {ms.max():>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
