"""Serve's requests without a cluster: each request checked alone (the error class says its HTTP
status: MalformedRequest 400, BatchError 422), and a batch of checked requests answered each on its
own: requests of other row shapes run apart, a run that fails on one request fails only it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("ray", reason="backplane.ray needs Ray: pip install 'backplane-nn[ray]'")

import backplane  # noqa: E402
from backplane.ray import BatchError  # noqa: E402
from backplane.ray.answers import (MalformedRequest, ModelRunError, answer,  # noqa: E402
                                   request_rows)
from tests.ray.conftest import MOBILENET, REFERENCE, images, serial  # noqa: E402

ROW = images(1)[0].tolist()
"""One MobileNet row (3, 64, 64) as nested lists, as JSON gives it."""


def ragged() -> list:
    row = [[list(line) for line in plane] for plane in ROW]
    row[1][5].pop()
    return row


@pytest.fixture(scope="module")
def mobilenet() -> backplane.InferenceSession:
    return backplane.InferenceSession(str(MOBILENET), REFERENCE)


def lookup_model() -> bytes:
    """s = ReduceSum(x, axis 1), x (N, L) with L free; g = Gather(table (5, 2), idx (N,)): an
    index past 4 fails the run on CpuRef."""
    table = numpy_helper.from_array(np.arange(10, dtype=np.float32).reshape(5, 2), "table")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),
         helper.make_node("Gather", ["table", "idx"], ["g"], axis=0)], "lookup",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "L"]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["N"]),
         helper.make_tensor_value_info("g", TensorProto.FLOAT, ["N", 2])], [table, axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("request_, error, message", [
    ([ROW], MalformedRequest,
     "a request maps each input name to one row (a JSON object), got list"),
    ({"input": ragged()}, MalformedRequest,
     "input 'input' is not an array: input[1][5] has 63 items where 64 are expected"),
    ({"input": [[[None] * 64] * 64] * 3}, MalformedRequest,
     "input 'input' holds a null among its values: an input is an array of numbers"),
    ({"input": 10**30}, MalformedRequest, "input 'input' holds integers beyond int64"),
    ({"pixels": ROW}, BatchError, "the request lacks input(s) input and names pixels, not input(s) "
                                  "of the model: a request maps every input of the model (input)"),
    ({"input": ROW, "mask": [1]}, BatchError, "the request names mask, not input(s) of the model"),
    ({"input": [[["0.5"] * 64] * 64] * 3}, BatchError,
     "input 'input' holds strings (<U3), the model takes float32: not a cast of the same kind"),
    ({"input": np.zeros((3, 32, 32))}, BatchError,
     "input 'input' has shape (3, 32, 32), the model takes rows of shape (3, 64, 64)"),
])
def test_a_request_that_does_not_fit_is_refused_with_its_reason(mobilenet, request_, error,
                                                                message):
    with pytest.raises(error) as refused:
        request_rows(mobilenet, request_)
    assert message in str(refused.value)
    # the class is the HTTP status: MalformedRequest 400, any other BatchError 422
    assert isinstance(refused.value, MalformedRequest) == (error is MalformedRequest)


def test_a_request_of_lists_becomes_a_row_of_the_inputs_dtype(mobilenet):
    feeds = request_rows(mobilenet, {"input": ROW})
    assert feeds["input"].shape == (1, 3, 64, 64) and feeds["input"].dtype == np.float32
    np.testing.assert_array_equal(feeds["input"][0], np.asarray(ROW, np.float32))


def test_a_batch_answers_each_request(mobilenet):
    x = images(3)
    answers = answer(mobilenet, [request_rows(mobilenet, {"input": row}) for row in x],
                     ["logits"], fixed=1)
    want = serial(mobilenet, {"input": x})[0]
    for got, row in zip(answers, want):
        assert isinstance(got, dict)
        np.testing.assert_array_equal(got["logits"], row)


def test_a_run_that_fails_on_one_request_fails_it_alone():
    session = backplane.InferenceSession(lookup_model(), REFERENCE)
    requests = [{"x": [1.0, 2.0], "idx": 1}, {"x": [3.0, 4.0], "idx": 7},  # 7: past the table
                {"x": [5.0, 6.0, 7.0], "idx": 4},  # another length: a run of its own
                {"x": [8.0, 9.0], "idx": 0}]
    answers = answer(session, [request_rows(session, r) for r in requests], ["s", "g"], None)
    for request, got in zip(requests, answers):
        if request["idx"] == 7:
            continue
        assert isinstance(got, dict)
        s, g = session.run(None, request_rows(session, request))
        np.testing.assert_array_equal(got["s"], s[0])
        np.testing.assert_array_equal(got["g"], g[0])
    assert isinstance(answers[1], ModelRunError)
    with pytest.raises(backplane.ExecutionError) as alone:
        session.run(None, request_rows(session, requests[1]))
    assert str(answers[1]) == f"the model's run failed on this request: ExecutionError: " \
                              f"{alone.value}"

