"""The runtime's own cost per layer: a chain of N Adds on 1-element tensors, where the kernels cost
almost nothing and what is left is the run loop (and each backend's per-call cost).

Usage:
    python bench/bench_overhead.py [--layers 500] [--runs 300] [--backends CpuRef --backends CpuAcc,CpuRef]

Each configuration runs in a process of its own (ONNX Runtime's spinning threads would slow whatever
shares its process). Per configuration, the median wall time of one ``run`` of a 1-layer chain and of
an N-layer chain; the cost per layer is their difference over N - 1. ONNX Runtime's ``run`` on the same
models is printed for comparison (``--no-ort`` leaves it out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def chain(n: int) -> onnx.ModelProto:
    nodes = [helper.make_node("Add", [f"t{i}", "one"], [f"t{i + 1}"], name=f"add{i}") for i in range(n)]
    graph = helper.make_graph(
        nodes, f"chain{n}", [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, [1])],
        [numpy_helper.from_array(np.ones(1, np.float32), "one")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def worker(runtime: str, layers: int, runs: int) -> dict[str, float]:
    feeds = {"t0": np.zeros(1, np.float32)}
    medians = {}
    for n in (1, layers):
        if runtime == "onnxruntime":
            import onnxruntime as ort

            options = ort.SessionOptions()
            options.intra_op_num_threads = 1
            session = ort.InferenceSession(chain(n).SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
        else:
            import backplane
            from backplane.runtime.runtime import Runtime, RuntimeOptions

            options = RuntimeOptions(backend_options={"CpuAcc.threads": 1})
            session = backplane.InferenceSession(chain(n), backends=runtime.split(","),
                                                 runtime=Runtime(options))
        for _ in range(20):
            session.run(None, feeds)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(None, feeds)
            times.append(time.perf_counter() - start)
        medians[str(n)] = statistics.median(times)
    return medians


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=500)
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--backends", action="append", default=[])
    ap.add_argument("--no-ort", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.layers, args.runs)))
        return 0
    from rich.console import Console
    from rich.table import Table

    runtimes = args.backends or ["CpuRef", "CpuAcc,CpuRef"]
    runtimes += [] if args.no_ort else ["onnxruntime"]
    table = Table(title=f"run-time cost per layer: a chain of {args.layers} Adds on 1-element tensors",
                  caption="per layer = (chain of N - chain of 1) / (N - 1); medians of "
                          f"{args.runs} runs")
    for column in ("runtime", "1 layer µs", f"{args.layers} layers µs", "per layer µs"):
        table.add_column(column, justify="left" if column == "runtime" else "right")
    for runtime in runtimes:
        done = subprocess.run([sys.executable, __file__, "--worker", runtime, "--layers",
                               str(args.layers), "--runs", str(args.runs)],
                              capture_output=True, text=True)
        if done.returncode:
            table.add_row(runtime, "failed", "", done.stderr.strip().splitlines()[-1][:60])
            continue
        medians = json.loads(done.stdout.strip().splitlines()[-1])
        one, many = medians["1"], medians[str(args.layers)]
        table.add_row(runtime if runtime == "onnxruntime" else f"backplane[{runtime}]",
                      f"{one * 1e6:.1f}", f"{many * 1e6:.1f}",
                      f"{(many - one) / (args.layers - 1) * 1e6:.2f}")
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
