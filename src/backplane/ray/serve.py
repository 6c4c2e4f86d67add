"""Ray Serve: a deployment around one session per replica, with Serve's dynamic request batching.

A request maps each model input to one row (the input's shape without the batch dimension);
Serve gathers the requests that arrive within ``batch_wait_timeout_s`` (at most
``max_batch_size``) and the replica runs them as one batch, answering each with its own row of
every output. Over HTTP the request is a JSON object of the same names (nested lists) and so is
the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import ray
from backplane.ray.batches import answer, fixed_batch, request_rows, run_rows
from backplane.ray.loading import Model, load_session, threads_of
from backplane.session import BackendSpec, InferenceSession, SessionOptions
from ray import serve


@serve.deployment
class ModelDeployment:
    """One session per replica; ``__call__`` answers a request, batched with the others waiting.

    Args:
        model, backends, sess_options, session_kwargs: as ``backplane.ray.Scorer`` takes them.
        max_batch_size, batch_wait_timeout_s: Serve's batching: the most requests run as one
            batch, and how long the first of them waits for others.
        health_request: the request the health check runs (each input -> one row); default:
            zeros of every input's row shape, free dimensions 1.
    """

    def __init__(self, model: Model, backends: Sequence[BackendSpec] | None = None,
                 sess_options: SessionOptions | None = None, *, max_batch_size: int = 8,
                 batch_wait_timeout_s: float = 0.005,
                 health_request: Mapping[str, Any] | None = None,
                 session_kwargs: Mapping[str, Any] | None = None) -> None:
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
        """The outputs of one request: output name -> row (a JSON object of lists over HTTP)."""
        over_http = hasattr(request, "json") and callable(request.json)
        if over_http:
            request = await request.json()
        result = await self.run_batch(request)
        if isinstance(result, Exception):  # this request's own error; the others got theirs
            raise result
        return {name: value.tolist() for name, value in result.items()} if over_http else result

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.005)  # set again from the arguments
    async def run_batch(self, requests: list[Any]) -> list[dict[str, np.ndarray] | Exception]:
        """Each request's outputs, or its error where it does not fit the model."""
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
               **deployment_options: Any) -> serve.Application:
    """A Serve application of ``ModelDeployment`` for ``model``, to ``serve.run``.

    Replicas: one per GPU of the cluster, each holding one (``num_gpus=1``), where the cluster has
    GPUs and ``num_replicas`` / ``num_gpus`` are not given; else ``num_replicas`` (default 1).
    Where ``sess_options`` is not given and no backend sets its threads, a replica's threads are
    ``num_cpus``. Each replica takes up to twice ``max_batch_size`` requests at once (Serve's
    ``max_ongoing_requests``), so that a batch can fill while another runs.
    ``deployment_options`` go to ``ModelDeployment.options`` (``name``, ``health_check_period_s``,
    ``max_ongoing_requests``...).
    """
    if not ray.is_initialized():
        ray.init()
    count, gpus = replicas(ray.cluster_resources().get("GPU", 0), num_replicas, num_gpus)
    sess_options = threads_of(num_cpus, backends, sess_options)
    deployment_options.setdefault("max_ongoing_requests", 2 * max_batch_size)
    options = ModelDeployment.options(
        num_replicas=count, ray_actor_options={"num_cpus": num_cpus, "num_gpus": gpus},
        **deployment_options)
    # bytes go as they are, not as an object ref: the application outlives the driver's refs
    return options.bind(model, backends, sess_options, max_batch_size=max_batch_size,
                        batch_wait_timeout_s=batch_wait_timeout_s, health_request=health_request,
                        session_kwargs=session_kwargs)
