"""bench/wild.py's report: the markdown table of its rows, the geometric means and the models below
``LOW``, a profile's lines. Apart from wild.py (which imports these names) so that the bench's
process handling and its report each stay one file a reader takes in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

RUNTIMES = ("onnxruntime", "openvino", "backplane")
LOW = 0.8  # issue 27: no model below this ORT / backplane ratio


def cell(result: dict[str, Any], key: str, fmt: str) -> str:
    value = result.get(key)
    return "failed" if value is None else format(value, fmt)


def table(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | ORT ms | OpenVINO ms | backplane ms | ORT / bp | OV / bp | load s ORT / OV / bp (import) "
             "| 1st output s ORT / OV / bp | bp done s | bp 1st call ms | bp layers per backend | diff |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        ms = ["-" if rt == "openvino" and "error" in r[rt] else cell(r[rt], "ms", ".3g") for rt in RUNTIMES]
        loads = " / ".join(cell(r[rt], "load_s", ".2f") if "error" not in r[rt] else "-" for rt in RUNTIMES)
        if "error" not in r["backplane"]:
            loads += f" ({cell(r['backplane'], 'import_s', '.2f')})"
        firsts = " / ".join(cell(r[rt], "output_s", ".2f") if "error" not in r[rt] else "-"
                            for rt in RUNTIMES)
        ratios = [f"{r[k]:.2f}" if r[k] else "-" for k in ("ort_over_bp", "ov_over_bp")]
        plan = " ".join(f"{b}:{n}" for b, n in r["backplane_plan"].get("placement", {}).items()) or "-"
        lines.append(f"| {r['model']} | {' | '.join(ms)} | {' | '.join(ratios)} | {loads} | {firsts} | "
                     f"{cell(r['backplane'], 'ready_s', '.2f')} | "
                     f"{cell(r['backplane'], 'first_ms', '.3g')} | {plan} | {r['diff']} |")
    return lines


def geomean(values: Sequence[float]) -> float:
    return float(np.exp(np.mean(np.log(values)))) if values else float("nan")


def verdict(results: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """The closing lines: geometric means of the ratios, the models below LOW, the failures."""
    ort = [r["ort_over_bp"] for r in results if r["ort_over_bp"]]
    ov = [r["ov_over_bp"] for r in results if r["ov_over_bp"]]
    low = sorted((r["ort_over_bp"], r["model"]) for r in results if r["ort_over_bp"] and r["ort_over_bp"] < LOW)
    # OpenVINO is timed where it loads; a model it refuses is said, not a failure of the bench
    failed = [f"{r['model']} on {rt}: {r[rt]['error']}" for r in results for rt in RUNTIMES
              if "error" in r[rt] and rt != "openvino"]
    refused = [f"{r['model']}: {r['openvino']['error'][:240]}" for r in results if "error" in r["openvino"]]
    summary = {"geomean_ort_over_bp": geomean(ort), "models_timed": len(ort),
               "geomean_ov_over_bp": geomean(ov), "models_timed_openvino": len(ov),
               "below": [{"model": m, "ort_over_bp": v} for v, m in low], "failed": failed,
               "openvino_refused": refused}
    lines = [f"geomean ORT / backplane {summary['geomean_ort_over_bp']:.3f} over {len(ort)} models; "
             f"OpenVINO / backplane {summary['geomean_ov_over_bp']:.3f} over {len(ov)} models",
             f"{len(low)} models below {LOW}: " + (", ".join(f"{m} {v:.2f}" for v, m in low) or "none")]
    lines += [f"failed: {f}" for f in failed] + [f"OpenVINO does not load {f}" for f in refused]
    return lines, summary


def profile_lines(name: str, reply: dict[str, Any]) -> list[str]:
    if "error" in reply:
        return [f"{name}: profile failed: {reply['error']}"]
    lines = [f"{name}: run_profiled {reply['total_s'] * 1e3:.3g} ms over {reply['layers']} timed layers; "
             f"the largest:"]
    lines += [f"    {t['s'] * 1e3:8.3f} ms  {t['backend']:8s} {t['op']:18s} {t['layer']}" for t in reply["top"]]
    if reply.get("torch_ops"):
        lines.append("  torch operators, self CPU time per run (torch.profiler):")
        lines += [f"    {t['ms']:8.3f} ms  {t['calls']:5.0f} calls  {t['op']}" for t in reply["torch_ops"]]
    return lines
