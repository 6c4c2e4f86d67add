"""The cost of one control-flow construct, backplane against ONNX Runtime (issue 27, items 3 and 4).

Usage:
    python bench/control_flow.py                  # 3 rounds, 2 threads
    python bench/control_flow.py --rounds 5 --json control_flow.json
    git archive <commit> src | tar -x -C /tmp/before
    python bench/control_flow.py --before /tmp/before/src   # and backplane from an earlier tree

Tiny models whose work is one Add, so that what is timed is the construct: ``add`` (the Add alone:
the floor of a run), ``if_add`` (an If whose branches are one Add each, reading an outer constant; its predicate an
input, so decided before the run: optimizer/decided.py), ``if_data`` (the same If, its predicate
ReduceSum(x) > 0 of an x of free size: not decided, the branch runs as a nested network),
``loop_10`` and ``loop_100`` (a Loop of 10 and 100 iterations carrying a [4] tensor through a
one-Add body), ``scan_100`` (a Scan over 100 rows with a one-Add state update). Each runtime runs
in processes of its own, alternating over ``--rounds`` (bench/wild.py's way); a process loads every
model, warms up, then times each for about ``--seconds``. A figure is the best of the rounds'
medians. Below the table: each construct's cost over the ``add`` floor, and a Loop's cost per
iteration ((loop_100 - loop_10) / 90). Runtimes: ONNX Runtime (CPUExecutionProvider, all
optimizations), backplane's default session (CpuAcc, CpuRef) and backplane on CpuRef alone; with
``--before SRC``, backplane's default session from that source tree too ("backplane-before").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from wild import backplane_version, environment  # noqa: E402  # (bench_openvino drops bench/ from the path)

from backplane.backends.torch.bench import timed_runs, worker_report  # noqa: E402

RUNTIMES = {"onnxruntime": None, "backplane": None, "backplane-CpuRef": ["CpuRef"],
            "backplane-before": None}
MODELS = ("add", "if_add", "if_data", "loop_10", "loop_100", "scan_100")
OPSET = 17


# -- the models -----------------------------------------------------------------------------------
def _tensor(name: str, shape: Sequence[int | str], elem: int = TensorProto.FLOAT) -> Any:
    return helper.make_tensor_value_info(name, elem, list(shape))


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any],
           constants: dict[str, Any]) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "control_flow", inputs, outputs,
                              [numpy_helper.from_array(np.asarray(v), n) for n, v in constants.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def build(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One bench model and its inputs."""
    x = np.arange(4, dtype=np.float32)
    one = {"one": np.ones(4, np.float32)}
    if name == "add":
        return _model([helper.make_node("Add", ["x", "one"], ["y"])], [_tensor("x", [4])],
                      [_tensor("y", [4])], one), {"x": x}
    if name in ("if_add", "if_data"):
        then = helper.make_graph([helper.make_node("Add", ["x", "one"], ["t"])], "then", [],
                                 [_tensor("t", [4])])
        other = helper.make_graph([helper.make_node("Add", ["x", "x"], ["e"])], "else", [],
                                  [_tensor("e", [4])])
        node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
        if name == "if_data":  # c = ReduceSum(x) > 0, x of a free size (4): not decided
            nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
                     helper.make_node("Greater", ["total", "zero"], ["c"]), node]
            return _model(nodes, [_tensor("x", ["n"])], [_tensor("y", ["n"])],
                          {**one, "zero": np.array(0, np.float32)}), {"x": x}
        return _model([node], [_tensor("c", [], TensorProto.BOOL), _tensor("x", [4])],
                      [_tensor("y", [4])], one), {"c": np.array(True), "x": x}
    if name.startswith("loop_"):
        body = helper.make_graph(
            [helper.make_node("Add", ["h_in", "one"], ["h_out"]),
             helper.make_node("Identity", ["c_in"], ["c_out"])], "body",
            [_tensor("i", [], TensorProto.INT64), _tensor("c_in", [], TensorProto.BOOL),
             _tensor("h_in", [4])],
            [_tensor("c_out", [], TensorProto.BOOL), _tensor("h_out", [4])])
        node = helper.make_node("Loop", ["M", "", "x"], ["y"], body=body)
        constants = {**one, "M": np.array(int(name.split("_")[1]), np.int64)}
        return _model([node], [_tensor("x", [4])], [_tensor("y", [4])], constants), {"x": x}
    if name == "scan_100":
        body = helper.make_graph([helper.make_node("Add", ["s_in", "row"], ["s_out"])], "body",
                                 [_tensor("s_in", [4]), _tensor("row", [4])], [_tensor("s_out", [4])])
        node = helper.make_node("Scan", ["x", "rows"], ["y"], body=body, num_scan_inputs=1)
        rows = np.arange(400, dtype=np.float32).reshape(100, 4)
        return _model([node], [_tensor("x", [4]), _tensor("rows", [100, 4])], [_tensor("y", [4])], {}), \
            {"x": x, "rows": rows}
    raise ValueError(f"unknown model {name!r}; the models are {', '.join(MODELS)}")


