"""Batch scoring with Ray Data: generated images through an ONNX CNN, the scores to Parquet.

    python examples/ray_scoring/score.py --model tests/data/tiny_mobilenet_v3.onnx --images 2000
    python examples/ray_scoring/score.py --model model.onnx --address auto --actors 8 --gpus 1

Each actor holds one backplane session; the model goes to the actors as bytes through Ray's
object store (put once), so workers on other machines need no copy of the file. The images here
are generated; a real job reads its own (``ray.data.read_images``, ``read_parquet``...) and maps
them to the model's input shape first.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import backplane.ray
import ray


def images(count: int, shape: tuple[int, ...]) -> ray.data.Dataset:
    """``count`` rows of an id and a generated float32 image of ``shape``."""
    def generate(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(int(batch["id"][0]))
        return {"id": batch["id"],
                "image": rng.standard_normal((len(batch["id"]), *shape), np.float32)}
    return ray.data.range(count).map_batches(generate, batch_size=256, num_cpus=0.25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an ONNX file or a backplane artifact")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--actors", type=int, default=2)
    parser.add_argument("--gpus", type=float, default=0, help="GPUs per actor (GpuAcc first)")
    parser.add_argument("--output", default="/tmp/backplane_scores")
    parser.add_argument("--address", default=None, help="a running cluster's (default: local)")
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.actors + 1)  # the actors' CPUs, and one for the other steps

    with open(args.model, "rb") as file:
        model = file.read()
    backends = ["GpuAcc", "CpuAcc", "CpuRef"] if args.gpus else ["CpuAcc", "CpuRef"]
    shape = (3, 64, 64)  # tiny_mobilenet_v3's input without its batch dimension
    scored = backplane.ray.map_batches(images(args.images, shape), model, backends=backends,
                                       input_columns={"input": "image"}, concurrency=args.actors,
                                       num_cpus=1, num_gpus=args.gpus, batch_size=64)
    top = scored.map_batches(lambda b: {**b, "class": b["logits"].argmax(axis=1)}, batch_size=256,
                             num_cpus=0.25)
    start = time.perf_counter()
    top.write_parquet(args.output)
    seconds = time.perf_counter() - start
    print(f"{args.images} images scored by {args.actors} actor(s) in {seconds:.1f} s "
          f"({args.images / seconds:.0f} images/s): {args.output}")
    print(ray.data.read_parquet(args.output).take(3))


if __name__ == "__main__":
    main()
