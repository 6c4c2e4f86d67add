"""What a small stacked recurrent net costs by each torch route, whole (issue 27): the floor under
the corpus's recurrent rows (gru_bi2_dyn19, lstm_bi2_*, gru_tm3_ts13), where ONNX Runtime runs a
whole 2-layer bidirectional net in 60-100 us and backplane's cost is per call and per op.

Usage:
    python bench/recurrent_floor.py                  # the corpus's three nets, 1 thread
    python bench/recurrent_floor.py --threads 2 --cases lstm:8:16:24:2:bidirectional

Each case is ``op:steps:input:hidden:layers:direction`` (op ``gru``, linear_before_reset=1, or
``lstm``), batch 1. The layers are stacked as torch's exporters write them (each layer's Y
(seq, dirs, batch, hidden) made (seq, batch, dirs * hidden) for the next). Routes, each on the
same ONNX weights:

- ``stepped``: CpuAcc's kernels (``recurrent.gru`` / ``lstm``) with the stepped ops forced
  (``_reset_first``, ``_lstm_steps``), the net traced and frozen: what the corpus rows run;
- ``fused``: the same with torch's fused kernel forced (torch.gru paired where CpuAcc pairs it,
  oneDNN's LSTM), traced and frozen;
- ``net``: torch's fused kernel for every layer in one call (``num_layers``), traced and frozen;
- ``cells``: ``torch.gru_cell`` / ``lstm_cell`` a step and direction, traced and frozen;
- ``packed`` (LSTM): eager, ``recurrent_packed.lstm`` a layer (weights reordered once);
- ``module``: eager ``torch.nn.GRU`` / ``LSTM`` under inference_mode (a user's floor);
- ``wave`` (stacked forward GRUs): every layer's step at once by wavefronts (``_wavefronts``),
  traced and frozen: a prototype, not a CpuAcc route.

The routes alternate in blocks of calls in one process; thread CPU us a call (p10 and median over
the blocks), the median of the per-block ratios to the first route (``stepped``; below 1: faster
than it) and the largest difference of the last layer's Y from its.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

CASES = "gru:8:12:20:2:bidirectional,lstm:8:16:24:2:bidirectional,gru:8:12:20:3:forward"
ROUTES = "stepped,fused,net,cells,packed,module,wave"


def _weights(torch: Any, op: str, steps: int, inputs: int, hidden: int, layers: int,
             dirs: int) -> tuple[list[tuple[Any, Any, Any]], Any]:
    """Per layer ONNX's W, R, B (recurrent weights small enough not to be chaotic), and x."""
    gates = 4 if op == "lstm" else 3
    generator = torch.Generator().manual_seed(0)
    weights, width = [], inputs
    for _ in range(layers):
        weights.append((torch.randn(dirs, gates * hidden, width, generator=generator) * 0.3,
                        torch.randn(dirs, gates * hidden, hidden, generator=generator) * 0.3,
                        torch.randn(dirs, 2 * gates * hidden, generator=generator) * 0.3))
        width = dirs * hidden
    return weights, torch.randn(steps, 1, inputs, generator=generator)


def _frozen(torch: Any, function: Callable[[Any, Any], Any], x: Any,
            zeros: Any) -> Callable[[], Any]:
    """``function(x, zeros)`` traced and frozen. The initial states are an input of the trace: a
    frozen trace of ``torch.gru_cell`` on a constant state computes the state's product once and
    then updates that constant in place (``add_``, ``sigmoid_``), a wrong value from the second
    call on (torch 2.13)."""
    class Net(torch.nn.Module):
        def forward(self, x: Any, zeros: Any) -> Any:
            return function(x, zeros)

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the tracer's warnings
        frozen = torch.jit.freeze(torch.jit.trace(Net().eval(), [x, zeros], check_trace=False))
    return lambda: frozen(x, zeros)


