"""ONNX Runtime's quantized ops (com.microsoft domain, the QOperator format its quantizer writes),
from its contrib-op documentation: dequantize, compute in float32, quantize (round half to even,
saturate). QGemm, DynamicQuantizeMatMul and MatMulIntegerToFloat take integer products of the
centred operands, as MatMulInteger does; DynamicQuantizeLSTM is an LSTM whose products are
DynamicQuantizeMatMuls. MatMulNBits and GatherBlockQuantized: block-quantized 2-, 4- and 8-bit
weights.

Table keys carry the domain ("com.microsoft::QLinearAdd"); versions are its opset's.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.cast import saturate_cast
from backplane.backends.reference.kernels.pool import average_pool
from backplane.backends.reference.kernels.quant import dynamic_quantize_linear
from backplane.backends.reference.kernels.reduce import softmax
from backplane.ir.graph import Layer, TensorInfo

MS = "com.microsoft::"


def _dequantize(x, scale, zero_point=None):
    centred = x.astype(np.int32) - (0 if zero_point is None else zero_point.astype(np.int32))
    return centred.astype(np.float32) * scale.astype(np.float32)


def _quantize(y, scale, zero_point, dtype):
    zero = 0 if zero_point is None else zero_point.astype(np.int32)
    return saturate_cast(np.rint(y / scale.astype(np.float32)) + zero, dtype)


# -- elementwise -------------------------------------------------------------------------------
def q_linear_add(A, A_scale, A_zero_point, B, B_scale, B_zero_point, C_scale,  # noqa: N803
                 C_zero_point=None):
    real = _dequantize(A, A_scale, A_zero_point) + _dequantize(B, B_scale, B_zero_point)
    return (_quantize(real, C_scale, C_zero_point, A.dtype),)


def q_linear_mul(A, A_scale, A_zero_point, B, B_scale, B_zero_point, C_scale,  # noqa: N803
                 C_zero_point=None):
    real = _dequantize(A, A_scale, A_zero_point) * _dequantize(B, B_scale, B_zero_point)
    return (_quantize(real, C_scale, C_zero_point, A.dtype),)


def q_linear_sigmoid(X, X_scale, X_zero_point, Y_scale, Y_zero_point=None):  # noqa: N803
    x = _dequantize(X, X_scale, X_zero_point)
    return (_quantize(1 / (1 + np.exp(-x)), Y_scale, Y_zero_point, X.dtype),)


def q_linear_leaky_relu(X, X_scale, X_zero_point, Y_scale, Y_zero_point=None,  # noqa: N803
                        alpha=0.01):
    x = _dequantize(X, X_scale, X_zero_point)
    y = np.where(x >= 0, x, np.float32(alpha) * x)
    return (_quantize(y, Y_scale, Y_zero_point, X.dtype),)


def q_linear_where(condition, X, x_scale, x_zero_point, Y, y_scale, y_zero_point,  # noqa: N803
                   z_scale, z_zero_point):
    real = np.where(condition, _dequantize(X, x_scale, x_zero_point),
                    _dequantize(Y, y_scale, y_zero_point))
    return (_quantize(real, z_scale, z_zero_point, z_zero_point.dtype),)


def q_linear_concat(Y_scale, Y_zero_point, *inputs, axis):  # noqa: N803
    # inputs: (tensor, scale, zero point) triples, each requantized to Y's scale and zero point.
    parts = [_quantize(_dequantize(x, s, z), Y_scale, Y_zero_point, Y_zero_point.dtype)
             for x, s, z in zip(inputs[0::3], inputs[1::3], inputs[2::3])]
    return (np.concatenate(parts, axis=axis),)


# -- pooling and softmax -----------------------------------------------------------------------
def q_linear_global_average_pool(X, x_scale, x_zero_point, y_scale, y_zero_point,  # noqa: N803
                                 channels_last=0):
    x = _dequantize(X, x_scale, x_zero_point)
    spatial = tuple(range(1, X.ndim - 1)) if channels_last else tuple(range(2, X.ndim))
    y = x.mean(axis=spatial, keepdims=True)
    return (_quantize(y, y_scale, y_zero_point, X.dtype),)


def q_linear_average_pool(X, x_scale, x_zero_point, y_scale, y_zero_point=None,  # noqa: N803
                          auto_pad="NOTSET", ceil_mode=0, channels_last=0, count_include_pad=0,
                          kernel_shape=None, pads=None, strides=None):
    x = _dequantize(X, x_scale, x_zero_point)
    if channels_last:  # (N, *spatial, C) -> (N, C, *spatial) and back
        x = np.moveaxis(x, -1, 1)
    (y,) = average_pool(x, auto_pad=auto_pad, ceil_mode=ceil_mode,
                        count_include_pad=count_include_pad, kernel_shape=kernel_shape, pads=pads,
                        strides=strides)
    if channels_last:
        y = np.moveaxis(y, 1, -1)
    return (_quantize(y, y_scale, y_zero_point, X.dtype),)


def q_linear_softmax(X, X_scale, x_zero_point, y_scale, y_zero_point, *, opset,  # noqa: N803
                     axis=None):
    x = _dequantize(X, X_scale, x_zero_point)
    if opset >= 13:  # along one axis, as Softmax-13
        y = softmax(x, axis=-1 if axis is None else axis)[0]
    else:  # over the trailing dimensions from axis on, as Softmax-1 and -11
        axis = (1 if axis is None else axis) % X.ndim
        flat = x.reshape(int(np.prod(X.shape[:axis])), -1)
        y = softmax(flat, axis=-1)[0].reshape(X.shape)
    return (_quantize(y, y_scale, y_zero_point, X.dtype),)


# -- matrix products ---------------------------------------------------------------------------
def _centred(x, zero_point):
    """An integer operand less its zero point (scalar, or per column of a matrix B)."""
    return x.astype(np.int32) - (0 if zero_point is None else zero_point.astype(np.int32))


def q_gemm(A, a_scale, a_zero_point, B, b_scale, b_zero_point, C=None, y_scale=None,  # noqa: N803
           y_zero_point=None, alpha=1.0, transA=0, transB=0):  # noqa: N803
    a = _centred(A, a_zero_point)
    b = _centred(B.T, b_zero_point) if transB else _centred(B, b_zero_point)  # (K, N)
    acc = (a.T if transA else a) @ b
    if C is not None:  # int32, quantized at the product's scale with zero point 0
        acc = acc + C.astype(np.int32)
    y = acc.astype(np.float32) * (np.float32(alpha) * a_scale.astype(np.float32)
                                  * b_scale.astype(np.float32))
    if y_scale is None:
        return (y,)
    return (_quantize(y, y_scale, y_zero_point, A.dtype if y_zero_point is None
                      else y_zero_point.dtype),)


def mat_mul_integer_to_float(A, B, a_scale, b_scale, a_zero_point=None,  # noqa: N803
                             b_zero_point=None, bias=None):
    acc = np.matmul(_centred(A, a_zero_point), _centred(B, b_zero_point))
    y = acc.astype(np.float32) * (a_scale.astype(np.float32) * b_scale.astype(np.float32))
    y = y.astype(a_scale.dtype)
    return (y if bias is None else y + bias,)


def dynamic_quantize_mat_mul(A, B, b_scale, b_zero_point=None, bias=None):  # noqa: N803
    # A quantized to uint8 over its range (DynamicQuantizeLinear), then MatMulIntegerToFloat.
    a, a_scale, a_zero_point = dynamic_quantize_linear(A.astype(np.float32))
    return mat_mul_integer_to_float(a, B, a_scale, b_scale, a_zero_point, b_zero_point, bias)


def mat_mul_n_bits(A, B, scales, zero_points=None, g_idx=None, bias=None, *, K, N,  # noqa: N803
                   block_size, bits=4, accuracy_level=0, weight_prepacked=0):
    # B: (N, k_blocks, blob) bytes, each holding 8 / bits values, low bits first, along K.
    k_blocks = -(-K // block_size)
    q = _unpack(B.reshape(N, -1), bits)[:, :k_blocks * block_size].reshape(N, k_blocks, block_size)
    if zero_points is None:
        zero = np.full((N, k_blocks, 1), 2 ** (bits - 1), np.float32)
    elif zero_points.dtype == np.uint8:  # packed like B, k_blocks per row
        zero = _unpack(zero_points.reshape(N, -1), bits)[:, :k_blocks, None].astype(np.float32)
    else:  # unpacked, A's type
        zero = zero_points.reshape(N, k_blocks, 1).astype(np.float32)
    w = (q.astype(np.float32) - zero) * scales.reshape(N, k_blocks, 1).astype(np.float32)
    w = w.reshape(N, -1)[:, :K]  # (N, K)
    y = np.matmul(A.astype(np.float32), w.T)
    if bias is not None:
        y = y + bias
    return (y.astype(A.dtype),)


def gather_block_quantized(data, indices, scales, zero_points=None, bits=4, block_size=128,
                           gather_axis=0, quantize_axis=1):
    # The whole table dequantized block by block along quantize_axis, then Gather; an index out
    # of range gives zeros. uint8 data of bits < 8 is packed along its last axis.
    if data.dtype == np.uint8 and bits < 8:
        data = _unpack(data.reshape(-1, data.shape[-1]), bits).reshape(*data.shape[:-1], -1)
        if zero_points is not None:
            zero_points = _unpack(zero_points.reshape(-1, zero_points.shape[-1]), bits).reshape(
                *zero_points.shape[:-1], -1)
    axis = quantize_axis % data.ndim
    default = 2 ** (bits - 1) if data.dtype == np.uint8 else 0
    zero = np.full(scales.shape, default, np.int32) if zero_points is None else zero_points
    blocks = [np.repeat(p, block_size, axis=axis).take(np.arange(data.shape[axis]), axis=axis)
              for p in (scales.astype(np.float32), zero.astype(np.int32))]
    table = (data.astype(np.int32) - blocks[1]) * blocks[0]
    axis, size = gather_axis % data.ndim, data.shape[gather_axis % data.ndim]
    valid = (indices >= -size) & (indices < size)
    out = np.take(table, np.where(valid, indices, 0), axis=axis)
    keep = valid.reshape(*[1] * axis, *indices.shape, *[1] * (data.ndim - axis - 1))
    return (np.where(keep, out, 0).astype(scales.dtype),)


def _unpack(packed, bits):
    """(rows, bytes) uint8 -> (rows, bytes * 8 / bits) values, the low bits of each byte first."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8)
    values = (packed[..., None] >> shifts) & np.uint8(2**bits - 1)
    return values.reshape(packed.shape[0], -1)


