"""CpuAcc's partitions compiled by TorchInductor (``CpuAcc.compile=inductor``) against CpuAcc's
default routes (oneDNN Graph, frozen TorchScript traces), model by model, in one process.

```
python bench/inductor_routes.py --models gpt_causal_ts15,resnet_basic_ts16 [--tier full]
    [--threads 1|2] [--blocks 10] [--runs 50]
```

For each model: a default session and an "inductor" one (its load time is inductor's compile:
cold where ``TORCHINDUCTOR_CACHE_DIR`` is empty), their outputs against CpuRef's (the worst over
outputs of max|diff| / max|CpuRef|) on both corpus samples, the count of NaN in the first output
with one NaN in the first float input (CpuRef's / inductor's / default's), then ``--blocks``
blocks of ``--runs`` runs of each, alternating which goes first. At 1 thread a run is timed in
the calling thread's CPU time (``time.thread_time``: a busy machine's preemptions left out), at 2
in wall time. One JSON line a model: the medians of the blocks, the median of the per-block
ratios inductor / default (below 1: inductor faster), the load average. The machine's crowding
check is off (``threads.CROWDED_CHECK``), so both sessions take the routes a quiet machine would.
A subgraph with convolutions or recurrent layers keeps CpuAcc's own route under "inductor"
(``inductor.CONVOLUTIONS``, ``RECURRENT``): a CNN measures the same route twice here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TIERS = {"small": ROOT / "tests" / "data" / "corpus",
         "full": Path.home() / ".cache" / "backplane" / "corpus-full"}


def _worst(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    worst = 0.0
    for g, w in zip(got, want):
        if w.dtype.kind == "f" and w.size:
            scale = float(np.nanmax(np.abs(w))) or 1.0
            worst = max(worst, float(np.nanmax(np.abs(g - w))) / scale)
    return worst


def _nan_counts(sessions: list, feeds: dict[str, np.ndarray]) -> list[int] | None:
    name = next((k for k, v in feeds.items() if v.dtype.kind == "f"), None)
    if name is None:
        return None
    poisoned = {k: v.copy() for k, v in feeds.items()}
    poisoned[name].flat[0] = np.nan
    return [int(np.isnan(s.run(None, poisoned)[0]).sum()) for s in sessions]


def bench(path: Path, threads: int, blocks: int, runs: int) -> dict[str, object]:
    from backplane import InferenceSession
    from backplane.backends.torch import threads as torch_threads

    torch_threads.CROWDED_CHECK = False
    feeds = [dict(np.load(path.with_suffix(f".s{i}.npz"))) for i in (0, 1)]
    default = InferenceSession(str(path), backends=[("CpuAcc", {"threads": threads}), "CpuRef"])
    default.run(None, feeds[0])
    start = time.perf_counter()
    compiled = InferenceSession(str(path), backends=[
        ("CpuAcc", {"threads": threads, "compile": "inductor"}), "CpuRef"])
    compiled.run(None, feeds[0])  # a partition of free dimensions compiles at its first run
    load = time.perf_counter() - start
    reference = InferenceSession(str(path), backends=["CpuRef"])
    diffs = [[_worst(s.run(None, f), reference.run(None, f)) for s in (compiled, default)]
             for f in feeds]
    nans = _nan_counts([reference, compiled, default], feeds[0])
    clock = time.thread_time if threads == 1 else time.perf_counter
    times: dict[str, list[float]] = {"default": [], "inductor": []}
    pair = [("default", default), ("inductor", compiled)]
    for _ in range(3):
        for _, session in pair:
            session.run(None, feeds[0])
    for block in range(blocks):
        for name, session in pair if block % 2 == 0 else pair[::-1]:
            begin = clock()
            for _ in range(runs):
                session.run(None, feeds[0])
            times[name].append((clock() - begin) / runs * 1e6)
    ratios = [i / d for i, d in zip(times["inductor"], times["default"])]
    return {"model": path.stem, "threads": threads, "clock": clock.__name__,
            "default_us": round(statistics.median(times["default"]), 1),
            "inductor_us": round(statistics.median(times["inductor"]), 1),
            "ratio": round(statistics.median(ratios), 3), "inductor_load_s": round(load, 1),
            "diff_vs_cpuref_s0_s1": diffs, "nan_cpuref_inductor_default": nans,
            "loadavg": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True)
    ap.add_argument("--tier", choices=sorted(TIERS), default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args(argv)
    for name in args.models.split(","):
        path = TIERS[args.tier] / f"{name}.onnx"
        print(json.dumps(bench(path, args.threads, args.blocks, args.runs)), flush=True)


if __name__ == "__main__":
    sys.exit(main())