def _kernels(torch: Any, op: str, weights: list, direction: str, stepped: bool) -> Callable:
    """The net by CpuAcc's kernels, their route forced while traced."""
    from backplane.backends.torch.kernels import recurrent

    def net(x: Any, zeros: Any) -> Any:
        dirs = weights[0][0].shape[0]
        for layer, (w, r, b) in enumerate(weights):
            h0 = zeros[layer * dirs:(layer + 1) * dirs]
            if op == "lstm":
                y = recurrent.lstm(x, w, r, b, None, h0, h0, direction=direction)[0]
            else:
                y = recurrent.gru(x, w, r, b, None, h0, direction=direction,
                                  linear_before_reset=1)[0]
            x = y.permute(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
        return x

    def traced(x: Any, zeros: Any) -> Callable[[], Any]:
        rule = "_stepped_lstm" if op == "lstm" else "_stepped_reset"
        kept = getattr(recurrent, rule)
        setattr(recurrent, rule, lambda *a: stepped and torch.jit.is_tracing())
        try:
            return _frozen(torch, net, x, zeros)
        finally:
            setattr(recurrent, rule, kept)
    return traced


def _torch_params(op: str, weights: list) -> list[list[Any]]:
    """Per layer torch's weight list (w_ih, w_hh, b_ih, b_hh a direction), torch's gate order."""
    from backplane.backends.torch.kernels import recurrent, recurrent_fused

    order = recurrent.LSTM_ORDER if op == "lstm" else recurrent.GRU_ORDER
    return [recurrent_fused.params_of(w, r, b, order) for w, r, b in weights]


def _wavefronts(torch: Any, weights: list, steps: int, hidden: int) -> Callable[[Any, Any], Any]:
    """Stacked forward GRUs (linear_before_reset=1) by wavefronts: at wavefront k every layer l
    takes its step k - l at once, one ``baddbmm`` for all layers of ``[u_l, h_l]`` (u_l the layer
    below's state, zero for the first, whose input projection is made before the loop) by
    ``[[W_zr, W_h, 0], [R_zr, 0, R_h]]``, then five ops a wavefront for all layers: steps + layers
    - 1 wavefronts, not steps x layers. A layer not started or finished keeps its state: its z
    gate's bias is +100 there (sigmoid 1.0, ``lerp`` to h exactly). The zero blocks meet only
    states (bounded, or NaN where the reference's are too). The states live in one buffer
    (wavefront, layer, hidden) that the last layer's Y is a view of. A prototype for the corpus's
    gru_tm3_ts13 (three such layers), not a CpuAcc route."""
    layers, width = len(weights), weights[0][0].shape[-1]
    waves = steps + layers - 1
    blocks = torch.zeros(layers, 2 * hidden, 4 * hidden)
    bias = torch.zeros(waves, layers, 4 * hidden)
    for layer, (w, r, b) in enumerate(weights):  # ONNX's gates z, r, h
        w, r, b = w[0], r[0], b[0]
        if layer:
            blocks[layer, :hidden, :3 * hidden] = w.t()
        blocks[layer, hidden:, :2 * hidden] = r[:2 * hidden].t()
        blocks[layer, hidden:, 3 * hidden:] = r[2 * hidden:].t()
        bias[:, layer] = torch.cat([b[:2 * hidden] + b[3 * hidden:5 * hidden],
                                    b[2 * hidden:3 * hidden], b[5 * hidden:]])
        idle = [k for k in range(waves) if not 0 <= k - layer < steps]
        bias[idle, layer, :hidden] += 100.0
    first = torch.cat([weights[0][0][0], torch.zeros(hidden, width)])  # (4 hidden, input)

    def run(x: Any, zeros: Any) -> Any:
        a = bias.clone()
        a[:steps, 0] += torch.nn.functional.linear(x[:, 0], first)
        a = a.unsqueeze(2).unbind(0)  # (layers, 1, 4 hidden) a wavefront
        states = x.new_zeros(waves + 1, layers + 1, hidden)
        states[0, 1:] = zeros[:, 0]
        pairs = states.as_strided((waves, layers, 1, 2 * hidden),
                                  ((layers + 1) * hidden, hidden, 2 * hidden, 1)).unbind(0)
        before = states[:waves, 1:].unsqueeze(2).unbind(0)
        after = states[1:, 1:].unsqueeze(2).unbind(0)
        gates = x.new_empty(layers, 1, 4 * hidden)
        zr, x_h, r_h = gates.split([2 * hidden, hidden, hidden], -1)
        z, r = zr.chunk(2, -1)
        for k in range(waves):
            torch.baddbmm(a[k], pairs[k], blocks, out=gates)
            zr.sigmoid_()
            n = torch.addcmul(x_h, r, r_h).tanh_()
            torch.lerp(n, before[k], z, out=after[k])
        return states[layers:, layers].unsqueeze(1)  # the last layer's Y (seq, 1, hidden)
    return run


def _routes(torch: Any, op: str, steps: int, inputs: int, hidden: int, layers: int,
            direction: str, names: list[str]) -> dict[str, Callable[[], Any]]:
    """Each route of ``names`` as a call of the net on one input (``packed``: LSTM only)."""
    bidirectional = direction == "bidirectional"
    dirs = 2 if bidirectional else 1
    weights, x = _weights(torch, op, steps, inputs, hidden, layers, dirs)
    params = _torch_params(op, weights)
    flat = [p for layer in params for p in layer]
    zeros = torch.zeros(layers * dirs, 1, hidden)
    kernel = torch.lstm if op == "lstm" else torch.gru

    def net(x: Any, zeros: Any) -> Any:
        state = (zeros, zeros) if op == "lstm" else zeros
        return kernel(x, state, flat, True, layers, 0.0, False, bidirectional, False)[0]

    def cells(x: Any, zeros: Any) -> Any:
        cell = torch.lstm_cell if op == "lstm" else torch.gru_cell
        for layer in params:
            ys = []
            for d in range(dirs):
                carried = (zeros[0], zeros[0]) if op == "lstm" else zeros[0]
                out = [None] * steps
                for t in (range(steps - 1, -1, -1) if d else range(steps)):
                    carried = cell(x[t], carried, *layer[4 * d:4 * d + 4])
                    out[t] = carried[0] if op == "lstm" else carried
                ys.append(torch.stack(out))
            x = torch.cat(ys, -1)
        return x

    def packed() -> Any:
        from backplane.backends.torch.kernels import recurrent_packed

        y = x
        with torch.no_grad():
            for layer in params:
                y = recurrent_packed.lstm(y, [zeros[:dirs], zeros[:dirs]], layer, True,
                                          bidirectional, False)[0]
        return y

    module = (torch.nn.LSTM if op == "lstm" else torch.nn.GRU)(
        inputs, hidden, num_layers=layers, bidirectional=bidirectional).eval()
    with torch.no_grad():
        for got, value in zip(module.parameters(), flat):
            got.copy_(value)

    def eager() -> Any:
        with torch.inference_mode():
            return module(x)[0]

    made = {"stepped": lambda: _kernels(torch, op, weights, direction, True)(x, zeros),
            "fused": lambda: _kernels(torch, op, weights, direction, False)(x, zeros),
            "net": lambda: _frozen(torch, net, x, zeros),
            "cells": lambda: _frozen(torch, cells, x, zeros),
            "packed": lambda: packed if op == "lstm" else None, "module": lambda: eager,
            "wave": lambda: None if op == "lstm" or bidirectional or layers < 2 else _frozen(
                torch, _wavefronts(torch, weights, steps, hidden), x, zeros)}
    routes = {name: made[name]() for name in names}
    return {name: route for name, route in routes.items() if route is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--routes", default=ROUTES)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.03, help="about this long a block")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    names = args.routes.split(",")
    print(f"threads {args.threads}, torch {torch.__version__}; thread CPU us a call, p10 / "
          f"median over {args.blocks} blocks; ratio: median per-block ratio to {names[0]}")
    for case in args.cases.split(","):
        op, steps, inputs, hidden, layers, direction = case.split(":")
        routes = _routes(torch, op, int(steps), int(inputs), int(hidden), int(layers), direction,
                         names)
        first = routes[names[0]]()
        calls = {}
        for name, route in routes.items():
            start = time.perf_counter()
            route()
            calls[name] = max(1, int(args.seconds / max(time.perf_counter() - start, 1e-6)))
        times: dict[str, list[float]] = {name: [] for name in routes}
        for block in range(args.blocks):
            for name in list(routes)[::1 if block % 2 == 0 else -1]:
                begun = time.thread_time()
                for _ in range(calls[name]):
                    routes[name]()
                times[name].append((time.thread_time() - begun) / calls[name] * 1e6)
        print(f"\n{case} (load {os.getloadavg()[0]:.1f})\n| route | us p10 / median | ratio | "
              f"diff |\n| --- | ---: | ---: | ---: |")
        for name, kept in times.items():
            ratio = statistics.median(b / a for a, b in zip(times[names[0]], kept))
            diff = float((routes[name]().reshape(first.shape) - first).abs().max())
            print(f"| {name} | {sorted(kept)[len(kept) // 10]:.0f} / "
                  f"{statistics.median(kept):.0f} | {ratio:.3f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
