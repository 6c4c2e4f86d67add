"""int8 CNNs on torch's int8 kernels without timing where those are known faster (issue 29):
ONNX Runtime's own static quantizer (QDQ and QOperator, per channel) writes the models, with a
free batch dimension as exporters write it; on a busy machine (``threads.crowded``: nothing is
timed) the large convolutions still run on the int8 route, the QOperator stem takes its
QuantizeLinear and the MaxPool after it, and a free-batch QOperator model's convolutions after a
QLinearAdd are fused in each shape's build. Outputs within one step of ONNX Runtime's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")
quantization = pytest.importorskip("onnxruntime.quantization")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion import int8  # noqa: E402
from tests.backends.torch.int8_cpu import int8_reference, torch_int8_exact  # noqa: E402
from tests.models.test_ort_tools import RandomReader  # noqa: E402

SHAPE = (2, 3, 64, 64)


def float_cnn(path: Path, batch: int | str) -> Path:
    """A ResNet-like stem (Conv 3 -> 16 at 64x64: 1.8 M multiply-adds, Relu, MaxPool 3/2), a
    residual block of two 3x3 convolutions of 32 channels at 32x32 (4.7 and 9.4 M), a depthwise one,
    GlobalAveragePool, Gemm; the block's output an output too; the batch dimension ``batch`` (a
    name: free)."""
    rng = np.random.default_rng(29)

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    weights = {"w0": w(16, 3, 3, 3), "b0": w(16), "w1": w(32, 16, 3, 3, scale=0.1), "b1": w(32),
               "w2": w(32, 32, 3, 3, scale=0.06), "b2": w(32), "wd": w(32, 1, 3, 3),
               "bd": w(32), "wg": w(10, 32), "bg": w(10)}
    node = helper.make_node
    nodes = [node("Conv", ["x", "w0", "b0"], ["c0"], pads=[1, 1, 1, 1]),
             node("Relu", ["c0"], ["r0"]),
             node("MaxPool", ["r0"], ["p0"], kernel_shape=[3, 3], strides=[2, 2],
                  pads=[1, 1, 1, 1]),
             node("Conv", ["p0", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             node("Relu", ["c1"], ["r1"]),
             node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             node("Add", ["c2", "r1"], ["s2"]),
             node("Relu", ["s2"], ["r2"]),
             node("Conv", ["r2", "wd", "bd"], ["cd"], pads=[1, 1, 1, 1], group=32),
             node("Relu", ["cd"], ["rd"]),
             node("GlobalAveragePool", ["rd"], ["gap"]),
             node("Flatten", ["gap"], ["flat"]),
             node("Gemm", ["flat", "wg", "bg"], ["y"], transB=1)]
    graph = helper.make_graph(
        nodes, "int8_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                          [batch, *SHAPE[1:]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10]),
         helper.make_tensor_value_info("r2", TensorProto.FLOAT, [batch, 32, 32, 32])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                                ir_version=8), str(path))
    return path


def quantized(tmp_path: Path, fmt: str, batch: int | str = SHAPE[0]) -> Path:
    path = tmp_path / f"{fmt}.onnx"
    quantization.quantize_static(float_cnn(tmp_path / "cnn.onnx", batch), path,
                                 RandomReader("x", SHAPE),
                                 quant_format=getattr(quantization.QuantFormat, fmt),
                                 per_channel=True, activation_type=quantization.QuantType.QUInt8,
                                 weight_type=quantization.QuantType.QInt8)
    return path


def output_step(path: Path) -> float:
    """The scale of the DequantizeLinear (or, in the QOperator format, of the QGemm) that makes
    the model's output."""
    model = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    (last,) = [n for n in model.graph.node if model.graph.output[0].name in n.output]
    return float(inits[last.input[1]])


def built_graphs(session: InferenceSession) -> list:
    """The graph of each shape's build of the session's Specialized layers."""
    loaded = session.runtime.network(session.network_id)
    return [runner.graph for step in loaded.steps
            for runner in getattr(step.workload, "built", {}).values()]


def feeds(seed: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)}


