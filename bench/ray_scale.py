"""Scoring generated images with a CNN through Ray Data, and serving it with Ray Serve (issue 16).

    python bench/ray_scale.py                        # both parts, on a local cluster of 2 CPUs
    python bench/ray_scale.py --images 8192 --actors 1 2 4 8 --address auto   # a running cluster
    python bench/ray_scale.py --part data            # or: --part serve

Ray Data: the same images scored by a plain loop over one session in this process (batches of
``--batch-size``) and by ``backplane.ray.map_batches`` with 1, 2, ... actors of one thread each;
rounds alternate between them, the median is reported. A Ray Data time is the whole pass: the
actors' start and their model loads are in it (the table's title says how long one load takes
here), and a row of an actor that runs no model shows what Ray Data itself costs.

Serve: ``backplane.ray.deployment`` with one replica of one thread, under a load generator of C
concurrent clients in this process, each sending its next request when the last is answered:
requests per second and latency percentiles, with Serve's batching on (``--max-batch-size``) and
off (1).

The model: a small CNN (five convolutions, 3x64x64 -> 10 classes, free batch dimension) built with
torch.nn and exported with torch.onnx.export; backends CpuAcc, CpuRef.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time

import numpy as np

import backplane
import backplane.ray
import ray
from ray import serve

BACKENDS = [("CpuAcc", {"threads": 1}), "CpuRef"]


def cnn_model(path: str) -> None:
    """A small CNN exported to ONNX with a free batch dimension (weights from a fixed seed)."""
    import torch
    from torch import nn

    torch.manual_seed(0)

    def block(cin: int, cout: int, stride: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride, 1), nn.BatchNorm2d(cout), nn.ReLU()]

    net = nn.Sequential(*block(3, 32, 2), *block(32, 64, 2), *block(64, 128, 2),
                        *block(128, 128, 1), *block(128, 128, 2), nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(), nn.Linear(128, 10)).eval()
    torch.onnx.export(net, (torch.zeros(1, 3, 64, 64),), path, input_names=["input"],
                      output_names=["logits"], opset_version=17, dynamo=False,
                      dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}})


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), platform.processor())
    import onnx
    import torch
    return (f"CPU: {cpu}, {os.cpu_count()} logical CPUs, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
            f"Python {platform.python_version()}, numpy {np.__version__}, "
            f"torch {torch.__version__}, onnx {onnx.__version__}, ray {ray.__version__}, "
            f"backplane {backplane.__version__}")


# -- Ray Data --------------------------------------------------------------------------------------
def plain_loop(model: bytes, images: np.ndarray, batch_size: int) -> float:
    """Seconds to score every image with one session in this process, one batch after the other."""
    session = backplane.InferenceSession(model, BACKENDS)
    start = time.perf_counter()
    for first in range(0, len(images), batch_size):
        session.run(None, {"input": images[first:first + batch_size]})
    return time.perf_counter() - start


class Copy:
    """A callable class that scores nothing (the first pixels as "logits"): what Ray Data itself
    costs on the same rows, without a model."""

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": batch["input"][:, 0, 0, :10].copy()}


def ray_data(model: bytes | None, images: np.ndarray, batch_size: int, actors: int
             ) -> tuple[float, float]:
    """A whole pass of map_batches over ``images`` with ``actors`` actors (``model`` None: of
    ``Copy``): its seconds, and the seconds until its first block came out (the actors' start and
    model loads, mostly)."""
    blocks = np.array_split(images, max(16, 4 * actors))  # blocks for every actor to take
    dataset = ray.data.from_numpy(blocks).rename_columns({"data": "input"})
    if model is None:
        dataset.context.execution_options.preserve_order = True  # as map_batches sets it
        scored = dataset.map_batches(Copy, compute=ray.data.ActorPoolStrategy(size=actors),
                                     num_cpus=1, batch_size=batch_size, batch_format="numpy")
    else:
        scored = backplane.ray.map_batches(dataset, model, backends=BACKENDS, concurrency=actors,
                                           num_cpus=1, batch_size=batch_size)
    start = time.perf_counter()
    rows, first = 0, 0.0
    for batch in scored.iter_batches(batch_size=None):
        rows += len(batch["logits"])
        if not first:
            first = time.perf_counter() - start
    seconds = time.perf_counter() - start
    if rows != len(images):
        raise RuntimeError(f"Ray Data scored {rows} rows of {len(images)}")
    return seconds, first


def bench_data(model: bytes, args: argparse.Namespace) -> None:
    images = np.random.default_rng(0).standard_normal((args.images, 3, 64, 64), np.float32)
    start = time.perf_counter()
    backplane.InferenceSession(model, BACKENDS).run(None, {"input": images[:1]})
    load = time.perf_counter() - start
    runs: dict[str, list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        seconds = plain_loop(model, images, args.batch_size)
        runs.setdefault("plain loop, 1 process", []).append((seconds, 0.0))
        runs.setdefault("Ray Data, 1 actor, no model", []).append(
            ray_data(None, images, args.batch_size, 1))
        for actors in args.actors:
            runs.setdefault(f"Ray Data, {actors} actor(s) x 1 thread", []).append(
                ray_data(model, images, args.batch_size, actors))
        print(f"  round {round_ + 1} of {args.rounds} done", flush=True)
    print(f"\nRay Data: {args.images} images 3x64x64, batches of {args.batch_size}, median of "
          f"{args.rounds} rounds. One session's load and first run here: {load:.2f} s. "
          f"'first out': seconds until the first block came out (the actors' start and more); "
          f"'no model': an actor that copies a few pixels, Ray Data's own cost")
    print(f"| {'how':34} | {'seconds':>7} | {'images/s':>8} | {'vs loop':>7} | "
          f"{'first out':>9} |")
    print(f"| {'-' * 34} | {'-' * 7}:| {'-' * 8}:| {'-' * 7}:| {'-' * 9}:|")
    base = statistics.median(seconds for seconds, _ in runs["plain loop, 1 process"])
    for how, times in runs.items():
        median = statistics.median(seconds for seconds, _ in times)
        first = statistics.median(first for _, first in times)
        print(f"| {how:34} | {median:7.2f} | {args.images / median:8.0f} | "
              f"{base / median:6.2f}x | {first:9.2f} |")


# -- Ray Serve -------------------------------------------------------------------------------------
async def load(handle: serve.handle.DeploymentHandle, clients: int, seconds: float,
               images: np.ndarray) -> list[float]:
    """Latencies of the requests ``clients`` closed-loop clients send for ``seconds``."""
    latencies: list[float] = []
    end = time.perf_counter() + seconds

    async def client(index: int) -> None:
        while time.perf_counter() < end:
            start = time.perf_counter()
            await handle.remote({"input": images[(index + len(latencies)) % len(images)]})
            latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(client(i) for i in range(clients)))
    return latencies


def bench_serve(model: bytes, args: argparse.Namespace) -> None:
    images = np.random.default_rng(1).standard_normal((64, 3, 64, 64), np.float32)
    print(f"\nRay Serve: 1 replica x 1 thread taking {2 * args.max_batch_size} requests at once, "
          f"closed-loop clients in this process, {args.serve_seconds:g} s each (after 1 s of "
          f"warm-up), batches gathered for up to {args.batch_wait_ms:g} ms")
    print(f"| {'max_batch_size':>14} | {'clients':>7} | {'requests':>8} | {'req/s':>7} | "
          f"{'p50 ms':>7} | {'p90 ms':>7} | {'p99 ms':>7} | {'mean batch':>10} |")
    print(f"| {'-' * 14}:| {'-' * 7}:| {'-' * 8}:| {'-' * 7}:| {'-' * 7}:| {'-' * 7}:| {'-' * 7}:| "
          f"{'-' * 10}:|")
    for max_batch in sorted({1, args.max_batch_size}):
        app = backplane.ray.deployment(model, backends=BACKENDS, max_batch_size=max_batch,
                                       batch_wait_timeout_s=args.batch_wait_ms / 1000,
                                       max_ongoing_requests=2 * args.max_batch_size,
                                       name="cnn")
        handle = serve.run(app, name="bench", route_prefix=None)
        for clients in args.clients:
            asyncio.run(load(handle, clients, 1.0, images))
            before = handle.stats.remote().result()
            latencies = np.array(asyncio.run(load(handle, clients, args.serve_seconds, images)))
            after = handle.stats.remote().result()
            p50, p90, p99 = np.percentile(latencies * 1000, [50, 90, 99])
            requests, batches = (after[k] - before[k] for k in ("requests", "batches"))
            batch = requests / batches
            print(f"| {max_batch:14} | {clients:7} | {len(latencies):8} | "
                  f"{len(latencies) / args.serve_seconds:7.1f} | {p50:7.1f} | {p90:7.1f} | "
                  f"{p99:7.1f} | {batch:10.1f} |", flush=True)
        serve.delete("bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["data", "serve", "both"], default="both")
    parser.add_argument("--images", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--serve-seconds", type=float, default=10.0)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--cpus", type=int, default=2, help="a local cluster's CPUs")
    parser.add_argument("--address", default=None, help="a running cluster's (default: local)")
    args = parser.parse_args()
    print(machine())
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    with tempfile.TemporaryDirectory() as folder:
        cnn_model(os.path.join(folder, "cnn.onnx"))
        with open(os.path.join(folder, "cnn.onnx"), "rb") as file:
            model = file.read()  # bytes: through the object store to workers on any machine
    if args.part in ("data", "both"):
        bench_data(model, args)
    if args.part in ("serve", "both"):
        bench_serve(model, args)
    print("\n" + machine().splitlines()[0].split(", load")[0] + ", load average after: "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
