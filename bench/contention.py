"""A busy machine: backplane's CpuAcc against ONNX Runtime while CPU-burning neighbours run.

Each configuration runs in a process of its own, in alternating order over ``--rounds``, batch 1,
with ``--burners`` processes spinning on the CPU. ``--burners 0,1`` measures each configuration
quiet (no burner) and busy (one) in the same rounds, the burners started and stopped around each
condition, the conditions alternating too. A configuration is a runtime and its thread settings:

- ``cpuacc``: CpuAcc,CpuRef as a session takes them by default (``CpuAcc.threads`` "auto": the
  thread policy of ``src/backplane/backends/torch/threads.py``);
- ``cpuacc:T``: CpuAcc.threads=T (``cpuacc:2`` on a 2-core machine is torch's own count, the
  default before the policy);
- ``cpuacc:T:passive``: the same with OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep at once
  instead of spinning when they wait; set before torch loads);
- ``cpuacc:T:spin=N``: the same with GOMP_SPINCOUNT=N (libgomp's spins before it sleeps; 300000
  when unset);
- ``ort`` / ``ort:T``: ONNX Runtime's CPU provider, default or T intra-op threads.

A table per burner count gives, per configuration, the median, the 10th and 90th percentile and the
worst run in ms over every timed run of every round, the CPU the process's other threads took
over a run and the ``--gap`` after it (mean ms: OpenMP's spinning after a parallel region, CPU
taken from a neighbour), and the thread counts CpuAcc ran at (the share of runs at each). With a
quiet baseline, a last table gives each configuration's slowdown (busy over quiet, median and
p90). Printed with them: the CPU model, its core count, the load average
(1, 5 and 15 minutes, as ``uptime`` gives it) around each condition of each round, and the library
versions.

Usage:
    python bench/contention.py [MODEL.onnx] [--burners 0,1] [--rounds 3] [--runs 50] [--gap 5]
                               [--configs cpuacc,cpuacc:2,cpuacc:1,cpuacc:2:passive,ort,ort:1]
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
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "mobilenet_v2_w020_c10.onnx"
BURN = "while True: pass"


def worker(model: str, config: str, runs: int, warmup: int, gap: float = 0.0) -> dict[str, Any]:
    """Times of ``runs`` runs of ``model`` in this process under ``config`` (seconds), the thread
    count torch had after each (CpuAcc's; none for ONNX Runtime), and the CPU seconds the
    process's other threads took over each run and the ``gap`` slept after it (a spinning OpenMP
    thread's: CPU a neighbour on that core does not get)."""
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
    stored = Path(model).with_suffix(".s0.npz")  # a corpus model's own inputs (their dtypes)
    if stored.exists():
        with np.load(stored) as given:
            feeds = {name: given[name] for name in given.files}
    for _ in range(warmup):
        session.run(None, feeds)
    counts = (lambda: 0) if kind == "ort" else __import__("torch").get_num_threads
    times, used, others = [], [], []
    for _ in range(runs):
        process, thread = time.process_time(), time.thread_time()
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
        if gap:
            time.sleep(gap)
        others.append(time.process_time() - process - (time.thread_time() - thread))
        used.append(counts())
    return {"times": times, "threads": used, "others": others}


def run_config(model: str, config: str, runs: int, warmup: int, gap: float = 0.0
               ) -> dict[str, Any]:
    env = dict(os.environ)
    if config.endswith(":passive"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if ":spin=" in config:
        env["GOMP_SPINCOUNT"] = config.split(":spin=")[1]
    reply = subprocess.run([sys.executable, __file__, "--worker", config, model, "--runs", str(runs),
                            "--warmup", str(warmup), "--gap", str(gap * 1e3)],
                           capture_output=True, text=True, env=env)
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


def load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(args: argparse.Namespace, configs: list[str], counts: list[int]) -> dict:
    """{burners: {config: {"times": [...], "threads": [...]}}}, alternating configurations within a
    condition and conditions within a round, each order reversed every other round."""
    results = {n: {c: {"times": [], "threads": [], "others": []} for c in configs}
               for n in counts}
    for round_ in range(args.rounds):
        flip = round_ % 2 == 1
        for burners in (counts[::-1] if flip else counts):
            print(f"round {round_ + 1}, {burners} burner(s): {load()}", flush=True)
            spinning = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(burners)]
            try:
                for config in (configs[::-1] if flip else configs):
                    reply = run_config(args.model, config, args.runs, args.warmup,
                                       args.gap / 1e3)
                    for key in ("times", "threads", "others"):
                        results[burners][config][key] += reply[key]
            finally:
                for burner in spinning:
                    burner.kill()
                    burner.wait()
    print(f"after: {load()}")
    return results


def table(burners: int, results: dict) -> None:
    print(f"\n{burners} burner(s)")
    print(f"{'config':<22} {'median ms':>10} {'p10':>8} {'p90':>8} {'worst':>9} "
          f"{'others ms':>10}  threads (share of runs)")
    for config, got in results.items():
        ms = np.array(got["times"]) * 1e3
        used = [t for t in got["threads"] if t]
        shares = ", ".join(f"{t}: {used.count(t) / len(used):.0%}" for t in sorted(set(used)))
        print(f"{config:<22} {np.median(ms):>10.2f} {np.percentile(ms, 10):>8.2f} "
              f"{np.percentile(ms, 90):>8.2f} {ms.max():>9.2f} "
              f"{np.mean(got['others']) * 1e3:>10.3f}  {shares}")


def slowdowns(quiet: dict, busy: dict, burners: int) -> None:
    print(f"\nslowdown with {burners} burner(s), busy / quiet")
    print(f"{'config':<22} {'median':>8} {'p90':>8}")
    for config in quiet:
        q, b = (np.array(r[config]["times"]) for r in (quiet, busy))
        print(f"{config:<22} {np.median(b) / np.median(q):>7.2f}x "
              f"{np.percentile(b, 90) / np.percentile(q, 90):>7.2f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(DEMO))
    parser.add_argument("--burners", default="1",
                        help="CPU-burning processes meanwhile; a list (0,1) measures each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--gap", type=float, default=0.0,
                        help="ms slept after each run (a server between requests): the CPU "
                             "the process's other threads take then is in 'others ms'")
    parser.add_argument("--configs", default="cpuacc,cpuacc:2,cpuacc:1,cpuacc:2:passive,ort,ort:1")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.model, args.worker, args.runs, args.warmup,
                                args.gap / 1e3)))
        return 0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    counts = [int(n) for n in args.burners.split(",")]
    print(machine())
    print(f"model {args.model}; burners {counts}; {args.rounds} rounds x {args.runs} runs "
          f"(after {args.warmup} untimed) per configuration and condition")
    results = measure(args, configs, counts)
    for burners in counts:
        table(burners, results[burners])
    if 0 in counts:
        for burners in (n for n in counts if n):
            slowdowns(results[0], results[burners], burners)
    return 0


if __name__ == "__main__":
    sys.exit(main())
