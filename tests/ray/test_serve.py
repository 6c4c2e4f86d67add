"""Ray Serve on a local cluster: the deployment answers concurrent requests, batched, with the
model's outputs (through a handle and over HTTP), answers each bad request with its own 4xx and
reason while the good ones sent with it succeed, refuses a body past its size limit, runs its health
check, and a model that fails to load fails the deployment with backplane's error."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import socket
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="backplane.ray needs Ray: pip install 'backplane-nn[ray]'")

from ray import serve  # noqa: E402

import backplane  # noqa: E402
import backplane.ray  # noqa: E402
from tests.ray.conftest import MOBILENET, REFERENCE, images, serial  # noqa: E402

ROUTE = "/score"
LIMIT = 2**20
"""The deployment's max_request_bytes: a MobileNet row as JSON is about 250 kB."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def served(cluster, free_batch_model) -> Iterator[tuple[serve.handle.DeploymentHandle, int]]:
    """The free-batch MobileNet behind Serve (a handle, and HTTP on a port of its own)."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = backplane.ray.deployment(free_batch_model, backends=REFERENCE, max_batch_size=8,
                                   batch_wait_timeout_s=0.05, max_request_bytes=LIMIT,
                                   name="mobilenet")
    yield serve.run(app, name="scoring", route_prefix=ROUTE), port
    serve.shutdown()


@pytest.fixture(scope="module")
def mobilenet() -> backplane.InferenceSession:
    return backplane.InferenceSession(str(MOBILENET), REFERENCE)


def test_concurrent_requests_get_their_own_outputs_batched(served, mobilenet):
    handle, _ = served
    before = handle.stats.remote().result()
    x = images(24, seed=2)
    responses = [handle.remote({"input": x[i]}) for i in range(24)]  # all in flight at once
    got = np.stack([response.result()["logits"] for response in responses])
    np.testing.assert_allclose(got, serial(mobilenet, {"input": x})[0], rtol=1e-4, atol=1e-5)
    after = handle.stats.remote().result()
    requests, batches = (after[k] - before[k] for k in ("requests", "batches"))
    assert requests == 24
    assert batches < requests  # Serve gathered requests into batches


def test_a_request_that_does_not_fit_gets_its_error(served, mobilenet):
    handle, _ = served
    x = images(2, seed=3)
    good, bad = handle.remote({"input": x[0]}), handle.remote({"pixels": x[1]})
    with pytest.raises(Exception, match="lacks input\\(s\\) input and names pixels, not input"):
        bad.result()
    np.testing.assert_allclose(good.result()["logits"], mobilenet.run(None, {"input": x[:1]})[0][0],
                               rtol=1e-4, atol=1e-5)


def test_health_check_runs_the_model(served):
    handle, _ = served
    assert handle.check_health.remote().result() is None
    status = serve.status().applications["scoring"]
    assert status.status == "RUNNING"
    assert status.deployments["mobilenet"].status == "HEALTHY"


def test_over_http(served, mobilenet):
    _, port = served
    x = images(1, seed=4)
    body = json.dumps({"input": x[0].tolist()}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{ROUTE}", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    np.testing.assert_allclose(answer["logits"], mobilenet.run(None, {"input": x})[0][0],
                               rtol=1e-4, atol=1e-5)


def post(port: int, body: bytes, chunked: bool = False) -> tuple[int, bytes]:
    """The status and answer of ``body`` posted to the deployment (``chunked``: in chunks of
    64 kB without a Content-Length)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        if chunked:
            chunks = (body[i:i + 2**16] for i in range(0, len(body), 2**16))
            connection.request("POST", ROUTE, body=chunks, encode_chunked=True,
                               headers={"Content-Type": "application/json"})
        else:
            connection.request("POST", ROUTE, body=body,
                               headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_bad_requests_get_their_own_4xx_while_the_others_succeed(served, free_batch_model):
    handle, port = served
    x = images(4, seed=6)
    ragged = x[0].tolist()
    ragged[2][10] = ragged[2][10][:-1]
    big = json.dumps({"input": [0.5] * (LIMIT // 4)}).encode()
    bad = {  # body, chunked -> the status and the reason
        "ragged": (json.dumps({"input": ragged}).encode(), False, 400,
                   "input 'input' is not an array: input[2][10] has 63 items where 64 are "
                   "expected"),
        "not JSON": (b'{"input": [[[0.5, ', False, 400, "the body is not JSON: "),
        "strings": (json.dumps({"input": np.full((3, 64, 64), "0.5").tolist()}).encode(), False,
                    422, "input 'input' holds strings (<U3), the model takes float32"),
        "unknown": (json.dumps({"input": x[1].tolist(), "mask": [1]}).encode(), False, 422,
                    "the request names mask, not input(s) of the model: a request maps every "
                    "input of the model (input) to one row"),
        "shape": (json.dumps({"input": x[1, :, :32, :32].tolist()}).encode(), False, 422,
                  "input 'input' has shape (3, 32, 32), the model takes rows of shape "
                  "(3, 64, 64)"),
        "too large": (big, False, 413, f"the request's body is {len(big)} bytes (its "
                                       f"Content-Length), over this deployment's limit of {LIMIT}"),
        "too large, chunked": (big, True, 413, f"the request's body is over this deployment's "
                                               f"limit of {LIMIT} bytes (max_request_bytes)"),
    }
    good = [json.dumps({"input": row.tolist()}).encode() for row in x]
    before = handle.stats.remote().result()
    with concurrent.futures.ThreadPoolExecutor(len(good) + len(bad)) as pool:  # all at once
        goods = [pool.submit(post, port, body) for body in good]
        bads = {name: pool.submit(post, port, body, chunked)
                for name, (body, chunked, _, _) in bad.items()}
        answers = [future.result() for future in goods]
        refusals = {name: future.result() for name, future in bads.items()}
    for name, (_, _, status, message) in bad.items():
        assert refusals[name][0] == status, (name, refusals[name])
        assert message in json.loads(refusals[name][1])["error"], (name, refusals[name])
    local = backplane.InferenceSession(free_batch_model, REFERENCE)
    for row, (status, got) in zip(x, answers):
        assert status == 200, got
        want = local.run(None, {"input": row[None]})[0][0]
        np.testing.assert_allclose(json.loads(got)["logits"], want, rtol=1e-5, atol=1e-6)
    after = handle.stats.remote().result()
    assert after["requests"] - before["requests"] == len(good)  # the bad ones never joined one


def test_a_model_that_fails_to_load_fails_the_deployment(served):
    with pytest.raises(RuntimeError, match="Deploying application broken failed"):
        serve.run(backplane.ray.deployment(b"not a model", name="broken"), name="broken",
                  route_prefix="/broken")
    message = serve.status().applications["broken"].deployments["broken"].message
    assert "the bytes given are not an ONNX model" in message
    serve.delete("broken")
