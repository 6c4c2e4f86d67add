"""Zero-copy fallback in the middle of a GPU network: does it pay, given the GPU's asynchrony?

The Ethos-N design's open question, in figures. A model runs on GpuAcc with one block in its middle
forced (pinned) to another backend:

- ``all-gpu``: no pin, GpuAcc takes everything it can (the baseline);
- ``copy``: the block pinned to CpuRef: the tensors cross to the host and back (two copies each, and
  the host waits for the GPU before the block);
- ``zero-copy``: the block pinned to TritonGpu (examples/triton_gpu), a second GPU backend with its own
  stream: the tensors are imported both ways through DLPack, the streams wait on events, the host
  never waits inside the run.

The block: the chain of elementwise layers (Add, Mul, Sub, Div, Relu, Sigmoid, Tanh: what TritonGpu
runs) around the model's middle residual Add. Each (model, mode) runs in its own process, the modes
alternating, batch 1, inputs and outputs in CUDA memory through IOBinding (so the figures are the
network's own, not the user's uploads).

Usage (on a GPU machine):
    python bench/zero_copy.py MODEL.onnx [MODEL.onnx ...] [--runs 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODES = ("all-gpu", "copy", "zero-copy")
CHAIN_OPS = {"Add", "Mul", "Sub", "Div", "Relu", "Sigmoid", "Tanh"}


def middle_block(graph) -> list[str]:
    """Names of the elementwise layers chained to the model's middle residual Add (an Add of two
    computed tensors)."""
    producers = {o: layer for layer in graph.layers for o in layer.outputs}
    consumers: dict[str, list] = {}
    for layer in graph.layers:
        for name in layer.inputs:
            consumers.setdefault(name, []).append(layer)
    residual = [layer for layer in graph.layers if layer.op_type == "Add"
                and all(n in producers and n not in graph.constants for n in layer.inputs)]
    if not residual:
        raise SystemExit("no residual Add in the model")
    middle = residual[len(residual) // 2]
    block = [middle]
    after = middle
    while True:  # the elementwise layers right after it, while each is the only reader
        readers = consumers.get(after.outputs[0], [])
        if len(readers) != 1 or readers[0].op_type not in CHAIN_OPS:
            break
        after = readers[0]
        block.append(after)
    return [layer.name for layer in block]


def feeds(session) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    values = {}
    for arg in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in arg.shape]
        if "int" in arg.type:
            if "mask" in arg.name:
                values[arg.name] = np.ones(shape, np.int64)
            elif "type" in arg.name:  # token types: 0 or 1
                values[arg.name] = np.zeros(shape, np.int64)
            else:
                values[arg.name] = rng.integers(0, 1000, shape).astype(np.int64)
        else:
            values[arg.name] = rng.standard_normal(shape).astype(np.float32)
    return values


def child(model: str, mode: str, runs: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "examples" / "triton_gpu" / "src"))
    import triton_gpu_backend

    from backplane import InferenceSession
    from backplane.backends.registry import registry
    from backplane.frontends.onnx import import_onnx, load_model

    registry.register("TritonGpu", triton_gpu_backend.backend_factory, origin="examples/")
    block = middle_block(import_onnx(load_model(model)[0]))
    pins = {} if mode == "all-gpu" else \
        {name: "CpuRef" if mode == "copy" else "TritonGpu" for name in block}
    session = InferenceSession(model, ["GpuAcc", "TritonGpu", "CpuRef"], pins=pins)
    report = session.report
    crossings = [c for c in report.copies if "user" not in (c.source, c.target)]
    host = feeds(session)
    binding = session.io_binding()
    for name, value in host.items():
        binding.bind_input(name, torch.from_numpy(value).cuda())
    for arg in session.get_outputs():
        binding.bind_output(arg.name, "cuda")
    for _ in range(20):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run_with_iobinding(binding)  # synchronizes the outputs before it returns
        times.append(time.perf_counter() - start)
    out = binding.copy_outputs_to_cpu()
    return {"ms": statistics.median(times) * 1e3, "block": block,
            "copies": sum(c.strategy == "copy" for c in crossings),
            "imports": sum(c.strategy == "import" for c in crossings),
            "copied_bytes": sum(c.nbytes or 0 for c in crossings if c.strategy == "copy"),
            "partitions": len(report.subgraphs) if hasattr(report, "subgraphs") else None,
            "checksum": float(sum(np.abs(o).sum() for o in out))}


def machine() -> str:
    import onnx
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return (f"{gpu}; python {platform.python_version()}, torch {torch.__version__}, triton "
            f"{triton_version}, onnx {onnx.__version__}, numpy {np.__version__}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.runs)))
        return 0
    print(machine(), flush=True)
    for model in args.models:
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for round_ in range(args.rounds):
            order = MODES if round_ % 2 == 0 else MODES[::-1]  # alternating
            for mode in order:
                done = subprocess.run([sys.executable, __file__, "--runs", str(args.runs),
                                       "--child", model, mode], capture_output=True, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
                if done.returncode:
                    print(done.stderr[-3000:], file=sys.stderr)
                    return 1
                results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
        name = Path(model).stem
        block = results["copy"][0]["block"]
        print(f"\n{name}: block of {len(block)} layers pinned: {', '.join(block)}")
        print(f"{'mode':>10} {'median ms (each round)':>32} {'copies':>7} {'imports':>8} "
              f"{'bytes copied':>13}")
        base = min(r["ms"] for r in results["all-gpu"])
        for mode in MODES:
            rounds = results[mode]
            ms = " ".join(f"{r['ms']:.3f}" for r in rounds)
            best = min(r["ms"] for r in rounds)
            print(f"{mode:>10} {ms:>32} {rounds[0]['copies']:>7} {rounds[0]['imports']:>8} "
                  f"{rounds[0]['copied_bytes']:>13}   x{best / base:.2f} of all-gpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
