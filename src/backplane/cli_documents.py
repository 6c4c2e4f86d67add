"""What ``backplane run`` prints and returns: the layer and backend tables, the JSON document, each
output's summary, and the route each compiled subgraph took (split from ``cli.py``)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import numpy as np
from rich.table import Table

from backplane.optimizer.report import unfolded_table
from backplane.runtime.loaded_network import LayerTiming
from backplane.session import InferenceSession


def compiled_routes(session: InferenceSession) -> list[str]:
    """How each subgraph a backend compiles as one layer runs, and why (issue 27, item 2): the
    route its workload took (``route``) and the reason it gives (``why``): "OneDnnGraph[...]:
    onednn_graph, measured fastest at load, 0.52 ms (layers 0.61 ms)"."""
    loaded = session.runtime.network(session.network_id)
    lines = []
    for step, layer in zip(loaded.steps, loaded.layers):
        route, why = getattr(step.workload, "route", None), getattr(step.workload, "why", None)
        if route is not None and why is not None and layer.op_type in ("OneDnnGraph", "Traced"):
            lines.append(f"{layer.name}: {why}" if why.startswith(f"{route}:") else
                         f"{layer.name}: {route}, {why}")
    return lines


def _run_document(args: argparse.Namespace, session: InferenceSession, timings: list[LayerTiming],
                  totals: list[float], outputs: list[Any], trace: str | None) -> dict[str, Any]:
    document: dict[str, Any] = {
        "model": args.model, "backends": session.get_providers(),
        "default_backends": getattr(args, "default_backends", False),
        "placement": session.report.counts(),
        "layers": [{"index": i, "layer": t.layer, "op_type": t.op_type, "backend": t.backend,
                    "ms": t.seconds * 1e3} for i, t in enumerate(timings)],
        "per_backend": _per_backend(timings),
        "runs": {"count": len(totals)} | ({
            "median_ms": statistics.median(totals) * 1e3, "min_ms": min(totals) * 1e3,
            "max_ms": max(totals) * 1e3} if totals else {}),
        "outputs": [_output(arg.name, value) for arg, value in zip(session.get_outputs(), outputs)],
    }
    if trace:
        document["trace"] = trace
    return document


def _output(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, np.ndarray):
        entry: dict[str, Any] = {"name": name, "dtype": str(value.dtype), "shape": list(value.shape)}
        if value.dtype.kind in "biuf" and value.size:
            flat = value.reshape(-1)
            entry["first"] = flat[:5].tolist()
            if value.ndim <= 2:
                entry["argmax"] = int(np.argmax(flat))
        return entry
    return {"name": name, "value": repr(value)}


def _keep_faster(best: list[LayerTiming], new: list[LayerTiming]) -> list[LayerTiming]:
    """Per layer, the faster of two runs (the steadiest view of where time goes)."""
    return [a if a.seconds <= b.seconds else b for a, b in zip(best, new)]


def _per_backend(timings: list[LayerTiming]) -> list[dict[str, Any]]:
    total = sum(t.seconds for t in timings) or 1.0
    rows = []
    for backend in dict.fromkeys(t.backend for t in timings):
        mine = [t.seconds for t in timings if t.backend == backend]
        rows.append({"backend": backend, "layers": len(mine), "ms": sum(mine) * 1e3,
                     "share": sum(mine) / total})
    return rows


def _layer_table(timings: list[LayerTiming]) -> Table:
    rows = [(str(i), t.layer, t.op_type, t.backend, f"{t.seconds * 1e3:.3f}")
            for i, t in enumerate(timings)]
    return unfolded_table("Where each layer ran (fastest of the runs)",
                          ("#", "layer", "op", "backend", "ms"), rows, right=("#", "ms"))


def _backend_table(timings: list[LayerTiming]) -> Table:
    rows = [(r["backend"], str(r["layers"]), f"{r['ms']:.2f}", f"{r['share']:.0%}")
            for r in _per_backend(timings)]
    return unfolded_table("Per backend", ("backend", "layers", "ms", "share"), rows,
                          right=("layers", "ms", "share"))


def _summary(value: Any) -> str:
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.size:
        flat = value.reshape(-1)
        top = int(np.argmax(flat)) if value.ndim <= 2 else None
        head = np.array2string(flat[:5], precision=4, separator=", ")
        extra = f", argmax {top}" if top is not None else ""
        return f"{value.dtype}{list(value.shape)} first {head}{extra}"
    return repr(value)
