"""The fixed cost of one convolution call: ONNX Runtime's per-node cost against oneDNN's through
PyTorch (what CpuAcc's FusedConv calls), on a tensor so small that the arithmetic is negligible;
and with ``--floor``, the cost of a call itself: ``session.run`` of a lone Relu on (1, 64)
float32, ONNX Runtime (1 intra-op thread), backplane's CpuRef and CpuAcc,CpuRef (default
options), each in a process of its own, alternating over ``--blocks``; per runtime the median
over the blocks of each process's best of 7 x ``--calls`` calls, in wall time and in the calling
thread's CPU time (steadier on a busy machine), with the load average.

Usage:
    python bench/bench_call_cost.py [--threads 2] [--convs 100]
    python bench/bench_call_cost.py --floor [--blocks 8] [--calls 5000]

ONNX Runtime: (a chain of N 1x1 Convs on 1x8x4x4 - a chain of 1) / (N - 1). PyTorch:
``torch.ops.mkldnn._convolution_pointwise`` (prepacked weight, channels-last input) and
``F.conv2d`` on the same tensor. Medians; each runtime in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np


def _median_us(call, runs: int = 2000) -> float:
    for _ in range(200):
        call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def ort_worker(threads: int, convs: int) -> dict[str, float]:
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    def chain(n: int) -> bytes:
        w = numpy_helper.from_array(np.random.default_rng(0).random((8, 8, 1, 1), np.float32), "w")
        nodes = [helper.make_node("Conv", [f"t{i}", "w"], [f"t{i + 1}"]) for i in range(n)]
        info = [helper.make_tensor_value_info(f"t{i}", TensorProto.FLOAT, [1, 8, 4, 4]) for i in (0, n)]
        model = helper.make_model(helper.make_graph(nodes, "chain", [info[0]], [info[1]], [w]),
                                  opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return model.SerializeToString()

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    feeds = {"t0": np.random.default_rng(1).random((1, 8, 4, 4), np.float32)}
    one, many = (ort.InferenceSession(chain(n), options, providers=["CPUExecutionProvider"])
                 for n in (1, convs))
    t1, tn = _median_us(lambda: one.run(None, feeds)), _median_us(lambda: many.run(None, feeds), 300)
    return {"onnxruntime Conv node": (tn - t1) / (convs - 1)}


def torch_worker(threads: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    x = torch.rand(1, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    w, b = torch.rand(8, 8, 1, 1), torch.zeros(8)
    packed = torch.ops.mkldnn._reorder_convolution_weight(w, [0, 0], [1, 1], [1, 1], 1, [1, 8, 4, 4])
    pointwise = torch.ops.mkldnn._convolution_pointwise
    return {
        "torch.ops.mkldnn._convolution_pointwise": _median_us(
            lambda: pointwise(x, packed, b, [0, 0], [1, 1], [1, 1], 1, "none", [], None)),
        "torch F.conv2d": _median_us(lambda: F.conv2d(x, w, b)),
    }


def floor_worker(runtime: str, calls: int) -> dict[str, float]:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    data = model.SerializeToString()
    if runtime == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session: Any = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
    else:
        import backplane

        session = backplane.InferenceSession(data, backends=runtime.split(","))
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)}
    run = session.run
    for _ in range(2000):
        run(None, feeds)
    wall, cpu = [], []
    for _ in range(7):
        start, used = time.perf_counter(), time.thread_time()
        for _ in range(calls):
            run(None, feeds)
        wall.append((time.perf_counter() - start) / calls * 1e6)
        cpu.append((time.thread_time() - used) / calls * 1e6)
    return {"wall": min(wall), "cpu": min(cpu)}


def floor(blocks: int, calls: int) -> None:
    got: dict[str, list[dict[str, float]]] = {r: [] for r in FLOOR_RUNTIMES}
    loads = []
    for _ in range(blocks):
        for runtime in FLOOR_RUNTIMES:
            done = subprocess.run([sys.executable, __file__, "--floor-worker", runtime,
                                   "--calls", str(calls)], capture_output=True, text=True,
                                  check=True)
            got[runtime].append(json.loads(done.stdout.strip().splitlines()[-1]))
            loads.append(os.getloadavg()[0])
    print(f"session.run of a lone Relu, median over {blocks} blocks of the best of 7 x {calls} "
          f"calls; load average {min(loads):.2f}-{max(loads):.2f}")
    for runtime, rows in got.items():
        wall = statistics.median(r["wall"] for r in rows)
        cpu = statistics.median(r["cpu"] for r in rows)
        print(f"{runtime:<14} {wall:7.2f} us wall  {cpu:7.2f} us thread CPU")


FLOOR_RUNTIMES = ("onnxruntime", "CpuRef", "CpuAcc,CpuRef")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--convs", type=int, default=100)
    ap.add_argument("--worker", choices=("ort", "torch"), help=argparse.SUPPRESS)
    ap.add_argument("--floor", action="store_true", help="the cost of session.run itself")
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--floor-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.floor_worker:
        print(json.dumps(floor_worker(args.floor_worker, args.calls)))
        return 0
    if args.floor:
        floor(args.blocks, args.calls)
        return 0
    if args.worker:
        result = ort_worker(args.threads, args.convs) if args.worker == "ort" else \
            torch_worker(args.threads)
        print(json.dumps(result))
        return 0
    for worker in ("ort", "torch"):
        done = subprocess.run([sys.executable, __file__, "--worker", worker, "--threads",
                               str(args.threads), "--convs", str(args.convs)],
                              capture_output=True, text=True, check=True)
        for name, us in json.loads(done.stdout.strip().splitlines()[-1]).items():
            print(f"{name:<42} {us:7.1f} us per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
