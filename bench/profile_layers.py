"""Where backplane's time goes against ONNX Runtime's, layer by layer, on one model.

Usage:
    python bench/profile_layers.py MODEL.onnx [--backends CpuAcc,CpuRef] [--option KEY=VALUE ...]
                                   [--threads 2] [--runs 50] [--top 25]

Each runtime runs in a process of its own (ONNX Runtime's spinning threads slow whatever shares its
process). ONNX Runtime: its profiler (``enable_profiling``), median per node over the runs, and the
optimized graph it saves, from which each of its nodes is traced to the model's node that produced
its output (its fusions keep the last fused node's output; a node of the NCHWc layout is named after
the tensor it stands for, plus ``_nchwc``). backplane: ``run_profiled``, median per layer; a fused
layer's name joins the names of the model's nodes it took. Each backplane layer is then set against
the ONNX Runtime nodes that trace to the same model nodes, largest gap first. Profiled times include
each runtime's timing overhead, so their totals run above the plain medians of
``bench/bench_torch.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np


def _feeds(inputs) -> dict[str, np.ndarray]:
    rng, feeds = np.random.default_rng(0), {}
    for name, shape, kind in inputs:
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in shape]
        feeds[name] = (rng.integers(0, 2, shape).astype(np.int64) if "int" in kind
                       else rng.standard_normal(shape).astype(np.float32))
    return feeds


def ort_worker(model: str, threads: int, runs: int) -> dict[str, float]:
    """Median microseconds per original model node (and per untraced ONNX Runtime node)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.enable_profiling, options.profile_file_prefix = True, f"{tmp}/ort"
        options.optimized_model_filepath = f"{tmp}/optimized.onnx"
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        feeds = _feeds([(i.name, i.shape, i.type) for i in session.get_inputs()])
        for _ in range(runs + 5):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
        optimized = onnx.load(f"{tmp}/optimized.onnx", load_external_data=False)
    producer = {out: node.name for node in onnx.load(model, load_external_data=False).graph.node
                for out in node.output}
    traced = {}
    for node in optimized.graph.node:  # an NCHWc node is named after the tensor it stands for
        tensors = [node.name.removesuffix("_nchwc"), *node.output]
        names = [producer.get(t) for t in tensors if not node.op_type.startswith("Reorder")]
        traced[node.name] = next((n for n in names if n), f"(ORT) {node.op_type} {node.name}")
    times = defaultdict(list)
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            times[event["name"].removesuffix("_kernel_time")].append(event["dur"])
    per_node: dict[str, float] = defaultdict(float)
    for name, durations in times.items():
        per_node[traced.get(name, f"(ORT) {name}")] += statistics.median(durations[5:] or durations)
    return dict(per_node)


def backplane_worker(model: str, backends: str, threads: int, runs: int,
                     settings: list[str]) -> list[list]:
    """[layer, op type, backend, median microseconds] in execution order."""
    from backplane.backends.torch.bench import option_value
    from backplane.runtime.runtime import Runtime, RuntimeOptions
    from backplane.session import InferenceSession

    chosen = {"CpuAcc.threads": threads}
    for setting in settings:
        key, _, value = setting.partition("=")
        chosen[key] = option_value(value)
    options = RuntimeOptions(backend_options=chosen)
    session = InferenceSession(model, backends=backends.split(","), runtime=Runtime(options))
    feeds = _feeds([(i.name, i.shape, i.type) for i in session.get_inputs()])
    for _ in range(5):
        session.run(None, feeds)
    samples: dict[str, list[float]] = defaultdict(list)
    kinds = {}
    for _ in range(runs):
        for timing in session.run_profiled(None, feeds)[1]:
            samples[timing.layer].append(timing.seconds * 1e6)
            kinds[timing.layer] = (timing.op_type, timing.backend)
    return [[layer, *kinds[layer], statistics.median(values)] for layer, values in samples.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="profile_layers", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--backends", default="CpuAcc,CpuRef")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a backend option (CpuAcc.compile=layers); repeat for more")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--top", type=int, default=25, help="layers shown, largest gap first")
    parser.add_argument("--worker", choices=["ort", "backplane"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "ort":
        print(json.dumps(ort_worker(str(args.model), args.threads, args.runs)))
        return 0
    if args.worker == "backplane":
        print(json.dumps(backplane_worker(str(args.model), args.backends, args.threads, args.runs,
                                          args.option)))
        return 0

    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def worker(kind: str):
        reply = subprocess.run([sys.executable, __file__, str(args.model), "--worker", kind,
                                "--backends", args.backends, "--threads", str(args.threads),
                                "--runs", str(args.runs),
                                *[f"--option={o}" for o in args.option]],
                               capture_output=True, text=True, check=True)
        return json.loads(reply.stdout.strip().splitlines()[-1])

    ort_nodes, layers = worker("ort"), worker("backplane")
    rows, claimed = [], set()
    for layer, op_type, backend, ours in layers:
        nodes = [n for n in layer.split("+") if n in ort_nodes]
        claimed.update(nodes)
        rows.append((layer, op_type, backend, ours, sum(ort_nodes[n] for n in nodes)))
    rest = {name: us for name, us in ort_nodes.items() if name not in claimed}
    table = Table(title=f"{args.model.name}: backplane ({args.backends}) against ONNX Runtime, "
                        f"median µs per layer, {args.threads} threads")
    for column in ("layer", "op", "backend", "backplane", "ORT (same nodes)", "gap"):
        table.add_column(column, justify="right" if column in ("backplane", "ORT (same nodes)", "gap")
                         else "left", overflow="fold" if column == "layer" else "ellipsis")
    for layer, op_type, backend, ours, theirs in sorted(rows, key=lambda r: r[4] - r[3])[:args.top]:
        short = layer if len(layer) < 70 else layer[:33] + "…" + layer[-33:]
        table.add_row(Text(short), op_type, backend, f"{ours:.0f}", f"{theirs:.0f}",
                      f"{ours - theirs:+.0f}")
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(table)
    by_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for _, op_type, _, ours, theirs in rows:
        entry = by_op[op_type]
        entry[0] += 1
        entry[1] += ours
        entry[2] += theirs
    ops = Table(title="by backplane op type (µs, summed)")
    for column in ("op", "layers", "backplane", "ORT (same nodes)", "gap"):
        ops.add_column(column, justify="left" if column == "op" else "right")
    for op_type, (count, ours, theirs) in sorted(by_op.items(), key=lambda kv: kv[1][2] - kv[1][1]):
        ops.add_row(op_type, str(count), f"{ours:.0f}", f"{theirs:.0f}", f"{ours - theirs:+.0f}")
    ops.add_row("(ORT only: layout reorders, untraced)", str(len(rest)), "", f"{sum(rest.values()):.0f}",
                f"{-sum(rest.values()):+.0f}")
    console.print(ops)
    total_ours, total_theirs = sum(r[3] for r in rows), sum(ort_nodes.values())
    console.print(f"sum of layer medians: backplane {total_ours / 1e3:.2f} ms over {len(rows)} layers,"
                  f" ONNX Runtime {total_theirs / 1e3:.2f} ms over {len(ort_nodes)} traced nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
