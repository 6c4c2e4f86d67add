"""What GpuAcc captures (issue 28): a subgraph with a NonMaxSuppression is split there, the layers
before it one CUDA graph, those whose shapes it decides run one by one; a Resize (the layout
detector's upsampling) is captured with the rest instead of sending the model to the next backend,
and a subgraph whose capture fails runs uncaptured on the GPU. The split is checked without a GPU;
the runs need CUDA."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession, import_onnx  # noqa: E402
from backplane.backends.torch import cuda  # noqa: E402
from backplane.ir.graph import SubgraphView  # noqa: E402
from tests.backends.torch.gpu_corpus import gpuacc_matches_cpuref  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
BOXES = 16


def nms_model(boxes: int | str = BOXES) -> onnx.ModelProto:
    """Boxes and scores made on the device, NonMaxSuppression, then the kept boxes gathered: the
    post-processing detectors export (detect_nms_dyn21's shape, in small)."""
    nodes = [
        helper.make_node("Mul", ["boxes", "two"], ["b1"], name="scale"),
        helper.make_node("Add", ["b1", "one"], ["b2"], name="shift"),
        helper.make_node("Mul", ["scores", "three"], ["s1"], name="sharpen"),
        helper.make_node("Sigmoid", ["s1"], ["s2"], name="squash"),
        helper.make_node("Squeeze", ["b2"], ["flat"], axes=[0], name="flatten"),
        helper.make_node("NonMaxSuppression", ["b2", "s2", "keep", "iou", "least"], ["sel"],
                         name="nms"),
        helper.make_node("Gather", ["sel", "two_i"], ["index"], axis=1, name="which"),
        helper.make_node("Gather", ["flat", "index"], ["kept"], axis=0, name="pick"),
        helper.make_node("Mul", ["kept", "two"], ["out"], name="rescale"),
    ]
    inits = [numpy_helper.from_array(np.array(v, dtype=t), n) for n, v, t in (
        ("two", 2.0, np.float32), ("one", 1.0, np.float32), ("three", 3.0, np.float32),
        ("keep", [BOXES], np.int64), ("iou", [0.3], np.float32),
        ("least", [0.5], np.float32), ("two_i", 2, np.int64))]
    graph = helper.make_graph(
        nodes, "nms", [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [1, boxes, 4]),
                       helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 1, boxes])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def nms_feeds(seed: int, boxes: int = BOXES) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    corner = rng.uniform(0, 8, (1, boxes, 2))
    return {"boxes": np.concatenate([corner, corner + rng.uniform(1, 4, (1, boxes, 2))],
                                    axis=2).astype(np.float32),
            "scores": rng.standard_normal((1, 1, boxes)).astype(np.float32)}


