"""The index glue of a trace (``traced``'s frozen graphs) folded where the trace shows it does
nothing: the wrap of negative indices where the indices cannot be negative, and casts to the
dtype a value already has.

ONNX counts a negative index from the end, so the torch kernels of Gather, GatherElements,
GatherND and the scatters wrap their indices without reading them on the host
(``kernels.indexing._wrap``, ``traceable._gather``): ``aten::to`` int64, then
``aten::where(aten::lt(i, 0), aten::add(i, size), i)``, four ops at every run. Where the indices
are a sort's, a TopK's, an arg-max's or a NonZero's (through views and casts), none is negative
and the ``where`` gives ``i`` back: a YOLO-style head's two GatherElements by its TopK's indices
paid eight such ops a run. An index out of range still fails in the gather itself, as before.

The heads of an attention are index glue too: Q, K and V taken out of one product's result
(a Gather of the stacked projections, Reshapes and Transposes to heads) are chains of views
ending at an offset into it, which ``static_sizes.fold_views`` cuts where the offset starts (an
``as_strided`` of the input would fix the sample's offset). Where the chain's root is the fresh
result of a product (``FRESH``, or oneDNN's scripted product: its storage offset is 0 at every
run), ``fold_offset_views`` makes the whole chain one ``as_strided`` at that offset (a frozen
trace of the full-tier encoder's K and V heads, 7 views: 64 -> 44 us a call with two adds, 1
thread, load 7).
"""

from __future__ import annotations

from typing import Any

NON_NEGATIVE = {"aten::sort": 1, "aten::topk": 1, "aten::argsort": 0, "aten::argmax": 0,
                "aten::argmin": 0, "aten::nonzero": 0}
"""Ops whose output (at this position) holds indices, never negative."""

SAME_VALUES = frozenset({"aten::to", "aten::expand", "aten::as_strided", "aten::slice",
                         "aten::narrow", "aten::select", "aten::reshape", "aten::view",
                         "aten::permute", "aten::transpose", "aten::t", "aten::unsqueeze",
                         "aten::squeeze", "aten::flatten", "aten::contiguous", "aten::clone"})
"""Ops whose output holds only values of their first input (an integer cast keeps a
non-negative index non-negative)."""

INTEGERS = frozenset({"Long", "Int", "Short", "Char", "Byte"})


def fold_index_glue(graph: Any) -> int:
    """``graph`` (a traced TorchScript graph, changed in place) without the casts that give a
    value back as it is and the wraps of indices that cannot be negative, and its chains of views
    at an offset of a product's result as one view each (``fold_offset_views``); then dead code
    elimination. Returns how many ops were folded."""
    import torch

    folded = fold_offset_views(graph)
    for node in list(graph.nodes()):
        if node.kind() == "aten::to" and _same_dtype(node) or _idle_wrap(node):
            node.output().replaceAllUsesWith(node.inputsAt(0 if node.kind() == "aten::to" else 2))
            folded += 1
    if folded:
        torch._C._jit_pass_dce(graph)
    return folded


def _same_dtype(node: Any) -> bool:
    """Whether ``node``, an ``aten::to(self, dtype, non_blocking, copy, memory_format)``, returns
    ``self`` itself: the dtype ``self`` was traced with, no copy asked, no memory format."""
    import torch

    if node.inputsSize() != 5 or node.outputsSize() != 1:
        return False
    typed, dtype = node.inputsAt(0).type(), node.inputsAt(1).toIValue()
    copy, layout = node.inputsAt(3).toIValue(), node.inputsAt(4).toIValue()
    if not isinstance(typed, torch._C.TensorType) or not isinstance(dtype, int) or copy is not False \
            or layout is not None or typed.scalarType() is None:
        return False
    return _DTYPES.get(dtype) == typed.scalarType()


_DTYPES = {0: "Byte", 1: "Char", 2: "Short", 3: "Int", 4: "Long", 5: "Half", 6: "Float",
           7: "Double", 11: "Bool", 15: "BFloat16"}  # torch's ScalarType numbers, as a trace has them


def _idle_wrap(node: Any) -> bool:
    """Whether ``node`` is ``where(lt(i, 0), add(i, n), i)`` with ``i`` never negative."""
    if node.kind() != "aten::where" or node.inputsSize() != 3:
        return False
    condition, wrapped, indices = (node.inputsAt(k) for k in range(3))
    test, shifted = condition.node(), wrapped.node()
    if test.kind() != "aten::lt" or test.inputsAt(0).unique() != indices.unique() \
            or test.inputsAt(1).toIValue() != 0 or shifted.kind() != "aten::add" \
            or shifted.inputsAt(0).unique() != indices.unique():
        return False
    # the wrap's result is a new tensor, the indices may be read elsewhere: none written in place
    if any(use.user.kind().endswith("_") for use in node.output().uses()):
        return False
    return _never_negative(indices)


def _never_negative(value: Any) -> bool:
    """Whether ``value`` holds indices of an op of ``NON_NEGATIVE``, through ``SAME_VALUES``."""
    import torch

    while True:
        node = value.node()
        typed = value.type()
        if not isinstance(typed, torch._C.TensorType) or typed.scalarType() not in INTEGERS:
            return False
        if NON_NEGATIVE.get(node.kind()) == value.offset():
            return True
        if node.kind() not in SAME_VALUES:
            return False
        value = node.inputsAt(0)


FRESH = frozenset({"aten::linear", "aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm",
                   "mkldnn::_linear_pointwise"})
