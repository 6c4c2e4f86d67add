"""ONNX Runtime's optimized transformers against the plain ones (issue 29: "the optimized BERT no
slower than the plain one").

Usage:
    python bench/ort_optimized.py                         # every model below, 2 rounds, 2 threads
    python bench/ort_optimized.py --threads 1 --models encoder4_plain_dyn18 --rounds 3
    python bench/ort_optimized.py --tier small            # the corpus models at the small tier

Each model three ways, written into a temporary folder at bench time:

- ``<name>``: the export as it is;
- ``<name>_ortopt``: ``onnxruntime.transformers.optimizer.optimize_model`` (``bert`` or ``gpt2``,
  opt_level 0: its fusions alone: Attention, SkipLayerNormalization, BiasGelu, FastGelu, ...);
- ``<name>_ortsaved``: the model as ONNX Runtime saves it at ORT_ENABLE_EXTENDED (FusedMatMul,
  FusedGemm, Gelu, SkipLayerNormalization, ...; tests/models/test_ort_tools.py's ``ort_saved``).

The models: the repository's ``tiny_bert`` and ``tiny_gpt2`` (tests/data) and the corpus's
``encoder4_plain_dyn18`` (nn.TransformerEncoder, dynamo export) and ``gpt_causal_ts15`` (a GPT-2
shaped decoder, TorchScript export), at the ``--tier`` (default full: ~/.cache/backplane/corpus-full,
scripts/export_corpus.py --tier full). backplane (its default backends, CpuAcc then CpuRef) and ONNX
Runtime (ORT_ENABLE_ALL) run each file in processes of their own with bench/wild.py's worker (empty
caches, a cold load, warm-up, then timed calls), alternating over every file and runtime in each
round; a figure is the best of the rounds' medians. The table: bench/wild.py's per file, then per
model each runtime's plain ms over its optimized ms (above 1: the optimized file is faster).
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

DATA = ROOT / "tests" / "data"
MODELS = {"tiny_bert": ("bert", 2, {"small": 32, "full": 32}),
          "tiny_gpt2": ("gpt2", 2, {"small": 32, "full": 32}),
          "encoder4_plain_dyn18": ("bert", 4, {"small": 64, "full": 256}),
          "gpt_causal_ts15": ("gpt2", 4, {"small": 32, "full": 256})}
"""name -> the optimizer's model type, heads and hidden size at each tier (scripts/export_corpus.py;
tests/data/README.md for the tiny ones)."""
VARIANTS = ("", "_ortopt", "_ortsaved")
RUNTIMES = ("onnxruntime", "backplane")  # OpenVINO reads no com.microsoft op


def source(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """A model's manifest entry, its file and inputs as absolute paths."""
    if name.startswith("tiny_"):
        return {"file": str(DATA / f"{name}.onnx"), "inputs_files": [str(DATA / f"{name}.npz")],
                "exporter": "torchscript (scripts/export_models.py)", "opset": 17,
                "sizes": ["test data"]}
    entry = json.loads((args.corpus / "manifest.json").read_text())[name]
    return {**entry, "file": str(args.corpus / entry["file"]),
            "inputs_files": [str(args.corpus / f) for f in entry["inputs_files"]]}


def optimized_corpus(args: argparse.Namespace, names: list[str], tmp: Path) -> Path:
    """A corpus folder (``tmp``) whose manifest holds each model plain and its two optimized files."""
    import onnxruntime as ort
    from onnxruntime.transformers.optimizer import optimize_model

    entries = {}
    for name in names:
        entry = source(args, name)
        model_type, heads, hidden = MODELS[name]
        print(f"{name}: optimizing", file=sys.stderr, flush=True)
        optimized = optimize_model(entry["file"], model_type=model_type, num_heads=heads,
                                   hidden_size=hidden[args.tier], opt_level=0)
        optimized.save_model_to_file(str(tmp / f"{name}_ortopt.onnx"))
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(tmp / f"{name}_ortsaved.onnx")
        ort.InferenceSession(entry["file"], options, providers=["CPUExecutionProvider"])
        entries[name] = entry
        for variant, how in (("_ortopt", "optimize_model"), ("_ortsaved", "ORT-saved extended")):
            entries[name + variant] = {**entry, "file": str(tmp / f"{name}{variant}.onnx"),
                                       "exporter": f"{entry['exporter']}, {how}"}
    (tmp / "manifest.json").write_text(json.dumps(entries))
    return tmp


def bench(args: argparse.Namespace, files: list[str], tmp: Path) -> dict[str, dict[str, Any]]:
    """Every file on ONNX Runtime and backplane, alternating over all of them in each round."""
    return wild.bench_models(args, files, tmp, skipped={"openvino": "not run (no com.microsoft ops)"})


def ratio_lines(results: dict[str, dict[str, Any]], names: list[str]) -> list[str]:
    """Per model, each runtime's plain ms over its optimized files' ms."""
    lines = ["| model | ORT plain / optimize_model | ORT plain / saved "
             "| backplane plain / optimize_model | backplane plain / saved |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name in names:
        cells = []
        for rt in RUNTIMES:
            plain = results[name][rt].get("ms")
            for variant in VARIANTS[1:]:
                fused = results[name + variant][rt].get("ms")
                cells.append(f"{plain / fused:.2f}" if plain and fused else "-")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", help=f"comma-separated models (of {', '.join(MODELS)})")
    ap.add_argument("--tier", choices=("small", "full"), default="full",
                    help="the corpus models' tier (default full; the tiny ones are tests/data's)")
    ap.add_argument("--corpus", type=Path, help="the corpus folder (default: the tier's)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="timed calls per process, about")
    ap.add_argument("--warmup-seconds", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a process may take")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    args.profile_runs, args.background = 0, "default"  # wild.spawn passes them to its worker
    args.corpus = args.corpus or (wild.FULL_CORPUS if args.tier == "full" else wild.CORPUS)
    args.names = args.models.split(",") if args.models else list(MODELS)
    unknown = [name for name in args.names if name not in MODELS]
    if unknown:
        ap.error(f"unknown model {', '.join(unknown)}; the models are {', '.join(MODELS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the workers: backplane on CpuAcc
    header = [f"command: python bench/ort_optimized.py {' '.join(sys.argv[1:])}".rstrip(),
              *environment(args.threads), f"backplane {wild.backplane_version()}",
              f"corpus: {args.tier} tier, {args.corpus}"]
    print("\n".join(header), flush=True)
    with tempfile.TemporaryDirectory(prefix="ort_optimized.") as tmp:
        args.corpus = optimized_corpus(args, args.names, Path(tmp))
        files = [name + variant for name in args.names for variant in VARIANTS]
        results = bench(args, files, Path(tmp))
    load1, load5, _ = os.getloadavg()
    lines = wild.table(list(results.values())) + [""] + ratio_lines(results, args.names)
    lines.append(f"load average {load1:.2f} / {load5:.2f} (1 / 5 min) at the end")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"environment": header, "results": results}, indent=1,
                                        default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
