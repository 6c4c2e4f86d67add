"""Attention written out by an exporter, as one ``ScaledDotAttention`` layer (issue 27: the
corpus's transformers).

The spellings the corpus has, each ending Softmax(last axis) -> MatMul(probabilities, V):

    MatMul(Q, Kt) -> Div(c) | Mul(c) -> Add(mask)            torch.onnx, TorchScript exporter
    MatMul(Q, Kt) -> Mul(c) -> Where(condition, fill, .)     the same, a boolean causal mask
    Mul(Q, c) ; Mul(Kt, c) -> MatMul -> [Add(mask)]          dynamo's export (c * c the scale)
    FusedMatMul(Q, K, transB, alpha) -> Add(mask)            ONNX Runtime's saved models

Q (..., L, E), Kt (..., E, S) (K transposed, as the product reads it), V (..., S, Ev), of one
batch shape; the scale a constant scalar, the mask any tensor added to the scores (a constant
causal one, or made from the inputs: a padding mask), a Where's fill a constant scalar.

The layer computes what the layers compute, in one call and in place where it can (the scores'
scale, mask and fill): a Python call instead of five on the layer-by-layer path, fewer ops in a
trace (``attention_workload``), the same values within rounding, NaN where ONNX gives it (a row
masked throughout: softmax of -inf everywhere, as CpuRef and ONNX Runtime). torch's ``scaled_dot_product_attention`` was measured
and is not used: at every attention shape of the corpus (4 heads, length 8-128, head size 8-64)
its CPU kernel took about twice the explicit ops' time, 1 thread, CPU time, this 2-core AMD EPYC
(4 x 128 x 16 with a padding mask 145 against 297 us, 4 x 64 x 64 causal 83 against 168), and
the corpus's traced char tagger and GPT ran 3-8% slower with it; it also gives 0, not NaN, in a
row masked throughout. torch 2.13's CPU kernel is the faster at these shapes (4 x 8 x 8 causal,
1 thread: 11.6 against 21.1 us) but gives no NaN at all for a NaN in a query, so it stays out;
at the full-tier encoder's 4 x 32 x 64 (no mask) it took 194 us against these ops' 54 (baddbmm
21, softmax 17, bmm 17; 1 thread, thread CPU, load 6.7).

On CpuAcc with ``CpuAcc.native`` "auto" a float32 layer is one call of backplane's C instead
(``native/attention``, ``_Native``): the scores of a few query rows kept in L1 from the product
to the softmax to V, the keys a constant causal condition hides never computed, the output in
the merged-heads layout. CPU time of a run at 1 thread, 14271f4 against this, alternating
processes (load 7-12): the full tier's char_tagger 1.21-1.26 -> 1.02-1.09 ms, gpt_causal
3.03-3.32 -> 2.72-2.99, encoder4_plain 1.35-1.47 -> 1.21-1.37; the small tier's char_tagger
0.172 -> 0.145, gpt_causal 0.052 -> 0.040, encoder_padmask_dyn17 0.057 -> 0.048, gpt_sdpa 0.052
-> 0.044, gpt_fp16 0.058 -> 0.048. A trace for oneDNN Graph's fuser keeps torch's ops (the fuser
takes them into its partitions).
"""

from __future__ import annotations

import math
from typing import Any


from backplane.backends.api.backend import Workload
from backplane.backends.torch.backend import FUSED_DOMAIN
from backplane.backends.torch.fusion.patterns import Context
from backplane.ir.graph import Layer


def match_attention(softmax: Layer, ctx: Context) -> tuple[list[Layer], Layer] | None:
    """The attention that ``softmax`` is the middle of, or None."""
    made = ctx.graph.producers()
    shape = _shape(softmax.inputs[0], ctx)
    if softmax.domain or shape is None or not _last_axis(softmax, len(shape)):
        return None
    out = ctx.sole(softmax.outputs[0])
    if out is None or out.op_type != "MatMul" or out.domain or out.inputs[0] != softmax.outputs[0]:
        return None
    group, value, mask, scale = [softmax, out], softmax.inputs[0], None, None
    layer = _free(made.get(value), ctx, value)
    if layer is not None and layer.op_type in ("Add", "Where"):
        masked = _mask(layer, ctx)
        if masked is None:
            return None
        value, mask = masked
        group.insert(0, layer)
        layer = _free(made.get(value), ctx, value)
    if layer is not None and layer.op_type in ("Mul", "Div"):
        value = next((i for i in layer.inputs if ctx.const(i) is None), "")
        factor = _scalar(layer, value, ctx)
        if factor is None:
            return None
        scale = (layer.op_type, factor)
        group.insert(0, layer)
        layer = _free(made.get(value), ctx, value)
    product = _scores_product(layer, scale)
    if product is None:
        return None
    group.insert(0, layer)
    scale, transposed = product
    qk, scale = _scaled_operands(layer, scale, ctx, group)
    return _fused(group, [*qk, out.inputs[1]], mask, scale, ctx, transposed)


