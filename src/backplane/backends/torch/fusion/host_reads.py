"""``HostReads``: where a trace would keep a value computed from its inputs as a constant.

Why: ``traced.compile_traced`` runs a subgraph's layers once under this mode before tracing them;
a kernel that turns a computed value into a Python number, list or bool (a branch on data, a size
from data) would be frozen into the trace, so such a subgraph runs layer by layer instead.
(Split from ``fusion/traced.py``, which had reached the 500-line rule.)
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any


class HostReads:
    """A torch function mode that records where a tensor computed from the inputs is read on the
    host (``item``, ``tolist``, ``bool``, ``int``, ``numpy`` ...): such a read is a value a trace
    would keep as it was. Constants read on the host (a Reshape's shape) are not recorded: they
    cannot change between runs. Values are followed through every torch call and method, in-place
    ones included (a call's outputs are computed from its inputs)."""

    READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                       "__array__", "__complex__", "equal", "allclose", "is_nonzero"})

    def __init__(self, inputs: Sequence[Any]) -> None:
        from torch.overrides import TorchFunctionMode

        owner = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                return owner._call(func, args, kwargs or {})

        self._mode = _Mode()
        self._computed: dict[int, weakref.ref] = {}
        self.found: list[str] = []
        for value in inputs:
            self._mark(value)

    def __enter__(self) -> HostReads:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def _mark(self, value: Any) -> None:
        self._computed[id(value)] = weakref.ref(value)

    def _is_computed(self, value: Any) -> bool:
        ref = self._computed.get(id(value))
        return ref is not None and ref() is value

    def _call(self, func: Any, args: Any, kwargs: Any) -> Any:
        import torch
        from torch.utils._pytree import tree_flatten

        computed = any(isinstance(a, torch.Tensor) and self._is_computed(a)
                       for a in tree_flatten((args, kwargs))[0])
        name = getattr(func, "__name__", str(func))
        if computed and name in self.READS:
            self.found.append(name)
        outputs = func(*args, **kwargs)
        if computed:
            for value in tree_flatten(outputs)[0]:
                if isinstance(value, torch.Tensor):
                    self._mark(value)
        return outputs