def built_layers_within_a_step(session: InferenceSession, path: Path, feeds=feeds) -> list:
    """The layers of the session's one build (its layers and those they hold), after two runs
    within one output step of ONNX Runtime's."""
    step = output_step(path)
    for seed in range(2):
        got = session.run(None, feeds(seed))[0]
        assert float(np.max(np.abs(got - int8_reference(path, feeds(seed))[0]))) <= step * 1.001
    (graph,) = built_graphs(session)
    return [lay for outer in graph.layers for lay in [outer, *outer.attrs.get("layers", [])]]


def assert_within_a_step_of_cpuref(session: InferenceSession, path: Path, seeds: range) -> None:
    """Where torch's int8 kernels saturate (up to 26 steps off), CpuAcc's "auto" takes the float
    routes ("exact", int8_exact): the output within one step of CpuRef's (the float sums of a QDQ
    convolution may flip a tie: seed 2's r2 here, one value one step off)."""
    cpuref, step = InferenceSession(path, backends=["CpuRef"]), output_step(path)
    for seed in seeds:
        got, want = session.run(None, feeds(seed))[0], cpuref.run(None, feeds(seed))[0]
        assert float(np.max(np.abs(got - want))) <= step * 1.001


@pytest.fixture
def busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine: nothing is timed, each layer takes its first route or a known one."""
    monkeypatch.setattr(threads, "crowded", lambda: True)


@pytest.mark.parametrize("fmt", ["QDQ", "QOperator"])
def test_large_convolutions_take_int8_untimed_on_a_busy_machine(fmt: str, busy: None,
                                                                tmp_path: Path) -> None:
    from tests.conftest import inner_workloads

    path = quantized(tmp_path, fmt)
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "layers",
                                                           "route_cache": False}), "CpuRef"])
    routes = [(getattr(w, "route", None), getattr(w, "why", ""))
              for w in inner_workloads(session, "QLinearConv")]
    if not torch_int8_exact():  # they saturate (no VNNI): no int8 route, CpuRef's values
        assert "int8" not in {route for route, _ in routes}, routes
        assert_within_a_step_of_cpuref(session, path, range(3))
        return
    known = [why == int8.KNOWN_FASTER for _, why in routes]
    # the stem (its QuantizeLinear and MaxPool taken), both 3x3 convolutions and the depthwise one
    # (QDQ: chained in integers at every size, qdq_chain.CHAIN_MACS), each a QLinearConv known
    # faster (int8.QOPERATOR_MACS)
    assert known == [True] * 4, routes
    step = output_step(path)
    for seed in range(3):
        got = session.run(None, feeds(seed))[0]
        want = int8_reference(path, feeds(seed))[0]
        assert float(np.max(np.abs(got - want))) <= step * 1.001


def test_a_free_batch_qoperator_cnn_is_fused_in_its_build(busy: None, tmp_path: Path) -> None:
    """Each shape's build gives the outputs of ONNX Runtime's QLinearAdd static shapes
    (``optimizer.shapes``), so the QLinearConvs after it fuse; the stem takes its QuantizeLinear
    and its MaxPool."""
    from backplane.backends.torch.backend import FUSED_DOMAIN

    path = quantized(tmp_path, "QOperator", batch="N")
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],  # torch's route, pinned:
                               provider_options=[{"CpuAcc.native": "off"}, {}])  # (not C's)
    layers = built_layers_within_a_step(session, path)
    convs = [lay for lay in layers if lay.op_type == "QLinearConv"]
    assert len(convs) == 4 and all(lay.domain == FUSED_DOMAIN for lay in convs), convs
    assert convs[0].attrs["into"] is not None and convs[0].attrs["pool"] is not None
    assert convs[2].attrs["residual"] is not None


def test_a_compiled_qdq_cnn_is_checked_in_quantization_steps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compile's check takes a QDQ subgraph whose outputs differ from its layers' by one
    step in a few values (as ONNX Runtime's differ from CpuRef's): ONNX Runtime's QDQ model
    here is one OneDnnGraph, compiled, within one step of ONNX Runtime (its float convolutions'
    sums flip ties against CpuRef's and ONNX Runtime's). Its convolutions taken as small ones
    (below ``qdq_chain.CHAIN_MACS``, not chained in integers), as the small tier's are."""
    from backplane.backends.torch.fusion import qdq_chain
    from tests.backends.torch.test_qdq_compiled import _graph_layer, _workload

    monkeypatch.setattr(qdq_chain, "CHAIN_MACS", 1 << 40)
    path = quantized(tmp_path, "QDQ")
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "onednn_graph",
                                                           "route_cache": False})])
    assert _graph_layer(session).op_type == "OneDnnGraph"
    # oneDNN Graph's int8 kernels round their own way, and by how much depends on the CPU: where
    # this CPU's compile is off by more than a quantized model's yardstick (a CI machine of another
    # CPU refused it once; this AMD EPYC never did in 50 seeds), the layers run and say so
    workload = _workload(session)
    why = getattr(workload, "why", "")
    refused = why.startswith("oneDNN Graph could not compile")
    assert workload.route == "onednn_graph" or (workload.route in ("traced", "layers") and refused), why
    step = output_step(path)
    for seed in range(2):
        got = session.run(None, feeds(seed))[0]
        want = int8_reference(path, feeds(seed))[0]
        assert float(np.max(np.abs(got - want))) <= step * 1.001


