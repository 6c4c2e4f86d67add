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
- ``wave`` (stacked forward GRUs): every layer's step at once by wavefronts, CpuAcc's
  ``GruStack`` (``kernels/recurrent_stack.py``, what gru_tm3_ts13 runs), traced and frozen.

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


def _stack(torch: Any, weights: list) -> Callable[[Any, Any], Any]:
    """Stacked forward GRUs (linear_before_reset=1) as CpuAcc's GruStack runs them: every layer's
    step of a wavefront at once (``kernels/recurrent_stack.py``), the last layer's Y."""
    from backplane.backends.torch.kernels.recurrent_stack import GruStack

    stack = GruStack([tuple(t.numpy() for t in layer) for layer in weights])
    return lambda x, zeros: stack(x, None, [h.unsqueeze(0) for h in zeros.unbind(0)])[0]


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
                torch, _stack(torch, weights), x, zeros)}
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
