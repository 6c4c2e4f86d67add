"""Two of the CLI's commands' documents (split from ``cli.py``): ``backplane backends``'s tables of
the registered backends, and ``backplane bench --json``'s document."""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from backplane.backends.registry import registry
from backplane.backends.registry.dynamic import backend_paths
from backplane.frontends.onnx import ModelError
from backplane.optimizer.report import print_table, unfolded_table


def backends(args: argparse.Namespace, console: Console) -> Any:
    """``backplane backends``: every registered backend (its version, origin, availability,
    capabilities, options) and the dynamic-backend candidates skipped, as tables or JSON."""
    registry.load_entry_points()
    registry.load_dynamic_backends(backend_paths(args.dynamic_backends_path))
    entries: list[dict[str, Any]] = []
    for backend_id in registry.ids():
        entry: dict[str, Any] = {"id": backend_id, "origin": registry.origin(backend_id)}
        try:
            backend = registry.create(backend_id)
        except Exception as exc:  # a broken factory is shown, not fatal
            entry.update({"version": None, "available": False, "reason": str(exc),
                          "capabilities": {}, "ops": 0, "options": {}})
            entries.append(entry)
            continue
        status = backend.availability()
        entry.update({"version": backend.version, "available": status.ok,
                      "reason": None if status.ok else status.reason,
                      "capabilities": dict(backend.capabilities()), "ops": len(backend.KERNELS),
                      "options": dict(backend.OPTIONS)})
        entries.append(entry)
    skipped = [{"candidate": s.candidate, "reason": s.reason} for s in registry.skipped]
    if args.json:
        return 0, {"backends": entries, "skipped": skipped}
    rows = []
    for e in entries:
        caps = "\n".join(f"{k}={v}" for k, v in e["capabilities"].items())  # one a line, whole
        status = "yes" if e["available"] else f"no: {e['reason']}"
        rows.append((e["id"], e["version"] or "?", e["origin"], status, caps, str(e["ops"])))
    print_table(console, unfolded_table("Registered backends", ("id", "version", "from",
                                                                "available", "capabilities", "ops"),
                                        rows, folding=("available",), right=("ops",)))
    # the options in a table of their own, each whole on its line with what it takes: as a column
    # of the table above they need 121 columns, and folded at 100 they were cut inside their names
    options = [(name, what) for e in entries for name, what in e["options"].items()]
    if options:
        print_table(console, unfolded_table("Backend options (--backends A,B@A.option=value)",
                                            ("option", "takes"), options, folding=("takes",)))
    if skipped:
        print_table(console, unfolded_table("Skipped candidates", ("candidate", "reason"),
                                            [(s["candidate"], s["reason"]) for s in skipped],
                                            folding=("reason",)))
    return 0



def bench_document(cli_args: argparse.Namespace, argv: list[str], measure_peak: bool,
                   working: Callable[..., Any]) -> tuple[int, dict[str, Any]]:
    """What ``bench`` prints as tables, as one JSON document (the same processes, rounds, runs);
    ``working``: the CLI's progress bar (``cli._working``)."""
    from backplane import bench_engine as bench

    args = bench.parse_args(argv)
    model = args.models[0]
    if not model.is_file():
        raise ModelError(f"'{model}' is a directory: give the model's .onnx file" if model.is_dir()
                         else f"model file '{model}' does not exist")
    runtimes = bench.runtimes_of(args)
    peak = bench.measure_peak(args.threads, args.device) if measure_peak else None
    with tempfile.TemporaryDirectory(prefix="bench_torch.") as tmp, \
            working(cli_args, "starting", total=len(runtimes) * args.rounds) as step:
        started = False

        def advance(text: str) -> None:
            nonlocal started
            step(text, advance=1 if started else 0)
            started = True

        results = bench.bench_model(args, model, runtimes, Path(tmp), advance)
    flops = bench.model_flops(model)
    ort = results.get(bench.ORT)
    ort_ms = statistics.median(ort.times) * 1e3 if ort and ort.times else None
    rows = []
    for runtime, r in results.items():
        row: dict[str, Any] = {"runtime": runtime, "backplane": runtime not in (
            bench.ORT, bench.EAGER, bench.CUDA_GRAPH)}
        if r.error or not r.times:
            row["error"] = r.error or "no timed runs"
            row["skipped"] = bench.is_skip(runtime, r.error)
        else:
            ms = statistics.median(r.times) * 1e3
            rate = flops / (ms / 1e3) / 1e9
            row.update({"median_ms": ms, "spread_ms": [min(r.medians) * 1e3, max(r.medians) * 1e3],
                        "times_ms": [t * 1e3 for t in r.times],
                        "vs_ort": ort_ms / ms if ort_ms else None, "gflops": rate,
                        "share_of_peak": rate / peak if peak else None,
                        "load_s": statistics.median(r.loads), **r.plan})
            if runtime != bench.ORT and ort is not None:
                row["diff_vs_ort"] = bench.output_diff(r.outputs, ort.outputs)
        rows.append(row)
    failed = any("error" in row for row in rows if row["runtime"] not in (bench.EAGER,
                                                                          bench.CUDA_GRAPH))
    return (1 if failed else 0), {
        "model": str(model), "device": args.device, "threads": args.threads,
        "rounds": args.rounds, "runs": args.runs, "warmup": args.warmup,
        "gflop_per_run": flops / 1e9, "peak_gflops": peak, "results": rows}
