"""A kernel's parameters read once per kernel at load (``api.kernels.parameters``): a load checks
and binds every layer's kernel, and ``inspect.signature`` of each was 8-16 of the demo's 50-64 ms
CpuRef load. The answers stay those of ``inspect.signature``."""

from __future__ import annotations

import gc
import inspect
import weakref

import numpy as np
import pytest

from backplane.backends.api import kernels
from backplane.backends.api.kernels import UnsupportedError, bind_kernel, parameters
from backplane.backends.reference.kernels import KERNELS


def test_a_kernels_parameters_are_read_once_and_are_its_signatures() -> None:
    softmax = KERNELS["Softmax"][13]
    first = parameters(softmax)
    assert parameters(softmax) is first  # inspect.signature makes a new mapping each call
    assert list(first) == list(inspect.signature(softmax).parameters)


def test_an_unknown_attribute_is_refused_each_time() -> None:
    softmax = KERNELS["Softmax"][13]
    for _ in range(2):
        with pytest.raises(UnsupportedError, match="'nothing_here'"):
            bind_kernel(softmax, {"axis": 1, "nothing_here": 0}, 1)
    bound = bind_kernel(softmax, {"axis": 0}, 1)
    x = np.array([[1.0, 2.0], [3.0, 5.0]], np.float32)
    np.testing.assert_allclose(bound(x)[0].sum(axis=0), [1.0, 1.0], rtol=1e-6)


def test_a_kernel_made_at_load_is_not_kept_alive_by_the_cache() -> None:
    def make() -> object:
        def kernel(x: np.ndarray, *, alpha: float = 1.0) -> tuple[np.ndarray]:
            return (x * alpha,)
        return kernel

    kernel = make()
    assert list(parameters(kernel)) == ["x", "alpha"]  # type: ignore[arg-type]
    assert kernel in kernels._PARAMETERS
    # its own entry, not the cache's size: other sessions' threads in this worker (a background
    # load) add and drop kernels meanwhile (the size read one off in a mixed run)
    gone = weakref.ref(kernel)
    del kernel
    gc.collect()
    assert gone() is None
