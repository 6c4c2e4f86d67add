"""int8 against float: the corpus's quantized models beside their float twins, backplane against
ONNX Runtime and OpenVINO (issue 29, item 4).

Usage:
    python bench/int8.py                       # every pair below, 3 rounds, 2 threads
    python bench/int8.py --rounds 5 --pairs resnet_qdq_ort17 --json int8.json

The pairs (tests/data/corpus; scripts/export_corpus.py makes each quantized model from the same
seeded float module as its twin):

- ``resnet_qdq_ort17``: ONNX Runtime's static quantizer, QDQ (uint8 activations, int8 per-channel
  weights) of the ResNet whose float export is ``resnet_basic_ts16``;
- ``resnet_qlinear_ort15``: the same quantizer, QOperator (QLinearConv, QLinearMatMul) of that
  ResNet with a MatMul head (``resnet_basic_ts16`` has a Gemm head: the same work);
- ``gpt_dynquant_ort15``: its dynamic quantizer (DynamicQuantizeLinear, MatMulInteger) of the GPT
  whose float export is ``gpt_causal_ts15``;
- ``fakequant_qdq_ts13``: a QAT export (QuantizeLinear / DequantizeLinear pairs), no float twin.

backplane runs on the CPU (its processes see no CUDA device: the bench compares CPU kernels). Each
model and runtime runs in processes of its own, with bench/wild.py's worker (empty caches, a
cold load, warm-up, then timed calls for about ``--seconds``), alternating over every model and
runtime in each round; a figure is the best of the rounds' medians. The table: per model the three
runtimes' milliseconds and ORT / backplane, then per pair the float / int8 ratio of each runtime
(above 1: its int8 model is faster than its float one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import wild  # noqa: E402
from bench_openvino import environment  # noqa: E402

PAIRS = {"resnet_qdq_ort17": "resnet_basic_ts16", "resnet_qlinear_ort15": "resnet_basic_ts16",
         "gpt_dynquant_ort15": "gpt_causal_ts15", "fakequant_qdq_ts13": None}
"""Each quantized corpus model -> its float twin (None: it has none)."""


def bench(args: argparse.Namespace, names: list[str], tmp: Path) -> dict[str, dict[str, Any]]:
    """Every model on every runtime, alternating over all of them in each round."""
    rows = {name: {rt: {"medians": [], "loads": [], "imports": [], "firsts": [], "error": None,
                        "outputs": None, "plan": {}} for rt in wild.RUNTIMES} for name in names}
    for round_ in range(args.rounds):
        for name in names:
            _, model, feeds = wild.corpus_files(args, name)
            for rt, row in rows[name].items():
                if row["error"]:
                    continue
                print(f"{name}: {rt} (round {round_ + 1}/{args.rounds})", file=sys.stderr,
                      flush=True)
                save = tmp / f"{name}.{rt}.npz" if round_ == 0 else None
                reply = wild.spawn(args, rt, model, feeds, save)
                _record(row, reply, save)
    return {name: wild.summarize(name, wild.corpus_files(args, name)[0], rows[name])
            for name in names}


def _record(row: dict[str, Any], reply: dict[str, Any], save: Path | None) -> None:
    import numpy as np

    if "error" in reply:
        row["error"] = reply["error"]
        return
    row["medians"].append(statistics.median(reply["times"]))
    row["loads"].append(reply["load_s"])
    row["imports"].append(reply["import_s"])
    row["firsts"].append(reply["first_s"])
    row["plan"] = reply["plan"] or row["plan"]
    if save:
        with np.load(save) as saved:
            row["outputs"] = [saved[k] for k in saved.files]


def pair_lines(results: dict[str, dict[str, Any]], pairs: dict[str, str | None]) -> list[str]:
    """Per pair, each runtime's float ms / int8 ms."""
    lines = ["| int8 model | float twin | ORT float / int8 | OpenVINO float / int8 "
             "| backplane float / int8 | backplane int8 / ORT int8 |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for quantized, twin in pairs.items():
        cells = []
        for rt in wild.RUNTIMES:
            q = results[quantized][rt].get("ms")
            f = results[twin][rt].get("ms") if twin else None
            cells.append(f"{f / q:.2f}" if q and f else "-")
        ort, bp = (results[quantized][rt].get("ms") for rt in ("onnxruntime", "backplane"))
        cells.append(f"{bp / ort:.2f}" if ort and bp else "-")
        lines.append(f"| {quantized} | {twin or '-'} | {' | '.join(cells)} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", help=f"comma-separated quantized models (of {', '.join(PAIRS)})")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="timed calls per process, about")
    ap.add_argument("--warmup-seconds", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a process may take")
    ap.add_argument("--corpus", type=Path, default=wild.CORPUS)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    args.profile_runs = 0  # wild.spawn passes it on to its worker
    chosen = args.pairs.split(",") if args.pairs else list(PAIRS)
    unknown = [name for name in chosen if name not in PAIRS]
    if unknown:
        ap.error(f"unknown pair {', '.join(unknown)}; the pairs are {', '.join(PAIRS)}")
    args.chosen = {name: PAIRS[name] for name in chosen}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the workers: backplane on CpuAcc
    names = list(dict.fromkeys([*args.chosen, *(t for t in args.chosen.values() if t)]))
    header = environment(args.threads)
    print("\n".join(header), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = bench(args, names, Path(tmp))
    lines = wild.table(list(results.values())) + [""] + pair_lines(results, args.chosen)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"environment": header, "results": results}, indent=1,
                                        default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
