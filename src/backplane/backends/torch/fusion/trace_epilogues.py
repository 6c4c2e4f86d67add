"""Ops of a frozen trace folded into the products beside them (``traced``'s graphs, after
``static_sizes``): fewer ops a run, the same values.

A trace of small layers spends most of its time between its products, about 1-2 us an op in
TorchScript's interpreter on this project's 2-core AMD EPYC (a frozen graph of 31 sigmoids on
(1, 128): 62 us against 6.7 for one, 1 thread, load 9). Two folds here:

- ``fold_relus``: a Relu of a product's result (``aten::addmm``, read through views: a 1-d
  Conv's transposed output, ``traceable._conv``) is torch's ``_addmm_activation``, the product with
  the Relu done in place on its result: one op and one allocation fewer (the full-tier VAD's two
  convolutions). ``relu(NaN)`` is NaN in both.
- ``fold_means``: a mean read only by a product with a constant weight (directly, or
  concatenated with other rows first: the VAD's pooled encoder output into its LSTM step's
  ``[x, h]``) is a sum, its ``1 / n`` folded into that weight's rows for it. torch's mean on the
  CPU is its own reduction (a division by a number wrapped into a tensor and cast each call: 7.7
  against 3.4 us for the sum of (4, 128) rows at 1 thread, load 7); the values are the same up to
  rounding (the sum's order, ``1 / n`` rounded once into each weight: 2.4e-7 on the full-tier VAD's
  state, whose count is 4, a power of two, where the scaling itself is exact).
"""

from __future__ import annotations

from typing import Any

VIEW_KINDS = frozenset({"aten::as_strided", "aten::transpose", "aten::view", "aten::reshape",
                        "aten::unsqueeze", "aten::squeeze", "aten::t", "aten::permute"})
"""What may lie between a product and its Relu: views and reshapes, which an elementwise op
commutes with (a reshape that copies copies the same values, relu'd or not)."""


def fold_relus(graph: Any) -> int:
    """Each ``aten::relu`` of an ``aten::addmm``'s result (through views each read by the next
    alone) made the product's ``_addmm_activation``; returns how many were folded."""
    import torch

    folded = 0
    for relu in [n for n in graph.nodes() if n.kind() == "aten::relu"]:
        value = relu.inputsAt(0)
        while value.node().kind() in VIEW_KINDS and len(value.uses()) == 1:
            value = value.node().inputsAt(0)
        product = value.node()
        if product.kind() != "aten::addmm" or len(value.uses()) != 1:
            continue
        fused = graph.create("aten::_addmm_activation",
                             [*product.inputs(), graph.insertConstant(False)])
        fused.inputsAt(5).node().moveBefore(product)
        fused.insertBefore(product)
        fused.output().setType(value.type())
        value.replaceAllUsesWith(fused.output())
        relu.output().replaceAllUsesWith(relu.inputsAt(0))
        relu.destroy()
        product.destroy()
        folded += 1
    if folded:
        torch._C._jit_pass_dce(graph)
    return folded


def fold_means(graph: Any) -> int:
    """Each ``aten::mean`` of ``graph`` whose one reader is a product by a constant weight
    (``_weight_rows``) made an ``aten::sum``, the weight's rows for it scaled by ``1 / count`` in
    a constant of the reader's own; returns how many."""
    import torch

    folded = 0
    for mean in [n for n in graph.nodes() if n.kind() == "aten::mean"]:
        count = _count(mean)
        found = _weight_rows(mean.output()) if count else None
        if found is None:
            continue
        reader, index, rows = found
        weight = reader.inputsAt(index).toIValue().clone()
        if reader.kind() == "aten::linear":  # (N, K): its columns
            weight[:, rows] *= 1.0 / count
        else:
            weight[rows] *= 1.0 / count
        scaled = graph.insertConstant(weight)
        scaled.node().moveBefore(reader)
        reader.replaceInput(index, scaled)
        total = graph.create("aten::sum", list(mean.inputs()))
        total.insertBefore(mean)
        total.output().setType(mean.output().type())
        mean.output().replaceAllUsesWith(total.output())
        mean.destroy()
        folded += 1
    if folded:
        torch._C._jit_pass_dce(graph)
    return folded


PRODUCTS = {"aten::addmm": (1, 2), "aten::mm": (0, 1), "aten::linear": (0, 1)}
"""A product's op -> (the input its rows come in at, its weight's input)."""


def _count(mean: Any) -> int | None:
    """How many values ``mean`` (``aten::mean(self, dim, keepdim, dtype)``) averages, where its
    axes, its input's sizes and a result of two dimensions (rows, features) are known."""
    from backplane.backends.torch.fusion.static_sizes import _complete

    if mean.inputsSize() != 4 or any(mean.inputsAt(i).node().kind() != "prim::Constant"
                                     for i in (1, 2, 3)):
        return None
    axes, keep, dtype = (mean.inputsAt(i).toIValue() for i in (1, 2, 3))
    layout, result = _complete(mean.inputsAt(0)), _complete(mean.output())
    if layout is None or result is None or len(result[0]) != 2 or keep or dtype is not None \
            or not isinstance(axes, list) or not axes:
        return None
    count = 1
    for axis in axes:
        count *= layout[0][axis]
    return count


def _weight_rows(value: Any) -> tuple[Any, int, slice] | None:
    """(the product, its weight's input index, the weight's rows ``value`` meets) where ``value``'s
    one reader is a product by a constant weight, or a concatenation of rows along their features
    whose one reader is."""
    from backplane.backends.torch.fusion.static_sizes import _complete

    (use,) = value.uses() if len(value.uses()) == 1 else (None,)
    if use is None:
        return None
    width = _complete(value)[0][1]  # type: ignore[index]  # (rows, features): _count saw it
    begin, user = 0, use.user
    if user.kind() == "prim::ListConstruct":
        parts = [_complete(v) for v in user.inputs()]
        (cat,) = [u.user for u in user.output().uses()] if len(user.output().uses()) == 1 \
            else (None,)
        if cat is None or cat.kind() != "aten::cat" or cat.inputsAt(1).node().kind() \
                != "prim::Constant" or cat.inputsAt(1).toIValue() not in (1, -1) \
                or any(p is None or len(p[0]) != 2 for p in parts):
            return None
        begin = sum(p[0][1] for p in parts[:use.offset])  # type: ignore[index]
        (use,) = cat.output().uses() if len(cat.output().uses()) == 1 else (None,)
        if use is None:
            return None
        user = use.user
    rows_at, weight_at = PRODUCTS.get(user.kind(), (None, None))
    if use.offset != rows_at or user.inputsAt(weight_at).node().kind() != "prim::Constant":
        return None
    return user, weight_at, slice(begin, begin + width)
