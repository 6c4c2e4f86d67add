"""Control flow on GpuAcc (issue 28, item 3): an If read only by GPU layers hands its branch's GPU
result on as it is (no wait and copy to the host and back), each branch its own captured graph, its
predicate computed from the inputs on the host; a Loop whose body GpuAcc runs iterates over one
slot list, its carried values kept on the GPU. Each is compared with CpuRef on both predicate
values and on new inputs. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.builtin.bodies import IteratedBody  # noqa: E402
from backplane.backends.builtin.device import DeviceBranch  # noqa: E402

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
GPU = ["GpuAcc", "CpuRef"]  # no CpuAcc: nothing is timed against the CPU at load


def _branch(name: str, kernel: int) -> onnx.GraphProto:
    """Unsqueeze x to (N, 1, 16), a Conv1d of ``kernel`` taps and stride, Relu: a VAD's front end
    (the two branches give (N, 4, 16 / kernel): other shapes per predicate)."""
    nodes = [helper.make_node("Unsqueeze", ["x", "axis1"], [f"{name}_u"]),
             helper.make_node("Conv", [f"{name}_u", f"w{kernel}", f"b{kernel}"], [f"{name}_c"],
                              kernel_shape=[kernel], strides=[kernel]),
             helper.make_node("Relu", [f"{name}_c"], [f"{name}_out"])]
    return helper.make_graph(nodes, name, [], [
        helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)])


def if_model(output_of_if: bool = False, from_data: bool = False) -> onnx.ModelProto:
    """sr -> Gather -> Equal 16000 -> If (kernel 4 / kernel 2 front end) -> Conv -> Relu ->
    ReduceMean: the corpus VAD's shape in small; ``output_of_if``: the If's output is also a graph
    output (then it must reach the host). ``from_data``: the predicate also reads x (Or with
    Size(x) > 2**40, always false), so that the input alone does not decide the If before the run
    (optimizer/decided.py) and its branches run as nested networks."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("axis1", np.array([1], np.int64)), ("zero", np.array(0, np.int64)),
        ("rate", np.array(16000, np.int64)),
        ("w4", rng.standard_normal((4, 1, 4)).astype(np.float32)),
        ("b4", rng.standard_normal(4).astype(np.float32)),
        ("w2", rng.standard_normal((4, 1, 2)).astype(np.float32)),
        ("b2", rng.standard_normal(4).astype(np.float32)),
        ("we", rng.standard_normal((3, 4, 3)).astype(np.float32)),
        ("be", rng.standard_normal(3).astype(np.float32)), ("huge", np.array(2**40)))]
    nodes = [helper.make_node("Gather", ["sr", "zero"], ["sr0"], axis=0),
             helper.make_node("Equal", ["sr0", "rate"], ["is16" if not from_data else "eq"])]
    if from_data:
        nodes += [helper.make_node("Size", ["x"], ["size"]),
                  helper.make_node("Greater", ["size", "huge"], ["too_big"]),
                  helper.make_node("Or", ["eq", "too_big"], ["is16"])]
    nodes += [helper.make_node("If", ["is16"], ["front"], then_branch=_branch("then", 4),
                              else_branch=_branch("else", 2)),
             helper.make_node("Conv", ["front", "we", "be"], ["enc"], kernel_shape=[3],
                              pads=[1, 1]),
             helper.make_node("Relu", ["enc"], ["act"]),
             helper.make_node("ReduceMean", ["act"], ["y"], axes=[2], keepdims=0)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])]
    if output_of_if:
        outputs.append(helper.make_tensor_value_info("front", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "vad_if", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16]),
        helper.make_tensor_value_info("sr", TensorProto.INT64, [1])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _ifs(session: InferenceSession) -> list:
    loaded = session.runtime.network(session.network_id)
    return [(layer, step.workload) for step, layer in zip(loaded.steps, loaded.layers)
            if layer.op_type == "If"]


def _assert_matches(session: InferenceSession, reference: InferenceSession,
                    feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    got, want = session.run(None, feeds), reference.run(None, feeds)
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray) and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    return got


