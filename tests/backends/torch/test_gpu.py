"""GpuAcc on a CUDA device: the tiny models match ONNX Runtime, each static GPU subgraph runs as one
captured CUDA graph, and the node-suite cases of its ops match CpuRef. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.reference.backend import CpuRef  # noqa: E402
from backplane.backends.registry import registry  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.test_reference_kernels import _assert_same, _info, _layer, _value, node_cases  # noqa: E402
from tests.models.test_models import DATA, TINY, assert_close, ort, ort_outputs  # noqa: E402

CLAIMED = sorted(name for name, case in node_cases().items()
                 if case.model.graph.node[0].op_type in registry.create("CpuAcc").KERNELS)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graph", "eager"])
@pytest.mark.parametrize("name", TINY)
def test_tiny_models_match_onnx_runtime(name: str, graphs: bool) -> None:
    path = DATA / f"{name}.onnx"
    feeds = dict(np.load(DATA / f"{name}.npz"))
    options = RuntimeOptions(backend_options={"GpuAcc.cuda_graphs": graphs})
    session = InferenceSession(path, backends=["GpuAcc", "CpuRef"], runtime=Runtime(options))
    for _ in range(2):  # a replay gives the same answer as the first run
        assert_close(session.run(None, feeds), ort_outputs(path, feeds))
    ops = [layer.op_type for layer in session.optimized.graph.layers if layer.backend == "GpuAcc"]
    assert ops == ["CudaGraph"], ops  # replayed, or run layer by layer without graphs
    assert registry.create("GpuAcc").capabilities()["AsyncExecution"] is True


def test_new_inputs_reach_the_captured_graph() -> None:
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    session = InferenceSession(path, backends=["GpuAcc", "CpuRef"])
    first = session.run(None, feeds)[0]
    other = {k: v * 0.5 + 1 for k, v in feeds.items()}
    assert_close(session.run(None, other), ort_outputs(path, other))
    assert not np.allclose(first, session.run(None, other)[0])


@pytest.mark.parametrize("case_name", CLAIMED)
def test_node_case_matches_cpuref(case_name: str) -> None:
    case = node_cases()[case_name]
    layer = _layer(case.model)
    gpu, ref = registry.create("GpuAcc"), CpuRef()
    factory = gpu.tensor_handle_factories()[0]
    names = [i.name for i in case.model.graph.input]
    outs = [o.name for o in case.model.graph.output]
    for inputs, expected in case.data_sets:
        by_name = dict(zip(names, map(_value, inputs)))
        args = [by_name[n] if n else None for n in layer.inputs]
        expected_by_name = dict(zip(outs, map(_value, expected)))
        in_infos = [_info(a) for a in args]
        out_infos = [_info(expected_by_name.get(n)) for n in layer.outputs]
        if not gpu.is_layer_supported(layer, in_infos, out_infos):
            pytest.skip("not supported")
        workload = gpu.create_workload_factory().create_workload(layer, in_infos, out_infos)
        actual = [factory.copy_out(r) for r in workload(*[None if a is None else factory.copy_in(a)
                                                          for a in args])]
        reference = None
        if ref.is_layer_supported(layer, in_infos, out_infos):
            reference = ref.create_workload_factory().create_workload(layer, in_infos, out_infos)(*args)
        for index, name in enumerate(layer.outputs):
            if name in expected_by_name:
                want = reference[index] if reference is not None else expected_by_name[name]
                _assert_same(name, actual[index], want, case.rtol, case.atol)


def _conv_relu_model() -> onnx.ModelProto:
    """Conv -> Relu, Conv -> Add(residual) -> Relu, a bias-less Conv -> Relu, and a Conv whose output
    is read twice (by its Relu and as a graph output), which stays unfused."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def const(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    inits = [const("w1", 8, 8, 3, 3), const("b1", 8), const("w2", 8, 8, 1, 1), const("b2", 8),
             const("w3", 8, 8, 3, 3), const("w4", 8, 8, 1, 1), const("b4", 8)]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"]),
        helper.make_node("Add", ["x", "c2"], ["a2"]),
        helper.make_node("Relu", ["a2"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3"], ["c3"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c3"], ["r3"]),
        helper.make_node("Conv", ["r3", "w4", "b4"], ["c4"]),
        helper.make_node("Relu", ["c4"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "conv_relu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 8, 8]),
         helper.make_tensor_value_info("c4", TensorProto.FLOAT, [1, 8, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graph", "eager"])
def test_conv_relu_chains_run_as_one_cudnn_call(graphs: bool, monkeypatch) -> None:
    calls = {"relu": 0, "add_relu": 0}
    relu, add_relu = torch.cudnn_convolution_relu, torch.cudnn_convolution_add_relu

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)
        return call

    monkeypatch.setattr(torch, "cudnn_convolution_relu", counted("relu", relu))
    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", counted("add_relu", add_relu))
    model = _conv_relu_model()
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 8, 16, 16)).astype(np.float32)}
    options = RuntimeOptions(backend_options={"GpuAcc.cuda_graphs": graphs})
    session = InferenceSession(model, backends=["GpuAcc", "CpuRef"], runtime=Runtime(options))
    expected = ort.InferenceSession(model.SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)
    for _ in range(2):
        assert_close(session.run(None, feeds), expected)
    assert calls["add_relu"] >= 1 and calls["relu"] >= 2, calls  # c4 is read twice: not fused