# -- recurrent -----------------------------------------------------------------------------------
def dynamic_quantize_lstm(X, W, R, B=None, sequence_lens=None, initial_h=None,  # noqa: N803
                          initial_c=None, P=None, W_scale=None, W_zero_point=None,  # noqa: N803
                          R_scale=None, R_zero_point=None, activation_alpha=None,  # noqa: N803
                          activation_beta=None, activations=None, clip=None, direction="forward",
                          hidden_size=None, input_forget=0, *, n_outputs=3):
    # LSTM (gates i, o, f, c) whose two products are DynamicQuantizeMatMuls, as ONNX Runtime
    # runs it: X quantized to uint8 once over its whole range, the hidden state at every step.
    # W, R: (directions, input or hidden, 4 * hidden); scales and zero points per direction
    # (D,) or per direction and column (D, 4 * hidden).
    seq, batch = X.shape[:2]
    dirs, hidden = W.shape[0], R.shape[1]
    bias = np.zeros((dirs, 8 * hidden), np.float32) if B is None else B
    x_q, x_scale, x_zero = dynamic_quantize_linear(X.astype(np.float32))
    Y = np.zeros((seq, dirs, batch, hidden), np.float32)
    states = []
    for d in range(dirs):
        (x_gates,) = mat_mul_integer_to_float(x_q, W[d], x_scale, W_scale[d], x_zero,
                                              W_zero_point[d])
        x_gates = x_gates + bias[d, :4 * hidden] + bias[d, 4 * hidden:]
        h = np.zeros((batch, hidden), np.float32) if initial_h is None else initial_h[d]
        c = np.zeros((batch, hidden), np.float32) if initial_c is None else initial_c[d]
        peep = np.zeros((3, hidden), np.float32) if P is None else P[d].reshape(3, hidden)
        backward = direction == "reverse" or d == 1
        for t in reversed(range(seq)) if backward else range(seq):
            h_q, h_scale, h_zero = dynamic_quantize_linear(h)
            (h_gates,) = mat_mul_integer_to_float(h_q, R[d], h_scale, R_scale[d], h_zero,
                                                  R_zero_point[d])
            h, c = _lstm_step(x_gates[t] + h_gates, c, peep, clip, input_forget)
            Y[t, d] = h
        states.append((h, c))
    Y_h, Y_c = np.stack([h for h, _ in states]), np.stack([c for _, c in states])
    return (Y, Y_h, Y_c)[:n_outputs]


