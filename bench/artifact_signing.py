"""What checking a signature costs an artifact's load: a few hundred MB of weights, loaded unsigned
(each section's XXH3-64) and signed (the header's HMAC and every 16 MiB piece's sha256, on as many
threads as the process may use), in alternating turns.

    python bench/artifact_signing.py [--megabytes 400] [--repeat 7]

The model: a chain of MatMuls with square float32 weights (CpuRef), as many as make --megabytes.
Prints per way the median and the spread of ``container.read`` (the checks alone) and of
``InferenceSession(artifact)`` (the whole load), then one thread's sha256 over the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
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
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import backplane  # noqa: E402
from backplane import InferenceSession, SessionOptions  # noqa: E402
from backplane.artifact import SigningKey, container  # noqa: E402
from backplane.artifact.facts import cpu  # noqa: E402

SIDE = 2048  # 16 MiB per weight


def chain(megabytes: int) -> onnx.ModelProto:
    count = max(1, megabytes * 2**20 // (SIDE * SIDE * 4))
    rng = np.random.default_rng(0)
    nodes, weights, name = [], [], "x"
    for k in range(count):
        weights.append(numpy_helper.from_array(
            rng.standard_normal((SIDE, SIDE), dtype=np.float32) / SIDE, f"w{k}"))
        nodes.append(helper.make_node("MatMul", [name, f"w{k}"], [f"h{k}"]))
        name = f"h{k}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [1, SIDE])], [helper.make_tensor_value_info(
            name, TensorProto.FLOAT, [1, SIDE])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def timed(call) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    print(f"{cpu()['cpu']}, {len(os.sched_getaffinity(0))} CPUs, load {os.getloadavg()}")
    key = SigningKey(os.urandom(32))
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "chain.onnx"
        onnx.save(chain(args.megabytes), model)
        plain, signed = Path(folder) / "plain.bpl", Path(folder) / "signed.bpl"
        backplane.compile(model, ["CpuRef"], plain)
        backplane.compile(model, ["CpuRef"], signed, sign_key=key)
        print(f"artifact {plain.stat().st_size / 1e6:.0f} MB (signed "
              f"{signed.stat().st_size / 1e6:.0f} MB)")
        ways = {"unsigned (xxh3)": (plain, None), "signed (hmac + sha256 pieces)": (signed, key)}
        reads: dict[str, list[float]] = {w: [] for w in ways}
        loads: dict[str, list[float]] = {w: [] for w in ways}
        for turn in range(args.repeat + 1):  # the first turn warms the page cache, not counted
            for way, (path, k) in ways.items():
                read = timed(lambda: container.read(path, k))
                load = timed(lambda: InferenceSession(path, SessionOptions(artifact_key=k)))
                if turn:
                    reads[way].append(read)
                    loads[way].append(load)
        for way in ways:
            print(f"{way}: read {_spread(reads[way])}, InferenceSession {_spread(loads[way])}")
        data = container.read(signed).sections["constants"]
        one = [timed(lambda: hashlib.sha256(data).digest()) for _ in range(args.repeat)]
        print(f"one thread's sha256 of the constants ({len(data) / 1e6:.0f} MB): {_spread(one)}")


def _spread(times: list[float]) -> str:
    return f"{statistics.median(times):.3f} s ({min(times):.3f}-{max(times):.3f})"


if __name__ == "__main__":
    main()
