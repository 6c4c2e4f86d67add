"""Elementwise ops. (Placeholder: the full family is being written.)"""

from __future__ import annotations

import numpy as np

from backplane.backends.api.kernels import KernelTable


def add(a, b):
    return (np.add(a, b),)


def relu(x):
    return (np.maximum(x, 0).astype(x.dtype),)


KERNELS: KernelTable = {
    "Add": {7: add},
    "Relu": {6: relu},
}