def test_within_steps_takes_what_a_quantized_model_differs_by() -> None:
    import torch

    from backplane.backends.torch.fusion.quantized import within_steps

    step = 0.05
    expected = torch.arange(-500, 500, dtype=torch.float32) * step
    flipped = expected.clone()
    flipped[::20] += step  # 5% one step off: as ONNX Runtime against CpuRef
    assert within_steps(flipped, expected, step)
    far = flipped.clone()
    far[::50] += 2 * step  # 2% more than one step off
    assert not within_steps(far, expected, step)
    most = expected + step  # every value one step off
    assert not within_steps(most, expected, step)
    nan = expected.clone()
    nan[3] = float("nan")
    assert not within_steps(nan, expected, step) and within_steps(nan, nan.clone(), step)


def hard_swish_cnn(path: Path) -> Path:
    """Conv -> x * HardSigmoid(x) -> Conv (MobileNetV3's hard-swish as torch exports it)."""
    rng = np.random.default_rng(7)
    weights = {"w0": (rng.standard_normal((8, 3, 3, 3)) * 0.5).astype(np.float32),
               "w1": (rng.standard_normal((8, 8, 1, 1)) * 0.3).astype(np.float32)}
    node = helper.make_node
    nodes = [node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1]),
             node("HardSigmoid", ["c0"], ["h0"], alpha=1 / 6, beta=0.5),
             node("Mul", ["c0", "h0"], ["s0"]),
             node("Conv", ["s0", "w1"], ["y"])]
    graph = helper.make_graph(
        nodes, "hard_swish", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [SHAPE[0], 8, *SHAPE[2:]])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)],
                                ir_version=8), str(path))
    return path


@pytest.mark.parametrize("activations", ["QUInt8", "QInt8"])
def test_a_qoperator_hard_swish_is_one_lookup(activations: str, tmp_path: Path) -> None:
    """DequantizeLinear -> HardSigmoid -> QuantizeLinear -> QLinearMul(x, that), as ONNX
    Runtime's quantizer writes a hard-swish, is one Lookup layer: the layers' kernels on the 256
    values of x, the same values as the layers give one by one (CpuRef's within one step)."""
    path = tmp_path / "q.onnx"
    quantization.quantize_static(hard_swish_cnn(tmp_path / "cnn.onnx"), path,
                                 RandomReader("x", SHAPE),
                                 quant_format=quantization.QuantFormat.QOperator,
                                 activation_type=getattr(quantization.QuantType, activations))
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("HardSigmoid") == 1 and "QLinearMul" in ops
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "layers"}), "CpuRef"])
    assert "Lookup" in [lay.op_type for lay in _all_layers(session)]
    one_by_one = InferenceSession(path, backends=["CpuRef"])
    step = output_step(path)
    for seed in range(2):
        got = session.run(None, feeds(seed))[0]
        assert float(np.max(np.abs(got - one_by_one.run(None, feeds(seed))[0]))) <= step * 1.001
        assert float(np.max(np.abs(got - int8_reference(path, feeds(seed))[0]))) <= step * 1.001


