"""Layout ops: Reshape, Flatten, Squeeze / Unsqueeze, Transpose, Concat, Split, Expand, Tile, Pad,
CenterCropPad,
DepthToSpace / SpaceToDepth, Trilu, Identity, Dropout, Shape, Size, and the tensor makers
(Constant, ConstantOfShape, Range, EyeLike).

Where an attribute became an input in the same place (Squeeze / Unsqueeze axes at 13), one kernel
serves both, taking a list or an int64 array; where the signature moved (Split at 13, Pad at 11),
each form has its own kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.api.memory import check_allocation
from backplane.backends.reference.kernels.cast import is_integer
from backplane.frontends.onnx_types import onnx_to_numpy_dtype
from backplane.ir.graph import Layer, TensorInfo


def _axes(axes, ndim: int) -> list[int]:
    return [int(a) % ndim for a in np.ravel(axes)] if ndim else []


# -- reshapes ----------------------------------------------------------------------------------
def reshape(data, shape, allowzero=0):
    # A 0 copies the input's size at that position unless allowzero; -1 is inferred by NumPy.
    new_shape = [data.shape[i] if d == 0 and not allowzero else int(d) for i, d in enumerate(shape)]
    return (data.reshape(new_shape),)


def flatten(input, axis=1):  # noqa: A002
    axis = axis + input.ndim if axis < 0 else axis  # axis may equal the rank
    outer = math.prod(input.shape[:axis])
    return (input.reshape(outer, math.prod(input.shape[axis:])),)


def squeeze(data, axes=None):
    # the method np.squeeze calls, without its dispatcher's and its own Python frames
    if axes is None:
        return (data.squeeze(),)
    return (data.squeeze(axis=tuple(_axes(axes, data.ndim))),)


def unsqueeze(data, axes):
    given = np.ravel(axes).tolist()
    out_rank = data.ndim + len(given)
    at = {int(a) % out_rank for a in given}
    if len(at) != len(given):  # an axis named twice: np.expand_dims's error
        return (np.expand_dims(data, axis=tuple(_axes(axes, out_rank))),)
    # the same view as np.expand_dims's, by one reshape (its wrapper cost 6-10 us a call)
    sizes = iter(data.shape)
    return (data.reshape([1 if k in at else next(sizes) for k in range(out_rank)]),)


def transpose(data, perm=None):
    return (np.transpose(data, perm),)


def concat(*inputs, axis):
    return (np.concatenate(inputs, axis=axis),)


def expand(input, shape):  # noqa: A002
    # Broadcasting goes both ways: a 1 in `shape` keeps the input's size.
    target = np.broadcast_shapes(input.shape, tuple(int(d) for d in shape))
    check_allocation(target, input.dtype, "Expand's output")
    return (np.broadcast_to(input, target).copy(),)


def tile(input, repeats):  # noqa: A002
    repeats = [int(r) for r in repeats]
    check_allocation([n * r for n, r in zip(input.shape, repeats)], input.dtype, "Tile's output")
    return (np.tile(input, repeats),)


# -- Split -------------------------------------------------------------------------------------
def split_v2(input, axis=0, split=None, *, n_outputs):  # noqa: A002
    return _split(input, axis, split, n_outputs)


def split_v13(input, split=None, axis=0, *, n_outputs):  # noqa: A002
    return _split(input, axis, split, n_outputs)


def split(input, split=None, axis=0, num_outputs=None, *, n_outputs):  # noqa: A002
    if split is None and num_outputs is not None:  # equal chunks, the last one smaller
        chunk = -(-input.shape[axis] // num_outputs)
        split = [min(chunk, input.shape[axis] - i * chunk) for i in range(num_outputs)]
    return _split(input, axis, split, n_outputs)


def _split(x, axis, sizes, n_outputs):
    if sizes is None:
        return tuple(np.split(x, n_outputs, axis=axis))
    sizes = [int(s) for s in sizes]
    if any(s < 0 for s in sizes) or sum(sizes) != x.shape[axis]:
        raise ValueError(f"Split's sizes {sizes} must be >= 0 and add up to the axis's "
                         f"{x.shape[axis]}")
    return tuple(np.split(x, np.cumsum(sizes)[:-1], axis=axis))


# -- Pad ---------------------------------------------------------------------------------------
_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "edge", "wrap": "wrap"}


def pad(data, pads, constant_value=None, axes=None, mode="constant"):
    axes = _axes(range(data.ndim) if axes is None else axes, data.ndim)
    pads = [int(p) for p in pads]
    widths = [(0, 0)] * data.ndim
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[i + len(axes)])
    return (_pad(data, widths, mode, 0 if constant_value is None else constant_value),)


def pad_v2(data, pads, mode="constant", value=0.0):
    return pad(data, pads, np.array(value, dtype=data.dtype), None, mode)


def _pad(x, widths, mode, value):
    made = [n + b + e for n, (b, e) in zip(x.shape, widths)]
    if any(n < 0 for n in made):
        raise ValueError(f"Pad's pads {widths} would make the {list(x.shape)} input {made}: a "
                         f"negative pad removes at most what the axis has")
    # np.pad cannot crop: pad by the positive amounts, then slice off the negative ones.
    grow = [(max(b, 0), max(e, 0)) for b, e in widths]
    check_allocation([n + b + e for n, (b, e) in zip(x.shape, grow)], x.dtype, "Pad's output")
    kwargs = {"constant_values": value} if mode == "constant" else {}
    grown = np.pad(x, grow, mode=_PAD_MODES[mode], **kwargs).astype(x.dtype)
    crop = tuple(slice(-min(b, 0), size + min(e, 0)) for (b, e), size in zip(widths, grown.shape))
    return grown[crop]


def check_pad(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode", "constant")
    return None if mode in _PAD_MODES else f"Pad mode {mode!r} not known (known: {list(_PAD_MODES)})"


def center_crop_pad(input_data, shape, axes=None):
    # Crop or pad each axis about its centre: half of the difference (rounded down) goes first.
    widths = [(0, 0)] * input_data.ndim
    for axis, target in zip(_axes(range(input_data.ndim) if axes is None else axes, input_data.ndim),
                            shape):
        diff = int(target) - input_data.shape[axis]
        begin = diff // 2 if diff >= 0 else -(-diff // 2)
        widths[axis] = (begin, diff - begin)
    return (_pad(input_data, widths, "constant", 0),)


# -- blocks ------------------------------------------------------------------------------------
def depth_to_space(input, blocksize, mode="DCR"):  # noqa: A002
    n, c, h, w = input.shape
    b = blocksize
    if mode == "DCR":  # depth is (b, b, c/b²)
        blocks = input.reshape(n, b, b, c // b**2, h, w).transpose(0, 3, 4, 1, 5, 2)
    else:  # CRD: depth is (c/b², b, b)
        blocks = input.reshape(n, c // b**2, b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return (blocks.reshape(n, c // b**2, h * b, w * b),)


def space_to_depth(input, blocksize, mode="DCR"):  # noqa: A002
    n, c, h, w = input.shape
    b = blocksize
    blocks = input.reshape(n, c, h // b, b, w // b, b)  # (n, c, h/b, b, w/b, b)
    if mode == "DCR":  # depth becomes (b, b, c)
        blocks = blocks.transpose(0, 3, 5, 1, 2, 4)
    else:  # CRD: depth becomes (c, b, b)
        blocks = blocks.transpose(0, 1, 3, 5, 2, 4)
    return (blocks.reshape(n, c * b * b, h // b, w // b),)


def trilu(input, k=None, upper=1):  # noqa: A002
    k = 0 if k is None else int(k)
    return (np.triu(input, k) if upper else np.tril(input, k),)


# -- pass-through ------------------------------------------------------------------------------
def identity(input):  # noqa: A002
    return (input,)


def dropout_v7(data, ratio=0.5, *, n_outputs):
    # Inference: the data passes unchanged and the mask keeps everything.
    return (data, np.ones_like(data))[:n_outputs]


def dropout_v10(data, ratio=0.5, *, n_outputs):
    return (data, np.ones(data.shape, dtype=bool))[:n_outputs]


def dropout(data, ratio=None, training_mode=None, seed=None, *, n_outputs):
    rate = 0.5 if ratio is None else float(np.reshape(ratio, ()))
    if not 0 <= rate < 1:  # NaN included
        raise ValueError(f"Dropout's ratio {rate} is not in [0, 1)")
    if training_mode is None or not training_mode or rate == 0:
        return dropout_v10(data, n_outputs=n_outputs)
    # Training: keep an element where a uniform draw of NumPy's RandomState(seed) is >= ratio
    # (the spec leaves the generator to the runtime; no seed draws a fresh one each run), and
    # scale what is kept by 1 / (1 - ratio).
    mask = np.random.RandomState(seed).uniform(0, 1, data.shape) >= rate
    return ((mask * data / (1 - rate)).astype(data.dtype), mask)[:n_outputs]


def shape(data, start=0, end=None):
    return (np.array(data.shape[start:end], dtype=np.int64),)


def size(data):
    return (np.array(data.size, dtype=np.int64),)


# -- tensor makers -----------------------------------------------------------------------------
def constant(value=None, sparse_value=None, value_float=None, value_floats=None, value_int=None,
             value_ints=None, value_string=None, value_strings=None):
    if value is not None or sparse_value is not None:
        return (value if value is not None else sparse_value,)
    if value_float is not None or value_floats is not None:
        return (np.array(value_float if value_floats is None else value_floats, dtype=np.float32),)
    if value_int is not None or value_ints is not None:
        return (np.array(value_int if value_ints is None else value_ints, dtype=np.int64),)
    return (np.array(value_string if value_strings is None else value_strings, dtype=object),)


def constant_of_shape(input, value=None):  # noqa: A002
    fill = np.zeros(1, dtype=np.float32) if value is None else value
    shape = [int(d) for d in np.ravel(input).tolist()]  # Python ints in one call, not per element
    check_allocation(shape, fill.dtype, "ConstantOfShape's output")
    result = np.empty(shape, dtype=fill.dtype)  # np.full's own two steps, without its wrapper
    result[...] = fill.reshape(-1)[0]
    return (result,)


def range_(start, limit, delta, stash_type=1):
    dtype = start.dtype
    if dtype.itemsize == 2 and not is_integer(dtype):  # float16, bfloat16: count in stash_type
        start, limit, delta = (v.astype(onnx_to_numpy_dtype(stash_type)) for v in (start, limit, delta))
    start, limit, delta = (np.reshape(v, ()) for v in (start, limit, delta))  # scalars, or size 1
    count = max(math.ceil((limit - start) / delta), 0)
    check_allocation([count], dtype, "Range's output")
    return ((start + np.arange(count) * delta).astype(dtype),)


def eye_like(input, dtype=None, k=0):  # noqa: A002
    out_dtype = input.dtype if dtype is None else onnx_to_numpy_dtype(dtype)
    return (np.eye(*input.shape, k=k, dtype=out_dtype),)


KERNELS: KernelTable = {
    "Reshape": {5: reshape},  # allowzero (opset 14) defaults to the older behaviour
    "Flatten": {1: flatten},  # negative axes (opset 11) are a superset
    "Squeeze": {1: squeeze},  # axes: an attribute until opset 13, an input after; same kernel
    "Unsqueeze": {1: unsqueeze},
    "Transpose": {1: transpose},
    "Concat": {4: concat},
    "Split": {2: split_v2, 13: split_v13, 18: split},
    "Expand": {8: expand},
    "Tile": {6: tile},
    "Pad": {2: pad_v2, 11: pad},
    "CenterCropPad": {18: center_crop_pad},
    "DepthToSpace": {1: depth_to_space},
    "SpaceToDepth": {1: space_to_depth},  # mode (opset 28) defaults to the older behaviour
    "Trilu": {14: trilu},
    "Identity": {1: identity},
    "Dropout": {7: dropout_v7, 10: dropout_v10, 12: dropout},
    "Shape": {1: shape},
    "Size": {1: size},
    "Constant": {1: constant},
    "ConstantOfShape": {9: constant_of_shape},
    "Range": {11: range_},
    "EyeLike": {9: eye_like},
}

CHECKS = {"Pad": check_pad}

# Layout moves elements without arithmetic: right for every element type.
ANY_DTYPE = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split",
                       "Expand", "Tile", "Pad", "CenterCropPad", "DepthToSpace", "SpaceToDepth",
                       "Identity", "Shape", "Size"})
ANY_DTYPE |= {"Range"}  # float16 and bfloat16 count in float32 (stash_type), as the spec says
