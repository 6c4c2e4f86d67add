"""The recurrent layers' routes on CpuAcc against each other, layer by layer (issue 27): what the
thresholds in kernels/recurrent.py were measured with, to measure them again on a quiet machine.

Usage:
    python bench/recurrent_routes.py                      # the default grid, 1 thread
    python bench/recurrent_routes.py --cases lstm:8:16:64:bidirectional,gru:100:64:384:forward

Each case is ``op:steps:input:hidden:direction`` (op ``lstm``, ``gru`` (linear_before_reset=1)
or ``packed``). For lstm and gru, one layer traced and frozen as CpuAcc traces it, twice: torch's
fused kernel forced (oneDNN's LSTM, torch's GRU) and the stepped ops forced
(``recurrent._lstm_steps``, ``_reset_first``); for packed, one eager layer by torch.lstm under grad
mode (what CpuAcc's eager calls were) and by ``recurrent_packed.lstm`` (weights reordered once).
The two alternate in blocks of calls in one process; the table gives thread CPU us a call (p10 and
median over the blocks, load average printed), the median of the per-block ratios (below 1: the
second route is faster) and the largest difference of their outputs. Recurrent weights are scaled
small enough that the layer is not chaotic (at a larger scale rounding grows over the steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

CASES = ("lstm:8:16:32:bidirectional,lstm:8:16:96:bidirectional,lstm:13:16:32:bidirectional,"
         "gru:100:64:256:forward,gru:50:64:384:bidirectional,packed:100:64:128:bidirectional")


def _weights(torch: Any, gates: int, dirs: int, steps: int, inputs: int,
             hidden: int) -> list[Any]:
    """W, R, B, an input and an initial state, the same for both routes of a case."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(dirs, gates * hidden, inputs, generator=generator) * 0.3,
            torch.randn(dirs, gates * hidden, hidden, generator=generator) * 0.03,
            torch.randn(dirs, 2 * gates * hidden, generator=generator) * 0.3,
            torch.randn(steps, 1, inputs, generator=generator),
            torch.randn(dirs, 1, hidden, generator=generator) * 0.5]


def _traced(op: str, steps: int, inputs: int, hidden: int, direction: str,
            stepped: bool) -> Callable[[], Any]:
    """One layer traced and frozen, its route forced by the rule the kernel reads."""
    import torch

    from backplane.backends.torch.kernels import recurrent

    dirs = 2 if direction == "bidirectional" else 1
    w, r, b, x, h0 = _weights(torch, 4 if op == "lstm" else 3, dirs, steps, inputs, hidden)

    class Layer(torch.nn.Module):
        def forward(self, x: Any, h0: Any) -> Any:
            if op == "lstm":
                return recurrent.lstm(x, w, r, b, None, h0, h0, direction=direction)
            return recurrent.gru(x, w, r, b, None, h0, direction=direction, linear_before_reset=1)

    rules = {"lstm": ("_stepped_lstm", lambda *a: stepped and torch.jit.is_tracing()),
             "gru": ("_stepped_reset", lambda *a: stepped and torch.jit.is_tracing())}
    name, rule = rules[op]
    kept = getattr(recurrent, name)
    setattr(recurrent, name, rule)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the tracer's warnings
            frozen = torch.jit.freeze(torch.jit.trace(Layer().eval(), [x, h0], check_trace=False))
    finally:
        setattr(recurrent, name, kept)
    return lambda: frozen(x, h0)[0]


def _packed(steps: int, inputs: int, hidden: int, direction: str,
            packed: bool) -> Callable[[], Any]:
    """One eager layer by torch.lstm (grad mode on) or by recurrent_packed.lstm."""
    import torch

    from backplane.backends.torch.kernels import recurrent_packed

    bidirectional = direction == "bidirectional"
    w, r, b, x, h = _weights(torch, 4, 2 if bidirectional else 1, steps, inputs, hidden)
    params = []
    for d in range(w.shape[0]):
        params += [w[d], r[d], *b[d].chunk(2)]
    if packed:
        return lambda: recurrent_packed.lstm(x, [h, h], params, True, bidirectional, False)[0]
    return lambda: torch.lstm(x, [h, h], params, True, 1, 0.0, False, bidirectional, False)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.05, help="about this long a block")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(f"| case | first route us p10 / median | second us p10 / median | median ratio | "
          f"diff | load |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for case in args.cases.split(","):
        op, steps, inputs, hidden, direction = case.split(":")
        sizes = (int(steps), int(inputs), int(hidden), direction)
        if op == "packed":
            routes = [_packed(*sizes, False), _packed(*sizes, True)]
        else:
            routes = [_traced(op, *sizes, False), _traced(op, *sizes, True)]
        diff = float((routes[0]() - routes[1]()).abs().max())
        start = time.perf_counter()
        routes[0]()
        calls = max(1, int(args.seconds / max(time.perf_counter() - start, 1e-6)))
        times: list[list[float]] = [[], []]
        for _ in range(args.blocks):
            for kept, route in zip(times, routes):
                begun = time.thread_time()
                for _ in range(calls):
                    route()
                kept.append((time.thread_time() - begun) / calls * 1e6)
        ratio = statistics.median(b / a for a, b in zip(*times))
        cells = [f"{sorted(t)[len(t) // 10]:.0f} / {statistics.median(t):.0f}" for t in times]
        print(f"| {case} | {cells[0]} | {cells[1]} | {ratio:.3f} | {diff:.1e} | "
              f"{os.getloadavg()[0]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
