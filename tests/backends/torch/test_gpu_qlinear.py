"""GpuAcc's QLinearConv and QLinearMatMul as float32 sums (``backends/torch/gpu_qlinear.py``) and
the QOperator blocks around them (``gpu_int8._int8_chains``), their values bit for bit the layers'
own: on the CPU (``gpu_qlinear.on_gpu`` answered True), resnet_qlinear_ort15's steps as GpuAcc
builds them among them; on CUDA where there is one."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.registry import registry  # noqa: E402
from backplane.backends.torch import cuda as gpu_cuda  # noqa: E402
from backplane.backends.torch import gpu_fusion, gpu_int8, gpu_qlinear  # noqa: E402
from backplane.backends.torch.kernels import quantization  # noqa: E402
from backplane.frontends.onnx import import_onnx  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402
from backplane.optimizer import passes  # noqa: E402
from tests.backends.torch.test_gpu_int8 import CORPUS, _cuda_kernels, cuda  # noqa: E402


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(gpu_qlinear, "on_gpu", lambda tensor: True)


def _qlinear_conv(x: np.ndarray, w: np.ndarray, per_channel: bool, bias: bool, pads: list[int],
                  seed: int = 1, zero_x: int = 128):
    """A QLinearConv's step as int8_steps makes it, its inputs (torch, on the CPU) and its
    kernel."""
    rng = np.random.default_rng(seed)
    m = w.shape[0]
    f32 = np.float32
    consts = {"xs": f32(0.02), "xz": np.uint8(zero_x), "w": w,
              "ws": (rng.random(m if per_channel else ()) * 0.01 + 1e-3).astype(f32),
              "wz": np.zeros(m if per_channel else (), np.int8), "ys": f32(0.05),
              "yz": np.uint8(120)}
    if bias:
        consts["B"] = rng.integers(-5000, 5000, (m,), dtype=np.int32)
    consts = {k: np.asarray(v) for k, v in consts.items()}
    names = ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"] + (["B"] if bias else [])
    attrs = {"pads": pads, "kernel_shape": list(w.shape[2:]), "strides": [1, 1]}
    layer = Layer("c", "QLinearConv", names, ["y"], attrs)
    kernel = lambda *v: quantization.q_linear_conv(*v, **attrs)  # noqa: E731
    steps = [(kernel, names, ["y"])]
    gpu_int8.int8_steps([layer], steps, lambda name: None, consts)
    assert steps[0][0] is not kernel
    inputs = [torch.from_numpy(x)] + [torch.from_numpy(consts[n]) for n in names[1:]]
    return steps[0][0], inputs, kernel


@pytest.mark.parametrize("per_channel, bias, pads", [(False, True, [1, 1, 1, 1]),
                                                     (True, False, [0, 0, 0, 0])])
def test_qlinear_conv_with_constants_made_once_is_the_kernel_s(on_cpu, per_channel, bias,
                                                                pads) -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (1, 8, 9, 9), dtype=np.uint8)
    w = rng.integers(-128, 128, (6, 8, 3, 3), dtype=np.int8)
    step, inputs, kernel = _qlinear_conv(x, w, per_channel, bias, pads)
    (want,) = kernel(*inputs)
    (got,) = step(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("channels, wide", [(57, torch.float32), (58, torch.float64)])
def test_qlinear_conv_sums_in_float32_below_2_24(on_cpu, monkeypatch, channels, wide) -> None:
    """255 * 128 * 57 * 9 is below 2^24, 58 * 9 above it: at the extremes (x less its zero point
    255: 0 and -255; the weights -128, and 127 in a row) the sum in float32 is the kernel's to
    the bit, and past the bound the convolution stays in float64."""
    from backplane.backends.torch.kernels import nn

    seen = []
    conv = nn.conv
    monkeypatch.setattr(nn, "conv", lambda x, *a, **k: seen.append(x.dtype) or conv(x, *a, **k))
    x = np.full((1, channels, 5, 5), 255, np.uint8)
    x[0, :, 0] = 0
    w = np.full((2, channels, 3, 3), -128, np.int8)
    w[1, :, 0] = 127
    step, inputs, kernel = _qlinear_conv(x, w, True, False, [0, 0, 0, 0], seed=2, zero_x=255)
    (want,) = kernel(*inputs)
    (got,) = step(*inputs)
    assert seen == [wide]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("per_column", [False, True])
def test_qlinear_matmul_with_constants_is_the_kernel_s(on_cpu, monkeypatch, per_column) -> None:
    """A by B as one float32 product (B less its zero point made once), requantized, the
    kernel's values to the bit at A's extremes; the kernel's float64 sum is not called."""
    rng = np.random.default_rng(7)
    a = rng.integers(0, 256, (3, 64), dtype=np.uint8)
    a[0] = 0
    b = rng.integers(-128, 128, (64, 10), dtype=np.int8)
    b[:, 0] = -128
    n = 10 if per_column else ()
    consts = {"as": np.float32(0.02), "az": np.uint8(131), "B": b,
              "bs": (rng.random(n) * 0.01 + 1e-3).astype(np.float32),
              "bz": rng.integers(-3, 3, n, dtype=np.int8), "ys": np.float32(0.3),
              "yz": np.uint8(100)}
    consts = {k: np.asarray(v) for k, v in consts.items()}
    names = ["a", "as", "az", "B", "bs", "bz", "ys", "yz"]
    layer = Layer("q", "QLinearMatMul", names, ["y"])
    steps = [(lambda *v: quantization.q_linear_mat_mul(*v), names, ["y"])]
    gpu_int8.int8_steps([layer], steps, lambda name: None, consts)
    inputs = [torch.from_numpy(a)] + [torch.from_numpy(consts[n]) for n in names[1:]]
    (want,) = quantization.q_linear_mat_mul(*inputs)
    monkeypatch.setattr(quantization, "mat_mul_integer", None)  # the float64 sum: not called
    (got,) = steps[0][0](*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _qoperator_block():
    """QuantizeLinear read by two QLinearConvs (one's y read by a DequantizeLinear alone, the
    other's a subgraph output) and a QLinearMatMul -> DequantizeLinear: the layers, their
    kernels, the constants, and ``sole`` and ``uses`` as gpu_fusion.inner_steps makes them."""
    rng = np.random.default_rng(8)
    f32 = np.float32
    c = {"xs": f32(0.05), "xz": np.uint8(120), "ys": f32(0.4), "yz": np.uint8(7),
         "w1": rng.integers(-128, 128, (5, 4, 3, 3), dtype=np.int8),
         "w2": rng.integers(-128, 128, (3, 4, 1, 1), dtype=np.int8),
         "ws": (rng.random(5) * 0.01 + 1e-3).astype(f32), "wz": np.zeros(5, np.int8),
         "vs": f32(0.004), "vz": np.int8(0), "ds": f32(0.4), "dz": np.uint8(7),
         "as": f32(0.03), "az": np.uint8(2), "B": rng.integers(-128, 128, (6, 4), dtype=np.int8),
         "bs": f32(0.002), "bz": np.int8(1), "ms": f32(0.2), "mz": np.uint8(128)}
    c = {k: np.asarray(v) for k, v in c.items()}
    attrs = {"pads": [1, 1, 1, 1], "kernel_shape": [3, 3]}
    layers = [Layer("q", "QuantizeLinear", ["x", "xs", "xz"], ["q"]),
              Layer("c1", "QLinearConv", ["q", "xs", "xz", "w1", "ws", "wz", "ys", "yz"], ["y1"],
                    attrs),
              Layer("c2", "QLinearConv", ["q", "xs", "xz", "w2", "vs", "vz", "ys", "yz"], ["y2"],
                    {"kernel_shape": [1, 1]}),
              Layer("d1", "DequantizeLinear", ["y1", "ds", "dz"], ["f1"]),
              Layer("qa", "QuantizeLinear", ["a", "as", "az"], ["qa"]),
              Layer("mm", "QLinearMatMul", ["qa", "as", "az", "B", "bs", "bz", "ms", "mz"], ["p"]),
              Layer("d2", "DequantizeLinear", ["p", "ms", "mz"], ["f2"])]
    kernels = {"QuantizeLinear": quantization.quantize_linear,
               "DequantizeLinear": quantization.dequantize_linear,
               "QLinearMatMul": quantization.q_linear_mat_mul}
    bound = [(lambda *v, a=layer.attrs: quantization.q_linear_conv(*v, **a))
             if layer.op_type == "QLinearConv" else kernels[layer.op_type] for layer in layers]
    uses = {"y2": 1}
    consumer = {}
    for index, layer in enumerate(layers):
        for name in layer.inputs:
            uses[name] = uses.get(name, 0) + 1
            consumer[name] = index
    sole = lambda name: consumer.get(name) if uses.get(name) == 1 else None  # noqa: E731
    return layers, bound, c, sole, uses


def _qoperator_block_values(device: str) -> None:
    """The block's steps (``_qoperator_block``) on ``device`` against the layers' kernels on the
    CPU: the DequantizeLinear after a product computed with it, the QuantizeLinear before two
    products giving x - zx in float32, the y read outside left an integer; every output the
    layers' own to the bit (at a NaN and both saturations too)."""
    layers, bound, c, sole, uses = _qoperator_block()
    steps = [(k, layer.inputs, layer.outputs) for k, layer in zip(bound, layers)]
    gpu_int8.int8_steps(layers, steps, sole, c, uses)
    assert [s is None for s in steps] == [False, True, False, False, False, True, False]
    assert steps[3][1] == [*layers[1].inputs, "ds", "dz"]  # y1 gone
    assert steps[6][1] == [*layers[5].inputs, "ms", "mz"]  # p gone
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, 4, 6, 6)).astype(np.float32) * 4
    x[0, 0, 0, :3] = [np.nan, 1e9, -1e9]
    a = rng.standard_normal((3, 6)).astype(np.float32)

    def run(chosen, on):
        values = {"x": torch.from_numpy(x), "a": torch.from_numpy(a),
                  **{k: torch.from_numpy(v) for k, v in c.items()}}
        values = {k: v.to(on) for k, v in values.items()}
        for step in (s for s in chosen if s is not None):
            values.update(zip(step[2], step[0](*[values[n] for n in step[1]])))
        return values

    got = run(steps, device)
    want = run([(k, layer.inputs, layer.outputs) for k, layer in zip(bound, layers)], "cpu")
    assert got["q"].dtype == torch.float32 and got["qa"].dtype == torch.float32
    for name in ("f1", "y2", "f2"):
        assert got[name].dtype == want[name].dtype
        torch.testing.assert_close(got[name].cpu(), want[name], rtol=0, atol=0)