def test_a_lookup_gives_the_layers_values_in_any_memory_layout() -> None:
    """The table, gathered by a channels-last int8 x and by a sliced one, against the kernels'
    own values on x."""
    import torch

    from backplane.backends.torch.backend import FUSED_DOMAIN
    from backplane.backends.torch.fusion.lookup import lookup_workload
    from backplane.backends.torch.kernels.contrib_quant import q_linear_sigmoid
    from backplane.ir.graph import Layer

    scale, zero = np.array(0.05, np.float32), np.array(-3, np.int8)
    out_scale, out_zero = np.array(1 / 256, np.float32), np.array(-128, np.int8)
    sigmoid = Layer("s", "QLinearSigmoid", ["x", "xs", "xz", "ys", "yz"], ["y"], {},
                    "com.microsoft", 1)
    constants = {"xs": scale, "xz": zero, "ys": out_scale, "yz": out_zero}
    lookup = Layer("s", "Lookup", ["x"], ["y"], {"layers": [sigmoid], "x": "x", "y": "y",
                                                 "signed": True, "constants": constants},
                   FUSED_DOMAIN, 1)

    class Backend:
        @staticmethod
        def kernel_for(layer):
            return q_linear_sigmoid

    run = lookup_workload(lookup, Backend())
    x = torch.randint(-128, 128, (2, 5, 7, 3), dtype=torch.int8)
    args = [torch.from_numpy(np.array(constants[k])) for k in ("xs", "xz", "ys", "yz")]
    for case in (x.contiguous(memory_format=torch.channels_last), x[:, 1:4]):
        (got,) = run(case)
        (want,) = q_linear_sigmoid(case, *args)
        assert got.dtype == torch.int8 and torch.equal(got, want)


def _all_layers(session: InferenceSession) -> list:
    layers = []
    for lay in session.optimized.graph.layers:
        layers += [lay, *lay.attrs.get("layers", [])]
    return layers


@pytest.mark.parametrize("large", [False, True])
def test_a_traced_qoperator_graph_keeps_the_float_route_below_known_macs(
        large: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace holds the QLinearConvs' float route (TorchScript's) below ``KNOWN_MACS``, not the
    int8 one known faster layer by layer: with its int8 routes the small tier's QOperator ResNet
    was not traced and ran 2x slower. From it they keep the int8 route, and the layers run one
    by one (the full tier's QOperator ResNet traced on the float route ran 5x slower)."""
    if not large:  # these convolutions taken as small ones
        monkeypatch.setattr(int8, "KNOWN_MACS", 1 << 40)
    path = quantized(tmp_path, "QOperator")
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "onednn_graph",
                                                           "route_cache": False}), "CpuRef"])
    loaded = session.runtime.network(session.network_id)
    routes = [getattr(step.workload, "route", None) for step, lay in
              zip(loaded.steps, loaded.layers) if lay.op_type == "Traced"]
    if not torch_int8_exact():  # they saturate (no VNNI): traced on the float route at any size
        assert routes and "layers" not in routes, routes
        assert_within_a_step_of_cpuref(session, path, range(1))
        return
    assert routes and ("layers" in routes) == large, routes
    step = output_step(path)
    got = session.run(None, feeds(0))[0]
    assert float(np.max(np.abs(got - int8_reference(path, feeds(0))[0]))) <= step * 1.001


def test_a_round_trip_of_a_fresh_tensor_runs_in_its_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A QDQ hard-swish's round trips after HardSigmoid and Mul (kernels that always return a
    new tensor, read by the round trip alone) run in place; one whose input others read too
    does not; the outputs are CpuRef's within one step either way."""
    from backplane.backends.torch.fusion import qdq_chain

    monkeypatch.setattr(qdq_chain, "CHAIN_MACS", 1 << 20)  # QuantDequant layers, not chained
    path = tmp_path / "q.onnx"
    quantization.quantize_static(hard_swish_cnn(tmp_path / "cnn.onnx"), path,
                                 RandomReader("x", SHAPE),
                                 quant_format=quantization.QuantFormat.QDQ)
    session = InferenceSession(path, backends=[("CpuAcc", {"compile": "layers"}), "CpuRef"])
    trips = {lay.name.split("_QuantizeLinear")[0]: lay.attrs["fresh"]
             for lay in _all_layers(session)
             if lay.op_type == "QuantDequant" and not lay.attrs["layers"]}
    assert trips["h0"] and trips["s0"], trips
    assert not any(fresh for name, fresh in trips.items() if name not in ("h0", "s0")), trips
    step = output_step(path)
    want = InferenceSession(path, backends=["CpuRef"]).run(None, feeds(0))[0]
    assert float(np.max(np.abs(session.run(None, feeds(0))[0] - want))) <= step * 1.001
