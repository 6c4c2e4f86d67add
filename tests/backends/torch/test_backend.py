"""CpuAcc and GpuAcc as backends: registered without importing torch, available (or not) with a
reason, zero-copy torch-cpu memory, the thread option."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from backplane.backends.registry import registry
from backplane.backends.torch import backend as torch_backend


def test_importing_backplane_does_not_import_torch() -> None:
    code = ("import sys, backplane; from backplane.backends.registry import registry; "
            "assert {'CpuAcc', 'GpuAcc'} <= set(registry.ids()); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_torch_both_are_unavailable_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_backend, "torch_missing", lambda: "torch is not installed (test)")
    for backend in (torch_backend.CpuAcc(), torch_backend.GpuAcc()):
        status = backend.availability()
        assert not status.ok and status.reason == "torch is not installed (test)"
        assert backend.KERNELS == {}


def test_gpuacc_without_cuda_says_why() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    status = registry.create("GpuAcc").availability()
    assert not status.ok and ("CUDA" in status.reason)
    assert registry.create("GpuAcc").capabilities()["AsyncExecution"] is True


def test_cpuacc_memory_is_a_zero_copy_view_of_numpy() -> None:
    pytest.importorskip("torch")
    factory = registry.create("CpuAcc").tensor_handle_factories()[0]
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    tensor = factory.copy_in(array)
    assert tensor.data_ptr() == array.ctypes.data
    assert factory.copy_out(tensor).ctypes.data == array.ctypes.data
    frozen = np.arange(3.0)
    frozen.flags.writeable = False  # torch cannot view read-only memory: copied instead
    assert factory.copy_in(frozen).tolist() == [0.0, 1.0, 2.0]


def test_thread_option_sets_torch_threads() -> None:
    torch = pytest.importorskip("torch")
    from backplane.backends.api.backend import BackendOptions

    before = torch.get_num_threads()
    try:
        registry.create("CpuAcc").create_backend_context(BackendOptions({"CpuAcc.threads": 1}))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_refusals_give_reasons() -> None:
    pytest.importorskip("torch")
    from backplane.ir.graph import Layer, TensorInfo

    acc = registry.create("CpuAcc")
    u16 = TensorInfo((2,), np.dtype(np.uint16))
    support = acc.is_layer_supported(Layer("a", "Add", ["x", "y"], ["z"], opset=17), [u16, u16], [u16])
    assert not support.ok and "uint16" in support.reason
    f32 = TensorInfo((2,), np.dtype(np.float32))
    support = acc.is_layer_supported(Layer("t", "TfIdfVectorizer", ["x"], ["z"], opset=17), [f32],
                                     [f32])
    assert not support.ok and "no kernel for TfIdfVectorizer" in support.reason


def test_gpu_precision_option_names_the_choices() -> None:
    """GpuAcc.precision is checked without a GPU: the type it means, or an error listing them."""
    import types

    torch = pytest.importorskip("torch")
    from backplane.backends.torch import cuda

    def backend(value: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(options={"GpuAcc.precision": value})

    assert cuda.reduced_precision(backend("fp32")) is None
    assert cuda.reduced_precision(backend("fp16")) is torch.float16
    assert cuda.reduced_precision(backend("bf16")) is torch.bfloat16
    with pytest.raises(ValueError, match="'fp8' is not one of fp32, fp16, bf16"):
        cuda.reduced_precision(backend("fp8"))


def test_gpu_compile_and_layout_options_name_the_choices() -> None:
    """GpuAcc.compile and GpuAcc.channels_last are checked without a GPU."""
    torch = pytest.importorskip("torch")
    from backplane.backends.torch import cuda

    assert cuda.compiler_of({}) == "none"
    assert cuda.compiler_of({"GpuAcc.compile": "inductor"}) == "inductor"
    with pytest.raises(ValueError, match="'tvm' is not one of none, inductor"):
        cuda.compiler_of({"GpuAcc.compile": "tvm"})
    assert cuda.channels_last({}, None) is False  # auto: NCHW in float32
    assert cuda.channels_last({"GpuAcc.tf32": True}, None) is True  # auto: NHWC on tensor cores
    assert cuda.channels_last({}, torch.float16) is True  # auto: NHWC in fp16
    assert cuda.channels_last({"GpuAcc.channels_last": True}, None) is True
    assert cuda.channels_last({"GpuAcc.channels_last": False}, torch.float16) is False
    with pytest.raises(ValueError, match="'nhwc' is not one of auto, True, False"):
        cuda.channels_last({"GpuAcc.channels_last": "nhwc"}, None)


def test_a_subgraph_the_compiler_cannot_compile_runs_uncompiled(monkeypatch, caplog) -> None:
    """GpuAcc.compile=inductor: where the compiler fails, the subgraph keeps its layers' own kernels
    (the same answer), with a warning that names the subgraph and the error."""
    torch = pytest.importorskip("torch")
    from backplane.backends.torch import cuda

    def refuse(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", refuse)

    def run_layers(x):
        return [torch.relu(x) * 2]

    static = [torch.randn(3, 4)]
    with caplog.at_level("WARNING", logger="backplane.torch"):
        function = cuda.compiled(run_layers, static, "inductor", "CudaGraph[a..b](2 layers)")
    assert function is run_layers
    assert "CudaGraph[a..b](2 layers): inductor could not compile it (RuntimeError: no compiler " \
           "here); it runs uncompiled" in caplog.text
    assert cuda.compiled(run_layers, static, "none", "x") is run_layers