@pytest.mark.parametrize("precision, tolerance", [("fp16", 2e-2), ("bf16", 1e-1)])
@pytest.mark.parametrize("name", TINY)
def test_reduced_precision_stays_close_and_returns_float32(name: str, precision: str,
                                                          tolerance: float) -> None:
    """GpuAcc.precision (Arm NN's ReduceFp32ToFp16): float32 inside the graph becomes fp16 / bf16,
    the outputs come back as float32, within the stated tolerance of ONNX Runtime's (max |diff|
    relative to the output's max |value|)."""
    path = DATA / f"{name}.onnx"
    feeds = dict(np.load(DATA / f"{name}.npz"))
    options = RuntimeOptions(backend_options={"GpuAcc.precision": precision})
    session = InferenceSession(path, backends=["GpuAcc", "CpuRef"], runtime=Runtime(options))
    for got, want in zip(session.run(None, feeds), ort_outputs(path, feeds)):
        assert got.dtype == want.dtype
        if got.dtype == np.float32:
            assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
        else:
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graph", "eager"])
def test_runs_from_several_threads_give_each_its_own_answer(graphs: bool) -> None:
    """A captured graph copies every run's inputs into one set of static tensors and returns its
    static outputs: its network runs one run at a time (``exclusive``), so threads do not race."""
    from concurrent.futures import ThreadPoolExecutor

    path = DATA / "tiny_mobilenet_v3.onnx"
    base = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    options = RuntimeOptions(backend_options={"GpuAcc.cuda_graphs": graphs})
    session = InferenceSession(path, backends=["GpuAcc", "CpuRef"], runtime=Runtime(options))
    assert session.runtime.network(session.network_id).exclusive == graphs
    rng = np.random.default_rng(0)
    feeds = [{k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in base.items()}
             for _ in range(16)]
    expected = [session.run(None, f)[0] for f in feeds]
    assert min(np.abs(a - b).max() for a, b in zip(expected, expected[1:])) > 2e-4  # > atol below
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            got = list(pool.map(lambda f: session.run(None, f)[0], feeds))
            for g, e in zip(got, expected):
                if graphs:  # one replay of the same kernels: the same bits
                    np.testing.assert_array_equal(g, e)
                else:  # each thread has cuBLAS and cuDNN handles of its own: their own sums
                    np.testing.assert_allclose(g, e, rtol=0, atol=1e-4)