# -- the worker side ------------------------------------------------------------------------------
def load(runtime: str, model: onnx.ModelProto, threads: int) -> Any:
    if runtime == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    from backplane import InferenceSession, SessionOptions

    return InferenceSession(model, backends=RUNTIMES[runtime],
                            sess_options=SessionOptions(intra_op_num_threads=threads))


def worker(args: argparse.Namespace) -> None:
    """One process of one runtime: every model loaded, warmed up, timed; one JSON line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    medians, outputs = {}, {}
    for name in MODELS:
        model, feeds = build(name)
        session = load(args.worker, model, args.threads)

        def run(session: Any = session, feeds: dict = feeds) -> Any:
            return session.run(None, feeds)

        _, warm = timed_runs(run, 20, 20)
        runs = int(min(20000, max(50, args.seconds / max(statistics.median(warm), 1e-7))))
        result, times = timed_runs(run, 0, runs)
        medians[name] = statistics.median(times)
        outputs[name] = np.asarray(result[0]).tolist()
    replies.write(json.dumps({"medians": medians, "outputs": outputs}) + "\n")


# -- the parent side ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="processes per runtime, alternating (default 3)")
    ap.add_argument("--seconds", type=float, default=0.3, help="timed calls per model, in seconds (0.3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the results as a JSON document to this file")
    ap.add_argument("--before", type=Path, help="also time backplane from this source tree (its src/)")
    ap.add_argument("--worker", choices=tuple(RUNTIMES), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def spawn(args: argparse.Namespace, runtime: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", runtime, "--threads", str(args.threads),
               "--seconds", str(args.seconds)]
    if runtime == "backplane-before":
        command = ["env", f"PYTHONPATH={args.before}", *command]
    try:
        return worker_report(command, args.threads, 600)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 600 s"}


def report(best: dict[str, dict[str, float]]) -> list[str]:
    """The table (microseconds), then each construct's cost over the floor and per iteration."""
    names = [rt for rt in RUNTIMES if rt in best]
    lines = ["| model | " + " | ".join(f"{rt} us" for rt in names) + " | ORT / backplane |",
             "| --- | " + " | ".join("---:" for _ in names) + " | ---: |"]
    for model in MODELS:
        cells = [f"{best[rt][model] * 1e6:.1f}" for rt in names]
        ratio = best["onnxruntime"][model] / best["backplane"][model] \
            if {"onnxruntime", "backplane"} <= set(names) else float("nan")
        lines.append(f"| {model} | {' | '.join(cells)} | {ratio:.2f} |")
    for rt in names:
        t = {m: best[rt][m] * 1e6 for m in MODELS}
        lines.append(f"{rt}: If {t['if_add'] - t['add']:.1f} us over the Add alone (decided), "
                     f"{t['if_data'] - t['add']:.1f} (from data, with its ReduceSum and Greater); Loop "
                     f"{(t['loop_100'] - t['loop_10']) / 90:.2f} us per iteration, "
                     f"{t['loop_10'] - t['add'] - (t['loop_100'] - t['loop_10']) / 9:.1f} us per call; "
                     f"Scan {(t['scan_100'] - t['add']) / 100:.2f} us per row")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    header = [f"command: python bench/control_flow.py {' '.join(sys.argv[1:])}".rstrip(),
              f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
              *(line.replace(", backplane absent", "") for line in environment(args.threads)),
              f"backplane {backplane_version()}; {args.rounds} rounds, best of the rounds' medians"
              + (f"; backplane-before from {args.before}" if args.before else "")]
    print("\n".join(header), flush=True)
    runtimes = [rt for rt in RUNTIMES if args.before or rt != "backplane-before"]
    medians: dict[str, list[dict[str, float]]] = {rt: [] for rt in runtimes}
    answers: dict[str, Any] = {}
    for round_ in range(args.rounds):
        for rt in runtimes:
            print(f"round {round_ + 1}/{args.rounds}: {rt}", file=sys.stderr, flush=True)
            reply = spawn(args, rt)
            if "error" in reply:
                print(f"{rt} failed: {reply['error']}", flush=True)
                continue
            medians[rt].append(reply["medians"])
            answers[rt] = reply["outputs"]
    best = {rt: {m: min(r[m] for r in rounds) for m in MODELS} for rt, rounds in medians.items() if rounds}
    wrong = [f"{rt} {m}" for rt, outs in answers.items() for m in MODELS
             if not np.allclose(outs[m], answers.get("onnxruntime", outs)[m])]
    lines = report(best) + [f"outputs differing from ONNX Runtime's: {', '.join(wrong) or 'none'}"]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "best_s": best, "rounds_s": medians,
                                         "lines": lines}, indent=1))


if __name__ == "__main__":
    main()
