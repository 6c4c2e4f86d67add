"""The native CNN plan on the session's threads against oneDNN Graph's route on as many: both
sessions in one process, their runs interleaved, so that a busy machine's quiet moments fall on
both alike.

    python bench/cnn_threads.py [--models a,b] [--threads 2] [--runs 200] [--gap-ms 3]
                                [--tier full|small] [--side S]

Why one process: on a 2-vCPU machine shared by other jobs (load 6-12) the best run of a process
says when that process met a quiet moment, and two processes met different ones. Here each model
gets two sessions (``CpuAcc.native`` auto, the size rule lifted, and off; ``CpuAcc.threads`` fixed
at ``--threads``), run in turn, one run each, ``--runs`` times; a pause of ``--gap-ms`` after each
run lets torch's OpenMP threads stop spinning (they spin, then sleep, after a region) before the
other session's run. Printed: the best, 10th percentile and median wall of each, their ratios
(native over oneDNN), the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "tests" / "data" / "corpus"
FULL = Path(os.environ.get("BACKPLANE_CORPUS_FULL", Path.home() / ".cache/backplane/corpus-full"))
MODELS = "resnet_basic_dyn21,mobilenet_dw_ts13,unet_resize_dyn20,yolo_v8_ts17,layout_hswish_ts11"


def _feeds(path: str, side: int) -> dict:
    import numpy as np
    import onnx

    sample = path.replace(".onnx", ".s0.npz")
    rng = np.random.default_rng(0)
    if os.path.exists(sample):
        feeds = dict(np.load(sample))
    else:  # the demo (models/*.onnx): its declared shapes, a symbolic dimension 1
        graph = onnx.load(path, load_external_data=False).graph
        known = {i.name for i in graph.initializer}
        feeds = {i.name: rng.standard_normal([d.dim_value or 1 for d in
                                              i.type.tensor_type.shape.dim]).astype(np.float32)
                 for i in graph.input if i.name not in known}
    if side:
        feeds = {k: rng.standard_normal((*v.shape[:2], side, side)).astype(v.dtype)
                 if v.ndim == 4 else v for k, v in feeds.items()}
    return feeds


def _session(path: str, feeds: dict, mode: str, threads: int):
    from backplane import InferenceSession

    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                               input_shapes={k: list(v.shape) for k, v in feeds.items()},
                               provider_options=[{"CpuAcc.native": mode,
                                                  "CpuAcc.threads": threads}, {}])
    loaded = session.runtime.network(session.network_id)
    routes = [getattr(s.workload, "route", "?") for s, lay in zip(loaded.steps, loaded.layers)
              if lay.op_type in ("OneDnnGraph", "Traced")]
    return session, routes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--tier", choices=("small", "full"), default="full")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--gap-ms", type=float, default=3.0)
    parser.add_argument("--side", type=int, default=0)
    args = parser.parse_args()

    from backplane.backends.torch.fusion import native_cnn

    native_cnn.SMALL = 1 << 62
    folder = SMALL if args.tier == "small" else FULL
    print(f"wall us, {args.threads} threads (fixed), runs interleaved, {args.runs} each, "
          f"gap {args.gap_ms} ms")
    print("| model | native best / p10 / median | oneDNN best / p10 / median | native / oneDNN "
          "best, p10, median | routes | load |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for name in args.models.split(","):
        path = name if name.endswith(".onnx") else str(folder / f"{name}.onnx")
        feeds = _feeds(path, args.side)
        sessions = {mode: _session(path, feeds, mode, args.threads) for mode in ("auto", "off")}
        for session, _ in sessions.values():
            for _ in range(5):
                session.run(None, feeds)
        walls: dict[str, list[float]] = {mode: [] for mode in sessions}
        loads = [os.getloadavg()[0]]
        for _ in range(args.runs):
            for mode, (session, _) in sessions.items():
                start = time.perf_counter()
                session.run(None, feeds)
                walls[mode].append((time.perf_counter() - start) * 1e6)
                time.sleep(args.gap_ms / 1e3)
        loads.append(os.getloadavg()[0])
        figures = {}
        for mode, found in walls.items():
            found.sort()
            figures[mode] = (found[0], found[len(found) // 10], statistics.median(found))
        a, b = figures["auto"], figures["off"]
        routes = " / ".join(",".join(r) for _, r in sessions.values())
        print(f"| {Path(path).stem} | {a[0]:.0f} / {a[1]:.0f} / {a[2]:.0f} | "
              f"{b[0]:.0f} / {b[1]:.0f} / {b[2]:.0f} | {a[0] / b[0]:.2f}, {a[1] / b[1]:.2f}, "
              f"{a[2] / b[2]:.2f} | {routes} | {min(loads):.1f}-{max(loads):.1f} |", flush=True)


if __name__ == "__main__":
    main()
