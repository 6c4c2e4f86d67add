"""backplane against ONNX Runtime and eager PyTorch, one model at a time, each runtime in processes of
its own, alternating; a table of median, spread, ratio to ONNX Runtime and GFLOP/s.

Usage:
    python bench/bench_torch.py /tmp/anchors/models/resnet50.onnx
    python bench/bench_torch.py /tmp/anchors/models/*.onnx --backends CpuAcc,CpuRef --threads 2
    python bench/bench_torch.py m.onnx --backends CpuAcc,CpuRef --backends CpuRef --rounds 3
    python bench/bench_torch.py m.onnx --device cuda        # GpuAcc, and a CUDA-graph torch column

The code lives in backplane.bench_engine, so that ``backplane bench`` runs the same.
"""

import sys

from backplane.bench_engine import main

if __name__ == "__main__":
    sys.exit(main())