def _scaled_operands(product: Layer, scale: tuple[str, float] | None, ctx: Context,
                     group: list[Layer]) -> tuple[list[str], tuple[str, float] | None]:
    """Q and Kt as the scores' MatMul reads them, each taken from before a Mul by a constant
    scalar where one makes it (dynamo's export: Q and Kt each times E^-1/4), that factor folded
    into the scale and the Mul into ``group``: (c Q)(c Kt) is c^2 Q Kt, one alpha of the product
    instead of two elementwise ops (and their copies of Q and Kt) a block. Only a Mul, only a
    finite nonzero factor (``_scalar``), only where nothing else reads the scaled operand."""
    made, names, factor = ctx.graph.producers(), list(product.inputs), 1.0
    if product.op_type != "MatMul" or product.domain:
        return names, scale
    for i, name in enumerate(product.inputs):
        mul = _free(made.get(name), ctx, name)
        if mul is None or mul.op_type != "Mul" or mul.domain:
            continue
        value = next((n for n in mul.inputs if ctx.const(n) is None), "")
        times = _scalar(mul, value, ctx) if value else None
        if times is None or list(product.inputs).count(name) != 1 \
                or _shape(value, ctx) != _shape(name, ctx):  # a constant of more axes broadcasts
            continue
        names[i], factor = value, factor * times
        group.insert(0, mul)
    if factor == 1.0:
        return names, scale
    alpha = 1.0 if scale is None else scale[1] if scale[0] == "Mul" else 1.0 / scale[1]
    return names, ("Mul", alpha * factor)


def _scores_product(layer: Layer | None, scale: tuple[str, float] | None,
                    ) -> tuple[tuple[str, float] | None, bool] | None:
    """The scale and whether K comes untransposed, of the layer making the scores: a MatMul, or
    ONNX Runtime's FusedMatMul(Q, K, transB, alpha) as its saved models write Q Kt times the scale
    (no Mul / Div of its own after it); None where it is neither."""
    if layer is None:
        return None
    if layer.op_type == "MatMul" and not layer.domain:
        return scale, False
    a = layer.attrs
    if layer.op_type != "FusedMatMul" or layer.domain != "com.microsoft" or scale is not None \
            or any(a.get(flag, 0) for flag in ("transA", "transBatchA", "transBatchB")):
        return None
    alpha = float(a.get("alpha", 1.0))
    return (None if alpha == 1.0 else ("Mul", alpha)), bool(a.get("transB", 0))


def _fused(group: list[Layer], qkv: list[str], mask: tuple[str, ...] | None,
           scale: tuple[str, float] | None, ctx: Context,
           transposed: bool = False) -> tuple[list[Layer], Layer] | None:
    shapes = [_shape(name, ctx) for name in qkv]
    if any(s is None or len(s) < 3 for s in shapes):
        return None
    q, kt, v = shapes  # (..., L, E), (..., E, S), (..., S, Ev): one batch shape, no broadcast
    if transposed:  # K as (..., S, E)
        kt = (*kt[:-2], kt[-1], kt[-2])  # type: ignore[index]
    if not q[:-2] == kt[:-2] == v[:-2] or q[-1] != kt[-2] or kt[-1] != v[-2]:  # type: ignore
        return None
    inputs, attrs = list(qkv), {"scale": scale, "mask": None, "fill": None,
                                "transposed": transposed}
    if mask is not None:
        kind, name, fill = mask
        inputs.append(name)
        attrs.update(mask=kind, fill=fill)
    out = group[-1].outputs[0]
    fused = Layer("+".join(lay.name for lay in group), "ScaledDotAttention", inputs, [out], attrs,
                  FUSED_DOMAIN, 1)
    return group, fused


