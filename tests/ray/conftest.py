"""One local Ray cluster for the tests of this folder (Ray's start is most of their time), and the
models they score: tests/data's tiny MobileNet (batch fixed at 1), the same with a free batch
dimension, and with a batch fixed at 4. Each test file skips itself where Ray is absent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

DATA = Path(__file__).parent.parent / "data"
MOBILENET = DATA / "tiny_mobilenet_v3.onnx"
BERT = DATA / "tiny_bert.onnx"
REFERENCE = ["CpuRef"]
"""The backends of the exact comparisons (named: the session's default depends on the machine)."""


@pytest.fixture(scope="package")
def cluster() -> Iterator[None]:
    """``ray.init(num_cpus=2)``, shared by every test here that needs a cluster."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def with_batch(path: Path, batch: int | str) -> bytes:
    """The model with its inputs' and outputs' first dimension set to ``batch`` (a str: free)."""
    model = onnx.load(str(path))
    for value in [*model.graph.input, *model.graph.output]:
        dim = value.type.tensor_type.shape.dim[0]
        if isinstance(batch, str):
            dim.dim_param = batch
        else:
            dim.dim_value = batch
    return model.SerializeToString()


@pytest.fixture(scope="package")
def free_batch_model() -> bytes:
    return with_batch(MOBILENET, "N")


@pytest.fixture(scope="package")
def batch4_model() -> bytes:
    return with_batch(MOBILENET, 4)


def images(count: int, seed: int = 0) -> np.ndarray:
    """``count`` generated images the shape MobileNet takes, (count, 3, 64, 64) float32."""
    return np.random.default_rng(seed).standard_normal((count, 3, 64, 64)).astype(np.float32)


def serial(session, feeds: dict[str, np.ndarray], batch: int | None = 1) -> list[np.ndarray]:
    """The outputs of ``feeds`` run one slice of ``batch`` rows after the other (None: at once)."""
    rows = len(next(iter(feeds.values())))
    step = rows if batch is None else batch
    parts = [session.run(None, {n: v[i:i + step] for n, v in feeds.items()})
             for i in range(0, rows, step)]
    return [np.concatenate([p[k] for p in parts]) for k in range(len(parts[0]))]