def resize_model(height: int | str = 16, width: int | str = 12) -> onnx.ModelProto:
    """Conv, hard-swish, Resize x2 (linear), Conv, and a tf_crop_and_resize Resize whose region
    reaches outside the image (its extrapolated pixels): the layout detector's parts, at opset 11."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("HardSigmoid", ["c1"], ["g"], alpha=1 / 6, beta=0.5, name="gate"),
        helper.make_node("Mul", ["c1", "g"], ["h"], name="hswish"),
        helper.make_node("Resize", ["h", "roi", "scales"], ["up"], mode="linear", name="up"),
        helper.make_node("Conv", ["up", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Resize", ["c2", "box", "half"], ["y"], mode="linear",
                         coordinate_transformation_mode="tf_crop_and_resize",
                         extrapolation_value=7.0, name="crop"),
    ]
    inits = [numpy_helper.from_array(v.astype(np.float32), n) for n, v in (
        ("w1", rng.standard_normal((4, 3, 3, 3)) * 0.3), ("b1", rng.standard_normal(4)),
        ("w2", rng.standard_normal((2, 4, 3, 3)) * 0.3), ("roi", np.zeros(0)),
        ("scales", np.array([1, 1, 2, 2])), ("half", np.array([1, 1, 0.5, 0.5])),
        ("box", np.array([0, 0, -0.2, -0.1, 1, 1, 1.1, 1.2])))]
    graph = helper.make_graph(
        nodes, "layout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, height, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def test_nonmaxsuppression_splits_the_capture_there() -> None:
    graph = import_onnx(nms_model())
    views = cuda.capture_views(SubgraphView.of(graph, graph.layers), None)
    captured, chain = views.substitutions
    assert [lay.name for lay in captured.substitutable.layers] == ["scale", "shift", "sharpen",
                                                                   "squash", "flatten"]
    assert captured.replacement[0].op_type == "CudaGraph"
    # NonMaxSuppression decides how many boxes the rest sees: it and the layers after it, whose
    # outputs are the model's, one HostChain run on the host from one download of its inputs
    assert [lay.name for lay in chain.substitutable.layers] == ["nms", "which", "pick", "rescale"]
    assert chain.replacement[0].op_type == "HostChain" and views.untouched == []


def test_the_chain_stays_on_the_gpu_where_a_gpu_layer_reads_it() -> None:
    model = nms_model()  # the kept boxes read again by a layer that is not a light one
    model.graph.node.append(helper.make_node("Softmax", ["out"], ["soft"], name="soft"))
    model.graph.node.append(helper.make_node("Add", ["out", "soft"], ["both"], name="both"))
    model.graph.output.append(helper.make_tensor_value_info("both", TensorProto.FLOAT, None))
    graph = import_onnx(model)
    views = cuda.capture_views(SubgraphView.of(graph, graph.layers), None)
    assert [sub.replacement[0].op_type for sub in views.substitutions] == ["CudaGraph"]
    assert [lay.name for lay in views.untouched[0].layers] == ["nms", "which", "pick", "rescale",
                                                                "soft", "both"]


def test_free_inputs_and_host_values_are_not_captured() -> None:
    graph = import_onnx(nms_model("n"))  # the boxes' count free: nothing has a static shape
    assert cuda.capture_views(SubgraphView.of(graph, graph.layers), None).substitutions == []
    # a TopK whose k is computed: the layers up to it are captured, it and its readers are not
    topk = helper.make_node("TopK", ["scores2", "k"], ["v", "i"], name="topk")
    model = nms_model()
    model.graph.node.insert(4, helper.make_node("Reshape", ["s2", "flat_shape"], ["scores2"],
                                                name="row"))
    model.graph.node.insert(5, helper.make_node("Add", ["kk", "kk"], ["k"], name="count"))
    model.graph.node.insert(6, topk)
    model.graph.input.append(helper.make_tensor_value_info("kk", TensorProto.INT64, [1]))
    model.graph.initializer.append(numpy_helper.from_array(np.array([BOXES], np.int64),
                                                           "flat_shape"))
    model.graph.output.append(helper.make_tensor_value_info("v", TensorProto.FLOAT, None))
    graph = import_onnx(model)
    views = cuda.capture_views(SubgraphView.of(graph, graph.layers), None)
    captured = [lay.name for sub in views.substitutions for lay in sub.substitutable.layers
                if sub.replacement[0].op_type == "CudaGraph"]
    assert captured == ["scale", "shift", "sharpen", "squash", "row", "count"]


@needs_cuda
@pytest.mark.parametrize("boxes", [BOXES, "n"], ids=["static", "free"])
def test_a_detector_is_captured_up_to_its_nms_and_matches_cpuref(boxes) -> None:
    session = InferenceSession(nms_model(boxes), backends=["GpuAcc", "CpuRef"])
    reference = InferenceSession(nms_model(boxes), backends=["CpuRef"])
    for seed in range(4):  # each keeps another number of boxes
        feeds = nms_feeds(seed)
        (got,), (want,) = session.run(None, feeds), reference.run(None, feeds)
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert session.report.counts() == {"GpuAcc": 9}
    ops = [lay.op_type for lay in session.optimized.graph.layers if lay.backend == "GpuAcc"]
    if boxes == "n":  # each signature's build, run whole from host memory (cuda_host.HostTail)
        (built,) = session.runtime.network(session.network_id).host_runs.built.values()
        ops = list(built.kinds)
    assert ops == ["CudaGraph", "HostChain"]


@needs_cuda
@pytest.mark.parametrize("name", ["detect_nms_dyn21", "detect_nms_ts14"])
def test_the_corpus_detectors_on_the_gpu_match_cpuref(name: str) -> None:
    """Their NonMaxSuppression and post-process on the host (``gpu_host_chain``), the rest one
    CUDA graph a signature: CpuRef's selections box for box, the boxes within float32 rounding."""
    session = gpuacc_matches_cpuref(name, 1e-5)
    assert session.report.counts() == {"GpuAcc": len(session.report.layers)}
    loaded = session.runtime.network(session.network_id)
    kinds = {lay.op_type for lay in loaded.layers}
    for step, lay in zip(loaded.steps, loaded.layers):
        if lay.op_type == "Specialized":
            kinds |= {inner.op_type for built in step.workload.built.values()
                      for inner in built.graph.layers}
    if loaded.host_runs is not None:  # the signature run whole (cuda_host.HostTail)
        kinds |= {kind for built in loaded.host_runs.built.values() if built is not None
                  for kind in built.kinds}
    assert "HostChain" in kinds and "NonMaxSuppression" not in kinds


@needs_cuda
@pytest.mark.parametrize("free", [False, True], ids=["static", "free"])
def test_resize_is_captured_on_the_gpu_not_sent_to_the_cpu(free: bool) -> None:
    dims = ("h", "w") if free else (16, 12)
    session = InferenceSession(resize_model(*dims), backends=["GpuAcc", "CpuAcc", "CpuRef"])
    reference = InferenceSession(resize_model(*dims), backends=["CpuRef"])
    sizes = [(16, 12), (10, 14)] if free else [(16, 12)]
    for height, width in sizes:
        x = np.random.default_rng(height).standard_normal((1, 3, height, width)).astype(np.float32)
        (got,), (want,) = session.run(None, {"x": x}), reference.run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
        assert (got == 7.0).any()  # the crop's extrapolated pixels
    assert session.report.counts() == {"GpuAcc": 6}
    ops = [lay.op_type for lay in session.optimized.graph.layers if lay.backend == "GpuAcc"]
    assert ops == (["Specialized"] if free else ["CudaGraph"])
    if free:  # each signature built as one CudaGraph layer, run whole with its copies
        from backplane.backends.torch.cuda_host import HostGraph

        built = session.runtime.network(session.network_id).host_runs.built
        assert len(built) == 2 and all(isinstance(g, HostGraph) for g in built.values())


@needs_cuda
def test_a_failed_capture_runs_on_the_gpu_uncaptured(monkeypatch, caplog) -> None:
    from backplane.backends.torch.kernels import vision

    # Resize's taps uploaded from pageable memory at every call, as before they were kept: the
    # warm-up runs, the capture refuses the copy
    monkeypatch.setattr(vision, "_on_device", lambda array, device: torch.from_numpy(array).to(device))
    session = InferenceSession(resize_model(), backends=["GpuAcc", "CpuAcc", "CpuRef"])
    assert session.report.counts() == {"GpuAcc": 6}  # not the whole model on CpuAcc
    assert "not captured as a CUDA graph" in caplog.text
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 12)).astype(np.float32)
    (want,) = InferenceSession(resize_model(), backends=["CpuRef"]).run(None, {"x": x})
    for _ in range(2):
        (got,) = session.run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
