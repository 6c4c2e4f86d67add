"""The layers around an int8 CNN's convolutions on CpuAcc (issue 29): a free-batch QOperator model's
pooled head keeps static shapes in its Specialized build, so its QGemm is one fused layer (it ran
as the kernel, converting its weight at every call: 0.8 of the full tier's QOperator ResNet's 4 ms);
the quantized pools and the dequantization of 8-bit tensors in one float32 pass, CpuRef's values.
Models from ONNX Runtime's own quantizer, outputs within one step of ONNX Runtime's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
quantization = pytest.importorskip("onnxruntime.quantization")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.backend import FUSED_DOMAIN  # noqa: E402
from tests.backends.torch.test_int8_routes import built_layers_within_a_step  # noqa: E402
from tests.backends.torch.int8_cpu import torch_int8_exact  # noqa: E402
from tests.models.test_ort_tools import RandomReader  # noqa: E402

SHAPE = (1, 3, 32, 32)


def pooled_cnn(path: Path) -> Path:
    """Conv 3 -> 16, Relu, AveragePool 2/2, GlobalAveragePool, Flatten, Gemm (ResNet's head after
    an average pool), a free batch dimension."""
    rng = np.random.default_rng(29)
    weights = {"w0": rng.standard_normal((16, 3, 3, 3)) * 0.2, "b0": rng.standard_normal(16) * 0.1,
               "wg": rng.standard_normal((10, 16)) * 0.3, "bg": rng.standard_normal(10) * 0.1}
    node = helper.make_node
    nodes = [node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
             node("Relu", ["c0"], ["r0"]),
             node("AveragePool", ["r0"], ["a0"], kernel_shape=[2, 2], strides=[2, 2]),
             node("GlobalAveragePool", ["a0"], ["gap"]),
             node("Flatten", ["gap"], ["flat"]),
             node("Gemm", ["flat", "wg", "bg"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "pooled_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            ["N", *SHAPE[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                                ir_version=8), str(path))
    return path


def feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)}


def test_a_free_batch_qoperator_head_is_fused_after_an_average_pool(tmp_path: Path) -> None:
    path = tmp_path / "qop.onnx"
    quantization.quantize_static(pooled_cnn(tmp_path / "cnn.onnx"), path,
                                 RandomReader("x", SHAPE),
                                 quant_format=quantization.QuantFormat.QOperator,
                                 per_channel=True, activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8)
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "QLinearAveragePool" in ops and "QGemm" in ops, ops
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],  # torch's route, pinned:
                               provider_options=[{"CpuAcc.native": "off"}, {}])  # (not C's)
    layers = built_layers_within_a_step(session, path, feeds)
    gemms = [lay for lay in layers if lay.op_type == "QGemm"]
    assert len(gemms) == 1 and gemms[0].domain == FUSED_DOMAIN, gemms


class Made:
    """The dtypes of the tensors torch's operators make inside the block (a dispatch mode)."""

    def __enter__(self) -> list:
        from torch.utils._python_dispatch import TorchDispatchMode

        made: list = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                out = func(*args, **(kwargs or {}))
                made.extend(o.dtype for o in (out if isinstance(out, (tuple, list)) else [out])
                            if isinstance(o, torch.Tensor))
                return out
        self.mode = Mode()
        self.mode.__enter__()
        return made

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


WIDE = {torch.int32, torch.int64, torch.float64}


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16])
@pytest.mark.parametrize("per_axis", [False, True])
def test_dequantize_linear_of_small_integers_is_one_float32_pass(dtype: type,
                                                                 per_axis: bool) -> None:
    """CpuAcc's DequantizeLinear of 8- and 16-bit integers: CpuRef's values bit for bit (NaN
    cannot arise), computed in float32 without int64 or float64 tensors (a channels-last 8-bit
    activation at 56x56x64 took 0.3 ms in those)."""
    from backplane.backends.reference.kernels.quant import dequantize_linear as reference
    from backplane.backends.torch.kernels.quantization import dequantize_linear

    rng = np.random.default_rng(3)
    info = np.iinfo(dtype)
    x = rng.integers(info.min, info.max, (1, 8, 5, 6), endpoint=True).astype(dtype)
    scale = (rng.random(8 if per_axis else ()) * 0.1 + 1e-3).astype(np.float32)
    zero = rng.integers(info.min, info.max, scale.shape, endpoint=True).astype(dtype)
    want = reference(x, scale, zero)[0]
    x_t = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
    with Made() as made:
        (got,) = dequantize_linear(x_t, torch.from_numpy(np.array(scale)),
                                   torch.from_numpy(np.array(zero)))
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)
    assert not WIDE & set(made), made