def test_tf32_belongs_to_the_session_that_asked_for_it() -> None:
    """Two sessions, one with GpuAcc.tf32: torch's process-wide switches are as they were after
    each load and each run, and the strict one matches fp32 more closely."""
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32

    def session(tf32: bool) -> InferenceSession:
        options = RuntimeOptions(backend_options={"GpuAcc.tf32": tf32})
        return InferenceSession(path, backends=["GpuAcc", "CpuRef"], runtime=Runtime(options))

    strict, loose = session(False), session(True)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    (want,) = InferenceSession(path, backends=["CpuRef"]).run(None, feeds)
    (exact,), (fast,) = strict.run(None, feeds), loose.run(None, feeds)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == before
    assert np.abs(exact - want).max() <= 1e-4 * np.abs(want).max()
    assert np.abs(fast - want).max() <= 2e-2 * np.abs(want).max()
    assert np.abs(exact - want).max() <= np.abs(fast - want).max()


@pytest.mark.parametrize("precision, tolerance", [("fp32", 1e-4), ("fp16", 2e-2)])
@pytest.mark.parametrize("name", TINY)
def test_inductor_compiled_graphs_match_onnx_runtime(name: str, precision: str,
                                                     tolerance: float) -> None:
    """GpuAcc.compile=inductor: each captured subgraph compiled by TorchInductor, then captured; the
    outputs stay within the precision's tolerance of ONNX Runtime's, and a replay with new inputs
    gives their answer."""
    path = DATA / f"{name}.onnx"
    feeds = dict(np.load(DATA / f"{name}.npz"))
    options = RuntimeOptions(backend_options={"GpuAcc.compile": "inductor",
                                              "GpuAcc.precision": precision})
    session = InferenceSession(path, backends=["GpuAcc", "CpuRef"], runtime=Runtime(options))
    ops = [layer.op_type for layer in session.optimized.graph.layers if layer.backend == "GpuAcc"]
    assert ops == ["CudaGraph"], ops
    for run in range(2):
        if run:
            feeds = {k: v * 0.5 + 1 if v.dtype == np.float32 else v for k, v in feeds.items()}
        for got, want in zip(session.run(None, feeds), ort_outputs(path, feeds)):
            assert got.dtype == want.dtype
            if got.dtype == np.float32:
                assert np.abs(got - want).max() <= tolerance * np.abs(want).max()
            else:
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_channels_last_changes_the_memory_not_the_answer(precision: str) -> None:
    """GpuAcc.channels_last: the convolutions' tensors in NHWC memory give the NCHW answer (the same
    in fp32 up to cuDNN's choice of kernel; in fp16 within its rounding)."""
    path = DATA / "tiny_mobilenet_v3.onnx"
    feeds = dict(np.load(DATA / "tiny_mobilenet_v3.npz"))

    def run(nhwc: bool) -> np.ndarray:
        options = RuntimeOptions(backend_options={"GpuAcc.channels_last": nhwc,
                                                  "GpuAcc.precision": precision})
        session = InferenceSession(path, backends=["GpuAcc", "CpuRef"], runtime=Runtime(options))
        return session.run(None, feeds)[0]

    nchw, nhwc = run(False), run(True)
    assert nhwc.flags.c_contiguous and nhwc.dtype == np.float32
    tolerance = 1e-5 if precision == "fp32" else 2e-2
    assert np.abs(nhwc - nchw).max() <= tolerance * np.abs(nchw).max()


def test_decoding_with_a_cache_stays_on_the_gpu() -> None:
    """One GPT-2 decoding step with a free past length: GpuAcc takes it whole (a Specialized layer,
    captured per past length), and several steps with the cache fed back match ONNX Runtime."""
    from tests.models.test_decoder_cache import PATH, _decode

    feeds = dict(np.load(DATA / "tiny_gpt2_decode.npz"))
    session = InferenceSession(PATH, backends=["GpuAcc", "CpuRef"])
    reference = ort.InferenceSession(str(PATH), providers=["CPUExecutionProvider"])
    for got, want in zip(_decode(lambda f: session.run(None, f), feeds),
                         _decode(lambda f: reference.run(None, f), feeds)):
        assert_close(got, want)
    assert session.report.partitions == ["GpuAcc"], session.report.partitions
