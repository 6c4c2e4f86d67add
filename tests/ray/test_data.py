"""Ray Data on a local cluster: backplane.ray.map_batches scores the rows as a serial run does, in
the same order, and a model that fails to load fails the actor with backplane's error."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="backplane.ray needs Ray: pip install 'backplane-nn[ray]'")

import backplane  # noqa: E402
import backplane.ray  # noqa: E402
from tests.ray.conftest import MOBILENET, REFERENCE, images, serial  # noqa: E402

TIMEOUT_S = 300  # far above what a run takes: reaching it means a hang


def table(x: np.ndarray) -> ray.data.Dataset:
    """Rows of an id and an image, in several blocks (so that several actors get work)."""
    return ray.data.from_items([{"id": i, "input": x[i]} for i in range(len(x))],
                               override_num_blocks=6)


def scored(dataset: ray.data.Dataset) -> list[dict[str, np.ndarray]]:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(dataset.take_all).result(timeout=TIMEOUT_S)


def test_two_actors_score_as_a_serial_run_in_order(cluster):
    x = images(48)
    rows = scored(backplane.ray.map_batches(table(x), str(MOBILENET), backends=REFERENCE,
                                            concurrency=2, num_cpus=1, batch_size=8))
    assert [row["id"] for row in rows] == list(range(48))
    session = backplane.InferenceSession(str(MOBILENET), REFERENCE)
    np.testing.assert_array_equal(np.stack([row["logits"] for row in rows]),
                                  serial(session, {"input": x})[0])


def test_a_free_batch_from_bytes_with_backend_options(cluster, free_batch_model):
    x = images(40, seed=1)
    backends = [("CpuAcc", {"threads": 1}), "CpuRef"]
    dataset = backplane.ray.map_batches(table(x), free_batch_model, backends=backends,
                                        output_columns={"logits": "scores"}, batch_size=16)
    rows = scored(dataset)
    assert [row["id"] for row in rows] == list(range(40))
    assert sorted(rows[0]) == ["id", "scores"]
    session = backplane.InferenceSession(str(MOBILENET), REFERENCE)
    np.testing.assert_allclose(np.stack([row["scores"] for row in rows]),
                               serial(session, {"input": x})[0], rtol=1e-4, atol=1e-5)


def test_an_artifact_shipped_as_bytes(cluster, tmp_path):
    path = tmp_path / "mobilenet.bpl"
    backplane.compile(str(MOBILENET), REFERENCE, str(path))
    x = images(12, seed=5)
    rows = scored(backplane.ray.map_batches(table(x), path.read_bytes(), batch_size=4))
    session = backplane.InferenceSession(str(MOBILENET), REFERENCE)
    np.testing.assert_array_equal(np.stack([row["logits"] for row in rows]),
                                  serial(session, {"input": x})[0])


def test_a_model_that_fails_to_load_fails_the_actor(cluster):
    with pytest.raises(Exception) as failure:
        scored(backplane.ray.map_batches(table(images(4)), b"not a model"))
    assert not isinstance(failure.value, concurrent.futures.TimeoutError)
    assert "ModelError: the bytes given are not an ONNX model" in str(failure.value)


def test_a_bad_backend_option_fails_the_actor_naming_the_options(cluster):
    with pytest.raises(Exception) as failure:
        scored(backplane.ray.map_batches(table(images(4)), str(MOBILENET),
                                         backends=[("CpuAcc", {"thread": 1})]))
    assert not isinstance(failure.value, concurrent.futures.TimeoutError)
    assert "OptionError" in str(failure.value) and "threads" in str(failure.value)
