"""Ray Serve: a deployment around one session per replica, with Serve's dynamic request batching.

A request maps each model input to one row (the input's shape without the batch dimension);
Serve gathers the requests that arrive within ``batch_wait_timeout_s`` (at most
``max_batch_size``) and the replica runs them as one batch, answering each with its own row of
every output. Over HTTP the request is a JSON object of the same names (nested lists) and so is
the answer. Each request is checked alone before it joins a batch: one that does not fit gets its
own error (over HTTP a 4xx and ``{"error": message}``) and never fails the others.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

import ray
from backplane.ray.answers import MalformedRequest, ModelRunError, answer, request_rows
from backplane.ray.batches import BatchError, fixed_batch, run_rows
from backplane.ray.loading import Model, load_session, threads_of
from backplane.session import BackendSpec, InferenceSession, SessionOptions
from ray import serve

MAX_REQUEST_BYTES = 8 * 2**20
"""The default limit of an HTTP request's body: a 3x224x224 float image as JSON is about 3 MB."""


class RequestTooLarge(ValueError):
    """An HTTP request's body over the deployment's ``max_request_bytes`` (HTTP 413)."""


STATUS: dict[type[Exception], int] = {
    RequestTooLarge: 413,  # refused before its body is read (or once it passes the limit)
    MalformedRequest: 400,  # not a request whatever the model: not JSON, ragged, a null
    BatchError: 422,  # well-formed, but not this model's: names, dtype, shape
    ModelRunError: 500,  # the model's run failed on this request, run alone
}
"""An HTTP answer's status for each error of a request: the first of its classes found here."""


@serve.deployment
class ModelDeployment:
    """One session per replica; ``__call__`` answers a request, batched with the others waiting.

    Args:
        model, backends, sess_options, session_kwargs: as ``backplane.ray.Scorer`` takes them.
        max_batch_size, batch_wait_timeout_s: Serve's batching: the most requests run as one
            batch, and how long the first of them waits for others.
        health_request: the request the health check runs (each input -> one row); default:
            zeros of every input's row shape, free dimensions 1.
        max_request_bytes: the most bytes of an HTTP request's body (None: no limit); a larger
            one is refused with 413 before it is read (from its Content-Length) or once the
            bytes read pass the limit (a body without Content-Length).
    """

    def __init__(self, model: Model, backends: Sequence[BackendSpec] | None = None,
                 sess_options: SessionOptions | None = None, *, max_batch_size: int = 8,
                 batch_wait_timeout_s: float = 0.005,
                 health_request: Mapping[str, Any] | None = None,
                 session_kwargs: Mapping[str, Any] | None = None,
                 max_request_bytes: int | None = MAX_REQUEST_BYTES) -> None:
        self.max_request_bytes = checked_limit(max_request_bytes)
        self.session = load_session(model, backends, sess_options, session_kwargs)
        self.fixed = fixed_batch(self.session)
        self.outputs = [arg.name for arg in self.session.get_outputs()]
        self.health_request = health_request if health_request is not None \
            else zeros_request(self.session)
        self.served = {"requests": 0, "batches": 0}
        self.run_batch.set_max_batch_size(max_batch_size)
        self.run_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.check_health()  # a model that loads but does not run fails the replica at its start

    async def __call__(self, request: Any) -> Any:
        """The outputs of one request: output name -> row.

        Through a handle, a request that does not fit raises its error (``MalformedRequest``,
        ``BatchError``; ``ModelRunError`` where the run failed on it). Over HTTP the answer is a
        JSON object of lists, or the error's status (``STATUS``) and ``{"error": message}``.
        """
        if not isinstance(request, Request):
            return _raised(await self.run_batch(request_rows(self.session, request)))
        try:
            body = await read_body(request, self.max_request_bytes)
            # on the event loop: json.loads and np.asarray of lists hold the GIL, a thread
            # would not let the loop run meanwhile
            feeds = parsed_request(self.session, body)
            result = _raised(await self.run_batch(feeds))
        except tuple(STATUS) as exc:
            status = next(STATUS[cls] for cls in type(exc).__mro__ if cls in STATUS)
            return JSONResponse({"error": str(exc)}, status_code=status)
        return {name: value.tolist() for name, value in result.items()}

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)  # set again from the arguments
    async def run_batch(self, requests: list[dict[str, np.ndarray]]
                        ) -> list[dict[str, np.ndarray] | ModelRunError]:
        """Each checked request's outputs, or its error where the model's run failed on it."""
        self.served["requests"] += len(requests)
        self.served["batches"] += 1
        return await asyncio.to_thread(answer, self.session, requests, self.outputs, self.fixed)

    def stats(self) -> dict[str, int]:
        """The requests this replica answered and the batches they ran in (to tune batching)."""
        return dict(self.served)

    def check_health(self) -> None:
        """Serve's health check: the model runs once (an error marks the replica unhealthy)."""
        feeds = request_rows(self.session, self.health_request)
        run_rows(self.session, feeds, self.outputs, self.fixed)


