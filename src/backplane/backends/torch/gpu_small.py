"""GpuAcc's small layers inside a captured subgraph, in few kernels: where a CUDA graph's replay of
a small model (the corpus VAD: one LSTM step, two Conv1d, a one-column head) is bound by its
kernels' count, each a few microseconds of GPU time whatever its work, and cuDNN's and cuBLAS's
kernels for large shapes take several (pads, split-K reduces, copies of the bias).

- A Conv1d of few output positions (``SMALL_CONV_COLUMNS``): its windows, one product adding the
  bias, one copy into the output with the Relu after it folded in (``conv1d_product``).
- A forward LSTM over one time step: two products and torch's fused cell (``_one_step_lstm``).
- A Gemm of one row by few columns (``SMALL_GEMM_COLUMNS``): a sum of products (``row_gemm``).

Each keeps its layer's own kernel for other shapes and types, and off CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.ir.graph import Layer

Step = tuple[Workload, Sequence[str], Sequence[str]]
"""One call inside a captured subgraph: the workload, the names it reads, the names it writes."""


def small_steps(layers: Sequence[Layer], steps: list[Step | None],
                 sole: Callable[[str], int | None], uses: dict[str, int],
                 constants: dict[str, np.ndarray]) -> None:
    """Small 1-d Convs (with the Relu that alone reads one) and one-step LSTMs as their GPU
    forms (``_small_conv1d``, ``_one_step_lstm``; ``uses``: the readers of each value, the
    subgraph's outputs counted). Rewrites ``steps`` in place."""
    for index, layer in enumerate(layers):
        step = steps[index]
        if step is None or layer.domain:
            continue
        if layer.op_type == "Gemm" and _plain_gemm(layer):
            steps[index] = (_one_row_gemm(step[0], bool(layer.attrs.get("transB", 0))), step[1],
                            step[2])
        if layer.op_type == "LSTM" and _plain_lstm(layer):
            weights = [n for n in layer.inputs[1:4] if n]
            y_read = bool(layer.outputs and uses.get(layer.outputs[0]))
            steps[index] = (_one_step_lstm(step[0], all(n in constants for n in weights),
                                           y_read), step[1], step[2])
        if layer.op_type != "Conv" or _conv1d_attrs(layer) is None:
            continue
        after = sole(layer.outputs[0])
        relu = None if after is None else steps[after]
        if relu is None or layers[after].op_type != "Relu" or layers[after].domain:  # type: ignore[index]
            steps[index] = (_small_conv1d(layer, step[0]), step[1], step[2])
            continue
        steps[index] = None
        steps[after] = (_small_conv1d(layer, step[0], relu[0]), step[1],  # type: ignore[index]
                        relu[2])


SMALL_CONV_COLUMNS = 64
SMALL_CONV_WEIGHTS = 4096
"""A Conv1d whose output has at most ``SMALL_CONV_COLUMNS`` positions (batch x length) and whose
weight at least ``SMALL_CONV_WEIGHTS`` elements runs as one matrix product over its unfolded input
(``_small_conv1d``). cuDNN's implicit-GEMM kernels are made for many positions: inside a captured
graph on an H100, the full-tier VAD's two Conv1d (1 -> 258 channels, kernel 256 stride 128 on 576
samples; 258 -> 128 channels, kernel 3, 4 positions) took 12.8-25.9 and 18.9-20.9 us of a run's
82-126 us of kernels, the first 7.4 us as unfold and addmm (the run's kernels: 68 us with both and
the LSTM step by its cell). audio_conv1d_dyn19's 16-channel ones (768 weights and fewer) stay on
cuDNN: not measured faster so."""


def _conv1d_attrs(layer: Layer) -> tuple[int, int, int, int, int] | None:
    """(kernel, stride, dilation, pad begin, pad end) of a 1-d Conv of one group with explicit or
    VALID padding, else None."""
    kernel = layer.attrs.get("kernel_shape")
    pads = list(layer.attrs.get("pads") or [0, 0])
    if kernel is None or len(kernel) != 1 or int(layer.attrs.get("group", 1)) != 1 \
            or layer.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or len(pads) != 2:
        return None
    if layer.attrs.get("auto_pad", "NOTSET") == "VALID":
        pads = [0, 0]
    strides, dilations = layer.attrs.get("strides") or [1], layer.attrs.get("dilations") or [1]
    return int(kernel[0]), int(strides[0]), int(dilations[0]), int(pads[0]), int(pads[1])


def _small_conv1d(conv: Layer, kernel: Workload, relu: Workload | None = None) -> Workload:
    """``conv`` (a 1-d Conv, ``_conv1d_attrs``), and the Relu after it where ``relu`` is given,
    as ``conv1d_product`` where it is small (``SMALL_CONV_WEIGHTS``) on CUDA, in one floating
    type; else its own kernel (and the Relu's)."""
    attrs = _conv1d_attrs(conv)
    assert attrs is not None, "only 1-d Convs come here"
    k, stride, dilation, begin, end = attrs

    def workload(X: Any, W: Any, B: Any = None) -> tuple[Any, ...]:
        length = (X.shape[-1] + begin + end - dilation * (k - 1) - 1) // stride + 1 \
            if X.dim() == 3 else 0
        if not (X.is_cuda and X.dim() == 3 and W.dim() == 3 and W.shape[2] == k
                and W.shape[1] == X.shape[1] and X.is_floating_point() and W.dtype == X.dtype
                and (B is None or B.dtype == X.dtype) and W.numel() >= SMALL_CONV_WEIGHTS
                and 0 < X.shape[0] * length <= SMALL_CONV_COLUMNS):
            out = kernel(X, W, B)
            return out if relu is None else relu(out[0])
        return (conv1d_product(X, W, B, attrs, relu is not None),)

    return workload


def conv1d_product(X: Any, W: Any, B: Any, attrs: tuple[int, int, int, int, int],  # noqa: N803
                   relu: bool = False) -> Any:
    """conv1d (``attrs``: ``_conv1d_attrs``'s) [then relu] as W (C_out, C_in*k) times the
    input's windows (``windows``), the product adding the bias (for batch 1, (L, C*k) @ (C*k,
    C_out), both operands transposed views), then one copy into the (N, C_out, L) output, the
    Relu's clamp in it (clamp_min keeps NaN, as torch's relu). Inside a CUDA graph cuDNN's path
    took seven or eight kernels (pad's fill and copy, unfold's copy, a split-K product, the bias,
    the transpose, the Relu). The same sums in another order: within float rounding of cuDNN's."""
    import torch

    weight = W.reshape(W.shape[0], -1)  # (C_out, C*k)
    cols = windows(X, attrs)  # (N, C*k, L)
    if X.shape[0] > 1:
        y = torch.matmul(weight, cols)  # (N, C_out, L)
        if B is not None:
            y = y.add_(B[:, None])
        return y.clamp_min_(0) if relu else y
    product = torch.mm(cols[0].t(), weight.t()) if B is None else \
        torch.addmm(B, cols[0].t(), weight.t())  # (L, C_out)
    out = torch.empty((1, W.shape[0], cols.shape[-1]), dtype=X.dtype, device=X.device)
    if relu:
        torch.clamp_min(product.t(), 0, out=out[0])
    else:
        out[0].copy_(product.t())
    return out


IM2COL_THREADS = 256
"""im2col's CUDA kernel gives a thread to each (channel, output position) and walks the kernel's
taps in it: the VAD's front end (1 channel, 4 positions, 256 taps) took 15 us so on the H100 (4
threads). Below this many (channels x positions) the windows are a strided view copied whole."""


def windows(X: Any, attrs: tuple[int, int, int, int, int]) -> Any:  # noqa: N803
    """The (N, C*k, L) windows of ``X`` (N, C, length) for a 1-d convolution of ``attrs``,
    padding included: im2col (``F.unfold``, the padding in it) where it has threads enough
    (``IM2COL_THREADS``), else the padded input's strided view copied."""
    import torch.nn.functional as F

    k, stride, dilation, begin, end = attrs
    n, c, length = X.shape
    out = (length + begin + end - dilation * (k - 1) - 1) // stride + 1
    if c * out >= IM2COL_THREADS:
        pad = begin
        if begin != end:  # im2col pads both ends alike
            X, pad = F.pad(X, (begin, end)), 0
        return F.unfold(X.unsqueeze(2), (1, k), dilation=(1, dilation), padding=(0, pad),
                        stride=(1, stride))
    if begin or end:
        X = F.pad(X, (begin, end))
    s_n, s_c, s_l = X.stride()
    view = X.as_strided((n, c, k, out), (s_n, s_c, dilation * s_l, stride * s_l))
    return view.reshape(n, c * k, out)


SMALL_GEMM_COLUMNS = 8
"""A Gemm of one row by at most this many columns (a classifier's or a VAD's head) runs as
``row_gemm`` on CUDA: cuBLAS took a copy of C, a gemv and a split-K reduce for the full-tier
VAD's (1, 128) x (128, 1), 7.7 us of GPU time inside its graph (H100)."""


def _plain_gemm(layer: Layer) -> bool:
    """Whether a Gemm is A @ op(B) + C: alpha and beta 1, A not transposed."""
    attrs = layer.attrs
    return float(attrs.get("alpha", 1.0)) == 1.0 and float(attrs.get("beta", 1.0)) == 1.0 \
        and not int(attrs.get("transA", 0))


def _one_row_gemm(kernel: Workload, trans_b: bool) -> Workload:
    """A Gemm (``_plain_gemm``) of a one-row A by few columns (``SMALL_GEMM_COLUMNS``) on CUDA
    as ``row_gemm``; other shapes and types: ``kernel``."""
    def workload(A: Any, B: Any, C: Any = None) -> tuple[Any, ...]:  # noqa: N803
        columns = B.shape[0] if trans_b else B.shape[-1]
        if not (A.is_cuda and A.dim() == 2 and B.dim() == 2 and A.shape[0] == 1
                and columns <= SMALL_GEMM_COLUMNS and A.is_floating_point()
                and B.dtype == A.dtype and (C is None or (C.dtype == A.dtype
                                                          and C.numel() in (1, columns)))):
            return kernel(A, B, C)  # type: ignore[no-any-return]
        return (row_gemm(A, B, C, trans_b),)

    return workload


def row_gemm(A: Any, B: Any, C: Any, trans_b: bool) -> Any:  # noqa: N803
    """A (1, K) @ op(B) (+ C) as one product by elements, one sum over K and the add of C: three
    small kernels (NaN kept: the sum carries it)."""
    rows = B if trans_b else B.t()  # (N, K)
    y = (rows * A).sum(1)  # (N,)
    if C is not None:
        y = y + C.reshape(-1)
    return y[None]


def _plain_lstm(layer: Layer) -> bool:
    """Whether an LSTM's attributes are torch's cell's: forward, the default activations, no
    clip, no coupled input and forget gates, time first, no sequence_lens or peepholes."""
    attrs = layer.attrs
    acts = attrs.get("activations")
    return (attrs.get("direction", "forward") == "forward" and attrs.get("clip") is None
            and (not acts or [str(a) for a in acts] == ["Sigmoid", "Tanh", "Tanh"])
            and not int(attrs.get("input_forget", 0)) and not int(attrs.get("layout", 0))
            and not any(layer.inputs[4:5]) and not any(layer.inputs[7:8]))


ONNX_TO_TORCH_GATES = [0, 2, 3, 1]
"""torch's LSTM gates (i, f, g, o) as indices into ONNX's (i, o, f, c)."""


def _one_step_lstm(kernel: Workload, constant: bool, y_read: bool = True) -> Workload:
    """A forward LSTM (``_plain_lstm``) over one time step, on CUDA, in three kernels: the input's
    and the state's products (``mv`` for one row) and torch's fused cell
    (``_thnn_fused_lstm_cell``: gates, biases, both states); Y a copy of Y_h where something
    reads it (``y_read``; each output is its own), else a view: torch.lstm_cell (the same three
    kernels) and the layer's kernel copied Y always (one kernel of the full-tier VAD's replay).
    Other shapes: ``kernel``. The gates' weights in torch's order are made once where they are
    constants (``constant``)."""
    import torch

    kept: dict[str, Any] = {}

    def weights(W: Any, R: Any, B: Any) -> list[Any]:  # noqa: N803
        if kept.get("for") is not None and all(a is b for a, b in zip(kept["for"], (W, R, B))):
            return kept["made"]  # type: ignore[no-any-return]
        hidden = R.shape[-1]

        def gates(m: Any) -> Any:
            return m.reshape(4, hidden, *m.shape[1:])[ONNX_TO_TORCH_GATES].reshape(m.shape)

        made = [gates(W[0]), gates(R[0]), *((None, None) if B is None else
                                            (gates(B[0, :4 * hidden]), gates(B[0, 4 * hidden:])))]
        if constant:
            kept.update({"for": (W, R, B), "made": made})
        return made

    def workload(*values: Any) -> tuple[Any, ...]:
        X, W, R, B, _, h0, c0 = (*values, *[None] * 7)[:7]  # noqa: N806  # ONNX's order
        if not (X.is_cuda and X.dim() == 3 and X.shape[0] == 1 and W.shape[0] == 1
                and X.is_floating_point() and h0 is not None and c0 is not None
                and W.dtype == R.dtype == X.dtype == h0.dtype == c0.dtype
                and (B is None or B.dtype == X.dtype)):
            return kernel(*values)  # type: ignore[no-any-return]
        w_ih, w_hh, b_ih, b_hh = weights(W, R, B)
        x, h = X[0], h0[0]  # (batch, input), (batch, hidden)
        if x.shape[0] == 1:
            gates_x, gates_h = torch.mv(w_ih, x[0])[None], torch.mv(w_hh, h[0])[None]
        else:
            gates_x, gates_h = torch.mm(x, w_ih.t()), torch.mm(h, w_hh.t())
        hy, cy, _ = torch.ops.aten._thnn_fused_lstm_cell(gates_x, gates_h, c0[0].contiguous(),
                                                         b_ih, b_hh)
        y = hy[None, None].clone() if y_read else hy[None, None]  # (1, 1, N, H)
        return y, hy[None], cy[None]  # Y_h, Y_c (1, N, H)

    return workload
