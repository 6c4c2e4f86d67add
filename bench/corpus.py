"""Run the corpus of real-world exports (tests/data/corpus) on backend lists; compare with ONNX Runtime.

    python bench/corpus.py                                # CpuRef, then CpuAcc,CpuRef
    python bench/corpus.py CpuAcc,CpuRef --models gpt_sdpa_dyn18,detect_nms_ts14 --runs 20
    python bench/corpus.py "CpuAcc,CpuRef@CpuAcc.threads=1"  # backend options after @, as backplane bench

Each positional argument is one backend list (comma-separated, most preferred first; backend options
after @, `A,B@OPTION=VALUE@OPTION=VALUE`). For every model
of tests/data/corpus/manifest.json and every list, one session is loaded and run at the model's two
input sizes (the .s0.npz and .s1.npz beside it): the first run of a size is compared with ONNX Runtime
(as tests/models/test_corpus.py compares: integers exactly, floats within 1e-4 of the output's scale,
float16 within 4 ulps at the scale), then `--runs` runs are timed. The table gives per model and list:
exporter, opset, the two sizes, the worst difference to ONNX Runtime (relative to the output's
scale, over outputs and sizes), the median ms per run at each size, where the layers ran (layer
counts per backend, from the placement report) and the verdict. The mismatches and errors are
printed under the table, and the exit status is 1 if there was any.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.models.test_corpus import (CORPUS, MANIFEST, compare_outputs, feeds,  # noqa: E402
                                      ort_outputs, quanta)

from backplane import InferenceSession, progress  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402


def parse_column(column: str) -> tuple[list[str], dict[str, object]]:
    """'A,B@OPTION=VALUE@...' -> (["A", "B"], {OPTION: VALUE}); values true / false / numbers / text."""
    backends, *settings = column.split("@")
    options: dict[str, object] = {}
    for setting in settings:
        key, _, text = setting.partition("=")
        value: object = text
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        options[key] = value
    return [b for b in backends.split(",") if b], options


def sizes_text(entry: dict) -> str:
    return " / ".join(",".join(f"{axis}={n}" for axis, n in size.items()) for size in entry["sizes"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backends", nargs="*", default=["CpuRef", "CpuAcc,CpuRef"],
                    help="backend lists, each comma-separated (default: CpuRef and CpuAcc,CpuRef)")
    ap.add_argument("--models", help="comma-separated model names (default: the whole corpus)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per size (default 5)")
    a = ap.parse_args()
    names = a.models.split(",") if a.models else list(MANIFEST)
    unknown = [n for n in names if n not in MANIFEST]
    if unknown:
        ap.error(f"unknown models {unknown}; the corpus has: {', '.join(MANIFEST)}")
    columns = [(spec, *parse_column(spec)) for spec in a.backends]

    rows, problems = [], []
    expected: dict[tuple[str, int], list] = {}
    started = False  # the bar steps as each pair after the first begins
    with progress.shown(), progress.task("corpus", total=len(names) * len(columns)) as step:
        for name in names:
            entry = MANIFEST[name]
            out_names = [o["name"] for o in entry["outputs"]]
            for label, backends, options in columns:
                row = {"model": name, "exporter": entry["exporter"], "opset": str(entry["opset"]),
                       "backends": label, "sizes": sizes_text(entry), "worst": "-", "ms": "-",
                       "placement": "-", "status": "ok"}
                rows.append(row)
                step(f"corpus: {name} on {label}", advance=1 if started else 0)
                started = True
                try:
                    runtime = Runtime(RuntimeOptions(backend_options=options))
                    session = InferenceSession(CORPUS / entry["file"], backends=backends,
                                               runtime=runtime)
                except Exception as e:  # noqa: BLE001 - reported under the table
                    row["status"] = "ERROR"
                    problems.append(f"{name} on {label}: load: {type(e).__name__}: {e}")
                    traceback.print_exc(limit=2, file=sys.stderr)
                    continue
                row["placement"] = " ".join(f"{b}:{n}" for b, n
                                            in sorted(session.report.counts().items()))
                worst, compared, times = 0.0, False, []
                for size in (0, 1):
                    feed = feeds(name, size)
                    if (name, size) not in expected:
                        expected[(name, size)] = ort_outputs(CORPUS / entry["file"], feed)
                    try:
                        actual = session.run(None, feed)
                    except Exception as e:  # noqa: BLE001
                        row["status"] = "ERROR"
                        problems.append(f"{name} on {label} at {sizes_text(entry).split(' / ')[size]}: run: "
                                        f"{type(e).__name__}: {e}")
                        traceback.print_exc(limit=2, file=sys.stderr)
                        times.append(None)
                        continue
                    rel, mismatches = compare_outputs(actual, expected[(name, size)], out_names,
                                                      quanta(name))
                    worst, compared = max(worst, rel), True
                    if mismatches:
                        row["status"] = "MISMATCH" if row["status"] == "ok" else row["status"]
                        problems += [f"{name} on {label} at {sizes_text(entry).split(' / ')[size]}: {m}"
                                     for m in mismatches]
                    samples = []
                    for _ in range(a.runs):
                        t0 = time.perf_counter()
                        session.run(None, feed)
                        samples.append((time.perf_counter() - t0) * 1e3)
                    times.append(statistics.median(samples) if samples else None)
                row["worst"] = "-" if not compared else \
                    "inf" if worst == float("inf") else f"{worst:.1e}"
                row["ms"] = " / ".join("-" if t is None else f"{t:.2f}" for t in times)

    import os
    import platform

    import numpy
    import onnx
    import onnxruntime

    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "absent"
    print(f"python {platform.python_version()}, numpy {numpy.__version__}, onnx {onnx.__version__}, "
          f"onnxruntime {onnxruntime.__version__}, torch {torch_version}, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}; {a.runs} timed runs per size, medians\n")
    columns = [("model", "model"), ("exporter", "exporter"), ("opset", "opset"), ("backends", "backends"),
               ("sizes", "sizes (s0 / s1)"), ("worst", "worst diff"), ("ms", "ms/run s0 / s1"),
               ("placement", "layers per backend"), ("status", "status")]
    widths = {key: max(len(title), *(len(r[key]) for r in rows)) for key, title in columns}
    print("| " + " | ".join(title.ljust(widths[key]) for key, title in columns) + " |")
    print("|" + "|".join("-" * (widths[key] + 2) for key, _ in columns) + "|")
    for r in rows:
        print("| " + " | ".join(r[key].ljust(widths[key]) for key, _ in columns) + " |")
    bad = [r for r in rows if r["status"] != "ok"]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} model x backend-list pairs match ONNX Runtime at both sizes")
    if problems:
        print("\nMismatches and errors:")
        for p in problems:
            print(f"- {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
