"""Rows of a table to a model's inputs and its outputs back to rows: no Ray in here.

A batch is a mapping of column name -> array whose first axis is the rows (Ray Data's "numpy"
batch format). The model's first input dimension is its batch dimension: a free one (``"N"``,
None) takes all the rows at once; a fixed one (``1``, ``8``) gets the rows in chunks of that size,
the last chunk padded with zeros and the padding's outputs dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from backplane.session import InferenceSession


class BatchError(ValueError):
    """A batch does not fit the model: a column missing, a dtype or a row shape that is not the
    input's, or an output without the batch dimension."""


def fixed_batch(session: InferenceSession) -> int | None:
    """The size of the inputs' batch dimension where it is fixed, None where it is free.

    Raises:
        BatchError: the inputs fix different batch sizes, or an input has no dimensions.
    """
    sizes = {}
    for arg in session.get_inputs():
        if not arg.shape:
            raise BatchError(f"input '{arg.name}' has no batch dimension (shape {arg.shape}): "
                             f"rows can only be fed to inputs whose first dimension is the batch")
        if isinstance(arg.shape[0], int) and arg.shape[0] >= 0:
            sizes[arg.name] = arg.shape[0]
    if len(set(sizes.values())) > 1:
        raise BatchError(f"the inputs fix different batch sizes: {sizes}")
    return next(iter(sizes.values()), None)


def feeds_from_columns(session: InferenceSession, batch: Mapping[str, Any],
                       input_columns: Mapping[str, str]) -> dict[str, np.ndarray]:
    """Each model input from its column (``input_columns``: input name -> column; an input not
    named there reads the column of its own name), cast to the input's dtype where that is a cast
    of the same kind (float64 -> float32), rows checked against the input's fixed dimensions."""
    feeds = {}
    for arg in session.get_inputs():
        column = input_columns.get(arg.name, arg.name)
        if column not in batch:
            raise BatchError(f"input '{arg.name}' reads column '{column}', which the batch does "
                             f"not have; its columns are: {', '.join(map(str, batch))} "
                             f"(map inputs to columns with input_columns={{input: column}})")
        feeds[arg.name] = _as_input(np.asarray(batch[column]), session, arg.name, column)
    return feeds


def _as_input(values: np.ndarray, session: InferenceSession, name: str, column: str) -> np.ndarray:
    info = session.graph.info(name)
    if values.dtype == object and len(values):  # a column of arrays, one per row
        values = np.stack(list(values))
    if not casts_to(values.dtype, info.dtype):
        raise BatchError(f"column '{column}' is {values.dtype}, input '{name}' takes "
                         f"{np.dtype(info.dtype)}: not a cast of the same kind")
    values = values.astype(info.dtype, copy=False) if info.dtype is not None else values
    if not row_fits(values.shape[1:], info.shape):
        raise BatchError(f"column '{column}' has rows of shape {tuple(values.shape[1:])}, input "
                         f"'{name}' takes rows of shape {tuple(info.shape[1:])} (its shape is "
                         f"{tuple(info.shape)}, the first dimension the batch)")
    return values


def casts_to(dtype: np.dtype, wanted: np.dtype | None) -> bool:
    """Whether values of ``dtype`` feed an input of ``wanted``: the same, or a cast of the same
    kind (float64 -> float32, int64 -> float32), not one of another kind (float32 -> int64)."""
    return wanted is None or dtype == wanted or np.can_cast(dtype, wanted, casting="same_kind")


def row_fits(row: Sequence[int], shape: Sequence[Any] | None) -> bool:
    """Whether a row of shape ``row`` fits an input of ``shape`` (the first dimension the batch,
    a free dimension anything): the same rank, the fixed dimensions equal."""
    if shape is None:
        return True
    wanted = list(shape[1:])
    return len(row) == len(wanted) and not any(
        isinstance(w, int) and w >= 0 and w != r for w, r in zip(wanted, row))


def run_rows(session: InferenceSession, feeds: Mapping[str, np.ndarray],
             output_names: Sequence[str], fixed: int | None) -> dict[str, np.ndarray]:
    """The outputs of ``feeds`` (every array's first axis the rows), one row out per row in, in
    order: all rows in one run where the batch is free, in chunks of ``fixed`` rows otherwise."""
    rows = _row_count(feeds)
    if rows == 0:
        return _empty_outputs(session, output_names)
    if fixed is None:
        return _checked(output_names, session.run(list(output_names), dict(feeds)), rows)
    parts: list[dict[str, np.ndarray]] = []
    for start in range(0, rows, fixed):
        chunk = {n: _padded(v[start:start + fixed], fixed) for n, v in feeds.items()}
        outputs = _checked(output_names, session.run(list(output_names), chunk), fixed)
        parts.append({n: v[:rows - start] for n, v in outputs.items()})
    return {n: np.concatenate([p[n] for p in parts]) for n in output_names}


def _row_count(feeds: Mapping[str, np.ndarray]) -> int:
    counts = {n: len(v) for n, v in feeds.items()}
    if len(set(counts.values())) > 1:
        raise BatchError(f"the inputs have different numbers of rows: {counts}")
    return next(iter(counts.values()), 0)


def _padded(values: np.ndarray, size: int) -> np.ndarray:
    if len(values) == size:
        return values
    pad = np.zeros((size - len(values),) + values.shape[1:], values.dtype)
    return np.concatenate([values, pad])


def _checked(names: Sequence[str], outputs: Sequence[Any], rows: int) -> dict[str, np.ndarray]:
    result = {}
    for name, value in zip(names, outputs):
        value = np.asarray(value)
        if value.ndim == 0 or value.shape[0] != rows:
            raise BatchError(f"output '{name}' has shape {value.shape} for {rows} rows in: only "
                             f"outputs whose first dimension is the batch become columns (choose "
                             f"the outputs with output_columns)")
        result[name] = value
    return result


def _empty_outputs(session: InferenceSession, names: Sequence[str]) -> dict[str, np.ndarray]:
    result = {}
    for name in names:
        info = session.graph.info(name)
        rest = list(info.shape[1:]) if info.shape else []
        if not all(isinstance(d, int) and d >= 0 for d in rest):
            raise BatchError(f"an empty batch: output '{name}' has free dimensions "
                             f"{tuple(info.shape or ())} besides the batch, so its empty column "
                             f"has no shape")
        result[name] = np.zeros([0, *rest], info.dtype)
    return result
