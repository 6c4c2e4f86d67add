"""Sequence and optional plumbing: no math, just Python lists and None (builtin's own kernels).

A sequence is a Python list of arrays; an empty optional is None.
"""

from __future__ import annotations

import numpy as np

from backplane.backends.api.kernels import KernelTable


def sequence_construct(*inputs):
    return (list(inputs),)


def sequence_length(input_sequence):
    return (np.array(len(input_sequence), dtype=np.int64),)


def sequence_at(input_sequence, position):
    return (input_sequence[int(position)],)


KERNELS: KernelTable = {
    "SequenceConstruct": {11: sequence_construct},
    "SequenceLength": {11: sequence_length},
    "SequenceAt": {11: sequence_at},
}
