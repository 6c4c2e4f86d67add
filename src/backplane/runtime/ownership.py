"""Outputs that are the caller's alone: copied where anything else holds their memory.

A run's output must not share memory with a constant of the session (an initializer, a folded
subgraph, a backend's converted weight), with the caller's inputs (Identity, Reshape, Transpose,
Slice... return views), with another output, or with a buffer a backend writes again at the next
run. ONNX Runtime copies every output into a fresh array. Here an output is copied only where its
memory may be held elsewhere, which is decided once per run and per output from who holds it:

- a NumPy array whose memory is its own (``OWNDATA``, or a view of such an array) is fresh when no
  Python object but the chain from the output holds any array of that chain: its reference counts
  are those of a freshly made array (measured once, at import, through the same functions, so the
  interpreter's own references are counted as they are here);
- a NumPy view of a torch CPU tensor (what CpuAcc and GpuAcc hand back) is fresh when that tensor
  is held by the view alone, its storage by that tensor alone (torch's own use count) and the
  storage's memory is neither an input's nor a constant's (``torch.from_numpy`` of an input or a
  constant makes a storage of its own over their memory; ``Held`` keeps the constants' spans).
  Memory is looked at only where the storage may be over another's: a storage torch's allocator
  made (``resizable``; ``from_numpy`` and DLPack make storages that are not) held by this tensor
  alone is memory no one else can reach, so a kernel's fresh result costs no search of the inputs
  and constants;
- anything else (memory of a library that says nothing of its owners, an mmap) is copied.

A copy where none was needed costs a memcpy of the output; a missed copy is a silent wrong answer.
The checks are a few reference counts per output (about a microsecond).
"""

from __future__ import annotations

import bisect
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np


class Held:
    """Memory a run's outputs may not be: the constants' (address, bytes) spans, found at load, and
    the run's inputs. Needed for torch-made outputs only: NumPy's owners show in reference counts,
    but a tensor over another array's memory (``torch.from_numpy``) hides that array."""

    def __init__(self, spans: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[list[int]] = []
        for start, size in sorted((a, n) for a, n in spans if n > 0):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], start + size)
            else:
                merged.append([start, start + size])
        self.starts = [start for start, _ in merged]
        self.ends = [end for _, end in merged]

    def overlaps(self, low: int, high: int) -> bool:
        """Whether the bytes [low, high) meet a constant's."""
        index = bisect.bisect_right(self.starts, high - 1) - 1
        return index >= 0 and self.ends[index] > low


NOTHING = Held()


def owned(outputs: list[Any], inputs: Sequence[Any] = (), held: Held = NOTHING,
          _measured: list[list[int]] | None = None,
          _probed: list[tuple[int, int]] | None = None) -> list[Any]:
    """``outputs`` with every host array that is not the run's own replaced by a copy of it.

    ``outputs`` must hold the only references the run kept (the network's slots already dropped),
    ``inputs`` the run's inputs and ``held`` the session's constants. Lists (ONNX sequences) are
    looked into; device tensors are returned as they are."""
    result = []
    for value in outputs:
        if type(value) is np.ndarray:
            # The two common cases first, in line (after a kernel has run, each call of a check
            # costs more than the check): an array of its own, or a view of a tensor whose
            # storage torch's allocator made, each held by the output alone (``_fresh``'s tests).
            base = value.base
            if _probed is not None:  # calibrating: the counts a fresh output has here
                _probed.append((sys.getrefcount(value), sys.getrefcount(base)))
                result.append(value)
                continue
            if base is None:
                if sys.getrefcount(value) == _ALONE and value.flags.owndata:
                    result.append(value)
                    continue
            elif type(base) is _TENSOR and sys.getrefcount(value) == _VIEW_ALONE \
                    and sys.getrefcount(base) == _TENSOR_ALONE:
                storage = base.untyped_storage()
                if _STORAGE_USE(storage._cdata) == _STORAGE_USES and (
                        storage.resizable() or _own_memory(value, storage, inputs, held)):
                    result.append(value)
                    continue
            if not _fresh(value, inputs, held, _measured):
                value = np.array(value, copy=True, order="K")
        elif isinstance(value, list):
            value = owned(value, inputs, held, _measured, _probed)
        elif isinstance(value, np.ndarray) and not _fresh(value, inputs, held, _measured):
            value = np.array(value, copy=True, order="K")  # a subclass of ndarray
        result.append(value)
    return result


