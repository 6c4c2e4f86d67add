"""Differential tests of the torch kernels of linear quantization (``kernels/quantization.py``:
QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, MatMulInteger, QLinearMatMul, ConvInteger,
QLinearConv) against CpuRef, over cases that hypothesis generates, in the harness of
``differential.py`` (its rules, layouts, settings and environment variables hold here too). They
must equal CpuRef exactly. The numeric kernels' are in test_kernels_numeric.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
import onnx  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from backplane.backends.torch.kernels import quantization  # noqa: E402
from tests.backends.torch.differential import (  # noqa: E402
    F16,
    F32,
    I8,
    I16,
    I32,
    I64,
    OPSET,
    SETTINGS,
    U8,
    axis_of,
    differential,
    float32s,
    place,
    run,
    schema_dtypes,
    shapes,
    tensor,
)


def _onnx_type(dtype: np.dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(dtype)


# -- linear quantization ---------------------------------------------------------------------------
QUANTIZED = (I8, U8, I16)


def _scale_and_zero(draw: Any, shape: list[int], dtype: np.dtype, scale_dtype: np.dtype,
                    opset: int) -> tuple[dict[str, Any], list[int]]:
    """A quantization's attributes and the shape of its scale and zero point: per tensor, per
    axis (opset 13) or per block (opset 21)."""
    kinds = ["tensor"] + (["axis"] if opset >= 13 and shape else []) + \
        (["block"] if opset >= 21 and shape else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "tensor":
        return {}, draw(st.sampled_from([[], [1]]))
    axis = axis_of(draw, len(shape))
    if kind == "axis":
        return {"axis": axis}, [shape[axis]]
    block = draw(st.integers(1, 3))
    blocked = list(shape)
    blocked[axis] = -(-shape[axis] // block)
    return {"axis": axis, "block_size": block}, blocked


@SETTINGS
@given(data=st.data())
def _quantize(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([10, 13, 19, OPSET]))
    dtype = draw(st.sampled_from([t for t in schema_dtypes(op, opset) if t.kind == "f"]))
    target = draw(st.sampled_from(QUANTIZED if opset >= 21 else (I8, U8)))
    shape = list(draw(shapes(max_side=3)))
    attrs, param_shape = _scale_and_zero(draw, shape, target, dtype, opset)
    # scales that make ties (x / scale exactly .5) and saturation likely
    scales = st.sampled_from([0.5, 1.0, 2.0, 0.1, 3.0])
    scale = draw(hnp.arrays(dtype, param_shape, elements=scales))
    x = tensor(draw, dtype, shape, low=-300, high=300, special=False)
    args = [x, place(scale)]
    info = np.iinfo(target)
    if draw(st.booleans()) or target == I16:
        zero = draw(hnp.arrays(target, param_shape, elements=st.integers(
            max(int(info.min), -20), min(int(info.max), 20))))
        args.append(place(zero))
    elif opset >= 21 and draw(st.booleans()):
        attrs["output_dtype"] = _onnx_type(target)
    differential(op, args, attrs, opset=opset, exact=True)


def test_quantize_linear() -> None:
    run(_quantize, "QuantizeLinear")


@SETTINGS
@given(data=st.data())
def _dequantize(op: str, data: Any) -> None:
    draw = data.draw
    opset = draw(st.sampled_from([10, 13, 19, OPSET]))
    dtype = draw(st.sampled_from([t for t in schema_dtypes(op, opset) if t != I64]))
    scale_dtype = F32 if opset < 19 else draw(st.sampled_from([F16, F32]))
    shape = list(draw(shapes(max_side=3)))
    attrs, param_shape = _scale_and_zero(draw, shape, dtype, scale_dtype, opset)
    scale = draw(hnp.arrays(scale_dtype, param_shape, elements=float32s(0.01, 4).map(abs)
                            .filter(lambda v: v > 0)))
    args = [tensor(draw, dtype, shape), place(scale)]
    if draw(st.booleans()) and dtype != I32:
        args.append(tensor(draw, dtype, param_shape, ("contiguous",)))
    differential(op, args, attrs, opset=opset, exact=True)


def test_dequantize_linear() -> None:
    run(_dequantize, "DequantizeLinear")


@SETTINGS
@given(data=st.data())
def _dynamic_quantize(op: str, data: Any) -> None:
    draw = data.draw
    x = tensor(draw, F32, draw(shapes(min_side=1)), low=-100, high=100, special=False)
    differential(op, [x], n_outputs=3, exact=True)


def test_dynamic_quantize_linear() -> None:
    run(_dynamic_quantize, "DynamicQuantizeLinear")


def _zero_point(draw: Any, dtype: np.dtype, size: int) -> Any:
    shape = draw(st.sampled_from([(), (size,)] if size else [()]))
    return tensor(draw, dtype, shape, ("contiguous",))


@SETTINGS
@given(data=st.data())
def _mat_mul_integer(op: str, data: Any) -> None:
    draw = data.draw
    a_type, b_type = (draw(st.sampled_from([I8, U8])) for _ in range(2))
    m, k, n = (draw(st.integers(1, 4)) for _ in range(3))
    a, b = tensor(draw, a_type, [m, k]), tensor(draw, b_type, [k, n])
    if op == "MatMulInteger":
        args = [a, b, _zero_point(draw, a_type, m), _zero_point(draw, b_type, n)]
        while len(args) > 2 and draw(st.booleans()):
            args.pop()
        differential(op, args, exact=True)
        return
    scale = st.sampled_from([0.5, 0.25, 0.01, 1.0, 3.0])
    y_type = draw(st.sampled_from([I8, U8]))
    scales = [place(np.array(draw(scale), F32)) for _ in range(3)]
    args = [a, scales[0], _zero_point(draw, a_type, 0), b, scales[1], _zero_point(draw, b_type, 0),
            scales[2], _zero_point(draw, y_type, 0)]
    differential(op, args, exact=True)


@pytest.mark.parametrize("op", ["MatMulInteger", "QLinearMatMul"])
def test_mat_mul_integer(op: str) -> None:
    run(_mat_mul_integer, op)


@SETTINGS
@given(data=st.data())
def _conv_integer(op: str, data: Any) -> None:
    draw = data.draw
    x_type, w_type = draw(st.sampled_from([I8, U8])), draw(st.sampled_from([I8, U8]))
    kernel = [draw(st.integers(1, 3)) for _ in range(2)]
    attrs: dict[str, Any] = {"kernel_shape": kernel} if draw(st.booleans()) else {}
    if draw(st.booleans()):
        attrs["pads"] = [draw(st.integers(0, k - 1)) for k in kernel * 2]
    if draw(st.booleans()):
        attrs["strides"] = [draw(st.integers(1, 2)) for _ in kernel]
    c_in, c_out = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    x = tensor(draw, x_type, [1, c_in, *(k + draw(st.integers(0, 2)) for k in kernel)])
    w = tensor(draw, w_type, [c_out, c_in, *kernel])
    if op == "ConvInteger":
        args = [x, w, _zero_point(draw, x_type, 0), _zero_point(draw, w_type, 0)]
        while len(args) > 2 and draw(st.booleans()):
            args.pop()
        differential(op, args, attrs, exact=True)
        return
    scale = st.sampled_from([0.5, 0.25, 0.01, 1.0, 3.0])
    y_type = draw(st.sampled_from([I8, U8]))
    w_scale = np.array([draw(scale) for _ in range(c_out)], F32)
    args = [x, place(np.array(draw(scale), F32)), _zero_point(draw, x_type, 0), w,
            place(w_scale if draw(st.booleans()) else w_scale[:1].reshape(())),
            place(np.zeros((), w_type)), place(np.array(draw(scale), F32)),
            _zero_point(draw, y_type, 0)]
    if draw(st.booleans()):
        args.append(tensor(draw, I32, [c_out], ("contiguous",), integers=(-1000, 1000)))
    differential(op, args, attrs, exact=True)


@pytest.mark.parametrize("op", ["ConvInteger", "QLinearConv"])
def test_conv_integer(op: str) -> None:
    run(_conv_integer, op)


def test_every_quantization_kernel_is_covered() -> None:
    covered = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger",
               "QLinearMatMul", "ConvInteger", "QLinearConv"}
    assert sorted(set(quantization.KERNELS) - covered) == []


def test_a_frozen_quantization_by_constants_casts_nothing() -> None:
    """QuantizeLinear's float32 route adds the zero point as float32: in a frozen trace of constant
    parameters the cast of the uint8 zero point is folded at freezing, where adding the uint8 one
    cast it at every call; CpuRef's integers all the same."""
    from torch.profiler import ProfilerActivity, profile

    scale, zero = torch.tensor(0.05), torch.tensor(128, dtype=torch.uint8)

    class Quantize(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return quantization.quantize_linear(x, scale, zero)[0]

    x = torch.from_numpy(np.random.default_rng(8).uniform(-8, 8, (1, 4, 5, 5)).astype(np.float32))
    with torch.no_grad():
        frozen = torch.jit.freeze(torch.jit.trace(Quantize().eval(), (x,)))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = frozen(x)
    # one cast: the result's to uint8 (and none of a constant)
    assert [e.cpu_parent.cpu_parent.name for e in prof.events()
            if e.name == "aten::_to_copy"] == ["forward"]
    want = np.clip(np.rint(x.numpy() / np.float32(0.05)) + 128, 0, 255).astype(np.uint8)
    np.testing.assert_array_equal(got.numpy(), want)
