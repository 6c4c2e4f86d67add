"""The cost per call and per layer against ONNX Runtime (issue 27, item 4): chains of small layers.

Usage:
    python bench/chains.py                      # 1, 10, 100 and 1000 layers, static and free batch
    python bench/chains.py --lengths 1,100 --rounds 3

Each model is a chain of ``n`` small layers on a (batch, 64) float32 tensor, Add of a constant,
Relu and Mul by a constant in turn (the 1-layer model is a lone Relu: the floor of a ``run``),
once with a static batch of 1 and once with a free batch dimension fed 1. ONNX Runtime
(CPUExecutionProvider, ORT_ENABLE_ALL) and backplane's default session (CpuAcc then CpuRef) each run
every model in processes of their own, alternating over ``--rounds``, as bench/wild.py does (its
worker: import, session, first call, warm-up, timed calls; empty caches); a runtime's figure is the
best of its rounds' medians. The table: both medians, ORT / backplane (above 1: backplane is
faster), and each runtime's cost per layer, (t(n) - t(1)) / (n - 1). ONNX Runtime's optimizer may
fold a chain of constants' Adds and Muls; the layers it runs are its own business: what counts is
what a user's call costs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import wild  # noqa: E402  # its worker and its process handling

WIDTH = 64
RUNTIMES = ("onnxruntime", "backplane")


def chain(n: int, free: bool) -> onnx.ModelProto:
    """``n`` small layers in a row (a lone Relu for 1), batch free or 1."""
    nodes, inits, last = [], [], "x"
    for i in range(n):
        out = "y" if i == n - 1 else f"t{i}"
        kind = "Relu" if n == 1 else ("Add", "Relu", "Mul")[i % 3]
        if kind == "Relu":
            nodes.append(helper.make_node("Relu", [last], [out], name=f"relu{i}"))
        else:
            value = np.full(WIDTH, 0.5 if kind == "Add" else 0.999, np.float32)
            inits.append(numpy_helper.from_array(value, f"c{i}"))
            nodes.append(helper.make_node(kind, [last, f"c{i}"], [out], name=f"{kind.lower()}{i}"))
        last = out
    batch = "N" if free else 1
    graph = helper.make_graph(nodes, f"chain{n}",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, WIDTH])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, WIDTH])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model)
    return model


def bench(args: argparse.Namespace, folder: Path, n: int, free: bool) -> dict[str, float | str]:
    name = f"chain{n}_{'free' if free else 'static'}"
    model, feeds = folder / f"{name}.onnx", folder / f"{name}.npz"
    onnx.save(chain(n, free), model)
    np.savez(feeds, x=np.random.default_rng(n).standard_normal((1, WIDTH)).astype(np.float32))
    best: dict[str, float | str] = {}
    for round_ in range(args.rounds):
        for runtime in RUNTIMES:
            print(f"{name}: {runtime} (round {round_ + 1}/{args.rounds})", file=sys.stderr, flush=True)
            reply = wild.spawn(args, runtime, model, feeds, None)
            if "error" in reply:
                best[runtime] = reply["error"]
                continue
            median = float(np.median(reply["times"]))
            previous = best.get(runtime)
            best[runtime] = median if not isinstance(previous, float) else min(previous, median)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1,10,100,1000", help="chain lengths (1,10,100,1000)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per runtime, alternating (2)")
    ap.add_argument("--seconds", type=float, default=0.5, help="timed calls per process (0.5 s)")
    ap.add_argument("--warmup-seconds", type=float, default=1.0, help="untimed calls first (1 s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for one process (600)")
    args = ap.parse_args(argv)
    args.profile_runs = 0
    lengths = [int(v) for v in args.lengths.split(",")]
    print(f"command: python bench/chains.py {' '.join(sys.argv[1:])}".rstrip())
    for line in wild.environment(args.threads):
        print(line.replace(", backplane absent", ""))
    print(f"backplane {wild.backplane_version()}; {args.rounds} rounds, best of the rounds' medians\n")
    failed = False
    with tempfile.TemporaryDirectory(prefix="chains.") as tmp:
        for free in (False, True):
            rows = {n: bench(args, Path(tmp), n, free) for n in lengths}
            print(f"batch {'free (fed 1)' if free else 'static 1'}:\n")
            print("| layers | ORT us | backplane us | ORT / bp | ORT us per layer | bp us per layer |")
            print("| ---: | ---: | ---: | ---: | ---: | ---: |")
            floor = rows.get(1, {})
            for n, row in rows.items():
                ort, bp = row.get("onnxruntime"), row.get("backplane")
                if not (isinstance(ort, float) and isinstance(bp, float)):
                    print(f"| {n} | {ort} | {bp} | - | - | - |")
                    failed = True
                    continue
                per = ["-", "-"]
                if n > 1 and all(isinstance(floor.get(rt), float) for rt in RUNTIMES):
                    per = [f"{(row[rt] - floor[rt]) / (n - 1) * 1e6:.2f}" for rt in RUNTIMES]  # type: ignore[operator]
                print(f"| {n} | {ort * 1e6:.1f} | {bp * 1e6:.1f} | {ort / bp:.2f} | {per[0]} | {per[1]} |")
            print()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
