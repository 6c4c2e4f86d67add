"""The least a GpuAcc whole run can take (issue 28): NumPy in, one CUDA graph of N small kernels
with its copies, NumPy out, through the same ``cuda_host.HostGraph`` a one-partition model's
session runs.

Usage (on a machine with a CUDA GPU):
    python bench/gpu_floor.py                       # N = 0, 1, 2, 4, 8, 16, 32, 64
    python bench/gpu_floor.py --kernels 0,16,44 --elements 4096

Why: on the small tier every one-partition model already runs one graph launch and one wait
(bench/gpu_profile.py), so what is left of its time is the host's fixed part (the inputs copied
into page-locked memory, the replay's launch, the wait, the outputs copied out) and the graph's
kernels, each a node of one to two microseconds however little it computes. Here each kernel is
an add of one small float32 tensor (``--elements``), so the figures are that floor and the cost
of one more node: a model of K kernels cannot run faster than about ``floor + K * node`` on this
GPU, whatever its kernels compute, and a model ONNX Runtime runs in less on two CPU cores can only
be won by fewer kernels, not faster ones.

Per N: the median wall time of a call (``HostGraph.__call__``: copies in, replay, wait, the
output buffer; ``--calls`` of them after a warm-up), and the median GPU time of a replay (CUDA
events around it, the input copy and the output kernel included). Then the least-squares line
through the calls' medians: the floor (N = 0: its copies and the output kernel) and the cost of
a kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def chain(count: int):  # noqa: ANN201 - a torch-free module: the type is torch's
    """``count`` kernels over one input, each reading the last one's output: N nodes in order."""
    def layers(x):  # noqa: ANN001, ANN202
        y = x
        for _ in range(count):
            y = y + 1.0
        return [y if count else x]
    return layers


def timed(count: int, elements: int, calls: int) -> tuple[float, float]:
    """A call's median wall ms and a replay's median GPU ms for a graph of ``count`` kernels."""
    import torch

    from backplane.backends.torch.cuda_host import HostGraph

    device = torch.device("cuda")
    feed = np.random.default_rng(0).standard_normal(elements).astype(np.float32)
    graph = HostGraph(chain(count), [torch.empty(elements, device=device)], device, [feed])
    for _ in range(50):
        out = graph([feed])
    np.testing.assert_allclose(out[0], feed + count, rtol=1e-6, atol=1e-5)  # it ran the chain
    wall = []
    for _ in range(calls):
        start = time.perf_counter()
        graph([feed])
        wall.append(time.perf_counter() - start)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu = []
    for _ in range(min(calls, 500)):
        np.copyto(graph.host_in[0], feed)
        begin.record()
        graph.graph.replay()
        end.record()
        end.synchronize()
        gpu.append(begin.elapsed_time(end))
    graph.close()
    return statistics.median(wall) * 1e3, statistics.median(gpu)


def line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """The least-squares intercept and slope of (N, ms) points."""
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(xs, ys, 1)
    return float(intercept), float(slope)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", default="0,1,2,4,8,16,32,64",
                    help="comma-separated kernel counts (0,1,2,4,8,16,32,64)")
    ap.add_argument("--elements", type=int, default=1024, help="float32 elements a tensor (1024)")
    ap.add_argument("--calls", type=int, default=3000, help="timed calls per count (3000)")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to time")
        return 0
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.elements} float32 elements, {args.calls} calls a count")
    print("| kernels | call ms (wall, median) | replay ms (GPU, median) |")
    print("| ---: | ---: | ---: |")
    walls, gpus = [], []
    for count in (int(k) for k in args.kernels.split(",")):
        wall, gpu = timed(count, args.elements, args.calls)
        walls.append((count, wall))
        gpus.append((count, gpu))
        print(f"| {count} | {wall:.4f} | {gpu:.4f} |")
    for name, points in (("call (wall)", walls), ("replay (GPU)", gpus)):
        floor, node = line(points)
        print(f"{name}: {floor * 1e3:.1f} us + {node * 1e3:.2f} us a kernel (least squares)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