def _mask(layer: Layer, ctx: Context) -> tuple[str, tuple[str, str, float | None]] | None:
    """(the scores' name, (kind, the mask's name, a Where's fill)) of an Add or Where on the
    scores; kind "add" (an additive mask), "where" (fill where the condition holds) or
    "where_not" (fill where it does not)."""
    if layer.domain:
        return None
    if layer.op_type == "Add":
        first, second = layer.inputs
        for scores, other in ((first, second), (second, first)):
            if _shape(scores, ctx) is not None and ctx.floating(ctx.graph.info(other).dtype) \
                    and _shape(scores, ctx) == _shape(layer.outputs[0], ctx) \
                    and _made_before(scores, ctx):
                return scores, ("add", other, None)
        return None
    condition, when, otherwise = layer.inputs
    for fill_name, scores, kind in ((when, otherwise, "where"), (otherwise, when, "where_not")):
        fill = ctx.const(fill_name)
        if fill is not None and fill.size == 1 and ctx.floating(fill.dtype) \
                and ctx.const(scores) is None:
            if _shape(scores, ctx) != _shape(layer.outputs[0], ctx):
                return None  # the condition broadcasts the scores: not a mask of them
            return scores, (kind, condition, float(fill.reshape(-1)[0]))
    return None


def _made_before(name: str, ctx: Context) -> bool:
    """Whether ``name`` is the scores (not the mask): a MatMul's (or FusedMatMul's) product in the
    view, or that product times or over a constant scalar."""
    made = ctx.graph.producers()
    layer = made.get(name)
    if layer is not None and layer.op_type in ("Mul", "Div") and not layer.domain \
            and _scalar(layer, next((i for i in layer.inputs if ctx.const(i) is None), ""), ctx):
        layer = made.get(next(i for i in layer.inputs if ctx.const(i) is None))
    return layer is not None and id(layer) in ctx.inside and (
        layer.op_type == "MatMul" and not layer.domain
        or layer.op_type == "FusedMatMul" and layer.domain == "com.microsoft")


def _free(layer: Layer | None, ctx: Context, out: str) -> Layer | None:
    """``layer`` where it is free to fuse and ``out``, its output, is read by one layer only."""
    if layer is None or id(layer) not in ctx.inside or id(layer) in ctx.taken \
            or len(ctx.consumers.get(out, [])) != 1 or out in ctx.graph.outputs:
        return None
    return layer


def _scalar(layer: Layer, scores: str, ctx: Context) -> float | None:
    other = layer.inputs[1] if layer.inputs[0] == scores else layer.inputs[0]
    value = ctx.const(other)
    if layer.domain or value is None or value.size != 1 or not ctx.floating(value.dtype) or \
            (layer.op_type == "Div" and layer.inputs[1] != other):
        return None
    factor = float(value.reshape(-1)[0])
    return factor if math.isfinite(factor) and factor != 0 else None


def _shape(name: str, ctx: Context) -> tuple[int, ...] | None:
    return ctx.float_shape(name)  # float16 too where it is computed in float32, as a trace does


def _last_axis(softmax: Layer, rank: int) -> bool:
    axis = int(softmax.attrs.get("axis", -1 if softmax.opset >= 13 else 1))
    return axis % rank == rank - 1  # below opset 13 Softmax flattens from its axis: the last only