@pytest.mark.parametrize("batch", [1, 3])
def test_if_read_on_the_gpu_hands_its_branch_over_on_the_gpu(batch: int) -> None:
    model = if_model(from_data=True)
    session, reference = InferenceSession(model, backends=GPU), \
        InferenceSession(model, backends=["CpuRef"])
    ((layer, workload),) = _ifs(session)
    assert layer.attrs.get("device_outputs") is True
    assert [type(run) for run in workload.runs] == [DeviceBranch, DeviceBranch]
    rng = np.random.default_rng(batch)
    seen = []
    for sr in (16000, 8000, 16000, 8000):  # both branches, each twice: their graphs replayed
        x = rng.standard_normal((batch, 16)).astype(np.float32)
        seen.append((x, sr, _assert_matches(session, reference, {"x": x, "sr": np.array([sr])})))
    for x, sr, (y,) in seen:  # no output of a run changed by a later one
        np.testing.assert_allclose(y, reference.run(None, {"x": x, "sr": np.array([sr])})[0],
                                   rtol=1e-4, atol=1e-5)


def test_input_predicate_decided_on_the_host() -> None:
    """The predicate from sr alone: the network's versions, each its branch inlined and whole on
    GpuAcc, the predicate computed by builtin on the host (optimizer/decided.py)."""
    session, reference = InferenceSession(if_model(), backends=GPU), \
        InferenceSession(if_model(), backends=["CpuRef"])
    (outer,) = session.optimized.graph.layers
    assert outer.op_type == "DecidedIf"
    for branch in ("then_branch", "else_branch"):
        layers = outer.attrs[branch].graph.layers
        assert "If" not in {lay.op_type for lay in layers}
        assert any(lay.backend == "GpuAcc" for lay in layers)
    x = np.random.default_rng(4).standard_normal((2, 16)).astype(np.float32)
    for sr in (16000, 8000, 16000):
        _assert_matches(session, reference, {"x": x, "sr": np.array([sr])})


def test_predicate_stays_on_the_gpu_where_no_host_backend_is_listed() -> None:
    model = if_model(from_data=True)
    session, reference = InferenceSession(model, backends=["GpuAcc"]), \
        InferenceSession(model, backends=["CpuRef"])
    assert {lay.backend for lay in session.optimized.graph.layers} <= {"GpuAcc", "builtin"}
    x = np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32)
    for sr in (16000, 8000):
        _assert_matches(session, reference, {"x": x, "sr": np.array([sr])})


def test_if_whose_output_the_user_reads_brings_it_to_the_host() -> None:
    model = if_model(output_of_if=True, from_data=True)
    session, reference = InferenceSession(model, backends=GPU), \
        InferenceSession(model, backends=["CpuRef"])
    ((layer, workload),) = _ifs(session)
    assert not layer.attrs.get("device_outputs")
    assert not any(isinstance(run, DeviceBranch) for run in workload.runs)
    x = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    for sr in (16000, 8000):
        _assert_matches(session, reference, {"x": x, "sr": np.array([sr])})


def test_corpus_vad_on_both_rates() -> None:
    path = CORPUS / "vad_lstm_if_ts16.onnx"
    session, reference = InferenceSession(path, backends=GPU), \
        InferenceSession(path, backends=["CpuRef"])
    (outer,) = session.optimized.graph.layers  # decided by sr: a version per branch, whole
    assert outer.op_type == "DecidedIf"
    for branch in ("then_branch", "else_branch"):
        assert {lay.backend for lay in outer.attrs[branch].graph.layers} - {"builtin"} \
            == {"GpuAcc"}
    for sample in ("s0", "s1"):
        feeds = dict(np.load(CORPUS / f"vad_lstm_if_ts16.{sample}.npz"))
        for sr in (16000, 8000):
            _assert_matches(session, reference, {**feeds, "sr": np.array([sr], np.int64)})