def test_qoperator_blocks_chain_without_8_bit_tensors(on_cpu) -> None:
    _qoperator_block_values("cpu")





@cuda
@pytest.mark.parametrize("channels, bias", [(8, True), (57, False)])
def test_qlinear_conv_on_cuda_sums_in_float32_as_the_kernel(channels, bias) -> None:
    """The float32 sum (torch's own convolution), requantized in one kernel, against the
    kernel's float64 on the CPU bit for bit: random values and (57 channels) the extremes just
    below 2^24; for one image the requantization one kernel among at most seven (x less its zero
    point, im2col, cuBLAS's product and split-K reduction, the requantization, the cast: seven
    for 57 channels on an H100), an eighth for a bias, where the float64 form took eight and
    more."""
    rng = np.random.default_rng(6)
    x = rng.integers(0, 256, (2, channels, 9, 9), dtype=np.uint8)
    w = rng.integers(-128, 128, (6, channels, 3, 3), dtype=np.int8)
    if channels == 57:
        x[0, :, :4], w[:3] = 0, -128  # with zero point 128: -128 x -128 at every tap
    step, inputs, kernel = _qlinear_conv(x, w, True, bias, [1, 1, 1, 1])
    (want,) = kernel(*inputs)
    cuda_inputs = [t.cuda() for t in inputs]
    (got,) = step(*cuda_inputs)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    one = [cuda_inputs[0][:1], *cuda_inputs[1:]]
    kernels = _cuda_kernels(lambda: step(*one))
    assert "backplane_requantize_kernel" in kernels and len(kernels) <= 7 + bias, kernels


