"""backplane.ray without a cluster: rows to inputs and back, fixed batches split and padded, the
Scorer called as an actor would call it, replicas per GPU (Serve's requests: test_answers.py)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ray", reason="backplane.ray needs Ray: pip install 'backplane-nn[ray]'")

import backplane  # noqa: E402
from backplane.ray import BatchError, Scorer  # noqa: E402
from backplane.ray.batches import feeds_from_columns, fixed_batch, run_rows  # noqa: E402
from backplane.ray.loading import threads_of  # noqa: E402
from backplane.ray.serve import replicas, zeros_request  # noqa: E402
from tests.ray.conftest import BERT, MOBILENET, REFERENCE, images, serial  # noqa: E402


@pytest.fixture(scope="module")
def mobilenet() -> backplane.InferenceSession:
    return backplane.InferenceSession(str(MOBILENET), REFERENCE)


def test_fixed_and_free_batch(mobilenet, free_batch_model, batch4_model):
    assert fixed_batch(mobilenet) == 1
    assert fixed_batch(backplane.InferenceSession(free_batch_model, REFERENCE)) is None
    assert fixed_batch(backplane.InferenceSession(batch4_model, REFERENCE)) == 4


@pytest.mark.parametrize("rows", [1, 4, 10])
def test_fixed_batch_of_4_split_and_padded(batch4_model, rows):
    session = backplane.InferenceSession(batch4_model, REFERENCE)
    x = images(rows)
    got = run_rows(session, {"input": x}, ["logits"], fixed=4)["logits"]
    padded = np.concatenate([x, np.zeros((-rows % 4, 3, 64, 64), np.float32)])
    want = serial(session, {"input": padded}, batch=4)[0][:rows]
    assert got.shape == (rows, 10)
    np.testing.assert_array_equal(got, want)


def test_free_batch_runs_once(free_batch_model, mobilenet):
    session = backplane.InferenceSession(free_batch_model, REFERENCE)
    x = images(6)
    got = run_rows(session, {"input": x}, ["logits"], fixed=None)["logits"]
    np.testing.assert_array_equal(got, session.run(None, {"input": x})[0])
    np.testing.assert_allclose(got, serial(mobilenet, {"input": x})[0], rtol=1e-5, atol=1e-6)


def test_empty_batch(mobilenet):
    got = run_rows(mobilenet, {"input": np.zeros((0, 3, 64, 64), np.float32)}, ["logits"], 1)
    assert got["logits"].shape == (0, 10) and got["logits"].dtype == np.float32


def test_scorer_maps_columns_and_keeps_the_others(mobilenet):
    x = images(5)
    scorer = Scorer(str(MOBILENET), REFERENCE, input_columns={"input": "image"},
                    output_columns={"logits": "scores"})
    out = scorer({"id": np.arange(5), "image": x.astype(np.float64)})  # float64: cast to float32
    assert sorted(out) == ["id", "scores"]
    np.testing.assert_array_equal(out["id"], np.arange(5))
    np.testing.assert_array_equal(out["scores"], serial(mobilenet, {"input": x})[0])


def test_scorer_on_several_inputs_and_outputs():
    data = np.load(BERT.with_suffix(".npz"))
    feeds = {name: np.repeat(data[name], 3, axis=0) for name in data.files}
    feeds["input_ids"][1] = (feeds["input_ids"][1] + 7) % 100  # rows that differ
    session = backplane.InferenceSession(str(BERT), REFERENCE)
    out = Scorer(str(BERT), REFERENCE, output_columns=["pooler_output"])(feeds)
    assert sorted(out) == ["pooler_output"]
    np.testing.assert_array_equal(out["pooler_output"], serial(session, feeds)[1])
    assert not np.array_equal(out["pooler_output"][0], out["pooler_output"][1])


def test_artifact_bytes_load_as_the_model(tmp_path, mobilenet):
    path = tmp_path / "mobilenet.bpl"
    backplane.compile(str(MOBILENET), REFERENCE, str(path))
    x = images(3)
    out = Scorer(path.read_bytes())({"input": x})
    np.testing.assert_array_equal(out["logits"], serial(mobilenet, {"input": x})[0])
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("batch, message", [
    ({"image": images(2)}, "input 'input' reads column 'input', which the batch does not have; "
                           "its columns are: image"),
    ({"input": np.zeros((2, 3, 32, 32), np.float32)},
     "column 'input' has rows of shape (3, 32, 32), input 'input' takes rows of shape (3, 64, 64)"),
])
def test_batches_that_do_not_fit(mobilenet, batch, message):
    with pytest.raises(BatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        feeds_from_columns(mobilenet, batch, {})


def test_a_cast_of_another_kind_is_refused():
    bert = backplane.InferenceSession(str(BERT), REFERENCE)
    data = np.load(BERT.with_suffix(".npz"))
    feeds = {name: data[name].astype(np.float32) for name in data.files}
    with pytest.raises(BatchError, match="column 'input_ids' is float32, input 'input_ids' takes "
                                         "int64: not a cast of the same kind"):
        feeds_from_columns(bert, feeds, {})


def test_unknown_column_names_list_the_models():
    with pytest.raises(BatchError,
                       match="output_columns names output 'probs'.*its names are: logits"):
        Scorer(str(MOBILENET), REFERENCE, output_columns=["probs"])
    with pytest.raises(BatchError, match="input_columns names input 'image'.*its names are: input"):
        Scorer(str(MOBILENET), REFERENCE, input_columns={"image": "pixels"})


def test_a_model_that_does_not_load_raises_backplanes_error():
    with pytest.raises(backplane.ModelError, match="not an ONNX model"):
        Scorer(b"not a model")


def test_zeros_request(free_batch_model):
    request = zeros_request(backplane.InferenceSession(free_batch_model, REFERENCE))
    assert request["input"].shape == (3, 64, 64) and request["input"].dtype == np.float32


@pytest.mark.parametrize("gpus, num_replicas, num_gpus, want", [
    (0, None, None, (1, 0)), (0, 3, None, (3, 0)), (4, None, None, (4, 1)),
    (4, None, 0.5, (8, 0.5)), (4, 2, None, (2, 1)), (4, None, 0, (1, 0)),
])
def test_one_replica_per_gpu(gpus, num_replicas, num_gpus, want):
    assert replicas(gpus, num_replicas, num_gpus) == want


def test_an_actors_threads_are_its_cpus_unless_set():
    assert threads_of(2, ["CpuAcc", "CpuRef"], None) == backplane.SessionOptions(
        intra_op_num_threads=2)
    assert threads_of(1, [("CpuAcc", {"threads": 3}), "CpuRef"], None) is None
    given = backplane.SessionOptions(strict=True)
    assert threads_of(1, None, given) is given
    assert threads_of(0.5, None, None) is None
