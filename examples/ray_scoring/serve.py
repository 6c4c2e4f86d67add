"""Serving with Ray Serve: one replica per GPU (or one on the CPU), requests batched by Serve.

    python examples/ray_scoring/serve.py --model tests/data/tiny_mobilenet_v3.onnx

Deploys the model, answers one request through a handle and one over HTTP (JSON), then shuts
Serve down. A service runs the same application with ``serve run`` or ``serve.run`` and keeps it.
"""

from __future__ import annotations

import argparse
import json
import urllib.request

import numpy as np

import backplane.ray
import ray
from ray import serve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an ONNX file or a backplane artifact")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    ray.init(num_cpus=2)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    with open(args.model, "rb") as file:
        app = backplane.ray.deployment(file.read(), backends=["GpuAcc", "CpuAcc", "CpuRef"],
                                       max_batch_size=8, batch_wait_timeout_s=0.005)
    handle = serve.run(app, name="scoring", route_prefix="/score")

    image = np.random.default_rng(0).standard_normal((3, 64, 64), np.float32)
    print("handle:", handle.remote({"input": image}).result())
    request = urllib.request.Request(f"http://127.0.0.1:{args.port}/score",
                                     data=json.dumps({"input": image.tolist()}).encode())
    with urllib.request.urlopen(request) as response:
        print("HTTP:  ", json.loads(response.read()))
    serve.shutdown()


if __name__ == "__main__":
    main()
