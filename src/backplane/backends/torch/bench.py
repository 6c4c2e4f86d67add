"""Moved to ``backplane.bench_engine`` (the parent side) and ``backplane.bench_worker`` (each
process): ``backplane bench`` times ONNX Runtime, OpenVINO and CpuRef as well, so its engine lives
beside the command line. This name stays so that ``from backplane.backends.torch.bench import ...``
(the scripts under bench/) keeps working."""

from __future__ import annotations

import sys

from backplane.bench_engine import *  # noqa: F401,F403
from backplane.bench_engine import main
from backplane.bench_worker import *  # noqa: F401,F403

if __name__ == "__main__":
    sys.exit(main())
