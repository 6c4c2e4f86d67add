"""The int8 CNN route's work that a second thread cannot share (issue 29: at two threads ONNX
Runtime's int8 CNNs gained 1.8x, backplane's 1.15x): an integer tensor handed to torch's quantized
kernels as a view of its memory, not copied on the calling thread."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime.quantization")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_qdq_chain import feeds, output_step, quantized  # noqa: E402
from tests.conftest import inner_workloads  # noqa: E402


@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "strided"])
def test_quint8_views_the_integers(layout: str) -> None:
    from backplane.backends.torch.fusion.int8_qlinear import _raw, quint8

    u8 = torch.randint(0, 256, (2, 5, 7, 3), dtype=torch.uint8)
    if layout == "channels_last":
        u8 = u8.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        u8 = u8[:, ::2]
    q = quint8(u8, 0.25, 17)
    assert q.dtype == torch.quint8 and q.q_scale() == 0.25 and q.q_zero_point() == 17
    assert torch.equal(q.int_repr(), u8) and torch.equal(_raw(q), u8)
    assert torch.equal(q.dequantize(), (u8.float() - 17) * 0.25)
    assert (q.data_ptr() == u8.data_ptr()) == (layout != "strided")  # a strided view is copied
    if layout == "channels_last":
        assert q.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("activations", ["QUInt8", "QInt8"])
def test_chained_convolutions_read_their_integers_in_place(activations: str,
                                                           tmp_path: Path) -> None:
    """The QLinearConvs after the stem read the integers the layer before wrote without a copy
    into a quint8 tensor (``_make_per_tensor_quantized_tensor``: one thread's pass each), leave
    them as they were, and the model stays within one step of CpuRef."""
    from torch.profiler import ProfilerActivity, profile

    path = quantized(tmp_path, activations)
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "layers", "int8": "kernels",
                                                           "route_cache": False}), "CpuRef"])
    convs = [w for w in inner_workloads(session, "QLinearConv")
             if getattr(w, "route", None) == "int8"]
    assert len(convs) == 5
    layer = next(lay for lay in _qlinear_layers(session) if lay.attrs["into"] is None
                 and lay.attrs.get("residual") is not None)
    unsigned = activations == "QUInt8"
    shapes = [layer.attrs["input_shape"], layer.attrs["output_shape"]]
    inputs = [torch.randint(0 if unsigned else -128, 256 if unsigned else 128, shape,
                            dtype=torch.uint8 if unsigned else torch.int8)
              .contiguous(memory_format=torch.channels_last) for shape in shapes]
    before = [x.clone() for x in inputs]
    (run,) = [w for lay, w in _pairs(session) if lay is layer]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(*inputs)
    ops = {event.key for event in prof.key_averages()}
    assert "quantized::conv2d" in ops and "quantized::add" in ops, sorted(ops)
    assert "aten::_make_per_tensor_quantized_tensor" not in ops, sorted(ops)
    assert all(torch.equal(x, y) for x, y in zip(inputs, before))
    reference = InferenceSession(path, backends=["CpuRef"])
    for seed in range(2):
        got, want = session.run(None, feeds(seed))[0], reference.run(None, feeds(seed))[0]
        assert float(np.max(np.abs(got - want))) <= output_step(path) * 1.001


def _pairs(session: InferenceSession) -> list:
    loaded = session.runtime.network(session.network_id)
    found = []
    for step, layer in zip(loaded.steps, loaded.layers):
        found += getattr(step.workload, "inner", [(layer, step.workload)])
    return found


def _qlinear_layers(session: InferenceSession) -> list:
    return [lay for lay, _ in _pairs(session) if lay.op_type == "QLinearConv"]


def test_each_thread_count_keeps_its_convolution_primitive(tmp_path: Path, capfd) -> None:
    """After a call at one thread and one at two, calls at either count create no oneDNN
    primitive: torch's int8 convolution keeps the primitive of a packed weight's first call, for
    that call's thread count, and made it again at every call at another count, on the calling
    thread (CpuAcc times a partition at one thread before it runs at two). The weights packed for
    oneDNN (torch's "x86" engine takes FBGEMM for some layers, and on CPUs without VNNI)."""
    if "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch has no oneDNN quantized engine")
    path = quantized(tmp_path, "QUInt8")
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "onednn"
    try:
        session = InferenceSession(path, backends=[("CpuAcc", {
            "compile": "layers", "int8": "kernels", "route_cache": False}), "CpuRef"])
    finally:
        torch.backends.quantized.engine = engine
    layer, run = next((lay, w) for lay, w in _pairs(session) if lay.op_type == "QLinearConv"
                      and lay.attrs["into"] is None and getattr(w, "route", None) == "int8")
    x = torch.randint(0, 256, layer.attrs["input_shape"], dtype=torch.uint8).contiguous(
        memory_format=torch.channels_last)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2):
            torch.set_num_threads(count)
            outputs.append(run(x)[0].clone())
        capfd.readouterr()
        torch.set_num_threads(1)  # the count of its first call, which torch's own pack keeps
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            run(x)  # a torch that keeps its primitive makes none here
        if "create:" in capfd.readouterr().out:  # torch 2.11 on the GPU machine's Xeon (AMX)
            pytest.skip("this torch creates its int8 convolution primitive at every call, from "
                        "oneDNN's cache, at one thread count too: there is no kept primitive")
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
            for count in (2, 1, 2):
                torch.set_num_threads(count)
                assert torch.equal(run(x)[0], outputs[count - 1])
        printed = capfd.readouterr().out
    finally:
        torch.set_num_threads(threads)
    assert "exec,cpu,convolution" in printed  # oneDNN's convolution ran, and said so
    assert "create:" not in printed, printed
