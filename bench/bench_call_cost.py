"""The fixed cost of one convolution call: ONNX Runtime's per-node cost against oneDNN's through
PyTorch (what CpuAcc's FusedConv calls), on a tensor so small that the arithmetic is negligible.

Usage:
    python bench/bench_call_cost.py [--threads 2] [--convs 100]

ONNX Runtime: (a chain of N 1x1 Convs on 1x8x4x4 - a chain of 1) / (N - 1). PyTorch:
``torch.ops.mkldnn._convolution_pointwise`` (prepacked weight, channels-last input) and
``F.conv2d`` on the same tensor. Medians; each runtime in a process of its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--convs", type=int, default=100)
    ap.add_argument("--worker", choices=("ort", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args()
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
