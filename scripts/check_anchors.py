"""Check the anchor models against ONNX Runtime: max|out - ORT| / max|ORT| per model and backend list.

Usage:
    python scripts/check_anchors.py [--models-dir /tmp/anchors] [--backends CpuRef --backends CpuAcc,CpuRef]

By default two backend lists: CpuRef alone, and the tests' partial backend (``TestPartial``: Conv,
Relu, Add, MatMul, Gemm and Mul on CpuRef's kernels, tests/conftest.py) in front of CpuRef, so that
every model runs split over two backends. Inputs are bench_torch's seeded feeds. Exit status 1 when a
difference is above ``--tolerance`` (default 1e-4).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ANCHORS = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "bert_base_s128", "gpt2_6l_512_s128"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/anchors"))
    ap.add_argument("--models", default=",".join(ANCHORS))
    ap.add_argument("--backends", action="append", default=[])
    ap.add_argument("--tolerance", type=float, default=1e-4)
    args = ap.parse_args()

    import logging

    import onnxruntime as ort
    from rich.console import Console
    from rich.table import Table

    import backplane
    from backplane.backends.registry import registry
    from backplane.backends.torch.bench import make_feeds

    sys.path.insert(0, str(ROOT))
    from tests.conftest import PartialBackend

    logging.getLogger("backplane.optimizer").setLevel(logging.ERROR)  # fallbacks are expected here
    registry.register(PartialBackend.id, PartialBackend)
    lists = args.backends or ["CpuRef", "TestPartial,CpuRef"]
    table = Table(title="max|out - ORT| / max|ORT| (layers per backend)")
    table.add_column("model")
    for backends in lists:
        table.add_column(backends, justify="right")
    worst = 0.0
    for name in args.models.split(","):
        path = args.models_dir / f"{name}.onnx"
        feeds = make_feeds(path)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        expected = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(
            None, feeds)
        cells = [name]
        for backends in lists:
            session = backplane.InferenceSession(str(path), backends=backends.split(","))
            outputs = session.run(None, feeds)
            diff = max(float(np.abs(a.astype(np.float64) - b).max() / np.abs(b).max())
                       for a, b in zip(outputs, expected))
            worst = max(worst, diff)
            counts = ", ".join(f"{k} {v}" for k, v in session.report.counts().items())
            cells.append(f"{diff:.1e} ({counts})")
        table.add_row(*cells)
    Console(width=160).print(table)
    return 1 if worst > args.tolerance else 0


if __name__ == "__main__":
    sys.exit(main())
