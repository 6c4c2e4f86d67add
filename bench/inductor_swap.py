"""A default session's runs before and after TorchInductor's background compile is swapped in
(``CpuAcc.inductor``, backends/torch/inductor_background.py), against another checkout's tree.

```
python bench/inductor_swap.py --models gpt_causal_ts15 [--tier full] [--threads 1|2]
    [--base /tmp/wt-base] [--pairs 2] [--runs 300]
```

Each process (a fresh cache folder each: inductor compiles cold, as a first load does) loads the
model in a default session (CpuAcc, CpuRef at ``--threads``), runs it once, then
``background.settle`` (no limit): the compile and the runs' timing; the runs of its first 5 s
are timed too (``during_*``: beside the compile). It reports the seconds that took, the process's and its compilers' CPU seconds meanwhile, and ``--runs`` runs after: median
thread CPU (what this thread spent: a busy machine's preemptions left out; at 1 thread the whole
run) and median wall, the route the Traced layer took, the load average. ``--base`` runs the same
in the tree at that path (its ``src`` first on the path), alternating with this one, ``--pairs``
times: old tree against new in separate processes, side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIERS = {"small": ROOT / "tests" / "data" / "corpus",
         "full": Path.home() / ".cache" / "backplane" / "corpus-full"}


def worker(model: str, threads: int, runs: int) -> dict:
    folder = tempfile.mkdtemp(prefix="inductor-swap.")
    os.environ["BACKPLANE_CACHE_DIR"] = folder
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    import numpy as np

    from backplane import InferenceSession, SessionOptions
    from backplane.backends.torch import background

    feeds = dict(np.load(model.replace(".onnx", ".s0.npz")))
    session = InferenceSession(model, SessionOptions(intra_op_num_threads=threads))
    session.run(None, feeds)
    start, cpu = time.perf_counter(), time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    during = []  # runs while the compile goes on beside them (at most 5 s of them)
    while background.pending() and time.perf_counter() - start < 5:
        a, b = time.thread_time(), time.perf_counter()
        session.run(None, feeds)
        during.append((time.thread_time() - a, time.perf_counter() - b))
    settled = background.settle(lambda: session.run(None, feeds), 1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = {"settle_s": time.perf_counter() - start, "settled": settled,
            "process_cpu_s": time.process_time() - cpu,
            "compilers_cpu_s": (after.ru_utime + after.ru_stime
                                - children.ru_utime - children.ru_stime)}
    for _ in range(20):
        session.run(None, feeds)
    cpu_times, walls = [], []
    for _ in range(runs):
        a, b = time.thread_time(), time.perf_counter()
        session.run(None, feeds)
        cpu_times.append(time.thread_time() - a)
        walls.append(time.perf_counter() - b)
    routes = sorted({str(getattr(work, "route", "?")) for work in _traced(session)})
    if during:
        done["during_cpu_ms"] = statistics.median(c for c, _ in during) * 1e3
        done["during_wall_ms"] = statistics.median(w for _, w in during) * 1e3
    return {**done, "cpu_ms": statistics.median(cpu_times) * 1e3,
            "wall_ms": statistics.median(walls) * 1e3, "routes": routes,
            "load": os.getloadavg()}


def _traced(session) -> list:
    """The Traced layers' workloads (each signature's, for a Specialized layer)."""
    from tests.backends.torch.test_traced import _inner_layers

    return [work for layer, work in _inner_layers(session) if layer.op_type == "Traced"]


def spawn(tree: Path, model: Path, threads: int, runs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, __file__, "--worker", str(model), "--threads",
                           str(threads), "--runs", str(runs)], env=env, capture_output=True,
                          text=True, timeout=2400)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": done.stderr[-600:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="")
    ap.add_argument("--tier", choices=tuple(TIERS), default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--base", type=Path, help="another checkout, run alternating with this one")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.runs)), flush=True)
        return
    trees = [("new", ROOT)] + ([("base", args.base)] if args.base else [])
    for name in args.models.split(","):
        model = TIERS[args.tier] / f"{name}.onnx"
        for pair in range(args.pairs):
            for label, tree in trees if pair % 2 else trees[::-1]:
                print(json.dumps({"model": name, "tree": label, "threads": args.threads,
                                  **spawn(tree, model, args.threads, args.runs)}), flush=True)


if __name__ == "__main__":
    main()