@cuda
def test_qoperator_blocks_on_cuda_are_the_layers_values() -> None:
    _qoperator_block_values("cuda")


def test_two_threads_leave_cudnn_switched_as_it_was(monkeypatch) -> None:
    """cuDNN's switch is process-wide: a thread's exact convolution started while another's is
    inside it must not read the switch off and put that back after the first restored it."""
    import threading

    from backplane.backends.torch.kernels import nn

    inside, go, go_second = threading.Event(), threading.Event(), threading.Event()
    calls: list[bool] = []

    def conv(x, *args, **kwargs):
        calls.append(torch._C._get_cudnn_enabled())
        if len(calls) == 1:
            inside.set()
            go.wait(5)
        else:
            go_second.wait(5)
        return (x,)

    monkeypatch.setattr(nn, "conv", conv)
    before = torch._C._get_cudnn_enabled()
    torch._C._set_cudnn_enabled(True)
    x = torch.zeros(1)
    try:
        first = threading.Thread(target=gpu_qlinear._exact_conv, args=(x, x, None, {}))
        second = threading.Thread(target=gpu_qlinear._exact_conv, args=(x, x, None, {}))
        first.start()
        assert inside.wait(5)
        second.start()
        second.join(0.2)  # inside the first's call, or waiting for it to end
        go.set()
        first.join(5)
        go_second.set()
        second.join(5)
        assert calls == [False, False] and torch._C._get_cudnn_enabled()
    finally:
        torch._C._set_cudnn_enabled(before)