def _lstm_step(gates, c, peep, clip, input_forget):
    """One LSTM step with the default activations (sigmoid, tanh, tanh); peep is (i, o, f)."""
    i, o, f, g = np.split(gates, 4, axis=-1)
    i, f = i + peep[0] * c, f + peep[2] * c
    if clip is not None:  # the inputs of the activations, peepholes added
        i, f, g = (np.clip(x, -clip, clip) for x in (i, f, g))
    i = 1 / (1 + np.exp(-i))
    f = 1 - i if input_forget else 1 / (1 + np.exp(-f))
    c = f * c + i * np.tanh(g)
    o = o + peep[1] * c
    if clip is not None:
        o = np.clip(o, -clip, clip)
    return 1 / (1 + np.exp(-o)) * np.tanh(c), c


# -- checks ------------------------------------------------------------------------------------
def check_mat_mul_n_bits(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    bits, attrs = layer.attrs.get("bits", 4), layer.attrs
    if bits not in (2, 4, 8):
        return f"MatMulNBits with bits={bits} not supported (takes 2, 4, 8)"
    if attrs.get("weight_prepacked", 0):
        return "MatMulNBits with weights prepacked for an execution provider not supported"
    if len(layer.inputs) > 4 and layer.inputs[4]:
        return "MatMulNBits with g_idx (deprecated) not supported"
    return None


def check_gather_block_quantized(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    dtype = inputs[0].dtype if inputs else None
    if dtype is not None and dtype not in BLOCK_QUANTIZED:
        return (f"GatherBlockQuantized of {dtype} data not supported (takes "
                f"{', '.join(sorted(d.name for d in BLOCK_QUANTIZED))})")
    if layer.attrs.get("bits", 4) not in (2, 4, 8):
        return f"GatherBlockQuantized with bits={layer.attrs['bits']} not supported (takes 2, 4, 8)"
    return None


BLOCK_QUANTIZED = frozenset(map(np.dtype, (ml_dtypes.int4, ml_dtypes.uint4, np.uint8)))


def check_dynamic_quantize_lstm(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("activations") not in (None, ["Sigmoid", "Tanh", "Tanh"] * 2,
                                              ["Sigmoid", "Tanh", "Tanh"]):
        return f"DynamicQuantizeLSTM activations {layer.attrs['activations']} not supported"
    if len(layer.inputs) > 4 and layer.inputs[4]:
        return "DynamicQuantizeLSTM with sequence_lens not supported"
    return None


KERNELS: KernelTable = {
    MS + "QLinearAdd": {1: q_linear_add},
    MS + "QLinearMul": {1: q_linear_mul},
    MS + "QLinearSigmoid": {1: q_linear_sigmoid},
    MS + "QLinearLeakyRelu": {1: q_linear_leaky_relu},
    MS + "QLinearConcat": {1: q_linear_concat},
    MS + "QLinearWhere": {1: q_linear_where},
    MS + "QLinearGlobalAveragePool": {1: q_linear_global_average_pool},
    MS + "QLinearAveragePool": {1: q_linear_average_pool},
    MS + "QLinearSoftmax": {1: q_linear_softmax},
    MS + "QGemm": {1: q_gemm},
    MS + "MatMulIntegerToFloat": {1: mat_mul_integer_to_float},
    MS + "DynamicQuantizeMatMul": {1: dynamic_quantize_mat_mul},
    MS + "MatMulNBits": {1: mat_mul_n_bits},
    MS + "DynamicQuantizeLSTM": {1: dynamic_quantize_lstm},
    MS + "GatherBlockQuantized": {1: gather_block_quantized},
}

CHECKS = {MS + "MatMulNBits": check_mat_mul_n_bits,
          MS + "GatherBlockQuantized": check_gather_block_quantized,
          MS + "DynamicQuantizeLSTM": check_dynamic_quantize_lstm}

ANY_DTYPE = frozenset({MS + "GatherBlockQuantized"})  # its check names the types