"""Ops whose result is a tensor of its own, at storage offset 0 (``aten::linear`` of more than
two dimensions gives a view of its product's result, at offset 0 too)."""


def fold_offset_views(graph: Any) -> int:
    """Each chain of two views or more (``static_sizes.VIEWS``, constant arguments) from a
    ``FRESH`` op's result made one ``as_strided`` of that result, at the offset the chain ends at,
    where composing the chain on a meta tensor of the result's traced layout gives the sizes and
    strides the tracer saw; returns how many views were replaced (dead ones go at the next DCE)."""
    from backplane.backends.torch.fusion.static_sizes import _view as view

    narrowed = _split_as_narrows(graph)
    replaced = 0
    for node in list(graph.nodes()):
        if not view(node) or not view(node.inputsAt(0).node()):
            continue
        root, steps = node.inputsAt(0), [node]
        while view(root.node()):
            steps.insert(0, root.node())
            root = root.node().inputsAt(0)
        if not _fresh(root.node()) or any(
                use.user.kind() in ("prim::Return", "prim::TupleConstruct")
                for use in node.output().uses()):
            continue
        layout = _composed(root, steps)
        if layout is None:
            continue
        made = graph.create("aten::as_strided", [root, *(graph.insertConstant(v) for v in layout)])
        for constant in list(made.inputs())[1:]:
            constant.node().moveBefore(node)
        made.insertBefore(node)
        made.output().setType(node.output().type())
        node.output().replaceAllUsesWith(made.output())
        replaced += 1
    for narrow, part in narrowed:  # a part read other than through folded views: the split's again
        if any(use.user.output().uses() for use in narrow.output().uses()):
            narrow.output().replaceAllUsesWith(part)
            narrow.destroy()
    return replaced


SPLITS = frozenset({"aten::split_with_sizes", "aten::split"})


def _split_as_narrows(graph: Any) -> list[tuple[Any, Any]]:
    """Each part of a split of a ``FRESH`` result (sizes and axis constants, its list unpacked)
    that only views read, read as a narrow of that result instead, so that ``fold_offset_views``
    takes the narrow into the chain after it: Q, K and V cut out of one product's result
    (``LinearSiblings``, GPT-2's Split of its c_attn) and then each taken into heads were a split,
    then one view each; without the split (where no other op reads a part), one op fewer a block.
    Returns (narrow, part) pairs: a part whose narrow is still read after the folding is read
    from the split again."""
    from backplane.backends.torch.fusion.static_sizes import _complete
    from backplane.backends.torch.fusion.static_sizes import _view as view

    made = []
    for unpack in list(graph.nodes()):
        split = unpack.inputsAt(0).node() if unpack.kind() == "prim::ListUnpack" else None
        if split is None or split.kind() not in SPLITS or not _fresh_viewed(split.inputsAt(0)):
            continue
        root, sizes, axis = split.inputsAt(0), _ints(split.inputsAt(1)), split.inputsAt(2).toIValue()
        parts = list(unpack.outputs())
        if isinstance(sizes, int):  # aten::split: parts of that size, the last one what is left
            sizes = [sizes] * len(parts)
        if not isinstance(sizes, list) or len(sizes) != len(parts) or not isinstance(axis, int):
            continue
        start = 0
        for part, size in zip(parts, sizes):
            layout, uses = _complete(part), part.uses()
            if uses and layout is not None and all(view(u.user) and u.offset == 0 for u in uses):
                narrow = graph.create("aten::narrow", [root, *(
                    graph.insertConstant(v) for v in (axis, start, layout[0][axis]))])
                for constant in list(narrow.inputs())[1:]:
                    constant.node().moveBefore(unpack)
                narrow.insertBefore(unpack)
                narrow.output().setType(part.type())
                part.replaceAllUsesWith(narrow.output())
                made.append((narrow, part))
            start += size
    return made


def _ints(value: Any) -> Any:
    """A constant int or int list of the graph (a ``prim::ListConstruct`` of constants too)."""
    node = value.node()
    if node.kind() == "prim::ListConstruct":
        items = [v.toIValue() for v in node.inputs()]
        return items if all(isinstance(i, int) for i in items) else None
    return value.toIValue()


def _fresh_viewed(value: Any) -> bool:
    """Whether ``value`` is a ``FRESH`` result or a chain of views of one (a product's rows
    viewed back in the input's batch shape, ``linear._flat_linear``)."""
    from backplane.backends.torch.fusion.static_sizes import _view as view

    while view(value.node()):
        value = value.node().inputsAt(0)
    return _fresh(value.node())


def _fresh(node: Any) -> bool:
    """A ``FRESH`` op, or the call of ``linear._scripted_onednn`` (named "product", oneDNN's
    product of a packed weight, inlined only when the trace is frozen)."""
    if node.kind() in FRESH:
        return True
    if node.kind() != "prim::CallFunction":
        return False
    function = node.inputsAt(0).node()
    return function.kind() == "prim::Constant" and "name" in function.attributeNames() \
        and function.s("name") == "product"


def _composed(root: Any, steps: list[Any]) -> tuple[list[int], list[int], int] | None:
    """The sizes, strides and storage offset ``steps`` make of ``root`` (at offset 0, its traced
    layout), where each is a view and the last is what the tracer saw; else None."""
    from backplane.backends.torch.fusion.static_sizes import _layouts

    found = _layouts(root, steps)
    return None if found is None else found[-1]
