"""Serve's requests checked one by one, and a batch of them answered each on its own: no Ray here.

A request maps each model input to one row (the input's shape without the batch dimension).
``request_rows`` checks one request alone, before it joins a batch, and turns it into feeds of
one row; what does not fit is refused with the request's own error:

- ``MalformedRequest`` (HTTP 400): not a request whatever the model: not a mapping, a value that is
  not an array of numbers (nested lists of different lengths, a null, a nested object);
- ``BatchError`` (HTTP 422): a well-formed request that does not fit this model: an input
  missing, a name that is not an input, a dtype that is no cast of the same kind, a row's shape.

``answer`` runs the checked requests of a batch: those whose rows have the same shapes as one
run; where a run fails, its requests again one by one, so that an error a request causes is its
own (``ModelRunError``, HTTP 500) and its message holds no other request's data.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backplane.ray.batches import BatchError, casts_to, row_fits, run_rows
from backplane.session import InferenceSession

log = logging.getLogger(__name__)

MAX_RANK = 64
"""NumPy's most dimensions: nested lists deeper than this are not an array."""


class MalformedRequest(BatchError):
    """A request that is no request whatever the model (HTTP 400): not a mapping of input names,
    or a value that is not a rectangular array of numbers."""


class ModelRunError(RuntimeError):
    """The model's run failed on this request, run alone (HTTP 500): the message is that run's."""


def request_rows(session: InferenceSession, request: Any) -> dict[str, np.ndarray]:
    """One request (each input name -> one row, without the batch axis) checked against the
    model's inputs, as feeds of one row each (cast to the input's dtype).

    Raises:
        MalformedRequest: not a mapping, or a value that is not an array of numbers.
        BatchError: names, dtypes or shapes that are not the model's inputs'.
    """
    if not isinstance(request, Mapping):
        raise MalformedRequest(f"a request maps each input name to one row (a JSON object), "
                               f"got {type(request).__name__}")
    names = [arg.name for arg in session.get_inputs()]
    missing = [n for n in names if n not in request]
    unknown = [str(n) for n in request if n not in names]
    if missing or unknown:
        lacks = f"lacks input(s) {', '.join(missing)}" if missing else ""
        extra = f"names {', '.join(unknown)}, not input(s) of the model" if unknown else ""
        raise BatchError(f"the request {' and '.join(filter(None, [lacks, extra]))}: a request "
                         f"maps every input of the model ({', '.join(names)}) to one row")
    return {name: _row(session, name, request[name]) for name in names}


def _row(session: InferenceSession, name: str, value: Any) -> np.ndarray:
    """``value`` as one row of input ``name``: a batch of one, in the input's dtype."""
    values = _array(name, value)
    info = session.graph.info(name)
    if not casts_to(values.dtype, info.dtype):
        raise BatchError(f"input '{name}' holds {_kind(values.dtype)}, the model takes "
                         f"{np.dtype(info.dtype)}: not a cast of the same kind")
    if not row_fits(values.shape, info.shape):
        raise BatchError(f"input '{name}' has shape {values.shape}, the model takes rows of "
                         f"shape {tuple(info.shape[1:])} (its input shape is "
                         f"{tuple(info.shape)}, the first dimension the batch)")
    dtype = values.dtype if info.dtype is None else info.dtype
    return values.astype(dtype, copy=False)[None]


def _array(name: str, value: Any) -> np.ndarray:
    """``value`` as an array of numbers (or strings: a dtype the model may refuse)."""
    try:
        values = np.asarray(value)
    except (ValueError, TypeError) as exc:  # nested lists of different lengths
        where = _ragged(value, _first_shape(value), name) or str(exc)
        raise MalformedRequest(f"input '{name}' is not an array: {where}") from exc
    if values.dtype == object:
        odd = [v for v in values.flat if not isinstance(v, (int, float, bool))][:1]
        what = ("integers beyond int64" if not odd else "a null" if odd[0] is None
                else f"a {type(odd[0]).__name__}")
        raise MalformedRequest(f"input '{name}' holds {what} among its values: an input is an "
                               f"array of numbers")
    return values


def _first_shape(value: Any) -> list[int]:
    """The shape that the first item at each depth of nested lists promises."""
    shape = []
    while isinstance(value, (list, tuple)) and len(shape) <= MAX_RANK:
        shape.append(len(value))
        value = value[0] if value else None
    return shape


def _ragged(value: Any, shape: list[int], where: str) -> str | None:
    """Where nested lists first differ from ``shape`` (None where they do not)."""
    if len(shape) > MAX_RANK:
        return f"lists nested more than {MAX_RANK} deep"
    if not isinstance(value, (list, tuple)):
        return f"{where} is a number where a list of {shape[0]} is expected" if shape else None
    if not shape:
        return f"{where} is a list where a number is expected"
    if len(value) != shape[0]:
        return f"{where} has {len(value)} items where {shape[0]} are expected"
    for index, item in enumerate(value):
        found = _ragged(item, shape[1:], f"{where}[{index}]")
        if found:
            return found
    return None


def _kind(dtype: np.dtype) -> str:
    return f"strings ({dtype})" if dtype.kind in "US" else str(dtype)


def answer(session: InferenceSession, requests: Sequence[Mapping[str, np.ndarray]],
           output_names: Sequence[str], fixed: int | None
           ) -> list[dict[str, np.ndarray] | ModelRunError]:
    """Serve's batch of checked requests (``request_rows``'s feeds): each one's outputs (output
    name -> its row), or the ``ModelRunError`` of a run that failed on it.

    Requests whose rows have the same shapes run as one batch (a free dimension besides the batch
    may differ between requests). Where a batch's run fails, its requests run one by one: the
    others are answered, and the error goes only to a request that fails alone.
    """
    groups: dict[tuple, list[int]] = {}
    for index, feeds in enumerate(requests):
        groups.setdefault(tuple((n, v.shape) for n, v in feeds.items()), []).append(index)
    answers: dict[int, dict[str, np.ndarray] | ModelRunError] = {}
    for indices in groups.values():
        group = [requests[i] for i in indices]
        answers.update(zip(indices, _run_group(session, group, output_names, fixed)))
    return [answers[i] for i in range(len(requests))]


def _run_group(session: InferenceSession, group: Sequence[Mapping[str, np.ndarray]],
               output_names: Sequence[str], fixed: int | None
               ) -> list[dict[str, np.ndarray] | ModelRunError]:
    try:
        feeds = {name: np.concatenate([f[name] for f in group]) for name in group[0]}
        outputs = run_rows(session, feeds, output_names, fixed)
    except Exception as exc:  # any failure of the run: no request may get another's error
        if len(group) == 1:
            return [ModelRunError(f"the model's run failed on this request: "
                                  f"{type(exc).__name__}: {exc}")]
        log.warning("a batch of %d requests failed (%s); running them one by one", len(group),
                    type(exc).__name__)
        return [_run_group(session, [feeds], output_names, fixed)[0] for feeds in group]
    return [{name: values[i] for name, values in outputs.items()} for i in range(len(group))]