def loop_model(steps: int = 5) -> onnx.ModelProto:
    """A Loop of a known trip count: h = tanh(x[i] @ W + h @ U), h carried, each h scanned out;
    its body on GpuAcc (the iteration number read by a Gather on the GPU)."""
    rng = np.random.default_rng(2)
    body = helper.make_graph([
        helper.make_node("Gather", ["x", "i"], ["xi"], axis=0),
        helper.make_node("MatMul", ["xi", "W"], ["a"]),
        helper.make_node("MatMul", ["h_in", "U"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Tanh", ["s"], ["h_out"]),
        helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        helper.make_node("Mul", ["h_out", "two"], ["scan"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("scan", TensorProto.FLOAT, [2, 8])])
    inits = [numpy_helper.from_array(v, n) for n, v in (
        ("W", rng.standard_normal((8, 8)).astype(np.float32) * 0.5),
        ("U", rng.standard_normal((8, 8)).astype(np.float32) * 0.5),
        ("two", np.array(2.0, np.float32)), ("trips", np.array(steps, np.int64)),
        ("yes", np.array(True)))]
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "yes", "h0"], ["h", "hs"], body=body)], "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 2, 8]),
         helper.make_tensor_value_info("h0", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("hs", TensorProto.FLOAT, [steps, 2, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_loop_body_on_the_gpu_iterates_over_one_slot_list() -> None:
    session, reference = InferenceSession(loop_model(), backends=GPU), \
        InferenceSession(loop_model(), backends=["CpuRef"])
    loaded = session.runtime.network(session.network_id)
    (loop,) = [step.workload for step, layer in zip(loaded.steps, loaded.layers)
               if layer.op_type == "Loop"]
    assert any(layer.backend == "GpuAcc" for layer in loop.bodies[0].layers)
    assert isinstance(loop.iterated, IteratedBody) and not loop.iterated.plain
    rng = np.random.default_rng(3)
    for _ in range(3):
        feeds = {"x": rng.standard_normal((5, 2, 8)).astype(np.float32),
                 "h0": rng.standard_normal((2, 8)).astype(np.float32)}
        _assert_matches(session, reference, feeds)


@pytest.mark.parametrize("name", ["loop_scripted_ts16", "cond_nested_dyn18"])
def test_corpus_control_flow_on_the_gpu(name: str) -> None:
    path = CORPUS / f"{name}.onnx"
    session, reference = InferenceSession(path, backends=GPU), \
        InferenceSession(path, backends=["CpuRef"])
    assert any(layer.backend == "GpuAcc" for layer in session.optimized.graph.layers)
    for sample in ("s0", "s1"):
        feeds = dict(np.load(CORPUS / f"{name}.{sample}.npz"))
        keep = [i.name for i in session.get_inputs()]
        for _ in range(2):
            _assert_matches(session, reference, {k: v for k, v in feeds.items() if k in keep})
    if name == "loop_scripted_ts16":  # the recurrence's body, its Slice bounds outer constants
        loaded = session.runtime.network(session.network_id)
        (loop,) = [step.workload for step, layer in zip(loaded.steps, loaded.layers)
                   if layer.name == "/Loop"]
        body = loop.bodies[0]
        built = [runner for step, layer in zip(body.steps, body.layers)
                 if layer.op_type == "Specialized" for runner in step.workload.built.values()]
        ops = [[layer.op_type for layer in runner.graph.layers] for runner in built]
        assert ops and all(kinds == ["CudaGraph"] for kinds in ops), ops  # captured whole


@pytest.mark.parametrize("case", [  # in, out, length, kernel, stride, dilation, pads, batch
    (1, 258, 576, 256, 128, 1, (64, 64), 1),  # the full-tier VAD's front end
    (258, 128, 4, 3, 1, 1, (1, 1), 2),  # its encoder
    (30, 50, 20, 3, 2, 2, (0, 1), 3),
    (40, 60, 9, 2, 1, 3, (2, 0), 1)])
def test_small_conv1d_is_one_matrix_product(case: tuple) -> None:
    import torch.nn.functional as F

    from backplane.backends.torch.gpu_small import _small_conv1d
    from backplane.ir.graph import Layer

    c_in, c_out, length, k, stride, dilation, pads, batch = case
    conv = Layer("conv", "Conv", ["x", "w", "b"], ["y"], {
        "kernel_shape": [k], "strides": [stride], "dilations": [dilation], "pads": list(pads)})

    def cudnn(*_: object) -> tuple:
        raise AssertionError("the small Conv1d ran cuDNN's kernel")

    rng = np.random.default_rng(4)
    x, w, b = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda()
               for shape in ((batch, c_in, length), (c_out, c_in, k), (c_out,)))
    x[0, 0, 1] = float("nan")  # NaN in, NaN out, where the reference puts it
    (got,) = _small_conv1d(conv, cudnn)(x, w, b)
    want = F.conv1d(F.pad(x.double(), pads), w.double(), b.double(), stride=stride,
                    dilation=dilation).float()
    np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(), rtol=1e-4, atol=1e-4)
    wide = torch.zeros((70, c_in, length), device="cuda")  # over SMALL_CONV_COLUMNS: cuDNN's
    with pytest.raises(AssertionError, match="cuDNN"):
        _small_conv1d(conv, cudnn)(wide, w, b)
    with pytest.raises(AssertionError, match="cuDNN"):  # under SMALL_CONV_WEIGHTS: cuDNN's
        _small_conv1d(conv, cudnn)(x[:, :1], w[:2, :1], b[:2])
