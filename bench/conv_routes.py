"""The floor of each torch route for one small convolution (+ bias + ReLU), at the small corpus
CNNs' shapes (issue 27): which route a Traced or OneDnnGraph layer's convolution could take.

Usage:
    python bench/conv_routes.py [--threads 1|2] [--blocks 11] [--calls 200] [--only stem,dw]

Per shape, in one process, the routes alternating within each block (median and best block of
``--blocks``; thread CPU us a call at 1 thread, wall us at 2, where thread CPU would hide the
wait for the second thread), the load average printed with each row:

- ``nchw`` / ``cl``: ``F.conv2d`` on a contiguous / channels-last input (torch picks its backend:
  its im2col kernel, Slow2d, for small ungrouped convolutions at one thread; oneDNN, its weight
  reordered at each call, for grouped ones), then ``relu_``;
- ``packed``: ``mkldnn::_convolution_pointwise`` on a weight reordered once, ReLU as its post-op
  (a Traced layer's route from ``conv.TRACED_PACKED_MACS`` and for every grouped convolution);
- ``slow``: ``aten::_slow_conv2d_forward`` (im2col + a product) forced, ungrouped only;
- ``im2col``: ``F.unfold`` then one ``addmm``, ungrouped only;
- ``llga``: the convolution and ReLU traced, frozen and compiled by oneDNN Graph: one partition
  (what a OneDnnGraph layer's convolution costs, the partition's own fixed cost included);
- ``ts``: the same trace frozen without the fuser (TorchScript's interpreter, torch's conv2d).

Where a OneDnnGraph ends in a Linear on a pooled vector (resnet_basic_ts16, mobilenet_dw_ts13),
``--linear`` also times that Linear as its own oneDNN Graph partition against TorchScript's
``aten::linear`` (pool, flatten and product traced either way).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {  # name: (C, H, W, K, kernel, stride, pad, groups): the corpus CNNs' small tier
    "stem": (3, 32, 32, 16, 5, 2, 2, 1),  # resnet_basic_ts16's first
    "block": (16, 8, 8, 16, 3, 1, 1, 1),  # its basic block's
    "down": (16, 8, 8, 32, 3, 2, 1, 1),
    "deep": (32, 4, 4, 32, 3, 1, 1, 1),
    "shortcut": (16, 8, 8, 32, 1, 2, 0, 1),
    "dw": (32, 16, 16, 32, 3, 1, 1, 32),  # mobilenet_dw_ts13's depthwise
    "pw": (32, 16, 16, 64, 1, 1, 0, 1),  # and pointwise
    "det_stem": (3, 32, 32, 16, 3, 2, 1, 1),  # detect_nms_ts14's
    "det_dw": (24, 8, 8, 24, 3, 1, 1, 24),
}


def timed(routes: dict[str, Callable[[], object]], blocks: int, calls: int,
          threads: int) -> dict[str, tuple[float, float]]:
    """Median and best block, us a call, of each route, the routes alternating in each block."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    for run in routes.values():
        for _ in range(10):
            run()
    found: dict[str, list[float]] = {name: [] for name in routes}
    for _ in range(blocks):
        for name, run in routes.items():
            start = clock()
            for _ in range(calls):
                run()
            found[name].append((clock() - start) / calls * 1e6)
    return {name: (sorted(v)[len(v) // 2], min(v)) for name, v in found.items()}


def compiled(module: torch.nn.Module, x: torch.Tensor, fuse: bool) -> Callable[[], object]:
    """``module`` traced and frozen (compiled by oneDNN Graph where ``fuse``), warmed up."""
    torch.jit.enable_onednn_fusion(fuse)
    try:
        frozen = torch.jit.freeze(torch.jit.trace(module.eval(), x))
        for _ in range(3):  # profiled, then compiled
            frozen(x)
    finally:
        torch.jit.enable_onednn_fusion(False)
    return lambda: frozen(x)


class Conv(torch.nn.Module):
    def __init__(self, weight, bias, stride, pad, groups) -> None:
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
        self.stride, self.pad, self.groups = stride, pad, groups

    def forward(self, x):
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.pad, 1, self.groups)
        return torch.relu(y)


def routes(c, h, w, k, kernel, stride, pad, groups) -> dict[str, Callable[[], object]]:
    cl = torch.channels_last
    weight, bias = torch.randn(k, c // groups, kernel, kernel), torch.randn(k)
    x = torch.randn(1, c, h, w)
    xc, wc = x.contiguous(memory_format=cl), weight.contiguous(memory_format=cl)
    packed = torch.ops.mkldnn._reorder_convolution_weight(weight, [pad] * 2, [stride] * 2, [1, 1],
                                                          groups, [1, c, h, w])
    pointwise = torch.ops.mkldnn._convolution_pointwise
    found = {
        "nchw": lambda: torch.relu_(F.conv2d(x, weight, bias, stride, pad, 1, groups)),
        "cl": lambda: torch.relu_(F.conv2d(xc, wc, bias, stride, pad, 1, groups)),
        "packed": lambda: pointwise(xc, packed, bias, [pad] * 2, [stride] * 2, [1, 1], groups,
                                    "relu", [], None)}
    if groups == 1:
        size = [kernel] * 2
        found["slow"] = lambda: torch.relu_(torch.ops.aten._slow_conv2d_forward(
            x, weight, size, bias, [stride] * 2, [pad] * 2))
        rows = weight.reshape(k, -1)
        out = [(n + 2 * pad - kernel) // stride + 1 for n in (h, w)]
        found["im2col"] = lambda: torch.relu_(torch.addmm(
            bias[:, None], rows, F.unfold(x, kernel, 1, pad, stride)[0])).view(1, k, *out)
    module = Conv(weight, bias, stride, pad, groups)
    found["llga"] = compiled(module, xc, True)
    found["ts"] = compiled(module, xc, False)
    return found


class Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = torch.nn.Parameter(torch.randn(10, 32)), torch.nn.Parameter(
            torch.randn(10))

    def forward(self, x):
        return F.linear(F.adaptive_avg_pool2d(x, 1).flatten(1), self.weight, self.bias)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=11)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--only", default="")
    parser.add_argument("--linear", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # TorchScript's deprecation
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    unit = "thread CPU" if args.threads == 1 else "wall"
    print(f"threads {args.threads}, {unit} us a call, median / best of {args.blocks} blocks "
          f"of {args.calls}, routes alternating")
    names = args.only.split(",") if args.only else list(SHAPES)
    for name in names:
        got = timed(routes(*SHAPES[name]), args.blocks, args.calls, args.threads)
        cells = "  ".join(f"{route} {m:.1f}/{b:.1f}" for route, (m, b) in got.items())
        print(f"{name:9s} {cells}  (load {os.getloadavg()[0]:.1f})")
    if args.linear:
        x = torch.randn(1, 32, 4, 4).contiguous(memory_format=torch.channels_last)
        got = timed({"llga": compiled(Head(), x, True), "ts": compiled(Head(), x, False)},
                    args.blocks, args.calls, args.threads)
        cells = "  ".join(f"{route} {m:.1f}/{b:.1f}" for route, (m, b) in got.items())
        print(f"{'linear':9s} {cells}  (load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
