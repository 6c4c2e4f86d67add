"""Load time from an artifact against load time from the ONNX file, and the artifact's size.

    python bench/artifact.py [MODEL.onnx ...] [--backends CpuRef --backends CpuAcc,CpuRef] [--repeat 3]

Default models: tests/data's tiny models. Per model and backend list: compile time, artifact size
against the model's, and the median load time of (a) InferenceSession(model.onnx) with CpuAcc's
routes already on disk (its best case: nothing measured), (b) the same with an empty route cache
(a first load), (c) InferenceSession(artifact) and (d) a compile-cache hit
(InferenceSession(model, cache_dir=...), with the routes of (a) and (c)); for (a), (c) and (d)
also the median first run after the load (``*_first_s``: a compiled OneDnnGraph of an artifact is
compiled by oneDNN Graph at its first run, so a user of one waits for load + first run), with the
model's saved inputs (``MODEL.npz``) or seeded ones, and ``outputs``: the artifact's first-run
outputs against the ONNX file's ("bitwise", or the largest difference over the largest value: the
round trip). Prints the CPU, the library versions and the load average (1, 5, 15 min) first, and
the load average after each row. On the GPU machine: ``--backends GpuAcc,CpuRef``.
"""

from __future__ import annotations

import argparse
import math
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
from backplane.backends.torch.bench import feeds_for  # noqa: E402


def median_seconds(make, repeat: int, feeds: dict[str, np.ndarray] | None = None,
                   outputs: list | None = None) -> tuple[float, float]:
    """The median time of ``make()`` (a load), and of the first run of what it made on ``feeds``
    (whose outputs go to ``outputs``, if given)."""
    loads, firsts = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        session = make()
        loads.append(time.perf_counter() - start)
        if feeds is not None:
            start = time.perf_counter()
            got = session.run(None, feeds)
            firsts.append(time.perf_counter() - start)
            if outputs is not None:
                outputs[:] = got
        del session
    return statistics.median(loads), statistics.median(firsts) if firsts else math.nan


def bench(model: Path, backends: list[str], repeat: int, folder: Path) -> dict[str, object]:
    routes = folder / "routes"
    os.environ["BACKPLANE_CACHE_DIR"] = str(routes)
    artifact = folder / f"{model.stem}.{'_'.join(backends)}.bpl"
    start = time.perf_counter()
    size = backplane.compile(model, backends, artifact)
    compile_s = time.perf_counter() - start
    feeds = feeds_for(model)
    expected: list[np.ndarray] = []
    warm, warm_first = median_seconds(lambda: InferenceSession(model, backends=backends), repeat,
                                      feeds, expected)

    def cold() -> InferenceSession:
        os.environ["BACKPLANE_CACHE_DIR"] = tempfile.mkdtemp(dir=folder)
        return InferenceSession(model, backends=backends)

    cold_s, _ = median_seconds(cold, repeat)
    os.environ["BACKPLANE_CACHE_DIR"] = str(routes)
    got: list[np.ndarray] = []
    from_artifact, artifact_first = median_seconds(lambda: InferenceSession(artifact), repeat,
                                                   feeds, got)
    cache = folder / "compiled"
    # the routes of (a) and (c), not the cache folder's own: else the entry's routes are measured
    # again, and may differ (a OneDnnGraph compiled in one, layer by layer in the other)
    same_routes = SessionOptions(cache_dir=str(routes))
    InferenceSession(model, backends, same_routes, cache_dir=cache)  # fills the entry
    hit, hit_first = median_seconds(
        lambda: InferenceSession(model, backends, same_routes, cache_dir=cache), repeat, feeds)
    return {"model": model.name, "backends": ",".join(backends),
            "model_bytes": model.stat().st_size, "artifact_bytes": size, "compile_s": compile_s,
            "onnx_warm_s": warm, "onnx_cold_s": cold_s, "artifact_s": from_artifact,
            "cache_hit_s": hit, "onnx_warm_first_s": warm_first, "artifact_first_s": artifact_first,
            "cache_hit_first_s": hit_first, "outputs": _compared(got, expected)}


def _compared(got: list[np.ndarray], expected: list[np.ndarray]) -> str:
    """"bitwise" where the artifact's outputs are the ONNX file's bit for bit, else the largest
    difference over the largest value of the ONNX file's outputs."""
    if len(got) == len(expected) and all(a.dtype == b.dtype and a.shape == b.shape
                                         and a.tobytes() == b.tobytes()
                                         for a, b in zip(got, expected)):
        return "bitwise"
    worst = max((float(np.max(np.abs(a.astype(np.float64) - b), initial=0.0))
                 / max(float(np.max(np.abs(b.astype(np.float64)), initial=0.0)), 1e-30)
                 for a, b in zip(got, expected)), default=float("nan"))
    return f"rel {worst:.1e}"


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
          f"{onnx.__version__}, backplane {backplane.__version__}; load average {load_average()}")
    columns = ("model", "backends", "model_bytes", "artifact_bytes", "compile_s", "onnx_cold_s",
               "onnx_warm_s", "artifact_s", "cache_hit_s", "onnx_warm_first_s", "artifact_first_s",
               "cache_hit_first_s", "outputs")
    print(" | ".join(columns) + " | load speedup (warm onnx / artifact) | load + first run "
          "speedup | load average after")
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for backends in lists:
                row = bench(model, backends, args.repeat, Path(tmp))
                cells = [f"{row[c]:.3f}" if c.endswith("_s") else str(row[c]) for c in columns]
                seconds = {c: float(row[c])  # type: ignore[arg-type]
                           for c in columns if c.endswith("_s")}
                speedup = seconds["onnx_warm_s"] / seconds["artifact_s"]
                both = ((seconds["onnx_warm_s"] + seconds["onnx_warm_first_s"])
                        / (seconds["artifact_s"] + seconds["artifact_first_s"]))
                print(" | ".join(cells) + f" | {speedup:.1f}x | {both:.1f}x | {load_average()}",
                      flush=True)


def load_average() -> str:
    return "/".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    main()