def _steps_run(graph, chained: bool, monkeypatch) -> tuple[dict[str, np.ndarray], int]:
    """The folded graph's layers run on the CPU with CpuAcc's kernels: as GpuAcc's steps
    (``gpu_fusion.inner_steps``, the GPU forms taken) where ``chained``, else each layer's own
    kernel. The outputs and the steps' count."""
    monkeypatch.setattr(gpu_qlinear, "on_gpu", lambda tensor: True)
    acc = registry.create("CpuAcc")
    backend = types.SimpleNamespace(kernel_for=acc.kernel_for, options={})
    steps = (gpu_fusion.inner_steps(graph.layers, backend, graph.outputs, graph.constants)
             if chained else
             [(gpu_fusion.bind_kernel(acc.kernel_for(layer), layer.attrs, len(layer.outputs)),
               layer.inputs, layer.outputs) for layer in graph.layers])
    env = gpu_cuda._upload(graph.layers, dict(graph.constants), torch.device("cpu"))
    feeds = dict(np.load(CORPUS / "resnet_qlinear_ort15.s0.npz"))
    env.update({n: torch.from_numpy(feeds[n]) for n in graph.inputs})
    for workload, names_in, names_out in steps:
        env.update(zip(names_out, workload(*[env[n] if n else None for n in names_in])))
    return {n: env[n].numpy() for n in graph.outputs}, len(steps)


def test_resnet_qlinear_s_steps_are_its_layers_own(monkeypatch) -> None:
    """resnet_qlinear_ort15 as GpuAcc's steps: its six QLinearConv and its QLinearMatMul as float32
    sums, each with the DequantizeLinear after it and the QuantizeLinear before it, the outputs
    its layers' own to the bit."""
    graph = import_onnx(CORPUS / "resnet_qlinear_ort15.onnx")
    graph = passes.remove_dead_layers(passes.fold_constants(graph[0] if isinstance(graph, tuple)
                                                            else graph))
    want, layers = _steps_run(graph, False, monkeypatch)
    got, steps = _steps_run(graph, True, monkeypatch)
    assert layers - steps >= 7, (layers, steps)  # a DequantizeLinear per product, joined
    for name in graph.outputs:
        np.testing.assert_array_equal(got[name], want[name])
