"""AcmeTiny: an out-of-tree backplane backend that runs three ops and lets CpuRef take the rest."""

import numpy as np

from backplane import Backend


def relu(x):
    return (np.maximum(x, 0).astype(x.dtype),)


def add(a, b):
    return (np.add(a, b),)


def mul(a, b):
    return (np.multiply(a, b),)


class AcmeTiny(Backend):
    id = "AcmeTiny"
    version = "0.1.0"
    KERNELS = {"Relu": {6: relu}, "Add": {7: add}, "Mul": {7: mul}}  # op -> {since opset: kernel}


# The three functions every dynamic backend exposes (Arm NN's "Dynamic backends base interface").
def get_backend_id():
    return AcmeTiny.id


def get_version():
    return (1, 0)  # the backplane backend API version this was written against


def backend_factory():
    return AcmeTiny()
