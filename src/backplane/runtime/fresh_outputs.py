"""Outputs made the caller's where they are handed over, not after the run.

Why: a run's outputs must be the caller's alone (``ownership.owned``), and that check, made on the
NumPy arrays a run returns, cannot tell a CpuAcc output's memory from an input's at a glance: the
handover to NumPy (``tensor.numpy()``) marks the tensor's storage not resizable, the mark the
check reads as "torch's allocator made it", so each such output paid the search of the inputs
and constants (the full-tier VAD's two outputs: about 13 us a run, once the trace had pushed the
interpreter's data out of the caches; its whole run costs 160).

Here the same rule is read on the tensor itself, before the handover: a CPU tensor held only by
the step's results and the caller's variable, its storage held by that tensor alone and made by
torch's allocator (resizable), is memory no one else can reach. A network whose run is one call
(``steps.one_call``) hands such outputs over as they are and the rest to ``ownership.owned``
(``LoadedNetwork.execute_owned``).
"""

from __future__ import annotations

import sys
from typing import Any

_TENSOR: Any = None  # torch.Tensor, once torch is imported (``fresh``'s first call)
_STORAGE_USE: Any = None
_USES = -1  # a fresh tensor's storage's uses while ``untyped_storage`` holds it (measured then)


class Made(tuple):  # type: ignore[type-arg]
    """A step's results that the step made in this call, each in memory of its own (a frozen
    trace whose every output is an op's result: ``static_sizes.outputs_made``, decided at its
    build): ``made`` looks at their references only."""

    __slots__ = ()


def made(value: Any) -> bool:
    """``fresh`` for one of ``Made`` results: held by the results and the caller alone."""
    return sys.getrefcount(value) == _REFS


def fresh(value: Any) -> bool:
    """Whether ``value``, one of a step's results (held by the results' sequence and the
    caller's variable only), is a CPU tensor whose memory no one else can reach (see above)."""
    if type(value) is not _TENSOR:
        if _TENSOR is not None or "torch" not in sys.modules:
            return False
        _calibrate()
        if type(value) is not _TENSOR:
            return False
    if sys.getrefcount(value) != _REFS or not value.is_cpu:
        return False
    storage = value.untyped_storage()
    return storage.resizable() and _STORAGE_USE(storage._cdata) == _USES


def _calibrate() -> None:
    """The uses ``fresh`` sees of a fresh tensor's storage, measured through ``fresh`` itself."""
    global _TENSOR, _STORAGE_USE, _USES
    import torch

    _TENSOR, _STORAGE_USE = torch.Tensor, torch._C._storage_Use_Count
    results = (torch.empty(1),)
    value = results[0]
    _USES = _STORAGE_USE(value.untyped_storage()._cdata)
    if not fresh(value):  # the interpreter counts otherwise: never vouch for anything
        _USES = -2


def _references(value: Any) -> int:
    return sys.getrefcount(value)  # as ``fresh`` and ``made`` read them: one argument deep


def _measured() -> int:
    """The references of a result held as a step's are (a sequence and a variable), read as
    ``fresh`` reads them: the interpreter's own references count alike."""
    results = (object(),)
    value = results[0]
    return _references(value)


_REFS = _measured()