def test_a_quantized_global_average_pool_reads_its_integers_once() -> None:
    """QLinearGlobalAveragePool on CpuAcc: within one step of CpuRef's (the mean of the integers,
    then centred and scaled), without a wide copy of X."""
    from backplane.backends.reference.kernels.contrib_quant import (
        q_linear_global_average_pool as reference,
    )
    from backplane.backends.torch.kernels.contrib_quant import q_linear_global_average_pool

    rng = np.random.default_rng(5)
    x = rng.integers(0, 255, (1, 16, 14, 14), endpoint=True).astype(np.uint8)
    params = [np.array(0.05, np.float32), np.array(7, np.uint8), np.array(0.02, np.float32),
              np.array(3, np.uint8)]
    want = reference(x, *params)[0]
    x_t = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
    with Made() as made:
        (got,) = q_linear_global_average_pool(x_t, *(torch.from_numpy(p) for p in params))
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert int(np.max(np.abs(got.numpy().astype(int) - want.astype(int)))) <= 1
    assert not WIDE & set(made), made


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16])
@pytest.mark.parametrize("per_axis", [False, True])
def test_quantize_linear_to_small_integers_stays_float32(dtype: type, per_axis: bool) -> None:
    """CpuAcc's QuantizeLinear of float32 to 8- and 16-bit integers: CpuRef's integers (ties of
    either zero-point parity, NaN, infinities, values far outside the range) without a float64
    tensor."""
    from backplane.backends.reference.kernels.quant import quantize_linear as reference
    from backplane.backends.torch.kernels.quantization import quantize_linear

    rng = np.random.default_rng(11)
    info = np.iinfo(dtype)
    scale = (rng.random(4 if per_axis else ()) * 0.05 + 1e-3).astype(np.float32)
    zero = rng.integers(info.min, info.max, scale.shape, endpoint=True).astype(dtype)
    steps = np.broadcast_to(scale.reshape(-1, 1, 1) if per_axis else scale, (4, 6, 25))
    halves = (rng.integers(-300, 300, (4, 6, 25)) + 0.5).astype(np.float32) * steps
    x = np.where(rng.random((4, 6, 25)) < 0.5, halves,
                 rng.standard_normal((4, 6, 25)).astype(np.float32) * 4).astype(np.float32)
    x[0, 0, :6] = [np.nan, np.inf, -np.inf, 1e30, -1e30, 0.0]
    x = x[None]
    want = reference(x, scale, zero)[0]
    with Made() as made:
        (got,) = quantize_linear(torch.from_numpy(x), torch.from_numpy(np.array(scale)),
                                 torch.from_numpy(np.array(zero)))
    assert got.numpy().dtype == want.dtype and np.array_equal(got.numpy(), want)
    assert torch.float64 not in made, made


@pytest.mark.parametrize("a_type", [np.uint8, np.int8])
@pytest.mark.parametrize(("with_c", "with_y", "trans_b"),
                         [(True, True, 1), (False, True, 0), (True, False, 1)])
def test_a_qgemm_by_int8_weights_is_an_integer_product(a_type: type, with_c: bool, with_y: bool,
                                                       trans_b: int) -> None:
    """QGemm by a constant int8 B (zero points 0, scales per column) of an 8-bit A: one fused
    layer whose product is torch._int_mm's (a quarter of the float weight's memory), CpuRef's
    values bit for bit (C as int32, y quantized or float, A's zero point at either end). Where
    torch's int8 kernels saturate (no VNNI: int8_exact) the layer takes its float route instead,
    CpuRef's values all the same."""
    from torch.profiler import ProfilerActivity, profile

    rng = np.random.default_rng(13)
    info = np.iinfo(a_type)
    m, k, n = 3, 64, 40
    a = rng.integers(info.min, info.max, (m, k), endpoint=True).astype(a_type)
    b = rng.integers(-127, 127, (n, k) if trans_b else (k, n), endpoint=True).astype(np.int8)
    inits = {"a_scale": np.array(0.02, np.float32), "a_zero": np.array(info.max - 3, a_type),
             "B": b, "b_scale": (rng.random(n) * 0.01 + 1e-3).astype(np.float32),
             "b_zero": np.zeros(n, np.int8), "C": rng.integers(-5000, 5000, n).astype(np.int32),
             "y_scale": np.array(0.7, np.float32), "y_zero": np.array(info.min + 9, a_type)}
    names = ["A", "a_scale", "a_zero", "B", "b_scale", "b_zero", "C" if with_c else "",
             *(["y_scale", "y_zero"] if with_y else [])]
    node = helper.make_node("QGemm", names, ["Y"], domain="com.microsoft", transB=trans_b)
    out_type = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(a_type)) if with_y \
        else TensorProto.FLOAT
    graph = helper.make_graph(
        [node], "qgemm", [helper.make_tensor_value_info(
            "A", onnx.helper.np_dtype_to_tensor_dtype(np.dtype(a_type)), [m, k])],
        [helper.make_tensor_value_info("Y", out_type, [m, n])],
        [numpy_helper.from_array(v, name) for name, v in inits.items() if name in names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "layers"}), "CpuRef"])
    fused = [lay for lay in session.optimized.graph.layers if lay.op_type == "QGemm"]
    assert [lay.domain for lay in fused] == [FUSED_DOMAIN]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (got,) = session.run(None, {"A": a})
    assert ("aten::_int_mm" in {event.key for event in prof.key_averages()}) \
        == torch_int8_exact()
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"A": a})
    assert got.dtype == want.dtype and np.array_equal(got, want)
