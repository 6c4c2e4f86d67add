"""What making every output the caller's own costs (issue 32, item 2): per corpus model and backend
list, how many outputs ``runtime.ownership.owned`` copies and the time it takes beside the run.

    python bench/ownership.py [--backends CpuRef "CpuAcc,CpuRef"] [--runs 20]

For each model of tests/data/corpus at its first size: the network's own outputs (``execute``) are
taken, then ``owned`` is timed on them (a fresh list per call, as a run hands it over) against the
median run. Prints the CPU, versions, and per model: outputs, copied, bytes copied, owned() us,
run ms and owned / run."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import backplane  # noqa: E402
from backplane.runtime.ownership import owned  # noqa: E402

CORPUS = ROOT / "tests" / "data" / "corpus"


def measure(path: Path, backends: list[str], runs: int) -> dict:
    session = backplane.InferenceSession(path, backends=backends)
    feed = dict(np.load(str(path).replace(".onnx", ".s0.npz")))
    loaded = session.runtime.network(session.network_id)
    values = [feed[name] for name in loaded.network.input_names]
    times, costs, copied, nbytes = [], [], 0, 0
    for _ in range(runs):
        start = time.perf_counter()
        raw = loaded.execute(values)
        middle = time.perf_counter()
        mine = owned(raw, values, loaded.held)
        times.append(middle - start)
        costs.append(time.perf_counter() - middle)
        copied = sum(a is not b for a, b in zip(raw, mine))
        nbytes = sum(int(b.nbytes) for a, b in zip(raw, mine) if a is not b)
        del raw, mine
    run, cost = statistics.median(times), statistics.median(costs)
    return {"outputs": len(loaded.output_slots), "copied": copied, "bytes": nbytes,
            "owned_us": cost * 1e6, "run_ms": run * 1e3, "share": cost / run}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["CpuRef", "CpuAcc,CpuRef"])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, numpy {np.__version__}, "
          f"backplane {backplane.__version__}, python {platform.python_version()}")
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    for column in args.backends:
        print(f"\n{column}\n{'model':28} outs copied    bytes  owned_us   run_ms   share")
        for name, entry in manifest.items():
            try:
                row = measure(CORPUS / entry["file"], column.split(","), args.runs)
            except Exception as exc:  # noqa: BLE001  # a model that does not run: said, not timed
                print(f"{name:28} {type(exc).__name__}: {str(exc)[:60]}")
                continue
            print(f"{name:28} {row['outputs']:4} {row['copied']:6} {row['bytes']:8} "
                  f"{row['owned_us']:9.1f} {row['run_ms']:8.3f} {row['share']:7.2%}")


if __name__ == "__main__":
    main()