def attention_workload(layer: Layer, backend: Any, inputs: Any = ()) -> Workload:
    """The layers' ops in one call: Q Kt, scaled, masked, softmax, times V. The products are
    ``bmm`` of the batch dimensions flattened (views where the layout allows, as ``matmul``'s
    own); the scale (a Div's as its reciprocal) and an additive mask that broadcasts over the
    flattened batch are ``baddbmm``'s alpha and input. ``matmul`` of 4-d operands expands,
    reshapes and views around its ``bmm``, and a ``mul_`` by a float is a double tensor in a
    trace, cast at every run (Q Kt times the scale of 4 x 8 x 8, traced, 1 thread: 8.5 -> 5.4
    us). The scores stay (-1, L, S) through the mask and the softmax where the mask is added by
    ``baddbmm``, or is a condition of one (L, S) for every head (a causal mask): two views fewer
    a run of each attention in a trace."""
    import torch

    from backplane.backends.torch.kernels.recurrent_fused import trace_constants, untraced

    a = layer.attrs
    kind, fill, scale, transposed = a["mask"], a["fill"], a["scale"], a.get("transposed", False)
    alpha = 1.0 if scale is None else scale[1] if scale[0] == "Mul" else 1.0 / scale[1]
    zeros: dict[Any, Any] = {}  # baddbmm's ignored input (beta 0), one per dtype and device
    native = _native(backend, kind, fill)
    threads = _session_threads(backend) if native is not None else 1

    def scores_of(q: Any, kt: Any, mask: Any) -> tuple[Any, bool]:
        """Q Kt times the scale, (..., L, S) flattened to (-1, L, S), and whether the mask
        was added: where it broadcasts over the flattened batch (its own batch all ones) or has
        Q's batch (a padding mask expanded over the heads: a view, its batch strides 0)."""
        q3, kt3 = q.reshape(-1, *q.shape[-2:]), kt.reshape(-1, *kt.shape[-2:])
        if kind == "add" and mask.dtype == q.dtype and mask.dim() >= 2 and (
                all(n == 1 for n in mask.shape[:-2]) or mask.shape[:-2] == q.shape[:-2]):
            return torch.baddbmm(mask.reshape(-1, *mask.shape[-2:]), q3, kt3, alpha=alpha), True
        if alpha == 1.0:
            return torch.bmm(q3, kt3), False  # a new tensor: masked in place below
        key = (q.dtype, q.device)
        if key not in zeros:
            with untraced(True):  # a constant of a trace, not an op of it
                zeros[key] = torch.zeros((), dtype=q.dtype, device=q.device)
        return torch.baddbmm(zeros[key], q3, kt3, beta=0, alpha=alpha), False

    def run(q: Any, kt: Any, v: Any, mask: Any = None) -> tuple[Any]:
        if native is not None and q.dtype == torch.float32 and q.device.type == "cpu" \
                and not native.fused_trace() and not _threads_win(q, v, threads):
            return (native.call(q, kt if transposed else kt.transpose(-1, -2), v, mask, alpha),)
        kt = kt.transpose(-1, -2) if transposed else kt
        shape = (*q.shape[:-1], kt.shape[-1])  # (..., L, S)
        scores, added = scores_of(q, kt, mask)  # (-1, L, S)
        if kind == "add" and not added:
            scores = scores.view(shape).add_(mask).view(-1, *shape[-2:])
        elif kind not in (None, "add"):  # Where: the fill where the condition holds (or not)
            condition = mask if kind == "where" else ~mask
            if condition.dim() > 2 and any(n != 1 for n in condition.shape[:-2]):
                scores = scores.view(shape).masked_fill_(condition, fill).view(-1, *shape[-2:])
            else:  # one (L, S) condition for every head: a constant's made once
                constant = trace_constants([mask])
                with untraced(trace_constants([condition])):
                    condition = condition.reshape(condition.shape[-2:])
                causal = _causal(condition, fill, scores) if constant else None
                if causal is not None:  # the masked values zeroed, then the fill added
                    scores = scores.tril_(causal[0]).add_(causal[1])
                else:
                    scores = scores.masked_fill_(condition, fill)
        out = torch.bmm(torch.softmax(scores, -1), v.reshape(-1, *v.shape[-2:]))
        return (out.view(*shape[:-1], v.shape[-1]),)
    return run



THREADS_FROM = 1 << 20
"""The work (batch x heads x L x S x (E + Ev)) above which torch's ops at two threads or more
beat the C on the calling thread (1 thread for the C, torch at 2, this session's AVX-512 EPYC,
quiet, us a call, torch / C: 4 x 64 x 64 x 32 27.4 / 27.1; 4 x 128 x 128 x 16 51.6 / 63.5; 8 x 128 x
128 x 64 210 / 265; 4 x 32 x 32 x 16 15.4 / 9.4): the full tier's char_tagger_ts14 ran 0.98 ms a
run with the C against 0.90 without."""


def _threads_win(q: Any, v: Any, threads: int) -> bool:
    """Whether torch's ops take this attention: a session of more than one thread (``threads``,
    read at load: a trace is made at one thread) and more work than ``THREADS_FROM``."""
    batch = q.numel() // (q.shape[-1] * q.shape[-2]) if q.dim() >= 2 else 1
    return threads > 1 and batch * q.shape[-2] * v.shape[-2] * (q.shape[-1] + v.shape[-1]) \
        > THREADS_FROM


def _session_threads(backend: Any) -> int:
    """The session's threads on a quiet machine: ``CpuAcc.threads`` where it gives a count, else
    the process governor's most where one runs (the signature's build traces at one thread),
    else torch's count now."""
    from backplane.backends.torch import threads
    from backplane.backends.torch.fusion.native_cnn import session_threads

    try:
        count = session_threads(backend)
    except Exception:  # noqa: BLE001  # a backend without options: one thread's choice
        return 1
    given = backend.options.get("CpuAcc.threads")
    if given in (None, "auto") and threads._GOVERNOR is not None:
        count = max(count, threads._GOVERNOR.most)
    return count


