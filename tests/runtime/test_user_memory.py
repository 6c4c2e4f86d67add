"""The user's tensors in place: inputs that speak DLPack read where they are, and IOBinding (ONNX
Runtime's ``io_binding``) with outputs bound to a device or to a buffer the user allocated. The CUDA
tests skip without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession
from backplane.backends.api.memory import device_of, host_view

DATA = Path(__file__).resolve().parents[1] / "data"
MODEL = DATA / "tiny_mobilenet_v3.onnx"


def _input() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((1, 3, 64, 64)).astype(np.float32)


def _cuda() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


class DLPackOnly:
    """A host array that speaks DLPack and nothing else (no __array__), as JAX and CuPy arrays do."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.shape, self.dtype = array.shape, array.dtype

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_a_dlpack_host_value_is_read_without_a_copy() -> None:
    array = _input()
    view = host_view(DLPackOnly(array))
    assert np.shares_memory(view, array)
    assert device_of(DLPackOnly(array)) == "cpu"


def test_a_torch_cpu_tensor_goes_into_cpuacc_without_a_copy() -> None:
    torch = pytest.importorskip("torch")
    x = _input()
    session = InferenceSession(MODEL, ["CpuAcc", "CpuRef"])
    expected = session.run(None, {"input": x})[0]
    results, timings = session.run_profiled(None, {"input": torch.from_numpy(x)})
    np.testing.assert_array_equal(results[0], expected)
    glue = {t.op_type for t in timings if t.op_type in ("MemCopy", "MemImport")}
    assert glue == {"MemImport"}, "host memory is imported both ways, never copied"


def test_a_value_on_an_unknown_device_is_refused_by_name() -> None:
    class OnAnNpu(DLPackOnly):
        def __dlpack_device__(self):
            return (9, 0)  # kDLVulkan

    session = InferenceSession(MODEL, ["CpuRef"])
    with pytest.raises(ValueError, match="DLPack device type 9"):
        session.run(None, {"input": OnAnNpu(_input())})


def test_io_binding_on_the_host_fills_a_buffer_given_for_an_output() -> None:
    x = _input()
    session = InferenceSession(MODEL, ["CpuRef"])
    expected = session.run(None, {"input": x})[0]
    binding = session.io_binding()
    binding.bind_cpu_input("input", x)
    buffer = np.zeros_like(expected)
    binding.bind_output("logits", buffer=buffer)
    session.run_with_iobinding(binding)
    (out,) = binding.get_outputs()
    assert out is buffer
    np.testing.assert_array_equal(buffer, expected)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], expected)


def test_io_binding_refuses_what_it_cannot_bind_and_names_the_choices() -> None:
    session = InferenceSession(MODEL, ["CpuRef"])
    binding = session.io_binding()
    with pytest.raises(ValueError, match="its inputs are: input"):
        binding.bind_input("image", _input())
    with pytest.raises(ValueError, match="its outputs are: logits"):
        binding.bind_output("probabilities")
    with pytest.raises(ValueError, match="not one of cpu, cuda"):
        binding.bind_output("logits", "npu")
    with pytest.raises(TypeError, match="not a raw buffer pointer"):
        binding.bind_input("input", device_type="cuda", buffer_ptr=1234)
    with pytest.raises(RuntimeError, match="run_with_iobinding"):
        binding.get_outputs()
    with pytest.raises(ValueError, match=r"\['input'\] not bound"):
        session.run_with_iobinding(binding)
    binding.bind_input("input", _input())
    binding.bind_output("logits", buffer=np.zeros((1, 3), np.float32))
    with pytest.raises(ValueError, match="has shape"):
        session.run_with_iobinding(binding)
    other = InferenceSession(MODEL, ["CpuRef"])
    with pytest.raises(TypeError, match="this session"):
        other.run_with_iobinding(binding)


# -- CUDA ------------------------------------------------------------------------------------------
def test_a_cuda_tensor_in_and_out_stays_on_the_gpu() -> None:
    """GpuAcc all the way: the input is imported, the output left on the device; the profile shows
    no copy at all, and the outputs match the host run's."""
    _cuda()
    import torch

    x = _input()
    session = InferenceSession(MODEL, ["GpuAcc", "CpuRef"])
    assert set(session.report.counts()) <= {"GpuAcc", "builtin"}
    expected = session.run(None, {"input": x})[0]
    binding = session.io_binding()
    binding.bind_input("input", torch.from_numpy(x).cuda())
    binding.bind_output("logits", "cuda")
    session.run_with_iobinding(binding)
    (out,) = binding.get_outputs()
    assert isinstance(out, torch.Tensor) and out.is_cuda
    np.testing.assert_allclose(out.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)
    loaded = session.runtime.network(session.network_id)
    plan = loaded.plan(["cuda:0"], ["cuda:0"])
    copies = [layer.name for layer in plan.layers if layer.op_type == "MemCopy"]
    assert not [c for c in copies if "host" in c], copies
    # a second run must not overwrite the first run's output (captured graphs reuse theirs)
    first = out.clone()
    binding.bind_input("input", torch.from_numpy(-x).cuda())
    session.run_with_iobinding(binding)
    torch.testing.assert_close(out, first)


def test_a_cuda_input_read_by_the_host_is_copied_once() -> None:
    _cuda()
    import torch

    x = _input()
    session = InferenceSession(MODEL, ["CpuRef"])
    expected = session.run(None, {"input": x})[0]
    results, timings = session.run_profiled(None, {"input": torch.from_numpy(x).cuda()})
    np.testing.assert_array_equal(results[0], expected)
    assert [t.layer for t in timings if t.op_type == "MemCopy"] == \
        ["MemCopy[input](user cuda:0->host)"]


def test_a_cuda_output_into_a_buffer_the_user_allocated() -> None:
    _cuda()
    import torch

    x = _input()
    session = InferenceSession(MODEL, ["GpuAcc", "CpuRef"])
    expected = session.run(None, {"input": x})[0]
    buffer = torch.zeros(expected.shape, device="cuda")
    binding = session.io_binding()
    binding.bind_input("input", torch.from_numpy(x).cuda())
    binding.bind_output("logits", buffer=buffer)
    session.run_with_iobinding(binding)
    assert binding.get_outputs()[0] is buffer
    np.testing.assert_allclose(buffer.cpu().numpy(), expected, rtol=1e-4, atol=1e-5)