def _own_memory(value: np.ndarray, storage: Any, inputs: Sequence[Any], held: Held) -> bool:
    """Whether a storage not made by torch's allocator is over memory of no constant and no input
    (``_fresh_tensor``'s last tests)."""
    low = storage.data_ptr()
    if held.starts and held.overlaps(low, low + storage.nbytes()):
        return False
    for given in inputs:
        if type(given) is np.ndarray:
            if np.may_share_memory(value, given):
                return False
        elif _is_cpu_tensor(given) and given.untyped_storage().data_ptr() == low:
            return False
    return True


def _fresh(value: np.ndarray, inputs: Sequence[Any], held: Held,
           measured: list[list[int]] | None) -> bool:
    counts, root = _chain(value)
    if root is not None:
        return _fresh_tensor(value, root, counts, inputs, held, measured)
    if measured is not None:  # calibrating: what a fresh output looks like from here
        measured.append(counts)
        return True
    return counts[0] == _HEAD and all(count == _LINK for count in counts[1:])


def _fresh_tensor(value: np.ndarray, root: Any, counts: list[int], inputs: Sequence[Any],
                  held: Held, measured: list[list[int]] | None) -> bool:
    """The same for a NumPy view of a torch CPU tensor: the view held by the output alone, the
    tensor by the view alone, its storage by that tensor alone, and the storage's memory no
    constant's and no input's."""
    storage = root.untyped_storage()
    uses = _use_count(storage._cdata)
    if measured is not None:
        measured.append([*counts, sys.getrefcount(root), uses])
        return True
    if _TENSOR_REFS == -1:
        _calibrate_torch()
    if counts != [_TENSOR_HEAD] or sys.getrefcount(root) != _TENSOR_REFS or uses != _STORAGE_USES:
        return False
    if storage.resizable():
        return True  # torch's allocator made it (see the module's docstring): no one else's memory
    low = storage.data_ptr()
    if held.overlaps(low, low + storage.nbytes()):
        return False
    for given in inputs:
        if isinstance(given, np.ndarray):
            if np.may_share_memory(value, given):
                return False
        elif _is_cpu_tensor(given) and given.untyped_storage().data_ptr() == low:
            return False
    return True


def _chain(value: np.ndarray) -> tuple[list[int], Any]:
    """The reference counts along ``value``'s chain of ``.base`` arrays, and the chain's owner where
    it is a torch CPU tensor (None where the memory is an array's own). A chain whose owner is
    anything else gets the count -1, which no fresh chain has."""
    counts = []
    node = value
    while True:
        counts.append(sys.getrefcount(node))
        base = node.base
        if base is None:
            return (counts if node.flags.owndata else [*counts, -1]), None
        if not isinstance(base, np.ndarray):
            return (counts, base) if _is_cpu_tensor(base) else ([*counts, -1], None)
        node = base


def _is_cpu_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor) and value.is_cpu


def _use_count(storage: Any) -> int:
    """How many tensors hold a storage (torch's own count)."""
    return sys.modules["torch"]._C._storage_Use_Count(storage)  # type: ignore[no-any-return]


def _calibrate() -> tuple[int, int, int]:
    """The counts ``_chain`` sees on a fresh output array (the head) and on a fresh view's base (a
    link), and those ``owned`` sees on a fresh array at once, measured through the calls a run
    makes: the interpreter's own references count alike."""
    measured: list[list[int]] = []
    owned([np.empty(2)], _measured=measured)
    owned([np.empty(4)[1:3]], _measured=measured)
    (head,), (_, link) = measured
    probed: list[tuple[int, int]] = []
    owned([np.empty(2)], _probed=probed)
    return head, link, probed[0][0]


def _calibrate_torch() -> None:
    """The same for a fresh torch-made output: the tensor's references and its storage's uses
    (``_fresh_tensor``'s), then the view's and the tensor's references ``owned`` sees at once."""
    global _TENSOR_HEAD, _TENSOR_REFS, _STORAGE_USES, _TENSOR, _STORAGE_USE
    global _VIEW_ALONE, _TENSOR_ALONE
    import torch

    measured: list[list[int]] = []
    owned([torch.empty(4).numpy()], _measured=measured)
    _TENSOR_HEAD, _TENSOR_REFS, _STORAGE_USES = measured[0]
    probed: list[tuple[int, int]] = []
    owned([torch.empty(4).numpy()], _probed=probed)
    (_VIEW_ALONE, _TENSOR_ALONE), = probed
    _TENSOR, _STORAGE_USE = torch.Tensor, torch._C._storage_Use_Count


_TENSOR: Any = None  # torch.Tensor, once a torch-made output was calibrated
_STORAGE_USE: Any = None
_VIEW_ALONE = _TENSOR_ALONE = _ALONE = -1  # no output taken at once before they are measured
_HEAD, _LINK, _ALONE = _calibrate()
_TENSOR_HEAD = _TENSOR_REFS = _STORAGE_USES = -1  # measured at the first torch-made output
