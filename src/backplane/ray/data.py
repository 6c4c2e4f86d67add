"""Ray Data batch scoring: ``Scorer`` for ``Dataset.map_batches``, one session per actor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

import ray
import ray.data
from backplane.ray.batches import BatchError, feeds_from_columns, fixed_batch, run_rows
from backplane.ray.loading import Model, load_session, shipped, threads_of
from backplane.session import BackendSpec, SessionOptions


class Scorer:
    """A callable class for ``Dataset.map_batches``: each actor loads one session and scores the
    batches it is given, one output row per input row, in order.

    Args:
        model: an ONNX file's path, an artifact's path (``backplane.compile``), ONNX or artifact
            bytes, a ModelProto, or an object ref to bytes (``ray.put``). A path is handed to
            ``InferenceSession`` as it is, so every worker must see the file there.
        backends: as ``InferenceSession`` takes them, options included
            (``[("CpuAcc", {"threads": 1}), "CpuRef"]``).
        sess_options: the session's ``SessionOptions``.
        input_columns: model input name -> the column it reads; an input not named reads the
            column of its own name.
        output_columns: the outputs to keep as columns, as a list of output names (the column
            named after the output) or a mapping output name -> column; default: every output.
        session_kwargs: any other keyword of ``InferenceSession`` (``input_shapes``, ``pins``...).

    A batch comes back with the columns the model did not read, as they were, and one column per
    output kept. The model's first input dimension is the batch: a free one takes the whole batch
    in one run, a fixed one (often 1) gets the batch split into runs of that size, the last padded.
    """

    def __init__(self, model: Model, backends: Sequence[BackendSpec] | None = None,
                 sess_options: SessionOptions | None = None, *,
                 input_columns: Mapping[str, str] | None = None,
                 output_columns: Sequence[str] | Mapping[str, str] | None = None,
                 session_kwargs: Mapping[str, Any] | None = None) -> None:
        self.session = load_session(model, backends, sess_options, session_kwargs)
        self.fixed = fixed_batch(self.session)
        inputs = [arg.name for arg in self.session.get_inputs()]
        outputs = [arg.name for arg in self.session.get_outputs()]
        self.input_columns = dict(input_columns or {})
        _check_names("input_columns names input", self.input_columns, inputs)
        if output_columns is None:
            output_columns = outputs
        self.output_columns = dict(output_columns) if isinstance(output_columns, Mapping) \
            else {name: name for name in output_columns}
        _check_names("output_columns names output", self.output_columns, outputs)

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = feeds_from_columns(self.session, batch, self.input_columns)
        outputs = run_rows(self.session, feeds, list(self.output_columns), self.fixed)
        read = {self.input_columns.get(name, name) for name in feeds}
        scored = {column: values for column, values in batch.items() if column not in read}
        scored.update({column: outputs[name] for name, column in self.output_columns.items()})
        return scored


def _check_names(what: str, given: Mapping[str, str], known: Sequence[str]) -> None:
    for name in given:
        if name not in known:
            raise BatchError(f"{what} '{name}', which the model does not have; its names are: "
                             f"{', '.join(known)}")


def map_batches(dataset: ray.data.Dataset, model: Model, *,
                backends: Sequence[BackendSpec] | None = None,
                sess_options: SessionOptions | None = None,
                input_columns: Mapping[str, str] | None = None,
                output_columns: Sequence[str] | Mapping[str, str] | None = None,
                concurrency: int | tuple[int, int] = 1, num_cpus: float = 1, num_gpus: float = 0,
                batch_size: int | str | None = 64, preserve_order: bool = True,
                session_kwargs: Mapping[str, Any] | None = None,
                **map_batches_args: Any) -> ray.data.Dataset:
    """``dataset`` scored by ``model`` on a pool of actors, each holding one ``Scorer``.

    Args:
        dataset: the rows; the model's inputs read their columns (``input_columns``).
        model, backends, sess_options, input_columns, output_columns, session_kwargs: as
            ``Scorer`` takes them. Bytes are put into Ray's object store once for every actor.
        concurrency: the actor pool's size, or its (min, max) to let Ray Data scale it.
        num_cpus, num_gpus: what each actor holds (a GPU each: ``num_gpus=1``). Where
            ``sess_options`` is not given and no backend sets its threads, the session's threads
            are ``num_cpus`` (``SessionOptions(intra_op_num_threads=...)``, CpuAcc's).
        batch_size: the rows per batch (an int where num_gpus is set).
        preserve_order: rows come out in the order they went in: sets Ray Data's
            ``execution_options.preserve_order`` in the dataset's ``DataContext``, which the
            datasets it was derived from share. False leaves the context as it is (Ray Data's
            default: no order, no waiting for a slow batch before the ones after it).
        map_batches_args: anything else ``Dataset.map_batches`` takes (``memory``,
            ``runtime_env``, ``max_restarts``...).
    """
    if isinstance(concurrency, int):
        compute = ray.data.ActorPoolStrategy(size=concurrency)
    elif isinstance(concurrency, tuple) and len(concurrency) == 2:
        compute = ray.data.ActorPoolStrategy(min_size=concurrency[0], max_size=concurrency[1])
    else:
        raise ValueError(f"concurrency must be the pool's size (an int) or its (min, max), got "
                         f"{concurrency!r}")
    sess_options = threads_of(num_cpus, backends, sess_options)
    if preserve_order:
        dataset.context.execution_options.preserve_order = True
    return dataset.map_batches(
        Scorer, compute=compute, num_cpus=num_cpus, num_gpus=num_gpus, batch_size=batch_size,
        batch_format="numpy", fn_constructor_args=(shipped(model), backends, sess_options),
        fn_constructor_kwargs={"input_columns": input_columns, "output_columns": output_columns,
                               "session_kwargs": session_kwargs},
        **map_batches_args)
