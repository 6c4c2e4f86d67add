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


VIEWS = frozenset({"aten::reshape", "aten::view", "aten::select", "aten::unsqueeze",
                   "aten::squeeze", "aten::transpose", "aten::t", "aten::permute", "aten::narrow",
                   "aten::slice", "aten::flatten", "aten::as_strided"})
"""The ops ``fold_views`` composes: each a view of its first input (a reshape or a flatten where
it is one), by arguments that are constants of the graph."""


def fold_views(graph: Any) -> int:
    """Each chain of views in ``graph`` (a traced TorchScript graph with static shapes, changed in
    place) made one view of the chain's first input: the value itself where the chain gives it
    back as it is (an unsqueeze then a reshape back, the VAD's ``(1, 128)`` state through a
    Squeeze, an Unsqueeze and a Concat's reshape), else one ``as_strided`` of it. A chain is
    composed on a meta tensor of its input's traced sizes and strides, and folded only where every
    step is a view (not a reshape that copies), ends where its input's storage offset is and has
    the sizes and strides the tracer saw. A chain that ends at another offset (the VAD's second
    state row: a select, a reshape, a select) is cut after its first step that made that view
    already (an as_strided of the input would fix the offset the sample had). Returns how many
    views were replaced."""
    import torch

    torch._C._jit_pass_constant_propagation(graph)  # the views' arguments as constants
    replaced = 0
    for node in list(graph.nodes()):
        if not _view(node) or not _view(node.inputsAt(0).node()):
            continue  # a chain's end, at least two views long
        root, steps = node.inputsAt(0), [node]
        while _view(root.node()):
            steps.insert(0, root.node())
            root = root.node().inputsAt(0)
        layouts = _layouts(root, steps)
        if layouts is None:
            continue
        sizes, strides, offset = layouts[-1]
        if offset != 0:  # at another offset: cut the chain where it was that view already
            earliest = layouts.index(layouts[-1])
            if earliest < len(steps) - 1 and not _returned(node.output()):
                node.output().replaceAllUsesWith(steps[earliest].output())
                replaced += 1
            continue
        if _complete(root) == (sizes, strides) and not _returned(node.output()):
            node.output().replaceAllUsesWith(root)
        else:
            node.output().replaceAllUsesWith(_as_strided(graph, node, root, sizes, strides))
        replaced += 1
    if replaced:
        torch._C._jit_pass_dce(graph)
    return replaced


def _view(node: Any) -> bool:
    return node.kind() in VIEWS and all(v.node().kind() == "prim::Constant"
                                        for v in list(node.inputs())[1:])


def _complete(value: Any) -> tuple[list[int], list[int]] | None:
    """The traced sizes and strides of ``value``, where the tracer knew them all."""
    import torch

    typed = value.type()
    if not isinstance(typed, torch._C.TensorType):
        return None
    sizes, strides = typed.sizes(), typed.strides()
    if sizes is None or strides is None or None in sizes or None in strides:
        return None
    return list(sizes), list(strides)


def _layouts(root: Any, steps: list[Any]) -> list[tuple[list[int], list[int], int]] | None:
    """The sizes, strides and storage offset each of ``steps`` makes of ``root`` on a meta tensor,
    or None where one step is not a view of it or the chain's end is not what the tracer saw."""
    import torch

    layout, wanted = _complete(root), _complete(steps[-1].output())
    scalar = root.type().scalarType()
    if layout is None or wanted is None or scalar is None or scalar.startswith("Q"):
        return None  # (a quantized tensor's views keep their ops)
    dtype = getattr(torch, scalar.lower(), None)
    if not isinstance(dtype, torch.dtype):
        return None
    found = []
    with torch.no_grad():
        try:
            base = value = torch.empty_strided(*layout, dtype=dtype, device="meta")
            for step in steps:
                op = getattr(torch.ops.aten, step.kind().split("::")[1])
                value = op(value, *[v.toIValue() for v in list(step.inputs())[1:]])
                if value._base is not base:
                    return None  # a reshape that copies
                found.append((list(value.shape), list(value.stride()), value.storage_offset()))
        except (RuntimeError, TypeError, ValueError):
            return None
    return found if list(found[-1][:2]) == list(wanted) else None


def _returned(value: Any) -> bool:
    """Whether ``value`` leaves the graph (an output stays a value of its own)."""
    return any(use.user.kind() in ("prim::Return", "prim::TupleConstruct") for use in value.uses())


def _as_strided(graph: Any, before: Any, root: Any, sizes: list[int], strides: list[int]) -> Any:
    made = graph.create("aten::as_strided", [root, graph.insertConstant(sizes),
                                             graph.insertConstant(strides),
                                             graph.insertConstant(None)])
    for constant in list(made.inputs())[1:]:
        constant.node().moveBefore(before)
    made.insertBefore(before)
    made.output().setType(before.output().type())
    return made.output()


MADE = frozenset({"aten::cat", "aten::stack", "aten::sigmoid", "aten::tanh", "aten::relu",
                  "aten::add", "aten::sub", "aten::mul", "aten::div", "aten::addmm", "aten::mm",
                  "aten::bmm", "aten::linear", "aten::addcmul", "aten::softmax",
                  "aten::log_softmax", "aten::clone", "aten::mean", "aten::sum", "aten::exp",
                  "aten::neg", "aten::gelu", "aten::layer_norm", "aten::_convolution",
                  "aten::_addmm_activation", "aten::_adaptive_avg_pool2d",
                  "aten::max_pool2d", "aten::avg_pool2d"})
"""Ops whose result is a tensor each call makes in memory of its own: never an input, a view of
one or a constant (not ``contiguous``, ``to`` or ``reshape``, which may give their input back)."""


def outputs_made(graph: Any) -> bool:
    """Whether each output of ``graph`` (a frozen trace) is the result of a ``MADE`` op: then each
    run's outputs are tensors that run made, whose memory nothing else holds (the runtime then looks
    at their references only: ``fresh_outputs.Made``)."""
    (returned,) = list(graph.outputs()) or [None]
    if returned is None:
        return False
    node = returned.node()
    values = list(node.inputs()) if node.kind() == "prim::TupleConstruct" else [returned]
    return all(value.node().kind() in MADE and _own_result(value.node()) for value in values)


def _own_result(node: Any) -> bool:
    """Whether ``node``'s schema returns a tensor of its own (not ``out=``'s: ``Tensor(a!)``)."""
    try:
        schema = node.schema()
    except RuntimeError:  # no schema: nothing known
        return False
    return "->" in schema and "(" not in schema.rsplit("->", 1)[1]
