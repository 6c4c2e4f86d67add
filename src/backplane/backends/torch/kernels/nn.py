"""Neural-network torch kernels: Conv, pools, Gemm / MatMul, normalizations, Softmax.

These are the plain, unfused kernels (weights arrive as inputs at run time); CpuAcc's fused and
prepacked forms of Conv and Gemm are in ``backends/torch/fusion.py``.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.conv import AUTO_PADS, spatial_pads
from backplane.backends.torch.kernels.common import FLOATS, for_nan_keeping_graph, for_onednn_graph
from backplane.ir.graph import Layer, TensorInfo

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _pad_both(x, begins, ends, value=0.0):
    widths = [w for b, e in zip(reversed(begins), reversed(ends)) for w in (b, e)]
    return F.pad(x, widths, value=value)


def conv(X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None,
         strides=None):
    rank = X.dim() - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    begins, ends = spatial_pads(X.shape[2:], W.shape[2:], strides, dilations, auto_pad, pads)
    if begins != ends:
        X, begins = _pad_both(X, begins, ends), [0] * rank
    if rank == 1 and group == 1 and _few_outputs(X, W, strides[0], begins[0], dilations[0]):
        return (_conv1d_as_product(X, W, B, strides[0], begins[0], dilations[0]),)
    return (_CONV[rank](X, W, B, strides, begins, dilations, group),)


PRODUCT_ROWS, PRODUCT_WEIGHTS = 10, 4096
"""A 1-d convolution of at most ``PRODUCT_ROWS`` outputs (batch times length) and at least
``PRODUCT_WEIGHTS`` weights on the CPU runs as one matrix product of its windows (a strided view of
the input) by the weight (``_conv1d_as_product``). torch's conv1d there takes
``_slow_conv2d_forward``, im2col then MKL's sgemm with the outputs as the product's short side, which
on this AMD EPYC falls off a cliff below 12 outputs: a VAD's (1, 258, 5) -> 128 kernel-3
convolution 258-280 us against 49-73 by the product, (1, 128, 8) -> 258 197 against 55; from 12
outputs, or under 4096 weights (a few us either way), conv1d is as fast or faster (1 thread, 49
shapes, load 5)."""


def _few_outputs(X, W, stride: int, pad: int, dilation: int) -> bool:
    span = (W.shape[2] - 1) * dilation + 1
    rows = X.shape[0] * ((X.shape[2] + 2 * pad - span) // stride + 1)
    return (X.device.type == "cpu" and X.dtype == torch.float32 and W.dtype == torch.float32
            and 0 < rows <= PRODUCT_ROWS and W.numel() >= PRODUCT_WEIGHTS)


def _conv1d_as_product(X, W, B, stride: int, pad: int, dilation: int):
    """conv1d as (N, L_out, C * k) windows by the (K, C * k) weight: the windows are a view of the
    (padded) input, the product one F.linear, its (N, L_out, K) result made (N, K, L_out)."""
    if pad:
        X = F.pad(X, [pad, pad])
    n, c, length = X.shape
    k = W.shape[2]
    out = (length - (k - 1) * dilation - 1) // stride + 1
    s_n, s_c, s_l = X.stride()
    windows = X.as_strided((n, out, c, k), (s_n, stride * s_l, s_c, dilation * s_l))
    y = F.linear(windows.reshape(n, out, c * k), W.reshape(W.shape[0], c * k), B)
    return y.transpose(1, 2).contiguous()


def _pool_geometry(X, kernel_shape, auto_pad, dilations, pads, strides):
    rank = X.dim() - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    begins, ends = spatial_pads(X.shape[2:], kernel_shape, strides, dilations, auto_pad, pads)
    return strides, dilations, begins, ends


def _ceil_sizes(spatial, kernel, strides, dilations, begins, ends):
    """The output sizes of a ceil_mode pool: the last window must start inside the input or its
    begin padding (never in the end padding), as in CpuRef and torch."""
    sizes = []
    for size, k, s, d, b, e in zip(spatial, kernel, strides, dilations, begins, ends):
        out = -(-(size + b + e - (k - 1) * d - 1) // s) + 1
        sizes.append(out - 1 if (out - 1) * s >= size + b else out)
    return sizes


def _trimmed(y, sizes):
    """y cut to ``sizes`` on its spatial axes: a pool run on an input padded here, where torch took
    the end padding for input and let one more ceil_mode window start in it."""
    return y[(Ellipsis, *(slice(0, n) for n in sizes))]


def max_pool(X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None,
             storage_order=0, strides=None, *, n_outputs=1):
    if not X.dtype.is_floating_point:
        # torch has no integer max pools on CUDA (nor a 1-d one on the CPU): 8-bit integers are
        # exact in float32, and a maximum selects one of them
        y, *indices = max_pool(X.float(), auto_pad, ceil_mode, dilations, kernel_shape, pads,
                               storage_order, strides, n_outputs=n_outputs)
        return (y.to(X.dtype), *indices)
    rank = X.dim() - 2
    strides, dilations, begins, ends = _pool_geometry(X, kernel_shape, auto_pad, dilations, pads,
                                                      strides)
    fits = begins == ends and all(2 * b <= k for b, k in zip(begins, kernel_shape))
    sizes = None
    if not fits:  # torch pads symmetrically, at most half a window: pad here instead
        if ceil_mode:
            sizes = _ceil_sizes(X.shape[2:], kernel_shape, strides, dilations, begins, ends)
        X, begins = _pad_both(X, begins, ends, -math.inf), [0] * rank
    pool = _MAX_POOL[rank]
    if n_outputs == 1 and _by_slices(X, kernel_shape, strides, begins, ends, dilations, ceil_mode):
        return (_strided_max(X, kernel_shape, strides),)
    if n_outputs == 1:
        if torch.jit.is_tracing() and (for_nan_keeping_graph() or not for_onednn_graph()):
            # torch's pool with indices, which oneDNN Graph leaves to torch: its own max pool
            # returns the window's largest number where the window holds NaN (common.relu)
            y = pool(X, kernel_shape, strides, begins, dilations, bool(ceil_mode),
                     return_indices=True)[0]
        else:
            y = pool(X, kernel_shape, strides, begins, dilations, bool(ceil_mode))
        return (y if sizes is None else _trimmed(y, sizes),)
    # indices: only where torch pads (check_max_pool), so that they are into X itself
    y, indices = pool(X, kernel_shape, strides, begins, dilations, bool(ceil_mode),
                      return_indices=True)
    if X.dtype.is_floating_point:
        # torch's index of a window with several NaNs is its last NaN, CpuRef's (NumPy's argmax)
        # the first: the first is the first maximum of the NaN mask
        _, first_nan = pool(torch.isnan(X).to(X.dtype), kernel_shape, strides, begins, dilations,
                            bool(ceil_mode), return_indices=True)
        indices = torch.where(torch.isnan(y), first_nan, indices)
    if storage_order:
        indices = _column_major(indices, X.shape[2:])
    planes = torch.arange(X.shape[0] * X.shape[1], device=X.device).reshape(*X.shape[:2],
                                                                          *[1] * rank)
    return y, indices + planes * math.prod(X.shape[2:])


_MOST_SLICES = 9
"""The largest window ``_strided_max`` takes: a pool of a 2x2 or 3x3 window (1 thread, this
project's 2-core AMD EPYC, ms, torch's pool with indices (what a trace holds) / without / slices):
(1, 16, 256, 256) 2x2 stride 2 NCHW 5.84 / 5.89 / 0.73, channels-last 0.54 / 0.53 / 0.18;
(1, 32, 112, 112) 3x3 stride 2 NCHW 2.94 / 2.93 / 0.77, channels-last 0.24 / 0.23 / 0.20;
(1, 64, 56, 56) 3x3 stride 1 NCHW 4.56 / 5.01 / 0.33, channels-last 0.28 / 0.28 / 0.31."""


def _by_slices(X, kernel_shape, strides, begins, ends, dilations, ceil_mode) -> bool:
    """Whether the pool is a max over a few strided views: unpadded, undilated, a small window
    that fits the input, no window cut by the end (ceil_mode)."""
    spatial = [int(n) for n in X.shape[2:]]
    return (not any(begins) and not any(ends) and all(d == 1 for d in dilations)
            and math.prod(kernel_shape) <= _MOST_SLICES
            and all(n >= k and (not ceil_mode or (n - k) % s == 0)
                    for n, k, s in zip(spatial, kernel_shape, strides)))


def _strided_max(X, kernel_shape, strides):
    """An unpadded max pool as elementwise maxima of strided views of X: torch's pool walks each
    window apart (NCHW: 5-8 times slower; its pool with indices, which a trace holds, likewise),
    where each maximum here is one vectorized pass in X's layout. The window's maximum is taken one
    spatial axis after the other (a max over the rows, then over the columns of that): k - 1
    maxima per axis of k, not k * k - 1, each of the first over the whole rows of the output's
    strided rows. 1 thread, this project's 2-core AMD EPYC, ms, every view at once / axis by axis:
    (1, 16, 256, 256) 2x2 stride 2 channels-last 0.58 / 0.41, NCHW 1.61 / 0.69; (1, 32, 112, 112)
    3x3 stride 2 0.39 / 0.20 and 1.03 / 0.37; (1, 64, 56, 56) 3x3 stride 1 0.30 / 0.18 and 0.40 /
    0.17 (a new input each call). torch.maximum keeps NaN, as CpuRef's pool does."""
    spatial = [int(n) for n in X.shape[2:]]  # ints: a trace's sizes are tensors
    outs = [(n - k) // s + 1 for n, k, s in zip(spatial, kernel_shape, strides)]
    y = X
    for axis, (k, m, s) in enumerate(zip(kernel_shape, outs, strides), start=2):
        along = None
        for offset in range(k):
            view = y[(slice(None),) * axis + (slice(offset, offset + (m - 1) * s + 1, s),)]
            along = view if along is None else torch.maximum(along, view)
        y = along
    return y.clone() if math.prod(kernel_shape) == 1 else y  # a view of X: the output is its own


def _column_major(index, spatial):
    """Row-major flat indices into ``spatial`` as column-major ones (storage_order=1)."""
    coords = []
    for n in reversed(spatial):
        coords.append(index % n)
        index = index // n
    result, stride = torch.zeros_like(index), 1
    for coord, n in zip(reversed(coords), spatial):
        result, stride = result + coord * stride, stride * n
    return result


def average_pool(X, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                 kernel_shape=None, pads=None, strides=None):
    rank = X.dim() - 2
    strides, dilated, begins, ends = _pool_geometry(X, kernel_shape, auto_pad, dilations, pads,
                                                    strides)
    if any(d != 1 for d in dilated) or _uncounted_padding(X.shape[2:], kernel_shape, begins, ends,
                                                          auto_pad, count_include_pad):
        return (_explicit_average_pool(X, kernel_shape, strides, dilated, begins, ends, ceil_mode,
                                      count_include_pad),)
    fits = begins == ends and all(2 * b <= k for b, k in zip(begins, kernel_shape))
    if rank == 3 and any(n < k for n, k in zip(X.shape[2:], kernel_shape)):
        fits = False  # torch's avg_pool3d wants the unpadded input to cover the window
    sizes = None
    if not fits:  # only reached when the padding counts (check_average_pool)
        if ceil_mode:
            sizes = _ceil_sizes(X.shape[2:], kernel_shape, strides, [1] * rank, begins, ends)
        X, begins = _pad_both(X, begins, ends), [0] * rank
    args = (kernel_shape, strides, begins, bool(ceil_mode), bool(count_include_pad))
    if sizes is None and not any(begins) and list(strides) == list(kernel_shape) \
            and _tiny_for_onednn_graph(X) and all(n % k == 0 for n, k in zip(X.shape[2:], strides)):
        return (_ADAPTIVE_AVG_POOL(X, [int(n) // k for n, k in zip(X.shape[2:], strides)]),)
    if rank == 3 and X.dtype == torch.float16 and X.device.type == "cpu":
        # torch's CPU avg_pool3d has no float16 kernel: in float32, rounded once at the end
        y = _AVG_POOL[rank](X.float(), *args).to(X.dtype)
    else:
        y = _AVG_POOL[rank](X, *args)
    return (y if sizes is None else _trimmed(y, sizes),)


def _uncounted_padding(spatial, kernel, begins, ends, auto_pad, count_include_pad):
    """Whether the padding is one torch cannot leave out of the divisor (asymmetric, automatic, over
    half a window, or a 3-d input smaller than the window) while the divisor must not count it."""
    if count_include_pad:
        return False
    symmetric = begins == ends and all(2 * b <= k for b, k in zip(begins, kernel))
    small_3d = len(kernel) == 3 and any(b for b in begins) and \
        any(n < k for n, k in zip(spatial, kernel))
    return not symmetric or auto_pad in ("SAME_UPPER", "SAME_LOWER") or small_3d


def _explicit_average_pool(X, kernel, strides, dilations, begins, ends, ceil_mode, count_pad):
    """An average pool torch's cannot run (dilations, padding left out of the divisor that torch
    would count): window sums as a depthwise convolution with ones (in float64, rounded once),
    divided by the count of input (and counted padding) elements, as CpuRef."""
    rank = X.dim() - 2
    sizes = _ceil_sizes(X.shape[2:], kernel, strides, dilations, begins, ends) if ceil_mode \
        else None
    extras = [0] * rank
    if sizes is not None:  # pad the end so that the last, partial window exists (never counted)
        extras = [max(0, (o - 1) * s + (k - 1) * d + 1 - (n + b + e)) for o, s, k, d, n, b, e
                  in zip(sizes, strides, kernel, dilations, X.shape[2:], begins, ends)]
    ends_all = [e + x for e, x in zip(ends, extras)]
    planes = X.reshape(-1, 1, *X.shape[2:]).to(torch.float64)
    ones = torch.ones((1, 1, *kernel), dtype=torch.float64, device=X.device)
    sums = _CONV[rank](_pad_both(planes, begins, ends_all), ones, None, strides, 0, dilations)
    inside = torch.ones((1, 1, *X.shape[2:]), dtype=torch.float64, device=X.device)
    if count_pad:
        inside = _pad_both(_pad_both(inside, begins, ends, 1.0), [0] * rank, extras)
    else:
        inside = _pad_both(inside, begins, ends_all)
    counts = _CONV[rank](inside, ones, None, strides, 0, dilations)
    return (sums / counts).to(X.dtype).reshape(*X.shape[:2], *sums.shape[2:])


def global_average_pool(X):
    return (spatial_mean(X, list(range(2, X.dim())), True),)


def spatial_mean(X, dims, keepdim):
    """``torch.mean(X, dims, keepdim)``; traced for oneDNN Graph, a mean over both spatial axes
    of a 4-D float tensor is an average pool over the whole map, which its fuser takes as a pool
    partition, and the partition before it then hands its output over in its own layout: torch's
    mean stays a call outside the partitions (a sum, a divisor made, an in-place division),
    each of those costing more than the pool (resnet_basic_ts16 at 32x32, its GlobalAveragePool
    on (1, 32, 2, 2): about 6 of 48 us a call of a 2-convolution trace, 1 thread, this 2-core AMD
    EPYC). The same sums in another order: equal within float rounding; NaN and Inf propagate as
    through the mean (a window's sum). A small one is torch's adaptive pool instead, which stays
    a call outside the partitions but a cheaper one than a partition (``_tiny_for_onednn_graph``)."""
    if (for_onednn_graph() and X.dim() == 4 and X.is_floating_point()
            and sorted(d % 4 for d in dims) == [2, 3]):
        if _tiny_for_onednn_graph(X):
            y = _ADAPTIVE_AVG_POOL(X, [1, 1])
            return y if keepdim else y.flatten(1)
        window = [int(n) for n in X.shape[2:]]  # ints: a trace's sizes are tensors
        y = F.avg_pool2d(X, window, window)  # strides given: the fuser refuses an empty list
        return y if keepdim else y.flatten(1)
    return torch.mean(X, dims, keepdim)


TINY_POOL = 16384
"""An average pool of a 4-D float input of at most this many values, traced for oneDNN Graph, is
torch's adaptive average pool (``_tiny_for_onednn_graph``)."""
_ADAPTIVE_AVG_POOL = torch.ops.aten._adaptive_avg_pool2d


def _tiny_for_onednn_graph(X) -> bool:
    """Whether an average pool of ``X`` traced for oneDNN Graph is torch's adaptive average pool,
    which the fuser does not take (its windows the same where the strides are the kernel and
    divide the map): a small pool is a partition of its own there, 10-15 us against ATen's
    kernel's 3-9 in the trace (1 thread, thread CPU, load 10, this 2-core AMD EPYC: (1, 32, 4, 4)
    to 2x2 29.5 -> 15.4 us a traced call, a global pool of (1, 32, 8, 8) 18.9 -> 9.2, of
    (1, 64, 16, 16) 25.4 -> 16.5)."""
    return for_onednn_graph() and X.dim() == 4 and X.dtype == torch.float32 \
        and X.numel() <= TINY_POOL


def global_max_pool(X):
    return (torch.amax(X, dim=tuple(range(2, X.dim())), keepdim=True),)


def gemm(A, B, C=None, alpha=1.0, beta=1.0, transA=0, transB=0):  # noqa: N803
    a = A.t() if transA else A
    b = B.t() if transB else B
    if C is None or beta == 0:
        y = a @ b
        return (y * alpha if alpha != 1.0 else y,)
    if alpha == 1.0 and beta == 1.0:  # addmm broadcasts C as Gemm does; the expand and the
        return (torch.addmm(C, a, b),)  # scalars cost more than the product of a small Gemm
    return (torch.addmm(C.expand(a.shape[0], b.shape[1]), a, b, beta=beta, alpha=alpha),)


def matmul(A, B):
    return (torch.matmul(A, B),)


def batch_normalization_v7(X, scale, B, mean, var, epsilon=1e-5, momentum=0.9, spatial=1):
    # spatial=0 (statistics per element, not per channel) is refused by check_batch_normalization
    return batch_normalization(X, scale, B, mean, var, epsilon)


def batch_normalization(X, scale, B, input_mean, input_var, epsilon=1e-5, momentum=0.9,
                        training_mode=0):
    params = (scale, B, input_mean, input_var)
    if any(p.dtype != X.dtype for p in params):
        # Since opset 15 the scale and bias (T1) and the statistics (T2) may have other float types
        # than X, which torch's batch_norm refuses: computed in the widest, as CpuRef does.
        wide = functools.reduce(torch.promote_types, (p.dtype for p in params), X.dtype)
        scale, B, input_mean, input_var = (p.to(wide) for p in params)
        y = F.batch_norm(X.to(wide), input_mean, input_var, scale, B, False, 0.0, epsilon)
        return (y.to(X.dtype),)
    return (F.batch_norm(X, input_mean, input_var, scale, B, False, 0.0, epsilon),)


def layer_normalization(X, Scale, B=None, axis=-1, epsilon=1e-5, stash_type=1, *, n_outputs=1):
    axis = axis % X.dim()
    normalized = tuple(X.shape[axis:])
    if n_outputs == 1 and tuple(Scale.shape) == normalized and (B is None or B.shape == Scale.shape):
        return (F.layer_norm(X, normalized, Scale, B, epsilon),)
    dims = tuple(range(axis, X.dim()))
    x = X.float() if X.dtype in (torch.float16, torch.bfloat16) else X
    mean = x.mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt(((x - mean) ** 2).mean(dim=dims, keepdim=True) + epsilon)
    y = ((x - mean) * inv_std).to(X.dtype) * Scale
    y = y + B if B is not None else y
    return (y, mean, inv_std)[:n_outputs]


def softmax(input, axis=-1):  # noqa: A002
    return (_rounded_once(torch.softmax, input, axis),)


def log_softmax(input, axis=-1):  # noqa: A002
    return (_rounded_once(torch.log_softmax, input, axis),)


def _rounded_once(fn, input, axis):  # noqa: A002
    """fp16 and bf16 computed in float32 and rounded once, as ONNX Runtime computes them (CpuAcc
    is within an fp16 ulp of its results) and torch's CUDA kernels do. torch's CPU kernels round
    steps to the type: LogSoftmax over the last axis (over a thousand fp16 ulps off where the result
    is near 0), Softmax over the other axes (about one ulp)."""
    if input.dtype in (torch.float16, torch.bfloat16) and input.device.type == "cpu":
        return fn(input, axis, dtype=torch.float32).to(input.dtype)
    return fn(input, axis)


def _coerced(kernel13):
    """Softmax before opset 13: over the 2-D coercion of the input at ``axis``."""
    def kernel(input, axis=1):  # noqa: A002
        flat = input.reshape(math.prod(input.shape[:axis]), -1)
        return (kernel13(flat, 1)[0].reshape(input.shape),)
    kernel.__name__ = f"{kernel13.__name__}_v1"
    return kernel


def check_conv(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        return f"auto_pad {auto_pad!r} not known (known: {list(AUTO_PADS)})"
    if inputs and inputs[0].shape is not None and not 3 <= len(inputs[0].shape) <= 5:
        return f"Conv of rank {len(inputs[0].shape)} (torch convolves 1 to 3 spatial axes)"
    return _check_window(layer, inputs)


def _check_window(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    """A window larger than the padded input (no output position at all) is an error in torch,
    even on an empty batch, where CpuRef gives an empty result."""
    if not inputs or inputs[0].shape is None or len(inputs[0].shape) < 3:
        return None
    spatial = inputs[0].shape[2:]
    kernel = layer.attrs.get("kernel_shape")
    if kernel is None and len(inputs) > 1 and inputs[1].shape is not None:
        kernel = inputs[1].shape[2:]  # Conv's weights
    if kernel is None or len(kernel) != len(spatial) or \
            not all(isinstance(d, int) for d in (*spatial, *kernel)):
        return None
    rank = len(spatial)
    strides = layer.attrs.get("strides") or [1] * rank
    dilations = layer.attrs.get("dilations") or [1] * rank
    begins, ends = spatial_pads(spatial, kernel, strides, dilations,
                                layer.attrs.get("auto_pad", "NOTSET"), layer.attrs.get("pads"))
    for size, k, d, b, e in zip(spatial, kernel, dilations, begins, ends):
        if size + b + e < (k - 1) * d + 1:
            return (f"{layer.op_type} window of {(k - 1) * d + 1} larger than its padded input "
                    f"({size + b + e}): no output position")
    return None


def _check_pool_pads(layer: Layer) -> str | None:
    """A pad as wide as the window lets a window lie in the padding alone (ONNX Runtime refuses
    such pads; CpuRef gives such a window an output where torch's ceil_mode rule drops it)."""
    kernel = layer.attrs.get("kernel_shape", [])
    rank = len(kernel)
    pads = layer.attrs.get("pads") or []
    dilations = layer.attrs.get("dilations") or [1] * rank
    if len(pads) == 2 * rank and any(p >= (k - 1) * d + 1 for p, k, d
                                     in zip(pads, [*kernel, *kernel], [*dilations, *dilations])):
        return f"{layer.op_type} pads {list(pads)} as wide as the window {list(kernel)}"
    return None


def check_max_pool(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    reason = check_conv(layer, inputs) or _check_pool_pads(layer)
    if reason:
        return reason
    if len(layer.outputs) > 1 and layer.outputs[1]:
        kernel = layer.attrs.get("kernel_shape", [])
        rank = len(kernel)
        pads = layer.attrs.get("pads") or [0] * 2 * rank
        if pads[:rank] != pads[rank:] or layer.attrs.get("auto_pad", "NOTSET") != "NOTSET":
            return "MaxPool indices with asymmetric or automatic padding"
        if any(2 * p > k for p, k in zip(pads, kernel)):
            # padded here, not by torch: its indices would count the padding
            return "MaxPool indices with padding over half the window (torch pads at most half)"
    return None


def check_average_pool(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    # every geometry runs: torch's pools where they match CpuRef, _explicit_average_pool elsewhere
    return check_conv(layer, inputs) or _check_pool_pads(layer)


def check_batch_normalization(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("training_mode", 0):
        return "BatchNormalization in training mode"
    if layer.attrs.get("spatial", 1) != 1:  # opset 7: statistics per element
        return "BatchNormalization with spatial=0"
    if len([n for n in layer.outputs if n]) > 1:  # before 14: the running statistics asked for
        return "BatchNormalization with its training outputs"
    return None


KERNELS: KernelTable = {
    "Conv": {1: conv},
    "MaxPool": {1: max_pool},
    "AveragePool": {1: average_pool},
    "GlobalAveragePool": {1: global_average_pool},
    "GlobalMaxPool": {1: global_max_pool},
    "Gemm": {7: gemm},
    "MatMul": {1: matmul},
    "BatchNormalization": {7: batch_normalization_v7, 9: batch_normalization},
    # ONNX's from opset 17; ONNX Runtime's own, the same op, before it (frontends/onnx_contrib.py)
    "LayerNormalization": {1: layer_normalization},
    "Softmax": {1: _coerced(softmax), 13: softmax},
    "LogSoftmax": {1: _coerced(log_softmax), 13: log_softmax},
}

CHECKS = {
    "Conv": check_conv,
    "MaxPool": check_max_pool,
    "AveragePool": check_average_pool,
    "BatchNormalization": check_batch_normalization,
}

INPUT_DTYPES = {op: FLOATS for op in KERNELS}
INPUT_DTYPES["MaxPool"] = FLOATS | {np.dtype(np.int8), np.dtype(np.uint8)}  # 8-bit since opset 12
