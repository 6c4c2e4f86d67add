"""Ray Serve on a local cluster: the deployment answers concurrent requests, batched, with the
model's outputs (through a handle and over HTTP), runs its health check, and a model that fails to
load fails the deployment with backplane's error."""

from __future__ import annotations

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
                                   batch_wait_timeout_s=0.05, name="mobilenet")
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
    with pytest.raises(Exception, match="lacks input\\(s\\) input: a request maps every input"):
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


def test_a_model_that_fails_to_load_fails_the_deployment(served):
    with pytest.raises(RuntimeError, match="Deploying application broken failed"):
        serve.run(backplane.ray.deployment(b"not a model", name="broken"), name="broken",
                  route_prefix="/broken")
    message = serve.status().applications["broken"].deployments["broken"].message
    assert "the bytes given are not an ONNX model" in message
    serve.delete("broken")
