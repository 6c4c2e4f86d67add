"""Sequence and optional plumbing: no math, just Python lists and None (builtin's own kernels).

A sequence is a Python list of arrays; an empty optional is None. Kernels never change a list they
are given: a sequence value may be read by other layers too.
"""

from __future__ import annotations

import operator

import numpy as np

from backplane.backends.api.kernels import KernelTable

SHAPE = operator.attrgetter("shape")


# -- sequences ---------------------------------------------------------------------------------
def sequence_construct(*inputs):
    return (list(inputs),)


def sequence_empty(dtype=1):
    return ([],)


def sequence_length(input_sequence):
    return (np.array(len(input_sequence), dtype=np.int64),)


def sequence_at(input_sequence, position):
    return (input_sequence[int(position)],)


def sequence_insert(input_sequence, tensor, position=None):
    # At the end by default; a negative position counts from the end.
    at = len(input_sequence) if position is None else _position(position, len(input_sequence) + 1)
    return (input_sequence[:at] + [tensor] + input_sequence[at:],)


def sequence_erase(input_sequence, position=None):
    # The last one by default.
    at = len(input_sequence) - 1 if position is None else _position(position, len(input_sequence))
    return (input_sequence[:at] + input_sequence[at + 1:],)


def _position(position, size: int) -> int:
    at = int(np.reshape(position, ()))
    return at + size if at < 0 else at


def split_to_sequence(input, split=None, axis=0, keepdims=1):  # noqa: A002
    length = input.shape[axis]
    if split is None:  # one element per position along axis, squeezed unless keepdims
        parts = np.split(input, length, axis=axis)
        return ([np.squeeze(p, axis=axis) for p in parts] if not keepdims else parts,)
    if split.ndim == 0:  # chunks of that size, the last one smaller
        bounds = list(range(int(split), length, int(split)))
    else:  # the sizes of the parts
        bounds = list(np.cumsum(split)[:-1])
    return (np.split(input, bounds, axis=axis),)


def concat_from_sequence(input_sequence, axis, new_axis=0):
    if new_axis:
        return (stacked(input_sequence, axis),)
    return (np.concatenate(input_sequence, axis=axis),)


def stacked(arrays, axis=0):
    """np.stack's result: along an axis before the last new one, the arrays joined along that
    axis and the result viewed with the new axis split off (one C call; np.stack makes a view of
    each array with a new axis first: 7.1 against 4 us for a Loop's 8 rows of 4). np.stack itself
    where the shapes differ (its error), the arrays are 0-d or the new axis is the last."""
    shapes = set(map(SHAPE, arrays))  # C calls: no Python frame per array
    if len(shapes) != 1:
        return np.stack(arrays, axis=axis)  # its error (or its empty stack's)
    (shape,) = shapes
    at = axis + len(shape) + 1 if axis < 0 else axis
    if not 0 <= at < len(shape):
        return np.stack(arrays, axis=axis)
    joined = np.concatenate(arrays, axis=at)  # a_i's row j at i * shape[at] + j along ``at``
    return joined.reshape(*shape[:at], len(arrays), *shape[at:])


# -- optionals ---------------------------------------------------------------------------------
def optional(input=None, type=None):  # noqa: A002
    return (input,)  # an absent input makes an empty optional of `type`


def optional_has_element(input=None):  # noqa: A002
    return (np.array(input is not None),)


def optional_get_element(input):  # noqa: A002
    if input is None:
        raise ValueError("OptionalGetElement of an empty optional")
    return (input,)


KERNELS: KernelTable = {
    "SequenceConstruct": {11: sequence_construct},
    "SequenceEmpty": {11: sequence_empty},
    "SequenceLength": {11: sequence_length},
    "SequenceAt": {11: sequence_at},
    "SequenceInsert": {11: sequence_insert},
    "SequenceErase": {11: sequence_erase},
    "SplitToSequence": {11: split_to_sequence},
    "ConcatFromSequence": {11: concat_from_sequence},
    "Optional": {15: optional},
    "OptionalHasElement": {15: optional_has_element},
    "OptionalGetElement": {15: optional_get_element},
}
