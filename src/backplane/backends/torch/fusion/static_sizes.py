"""A trace's sizes made constants of it (``traced``'s frozen graphs): what a run computed of the
shapes alone, computed once.

TorchScript's tracer records each size a kernel reads (``x.shape[i]``, ``x.size(i)``) as an
``aten::size`` of the traced value, and the arithmetic done on it as tensor ops: a Conv1d's output
length ``(length - kernel) // stride + 1`` became ``aten::size``, ``prim::NumToTensor``, two
``aten::sub``, ``aten::floor_divide``, ``aten::add`` and ``aten::Int`` at every run, and the
reshape of a constant weight to ``(out, in * kernel)`` by that length a reshape at every run too
(the full-tier VAD's trace: 26 sizes). A ``Traced`` layer's shapes never change between runs (its
boundary is static, ``traced.wrap``, and no layer in it makes sizes from data), and the tracer typed
each value with the sizes it had: those sizes are constants, and constant propagation then folds
the arithmetic, the lists made of it and the reshapes of constants.
"""

from __future__ import annotations

from typing import Any

FOLDED = frozenset({"aten::size", "aten::dim", "aten::numel"})
"""The shape reads made constants, where the value's traced type has every size."""


def fold_sizes(graph: Any) -> int:
    """Each shape read of ``graph`` (a traced TorchScript graph, changed in place) whose value the
    tracer typed with complete sizes replaced by the constant it read; then constant propagation
    and dead code elimination. Returns how many reads were replaced."""
    import torch

    replaced = 0
    for node in [n for n in graph.nodes() if n.kind() in FOLDED]:
        value = _constant_of(node)
        if value is None:
            continue
        constant = graph.insertConstant(value)
        constant.node().moveBefore(node)
        node.outputsAt(0).replaceAllUsesWith(constant)
        replaced += 1
    if replaced:
        torch._C._jit_pass_constant_propagation(graph)
        torch._C._jit_pass_dce(graph)
    return replaced


def _constant_of(node: Any) -> int | list[int] | None:
    """What ``node`` (a shape read) reads, from its input's traced type, or None where the type
    does not have it (a size unknown, a dimension given at run time)."""
    import torch

    kind, typed = node.kind(), node.inputsAt(0).type()
    sizes = typed.sizes() if isinstance(typed, torch._C.TensorType) else None
    if sizes is None or any(s is None for s in sizes):
        return None
    if kind == "aten::dim":
        return len(sizes)
    if kind == "aten::numel":
        count = 1
        for size in sizes:
            count *= size
        return count
    if node.inputsSize() == 1:  # aten::size(self): every size
        return list(sizes)
    dim = node.inputsAt(1).toIValue()
    if not isinstance(dim, int) or not -len(sizes) <= dim < len(sizes):
        return None
    return int(sizes[dim])
