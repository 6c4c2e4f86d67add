"""int8 against float: the corpus's quantized models beside their float twins, backplane against
ONNX Runtime and OpenVINO (issue 29, item 4).

Usage:
    python bench/int8.py                       # every pair below, 3 rounds, 2 threads
    python bench/int8.py --rounds 5 --pairs resnet_qdq_ort17 --json int8.json
    python bench/int8.py --tier full            # the 224x224 CNNs, quantized here (see below)

The pairs (tests/data/corpus; scripts/export_corpus.py makes each quantized model from the same
seeded float module as its twin):

- ``resnet_qdq_ort17``: ONNX Runtime's static quantizer, QDQ (uint8 activations, int8 per-channel
  weights) of the ResNet whose float export is ``resnet_basic_ts16``;
- ``resnet_qlinear_ort15``: the same quantizer, QOperator (QLinearConv, QLinearMatMul) of that
  ResNet with a MatMul head (``resnet_basic_ts16`` has a Gemm head: the same work);
- ``gpt_dynquant_ort15``: its dynamic quantizer (DynamicQuantizeLinear, MatMulInteger) of the GPT
  whose float export is ``gpt_causal_ts15``;
- ``fakequant_qdq_ts13``: a QAT export (QuantizeLinear / DequantizeLinear pairs), no float twin.

``--tier full``: the full tier's ``mobilenet_dw_ts13`` and ``resnet_basic_dyn21`` (224x224,
~/.cache/backplane/corpus-full), each quantized at bench time by ONNX Runtime's static quantizer
(``<name>_qdq``, ``<name>_qop``: uint8 activations, int8 weights per channel, calibrated on the
model's seeded inputs) into a temporary folder, beside their float selves.

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
FULL_FLOATS = ("mobilenet_dw_ts13", "resnet_basic_dyn21")
"""The full tier's CNNs (224x224) that ``--tier full`` quantizes, QDQ and QOperator."""
FULL_PAIRS = {f"{name}_{fmt}": name for name in FULL_FLOATS for fmt in ("qdq", "qop")}


class _Feeds:
    """onnxruntime.quantization's calibration reader over the tier's seeded inputs."""

    def __init__(self, feeds: list[dict[str, Any]]) -> None:
        self.feeds = iter(feeds)

    def get_next(self) -> dict[str, Any] | None:
        return next(self.feeds, None)


def quantized_full_tier(corpus: Path, tmp: Path) -> Path:
    """A corpus folder (in ``tmp``) whose manifest holds the full tier's CNNs (their files where
    they are) and their static ONNX Runtime quantizations, QDQ and QOperator (uint8 activations,
    int8 weights per channel, calibrated on the model's seeded inputs of every size), made here."""
    import numpy as np
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    manifest = json.loads((corpus / "manifest.json").read_text())
    entries = {}
    for name in FULL_FLOATS:
        entry = manifest[name]
        files = [str(corpus / f) for f in entry["inputs_files"]]
        entries[name] = {**entry, "file": str(corpus / entry["file"]), "inputs_files": files}
        for fmt, kind in (("qdq", QuantFormat.QDQ), ("qop", QuantFormat.QOperator)):
            path = tmp / f"{name}_{fmt}.onnx"
            print(f"{name}: quantizing ({fmt})", file=sys.stderr, flush=True)
            quantize_static(entries[name]["file"], str(path),
                            _Feeds([dict(np.load(f)) for f in files]), quant_format=kind,
                            per_channel=True, activation_type=QuantType.QUInt8,
                            weight_type=QuantType.QInt8)
            entries[f"{name}_{fmt}"] = {**entries[name], "file": str(path),
                                        "exporter": f"ort quantize_static {fmt}"}
    (tmp / "manifest.json").write_text(json.dumps(entries))
    return tmp


def bench(args: argparse.Namespace, names: list[str], tmp: Path) -> dict[str, dict[str, Any]]:
    """Every model on every runtime, alternating over all of them in each round."""
    return wild.bench_models(args, names, tmp)


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
    ap.add_argument("--corpus", type=Path, help="the corpus folder (default: the tier's)")
    ap.add_argument("--tier", choices=("small", "full"), default="small",
                    help="full: the full tier's 224x224 CNNs and their QDQ and QOperator "
                         "quantizations, made at bench time (python scripts/export_corpus.py "
                         "--tier full builds the tier)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    args.profile_runs = 0  # wild.spawn passes it on to its worker
    pairs = FULL_PAIRS if args.tier == "full" else PAIRS
    args.corpus = args.corpus or (wild.FULL_CORPUS if args.tier == "full" else wild.CORPUS)
    chosen = args.pairs.split(",") if args.pairs else list(pairs)
    unknown = [name for name in chosen if name not in pairs]
    if unknown:
        ap.error(f"unknown pair {', '.join(unknown)}; the {args.tier} tier's pairs are "
                 f"{', '.join(pairs)}")
    args.chosen = {name: pairs[name] for name in chosen}
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the workers: backplane on CpuAcc
    names = list(dict.fromkeys([*args.chosen, *(t for t in args.chosen.values() if t)]))
    header = [line.replace(", backplane absent", "") for line in environment(args.threads)]  # as wild.py
    print("\n".join(header), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tier == "full":
            args.corpus = quantized_full_tier(args.corpus, Path(tmp))
        results = bench(args, names, Path(tmp))
    lines = wild.table(list(results.values())) + [""] + pair_lines(results, args.chosen)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"environment": header, "results": results}, indent=1,
                                        default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
