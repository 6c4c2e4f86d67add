"""What a trace of CpuAcc's layers runs in place of their own workloads (``onednn_graph`` and
``traced`` trace through ``Forced``): the routes TorchScript can hold, forced, and the kernels of
``TRACEABLE_KERNELS``, which compute the same values as CpuAcc's own without reading a computed
value on the host, and in a form oneDNN Graph's fuser takes."""

from __future__ import annotations

from typing import Any

from backplane.backends.api.backend import BackendOptions
from backplane.ir.graph import Layer


class Forced:
    """``backend`` with some options replaced (the routes a trace can use), and the kernels a
    trace can hold (``TRACEABLE_KERNELS``) in place of its own."""

    def __init__(self, backend: Any, forced: dict[str, Any]) -> None:
        self._backend = backend
        self.options = BackendOptions({**backend.options.values, **forced})

    def kernel_for(self, layer: Layer) -> Any:
        if not layer.domain and layer.op_type in TRACEABLE_KERNELS:
            return TRACEABLE_KERNELS[layer.op_type]
        return self._backend.kernel_for(layer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _gather(data: Any, indices: Any, axis: int = 0) -> tuple[Any, ...]:
    """ONNX Gather without reading the indices on the host: one advanced index, which counts
    negative ones from the end itself (CpuAcc's own Gather reads the smallest index to skip
    that, a value a trace would keep: an embedding's Gather of token ids kept every transformer
    of the corpus layer by layer; a reshape, cast, ``where`` and ``index_select`` before, 9.0 ->
    4.6 us traced at 1 thread). Indices that are constants of the trace are counted from the end
    outside it, and one such index is a ``select``."""
    import torch

    from backplane.backends.torch.kernels.recurrent_fused import trace_constants, untraced

    axis = axis % data.dim()
    constant = trace_constants([indices])  # the trace's own (a state's row): known now
    if not constant and indices.dim():  # one aten::index, which counts negatives itself (a 0-d
        # index tensor would be an int read on the host: the index_select below)
        return (data[(slice(None),) * axis + (indices,)],)
    with untraced(constant):  # computed once, outside the trace, where the indices are constant
        flat = indices.reshape(-1).long()
        flat = torch.where(flat < 0, flat + data.shape[axis], flat)
        one = int(flat[0]) if constant and indices.dim() == 0 else None
    if one is not None:  # a view: no call a run (the VAD's state rows: 8 calls a run before)
        return (data.select(axis, one),)
    picked = torch.index_select(data, axis, flat)
    return (picked.reshape((*data.shape[:axis], *indices.shape, *data.shape[axis + 1:])),)


def _gemm(A: Any, B: Any, C: Any = None, alpha: float = 1.0, beta: float = 1.0, transA: int = 0,
          transB: int = 0) -> tuple[Any, ...]:  # noqa: N803
    """ONNX Gemm as ``F.linear`` where it is one (B transposed, no scaling, C absent or a bias of
    the outputs), else CpuAcc's own: oneDNN Graph's fuser failed on the ``addmm`` of a frozen
    transposed weight ("vector::_M_range_check", mobilenet_fp16_ts17's head in float32) and takes
    ``aten::linear``."""
    import torch.nn.functional as F

    from backplane.backends.torch.kernels.nn import gemm

    if (transB and not transA and alpha == 1.0 and A.dim() == 2
            and (C is None or beta == 1.0 and C.dim() == 1 and C.shape[0] == B.shape[0])):
        return (F.linear(A, B, C),)
    return gemm(A, B, C, alpha, beta, transA, transB)


def _conv(X: Any, W: Any, B: Any = None, auto_pad: str = "NOTSET", dilations: Any = None,
          group: int = 1, kernel_shape: Any = None, pads: Any = None,
          strides: Any = None) -> tuple[Any, ...]:  # noqa: N803
    """ONNX Conv as CpuAcc's own, but a 1-d one that CpuAcc computes as one product of its windows
    (``nn.PRODUCT_ROWS``: a few outputs) as one product of its windows read from the input padded
    time-major: (N, L + pads, C), one copy, whose windows of ``k`` positions are ``k * C``
    consecutive values, a strided view, by the weight ordered (tap, channel) to match, transposed
    once outside the trace. Its (N, K, L_out) result is a transposed view of the (N * L_out, K)
    product, so a convolution after it reads that view transposed back, contiguous, and pads it
    without a transposing copy. Before, ``F.unfold`` (im2col) made the columns (C, k): for the
    VAD's encoder a copy of its input made contiguous, then the columns (the full-tier VAD's
    trace 279 -> 257 us at 1 thread, p10 of blocks, this 2-core AMD EPYC at load 10). CpuAcc's
    own pads the input, copies the windows and copies its (N, L_out, K) product into (N, K,
    L_out). Not for oneDNN Graph's fuser, which takes aten::linear (``_gemm``)."""
    import torch
    import torch.nn.functional as F

    from backplane.backends.reference.kernels.conv import spatial_pads
    from backplane.backends.torch.kernels.nn import _few_outputs, conv
    from backplane.backends.torch.kernels.recurrent_fused import trace_constants, untraced

    if X.dim() != 3 or group != 1 or torch.jit.onednn_fusion_enabled():
        return conv(X, W, B, auto_pad, dilations, group, kernel_shape, pads, strides)
    stride, dilation = (strides or [1])[0], (dilations or [1])[0]
    (begin,), (end,) = spatial_pads(X.shape[2:], W.shape[2:], [stride], [dilation], auto_pad, pads)
    if begin != end:  # as CpuAcc's own: padded first, on both sides alike after
        X, begin = F.pad(X, [begin, end]), 0
    if not _few_outputs(X, W, stride, begin, dilation):
        return conv(X, W, B, "NOTSET", [dilation], group, kernel_shape, [begin, begin], [stride])
    n, channels, k = X.shape[0], X.shape[1], W.shape[2]
    rows = X.transpose(1, 2)  # (N, L + pads, C): time-major, one copy (none where it is already)
    rows = F.pad(rows, [0, 0, begin, begin]) if begin else rows.contiguous()
    out = (rows.shape[1] - (k - 1) * dilation - 1) // stride + 1
    if dilation == 1 and n == 1:  # k * C consecutive values a window
        windows = rows.as_strided((out, k * channels), (stride * channels, 1))
    else:
        windows = rows.as_strided((n, out, k, channels), (rows.shape[1] * channels,
                                                          stride * channels, dilation * channels,
                                                          1)).reshape(n * out, k * channels)
    constant = trace_constants([W])  # then ordered and transposed once, outside the trace
    with untraced(constant):
        weight = W.permute(2, 1, 0).reshape(k * channels, W.shape[0])  # (tap, channel) x K
        weight = weight.contiguous() if constant else weight
    y = torch.mm(windows, weight) if B is None else torch.addmm(B, windows, weight)
    return (y.view(n, out, W.shape[0]).transpose(1, 2),)


TRACEABLE_KERNELS = {"Conv": _conv, "Gather": _gather, "Gemm": _gemm}
"""ONNX ops whose CpuAcc kernel reads a computed value on the host, that oneDNN Graph's fuser fails
on, or that a trace runs in fewer calls, and the kernel a trace takes instead (the same values)."""
