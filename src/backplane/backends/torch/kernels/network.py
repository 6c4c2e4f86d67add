"""Network torch kernels beyond nn.py that are not recurrent: ConvTranspose and Col2Im; the
normalizations (Instance, Group, RMS, Lp, MeanVariance, LRN); LpPool, GlobalLpPool and MaxUnpool;
AffineGrid and GridSample. Statistics of float16 inputs are computed in float32
(``stash_type``), as CpuRef and ONNX Runtime do. (RNN, GRU and LSTM: ``recurrent.py``.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.conv import AUTO_PADS, spatial_pads
from backplane.backends.torch.kernels.common import FLOATS, NUMBERS, ints
from backplane.ir.graph import Layer, TensorInfo

# -- ConvTranspose, Col2Im -------------------------------------------------------------------------
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def conv_transpose(X, W, B=None, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None):
    rank = X.dim() - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    # torch pads both ends alike and caps output_padding: the whole result, then cut here
    full_sizes = [(int(n) - 1) * s + d * (int(k) - 1) + 1
                  for n, k, s, d in zip(X.shape[2:], W.shape[2:], strides, dilations)]
    begins, sizes = _transpose_crop(full_sizes, X.shape[2:], strides, auto_pad, output_padding,
                                    output_shape, pads)
    widths = [w for b, s, f in zip(reversed(begins), reversed(sizes), reversed(full_sizes))
              for w in (-b, b + s - f)]
    if not any(widths):  # the whole result: the bias in the call, no copy by an empty pad
        # (a U-Net's (1, 32, 64, 64) k2 s2 up-convolution, 1 thread: 0.53 -> 0.39 ms)
        return (_CONV_TRANSPOSE[rank](X, W, B, strides, 0, 0, group, dilations),)
    full = _CONV_TRANSPOSE[rank](X, W, None, strides, 0, 0, group, dilations)
    y = F.pad(full, widths)  # negative widths crop, positive ones add zeros
    return (y if B is None else y + B.reshape(-1, *[1] * rank),)


def _transpose_crop(full, ins, strides, auto_pad, output_padding, output_shape, pads):
    """Where the output starts in the unpadded result, and its size, per spatial axis."""
    rank = len(full)
    extra = list(output_padding or [0] * rank)
    if pads is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        sizes = list(output_shape[-rank:]) if output_shape else [i * s for i, s in zip(ins, strides)]
        totals = [f + e - o for f, e, o in zip(full, extra, sizes)]
        return [t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals], sizes
    pads = list(pads or [0] * 2 * rank)
    if output_shape:
        return pads[:rank], list(output_shape[-rank:])
    return pads[:rank], [f + e - b - a for f, e, b, a in zip(full, extra, pads[:rank], pads[rank:])]


def check_conv_transpose(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        return f"auto_pad {auto_pad!r} not known (known: {list(AUTO_PADS)})"
    if inputs and inputs[0].shape is not None and not 3 <= len(inputs[0].shape) <= 5:
        return f"ConvTranspose of rank {len(inputs[0].shape)} (torch has 1 to 3 spatial axes)"
    return None


def col2im(input, image_shape, block_shape, dilations=None, pads=None, strides=None):  # noqa: A002
    image, kernel = ints(image_shape), ints(block_shape)
    rank = len(image)
    dilations, strides = dilations or [1] * rank, strides or [1] * rank
    pads = pads or [0] * 2 * rank
    padded = [n + pads[i] + pads[i + rank] for i, n in enumerate(image)]
    blocks = [(p - d * (k - 1) - 1) // s + 1 for p, k, d, s in zip(padded, kernel, dilations, strides)]
    n, channels = input.shape[0], input.shape[1] // max(math.prod(kernel), 1)
    columns = input.reshape(n, channels, *kernel, *blocks)
    output = torch.zeros((n, channels, *padded), dtype=input.dtype, device=input.device)
    # every block's value at one kernel offset at a time, in CpuRef's order (the same sums)
    for offset in _offsets(kernel):
        window = tuple(slice(o * d, o * d + (b - 1) * s + 1, s)
                       for o, d, b, s in zip(offset, dilations, blocks, strides))
        output[(slice(None), slice(None), *window)] += columns[(slice(None), slice(None), *offset)]
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(rank))
    return (output[(slice(None), slice(None), *crop)],)


def _offsets(kernel):
    """Every offset of a kernel, row-major."""
    if not kernel:
        return [()]
    return [(o, *rest) for o in range(kernel[0]) for rest in _offsets(kernel[1:])]


# -- normalizations --------------------------------------------------------------------------------
def _stash(x):
    """x in float32 at least: statistics of float16 are taken in float32."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _per_channel(values, rank):
    return values.reshape(-1, *[1] * (rank - 2))


