"""Load time from an artifact against load time from the ONNX file, and the artifact's size.

    python bench/artifact.py [MODEL.onnx ...] [--backends CpuRef --backends CpuAcc,CpuRef] [--repeat 3]

Default models: tests/data's tiny models. Per model and backend list: compile time, artifact size
against the model's, and the median load time of (a) InferenceSession(model.onnx) with CpuAcc's
routes already on disk (its best case: nothing measured), (b) the same with an empty route cache
(a first load), (c) InferenceSession(artifact) and (d) a compile-cache hit
(InferenceSession(model, cache_dir=...), with the routes of (a) and (c)). Prints the CPU and the
library versions first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

import backplane  # noqa: E402
from backplane import InferenceSession, SessionOptions  # noqa: E402
from backplane.artifact.facts import cpu  # noqa: E402


def median_seconds(make, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        make()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(model: Path, backends: list[str], repeat: int, folder: Path) -> dict[str, object]:
    routes = folder / "routes"
    os.environ["BACKPLANE_CACHE_DIR"] = str(routes)
    artifact = folder / f"{model.stem}.{'_'.join(backends)}.bpl"
    start = time.perf_counter()
    size = backplane.compile(model, backends, artifact)
    compile_s = time.perf_counter() - start
    warm = median_seconds(lambda: InferenceSession(model, backends=backends), repeat)

    def cold() -> None:
        os.environ["BACKPLANE_CACHE_DIR"] = tempfile.mkdtemp(dir=folder)
        InferenceSession(model, backends=backends)

    cold_s = median_seconds(cold, repeat)
    os.environ["BACKPLANE_CACHE_DIR"] = str(routes)
    from_artifact = median_seconds(lambda: InferenceSession(artifact), repeat)
    cache = folder / "compiled"
    # the routes of (a) and (c), not the cache folder's own: else the entry's routes are measured
    # again, and may differ (a OneDnnGraph compiled in one, layer by layer in the other)
    same_routes = SessionOptions(cache_dir=str(routes))
    InferenceSession(model, backends, same_routes, cache_dir=cache)  # fills the entry
    hit = median_seconds(lambda: InferenceSession(model, backends, same_routes, cache_dir=cache),
                         repeat)
    return {"model": model.name, "backends": ",".join(backends), "model_bytes": model.stat().st_size,
            "artifact_bytes": size, "compile_s": compile_s, "onnx_warm_s": warm, "onnx_cold_s": cold_s,
            "artifact_s": from_artifact, "cache_hit_s": hit}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--backends", action="append", default=[])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    models = args.models or sorted((ROOT / "tests" / "data").glob("tiny_*.onnx"))
    lists = [b.split(",") for b in args.backends] or [["CpuRef"], ["CpuAcc", "CpuRef"]]
    import torch

    facts = cpu()
    print(f"CPU: {facts['cpu']} ({os.cpu_count()} logical CPUs; ISA: {facts['isa']}); torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}, onnx "
          f"{onnx.__version__}, backplane {backplane.__version__}")
    columns = ("model", "backends", "model_bytes", "artifact_bytes", "compile_s", "onnx_cold_s",
               "onnx_warm_s", "artifact_s", "cache_hit_s")
    print(" | ".join(columns) + " | speedup (warm onnx / artifact)")
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for backends in lists:
                row = bench(model, backends, args.repeat, Path(tmp))
                cells = [f"{row[c]:.3f}" if c.endswith("_s") else str(row[c]) for c in columns]
                speedup = float(row["onnx_warm_s"]) / float(row["artifact_s"])  # type: ignore[arg-type]
                print(" | ".join(cells) + f" | {speedup:.1f}x", flush=True)


if __name__ == "__main__":
    main()