def _raised(result: dict[str, np.ndarray] | ModelRunError) -> dict[str, np.ndarray]:
    if isinstance(result, ModelRunError):  # this request's own error; the others got theirs
        raise result
    return result


def checked_limit(max_request_bytes: int | None) -> int | None:
    """``max_request_bytes`` where it is a limit (an int >= 1) or None; ValueError otherwise."""
    if max_request_bytes is not None and (not isinstance(max_request_bytes, int)
                                          or isinstance(max_request_bytes, bool)
                                          or max_request_bytes < 1):
        raise ValueError(f"max_request_bytes must be a number of bytes >= 1 or None (no limit), "
                         f"got {max_request_bytes!r}")
    return max_request_bytes


async def read_body(request: Request, limit: int | None) -> bytes:
    """The body of ``request``, refused past ``limit`` bytes (None: no limit): from its
    Content-Length before a byte is read, else once the bytes read pass it.

    Raises:
        RequestTooLarge: over the limit.
        MalformedRequest: a Content-Length that is not a number.
    """
    declared = request.headers.get("content-length")
    if declared is not None and not declared.isdigit():
        raise MalformedRequest(f"Content-Length {declared!r} is not a number of bytes")
    if limit is not None and declared is not None and int(declared) > limit:
        raise RequestTooLarge(f"the request's body is {int(declared)} bytes (its Content-Length), "
                              f"over this deployment's limit of {limit} (max_request_bytes)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit is not None and size > limit:
            raise RequestTooLarge(f"the request's body is over this deployment's limit of "
                                  f"{limit} bytes (max_request_bytes): refused at {size} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parsed_request(session: InferenceSession, body: bytes) -> dict[str, np.ndarray]:
    """An HTTP request's JSON body as the feeds of one row (``request_rows``)."""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise MalformedRequest(f"the body is not JSON: {exc}") from exc
    return request_rows(session, request)


def zeros_request(session: InferenceSession) -> dict[str, np.ndarray]:
    """A request of zeros: every input's row shape, free dimensions 1."""
    request = {}
    for arg in session.get_inputs():
        info = session.graph.info(arg.name)
        row = [d if isinstance(d, int) and d >= 0 else 1 for d in (info.shape or [1])[1:]]
        request[arg.name] = np.zeros(row, info.dtype)
    return request


def replicas(cluster_gpus: float, num_replicas: int | None, num_gpus: float | None
             ) -> tuple[int, float]:
    """(replicas, GPUs per replica): one replica per GPU where the cluster has GPUs and neither is
    given; one replica of no GPU where it has none."""
    if num_gpus is None:
        num_gpus = 1 if cluster_gpus >= 1 else 0
    if num_replicas is None:
        num_replicas = int(cluster_gpus // num_gpus) if num_gpus else 1
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas} (the cluster has "
                         f"{cluster_gpus:g} GPUs, {num_gpus:g} per replica)")
    return num_replicas, num_gpus


def deployment(model: Model, *, backends: Sequence[BackendSpec] | None = None,
               sess_options: SessionOptions | None = None, num_replicas: int | None = None,
               num_cpus: float = 1, num_gpus: float | None = None, max_batch_size: int = 8,
               batch_wait_timeout_s: float = 0.005,
               health_request: Mapping[str, Any] | None = None,
               session_kwargs: Mapping[str, Any] | None = None,
               max_request_bytes: int | None = MAX_REQUEST_BYTES,
               **deployment_options: Any) -> serve.Application:
    """A Serve application of ``ModelDeployment`` for ``model``, to ``serve.run``.

    Replicas: one per GPU of the cluster, each holding one (``num_gpus=1``), where the cluster has
    GPUs and ``num_replicas`` / ``num_gpus`` are not given; else ``num_replicas`` (default 1).
    Where ``sess_options`` is not given and no backend sets its threads, a replica's threads are
    ``num_cpus``. Each replica takes up to twice ``max_batch_size`` requests at once (Serve's
    ``max_ongoing_requests``), so that a batch can fill while another runs. An HTTP request's
    body is refused (413) past ``max_request_bytes`` (default 8 MiB; None: no limit).
    ``deployment_options`` go to ``ModelDeployment.options`` (``name``, ``health_check_period_s``,
    ``max_ongoing_requests``...).
    """
    if not ray.is_initialized():
        ray.init()
    checked_limit(max_request_bytes)  # here, not at the replicas' start
    count, gpus = replicas(ray.cluster_resources().get("GPU", 0), num_replicas, num_gpus)
    sess_options = threads_of(num_cpus, backends, sess_options)
    deployment_options.setdefault("max_ongoing_requests", 2 * max_batch_size)
    options = ModelDeployment.options(
        num_replicas=count, ray_actor_options={"num_cpus": num_cpus, "num_gpus": gpus},
        **deployment_options)
    # bytes go as they are, not as an object ref: the application outlives the driver's refs
    return options.bind(model, backends, sess_options, max_batch_size=max_batch_size,
                        batch_wait_timeout_s=batch_wait_timeout_s, health_request=health_request,
                        session_kwargs=session_kwargs, max_request_bytes=max_request_bytes)