def instance_normalization(input, scale, B, epsilon=1e-5):  # noqa: A002
    return group_normalization(input, scale, B, epsilon, input.shape[1])


def group_normalization(X, scale, bias, epsilon=1e-5, num_groups=1, stash_type=1):
    """torch's ``group_norm`` without its affine, then the affine as one ``addcmul``, where torch
    takes the shapes: the statistics and the normalization were five calls (audio_conv1d_dyn19's
    GroupNorm, exported as an InstanceNormalization of its groups; (1, 16, 79), 1 thread, CPU us
    eager: 75 -> 8 for the normalization, this 2-core AMD EPYC at load 5). Not torch's affine:
    folded into the normalization (x * scale / std - mean * scale / std), a constant group came
    out 1.5e-5 from its bias, where it is exactly the bias here, in CpuRef and in ONNX Runtime.
    Nor on a channels-last tensor (a convolution's output on CpuAcc): torch's kernel for that
    layout takes the variance as E[x^2] - E[x]^2, and (1, 8, 6, 5) of mean 100 and deviation 0.1
    came out up to 0.33 from float64's (1.2e-4 contiguous): the input is made contiguous first.
    NaN spreads over its group as before."""
    x = _stash(X)
    if X.dim() >= 3 and 0 not in X.shape and X.shape[1] % num_groups == 0:
        y = torch.group_norm(x.contiguous(), num_groups, None, None, epsilon)
        y = torch.addcmul(_per_channel(_like(bias, x), X.dim()), y,
                          _per_channel(_like(scale, x), X.dim()))
        return (y if y.dtype == X.dtype else y.to(X.dtype),)
    grouped = x.reshape(X.shape[0], num_groups, -1)
    var, mean = torch.var_mean(grouped, dim=-1, correction=0, keepdim=True)
    y = ((grouped - mean) / torch.sqrt(var + epsilon)).reshape(X.shape)
    return ((y * _per_channel(scale, X.dim()) + _per_channel(bias, X.dim())).to(X.dtype),)


def _like(values, x):
    """``values`` in ``x``'s type (a float16 model's scale, where ``x`` is stashed in float32)."""
    return values if values.dtype == x.dtype else values.to(x.dtype)


def group_normalization_v18(X, scale, bias, epsilon=1e-5, num_groups=1):
    # opset 18: one scale and bias per group, repeated over the group's channels
    repeat = X.shape[1] // num_groups
    return group_normalization(X, scale.repeat_interleave(repeat), bias.repeat_interleave(repeat),
                               epsilon, num_groups)


def rms_normalization(X, scale, axis=-1, epsilon=1e-5, stash_type=1):
    x = _stash(X)
    axes = tuple(range(axis % X.dim(), X.dim()))
    rms = torch.sqrt((x * x).mean(dim=axes, keepdim=True) + epsilon)
    return ((x / rms * scale).to(X.dtype),)