TRIL_FROM = 2048
"""The scores (heads x L x S values) from which a constant causal condition is applied as
``tril_`` then ``add_`` of a constant holding the fill above the diagonal (``_causal``), not
``masked_fill_``: ATen's masked fill is a scalar loop (4 x 64 x 64 causal, 1 thread, thread CPU,
load 8: 47.7 us against 9.9; 4 x 8 x 8: 4.4 against 5.0)."""


def _causal(condition: Any, fill: float, scores: Any) -> tuple[int, Any] | None:
    """(the diagonal ``tril_`` keeps to, the constant to add) where the constant 2-d
    ``condition`` masks each row from one column on, that column moving one a row (a causal
    mask: ``triu`` of ones), the ``scores`` have ``TRIL_FROM`` values or more and the fill is not
    zero; else None. ``tril_`` zeroes the masked values (NaN and infinities too, which the fill
    replaces in ONNX's Where), and 0 + fill is the fill; an unmasked value plus 0 is itself (a
    -0 becomes +0, which the softmax reading it alone takes alike)."""
    import torch

    from backplane.backends.torch.kernels.recurrent_fused import untraced

    if scores.numel() < TRIL_FROM or fill == 0:
        return None
    k = triu_offset(condition)
    if k is None:
        return None
    with untraced(True):
        added = torch.zeros(condition.shape, dtype=scores.dtype,
                            device=scores.device).masked_fill_(condition, fill)
    return k - 1, added


def triu_offset(condition: Any) -> int | None:
    """k where the 2-d bool ``condition`` is ``triu`` of ones from diagonal k (each row masked from
    column i + k on: a causal mask) and masks part of some row; else None."""
    import torch

    from backplane.backends.torch.kernels.recurrent_fused import untraced

    if condition.dim() != 2 or condition.dtype != torch.bool:
        return None
    with untraced(True):
        rows, columns = condition.shape
        kept = (~condition).sum(1)  # values kept a row: min(max(i + k, 0), S) for triu(., k)
        inside = ((kept > 0) & (kept < columns)).nonzero()
        if not len(inside):
            return None
        row = int(inside[0, 0])
        k = int(kept[row]) - row
        if not torch.equal(condition, torch.ones(rows, columns, dtype=torch.bool,
                                                 device=condition.device).triu(k)):
            return None
    return k


class _Native:
    """A ScaledDotAttention's call of backplane's C (``native/attention``): the mask as the C
    takes it, an additive one as it is, a condition's fill by its bytes or, where the condition
    is a constant of the trace that is a causal ``triu`` (``triu_offset``), by its diagonal: the
    hidden keys are never computed (they are each the fill)."""

    def __init__(self, kind: str | None, fill: float | None) -> None:
        from backplane.backends.torch.kernels.common import for_onednn_graph
        from backplane.native import attention

        self.kind, self.fill, self.scaled = kind, fill, attention.scaled
        self.fused_trace = for_onednn_graph  # oneDNN Graph's fuser takes torch's ops

    def call(self, q: Any, k: Any, v: Any, mask: Any, alpha: float = 1.0) -> Any:
        import torch

        from backplane.backends.torch.kernels.recurrent_fused import trace_constants, untraced

        kind, fill = self.kind, self.fill
        if kind is None:
            return self.scaled(q, k, v, alpha=alpha)
        if kind == "add":
            if mask.dtype != torch.float32:
                mask = mask.to(torch.float32)  # (a float16 mask in a widened trace)
            return self.scaled(q, k, v, mask=mask, alpha=alpha)
        if all(n == 1 for n in mask.shape[:-2]) and trace_constants([mask]):
            with untraced(True):  # one (L, S) condition for every head, a constant
                hidden = mask.reshape(mask.shape[-2:])
                offset = triu_offset(hidden if kind == "where" else ~hidden)
            if offset is not None:
                return self.scaled(q, k, v, diagonal=offset, fill=fill, alpha=alpha)
        return self.scaled(q, k, v, cond=mask, invert=kind == "where_not", fill=fill, alpha=alpha)


def _native(backend: Any, kind: str | None, fill: float | None) -> _Native | None:
    """The layer's C call where it takes one: ``CpuAcc.native`` "auto" on CpuAcc, the library
    here; None where torch's ops run it."""
    if getattr(backend, "id", "") != "CpuAcc":
        return None
    from backplane.native import attention, build

    try:
        mode = build.mode(backend.options)
    except Exception:  # noqa: BLE001  # an unknown setting is the load's error to raise
        return None
    return _Native(kind, fill) if attention.usable(mode) else None
