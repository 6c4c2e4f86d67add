"""Two thread pools on the host's cores in one run: NumPy's BLAS and another backend's.

CpuRef computes with NumPy, whose BLAS (OpenBLAS) runs a product on a pool of threads that spin for
0.1-0.2 s after it before they sleep; CpuAcc's torch runs on an OpenMP pool, OpenVINO on TBB's. In
a run that goes from one to the other, each pool's threads still spin while the other's work: on
the developer machine (2-core AMD EPYC), resnet50 on CpuAcc with two of its convolutions pinned to
CpuRef took 177.2 ms a run, against 55.4 all on CpuAcc; with NumPy's BLAS on one thread, 55.2
(``bench/host_threads.py``; more in docs/architecture.md).

So in a network whose layers run on a backend of BLAS threads (``capabilities()["HostThreads"]``
"blas": CpuRef) and on one with another pool of its own ("openmp", "tbb"), the first one's
workloads run with NumPy's BLAS on one thread, set before each call and put back after it (2.5 us,
through threadpoolctl's handles on the libraries, found once). A network of CpuRef alone keeps
NumPy's threads. Measured placement times a CpuRef candidate on one BLAS thread too where another
backend it may share the run with has a pool of its own. The setting is the process's: a run of another network in another thread at the
same moment computes its BLAS products on one thread too (slower, not different).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from backplane.backends.api.backend import Backend, Workload
from backplane.ir.graph import Layer

BLAS = "blas"


def share(layers: Sequence[Layer], workloads: Sequence[Workload],
          backends: Mapping[str, Backend]) -> list[Workload]:
    """``workloads``, those of BLAS-threaded backends on one BLAS thread where the network also
    runs a backend with another pool of host threads (see above)."""
    used = {b: backends[b] for b in {lay.backend for lay in layers} if b in backends}
    if not mixed(used.values()):
        return list(workloads)
    blas_users = {b for b, backend in used.items() if backend.capabilities().get("HostThreads") == BLAS}
    libraries = blas_libraries()
    if not libraries:
        return list(workloads)
    return [OneBlasThread(w, libraries) if lay.backend in blas_users else w
            for lay, w in zip(layers, workloads)]


def mixed(backends: Iterable[Backend]) -> bool:
    """Whether ``backends`` hold one computing on BLAS threads and one with another pool."""
    kinds = {backend.capabilities().get("HostThreads") for backend in backends}
    return BLAS in kinds and bool(kinds - {BLAS, None})


@functools.lru_cache(maxsize=1)
def blas_libraries() -> tuple[Any, ...]:
    """threadpoolctl's controllers of the BLAS libraries loaded in this process (NumPy's)."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # a dependency, but the runtime runs without it, only slower
        return ()
    return tuple(lib for lib in ThreadpoolController().lib_controllers if lib.user_api == BLAS)


class OneBlasThread:
    """A workload called with the BLAS libraries on one thread, their counts put back after it
    (its ``profiled`` and ``write_into`` too); its other attributes are the wrapped workload's."""

    def __init__(self, workload: Workload, libraries: Sequence[Any]) -> None:
        self.workload, self.libraries = workload, libraries

    def __call__(self, *inputs: Any) -> Any:
        return self._limited(self.workload, inputs)

    def __getattr__(self, name: str) -> Any:
        if name in ("workload", "libraries"):  # not set yet (a copy being made)
            raise AttributeError(name)
        value = getattr(self.workload, name)
        if name == "profiled":
            return lambda *inputs: self._limited(value, inputs)
        if name == "write_into":
            return lambda memory, *inputs: self._limited(value, (memory, *inputs))
        return value

    def _limited(self, call: Any, inputs: Sequence[Any]) -> Any:
        counts = [lib.num_threads for lib in self.libraries]
        for lib in self.libraries:
            lib.set_num_threads(1)
        try:
            return call(*inputs)
        finally:
            for lib, count in zip(self.libraries, counts):
                lib.set_num_threads(count)