def lrn(X, size, alpha=0.0001, beta=0.75, bias=1.0):
    # the sum of squares over channels [c - floor((size-1)/2), c + ceil((size-1)/2)]; torch's
    # local_response_norm centres an even window the other way
    squares = (X * X).movedim(1, -1)
    padded = F.pad(squares, ((size - 1) // 2, size // 2))
    square_sum = padded.unfold(-1, size, 1).sum(dim=-1).movedim(-1, 1)
    return (X / (bias + alpha / size * square_sum) ** beta,)


def lp_normalization(input, axis=-1, p=2):  # noqa: A002
    norm = (input.abs() ** p).sum(dim=axis, keepdim=True) ** (1 / p)
    return (torch.where(norm == 0, 0, input / norm).to(input.dtype),)


def mean_variance_normalization(X, axes=(0, 2, 3)):
    axes = tuple(axes)
    mean = X.mean(dim=axes, keepdim=True)
    std = torch.sqrt((X * X).mean(dim=axes, keepdim=True) - mean * mean)
    return ((X - mean) / (std + 1e-9),)


def check_lrn(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if inputs and inputs[0].shape is not None and len(inputs[0].shape) < 2:
        return f"LRN of rank {len(inputs[0].shape)} (no channel axis)"
    return None


# -- pools -----------------------------------------------------------------------------------------
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def lp_pool(X, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2, pads=None,
            strides=None):
    rank = X.dim() - 2
    strides, dilations = list(strides or [1] * rank), list(dilations or [1] * rank)
    begins, ends = spatial_pads(X.shape[2:], kernel_shape, strides, dilations, auto_pad, pads)
    ends = [e + x for e, x in zip(ends, _ceil_extras(X.shape[2:], kernel_shape, strides, dilations,
                                                     begins, ends, ceil_mode))]
    widths = [w for b, e in zip(reversed(begins), reversed(ends)) for w in (b, e)]
    powers = F.pad(X.abs() ** p, widths).reshape(-1, 1, *[n + b + e for n, b, e
                                                         in zip(X.shape[2:], begins, ends)])
    # the sum over each window: a convolution with ones, one plane at a time
    ones = torch.ones((1, 1, *kernel_shape), dtype=X.dtype, device=X.device)
    sums = _CONV[rank](powers, ones, None, strides, 0, dilations)
    return ((sums ** (1 / p)).reshape(*X.shape[:2], *sums.shape[2:]),)


def _ceil_extras(spatial, kernel, strides, dilations, begins, ends, ceil_mode):
    """The end padding ceil_mode adds so that its last window exists (it must start inside the
    input or its begin padding)."""
    extras = []
    for size, k, s, d, b, e in zip(spatial, kernel, strides, dilations, begins, ends):
        extent = (k - 1) * d + 1
        count = (size + b + e - extent) / s + 1
        out = -int(-count // 1) if ceil_mode else int(count // 1)
        if ceil_mode and (out - 1) * s >= size + b:
            out -= 1
        extras.append(max(0, (out - 1) * s + extent - (size + b + e)))
    return extras


def global_lp_pool(X, p=2):
    sums = (X.abs() ** p).sum(dim=tuple(range(2, X.dim())), keepdim=True)
    return (sums ** (1 / p),)


def max_unpool(X, I, output_shape=None, kernel_shape=None, pads=None, strides=None):  # noqa: N803
    # I holds MaxPool's flat indices into the unpooled tensor of the default shape; a larger
    # output_shape adds zeros after the end of each axis
    rank = X.dim() - 2
    strides, pads = list(strides or [1] * rank), list(pads or [0] * 2 * rank)
    spatial = [(size - 1) * s + k - b - e for size, s, k, b, e
               in zip(X.shape[2:], strides, kernel_shape, pads[:rank], pads[rank:])]
    unpooled = torch.zeros((*X.shape[:2], *spatial), dtype=X.dtype, device=X.device)
    unpooled.reshape(-1)[I.reshape(-1).long()] = X.reshape(-1)
    if output_shape is None:
        return (unpooled,)
    target = ints(output_shape)
    widths = [w for n, t in zip(reversed(unpooled.shape), reversed(target)) for w in (0, t - n)]
    return (F.pad(unpooled, widths),)


def check_lp_pool(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    auto_pad = layer.attrs.get("auto_pad", "NOTSET")
    if auto_pad not in AUTO_PADS:
        return f"auto_pad {auto_pad!r} not known (known: {list(AUTO_PADS)})"
    if "kernel_shape" not in layer.attrs:
        return "kernel_shape attribute missing"
    if not 1 <= len(layer.attrs["kernel_shape"]) <= 3:
        return f"LpPool over {len(layer.attrs['kernel_shape'])} axes (torch convolves 1 to 3)"
    return None


# -- sampling --------------------------------------------------------------------------------------
_GRID_MODES = {"linear": "bilinear", "bilinear": "bilinear", "nearest": "nearest",
               "cubic": "bicubic", "bicubic": "bicubic"}
"""ONNX's GridSample modes (opset 16's names and opset 20's) as torch names them."""


def _wide(*tensors):
    """The float type to compute in: the widest of the inputs', float32 at least."""
    wide = torch.float32
    for t in tensors:
        wide = torch.promote_types(wide, t.dtype)
    return wide


def affine_grid(theta, size, align_corners=0):
    # theta (N, r, r+1) maps the homogeneous base grid (x, y[, z], 1) of the output to the input;
    # torch's affine_grid puts a size-1 axis at 0 where ONNX's linspace puts it at -1
    spatial = ints(size)[2:]
    wide = _wide(theta)
    axes = [torch.linspace(-1, 1, n, dtype=wide, device=theta.device) if align_corners else
            (2 * torch.arange(n, dtype=wide, device=theta.device) + 1) / n - 1 for n in spatial]
    mesh = torch.meshgrid(*axes, indexing="ij") if axes else []
    ones = torch.ones(spatial, dtype=wide, device=theta.device)
    base = torch.stack([*mesh[::-1], ones], dim=-1).reshape(-1, len(spatial) + 1)
    grid = base @ theta.to(wide).transpose(1, 2)  # (N, points, r)
    return (grid.reshape(theta.shape[0], *spatial, len(spatial)).to(theta.dtype),)


def grid_sample(X, grid, align_corners=0, mode="linear", padding_mode="zeros"):
    wide = _wide(X, grid)
    y = F.grid_sample(X.to(wide), grid.to(wide), _GRID_MODES[mode], padding_mode,
                      bool(align_corners))
    return (y.to(X.dtype),)


def check_grid_sample(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "linear")
    padding = layer.attrs.get("padding_mode", "zeros")
    if mode not in _GRID_MODES:
        return f"GridSample mode {mode!r} not known (known: {list(_GRID_MODES)})"
    if padding not in ("zeros", "border", "reflection"):
        return f"GridSample padding_mode {padding!r} not known (known: zeros, border, reflection)"
    rank = len(inputs[0].shape) if inputs and inputs[0].shape is not None else None
    if rank is not None and rank not in (4, 5):
        return f"GridSample of rank {rank} (torch samples 2 or 3 spatial axes)"
    if rank == 5 and _GRID_MODES[mode] == "bicubic":
        return "GridSample cubic over 3 spatial axes (torch's is 2-D only)"
    if _GRID_MODES[mode] == "bicubic" and padding != "zeros":
        # ONNX folds a coordinate outside the image into it before taking the 4 x 4 taps; torch
        # folds each tap instead
        return f"GridSample cubic with padding_mode {padding!r} (torch folds taps, not points)"
    return None


def check_affine_grid(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    size = inputs[1].shape if len(inputs) > 1 else None
    if size is not None and size != (4,) and size != (5,):
        return f"AffineGrid of size {size} (torch makes 2-D and 3-D grids)"
    return None


KERNELS: KernelTable = {
    "AffineGrid": {20: affine_grid},
    "GridSample": {16: grid_sample},
    "ConvTranspose": {1: conv_transpose},
    "Col2Im": {18: col2im},
    "InstanceNormalization": {6: instance_normalization},
    "GroupNormalization": {18: group_normalization_v18, 21: group_normalization},
    "RMSNormalization": {23: rms_normalization},
    "LRN": {1: lrn},
    "LpNormalization": {1: lp_normalization},
    "MeanVarianceNormalization": {9: mean_variance_normalization},
    "LpPool": {2: lp_pool},
    "GlobalLpPool": {2: global_lp_pool},
    "MaxUnpool": {9: max_unpool},
}

CHECKS = {
    "ConvTranspose": check_conv_transpose,
    "LRN": check_lrn,
    "LpPool": check_lp_pool,
    "GridSample": check_grid_sample,
    "AffineGrid": check_affine_grid,
}

INPUT_DTYPES = {**{op: FLOATS for op in KERNELS}, "Col2Im": NUMBERS}
