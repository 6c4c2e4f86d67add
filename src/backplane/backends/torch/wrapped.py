"""Workloads around a workload: what they do not set themselves is the inner workload's.

CpuAcc wraps a layer's workload for what happens around its calls: the background swaps its
work in (``background.Swapped``), a Trial times its candidates (``trials.Trial``), the thread
governor ticks (``threads.Governed``), a partition runs at fewer threads (``small.AtThreads``).
The runtime and the reports read the inner workload's attributes through them (``route``,
``why``, ``exclusive``, ``destroy``, ``profiled``, ``relayouts``, ...), so each wrapper is a
``Wrapper``: an attribute it does not hold is looked up on ``_target()``.
"""

from __future__ import annotations

import functools
from typing import Any


class Wrapper:
    """A workload around ``_target()`` (``self.work`` unless a subclass says otherwise): attributes
    not its own are read from it. Subclasses declare their own ``__slots__``."""

    __slots__ = ()

    def _target(self) -> Any:
        return self.work  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        if name in _own(type(self)):  # a slot not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self._target(), name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._target()!r})"


@functools.cache
def _own(cls: type) -> frozenset[str]:
    """The slots ``cls`` and its bases declare."""
    names: set[str] = set()
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names.update((slots,) if isinstance(slots, str) else slots)
    return frozenset(names)
