"""GpuAcc's exported LayerNorms as one LayerNormalization layer inside a captured subgraph
(``backends/torch/gpu_layernorm.py``): which chains become one, checked without a GPU on the
corpus's opset-15 GPT and opset-14 tagger at their samples' shapes, the fused subgraph's steps run
on the CPU against ONNX Runtime; the sessions against CpuRef need CUDA."""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import import_onnx  # noqa: E402
from backplane.backends.registry import registry  # noqa: E402
from backplane.backends.torch import cuda  # noqa: E402
from backplane.ir.graph import SubgraphView  # noqa: E402
from backplane.optimizer import passes  # noqa: E402
from tests.backends.torch.gpu_corpus import CORPUS, gpuacc_matches_cpuref  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
NORMS = {"gpt_causal_ts15": 5, "char_tagger_ts14": 8}


def _static(name: str) -> onnx.ModelProto:
    """The corpus model with its inputs fixed to its first sample's shapes."""
    model = onnx.load(CORPUS / f"{name}.onnx")
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    for value in model.graph.input:
        for dim, size in zip(value.type.tensor_type.shape.dim, feeds[value.name].shape):
            dim.ClearField("dim_param")
            dim.dim_value = size
    return model


def _captured(name: str):
    graph = passes.remove_dead_layers(passes.fold_constants(import_onnx(_static(name))))
    views = cuda.capture_views(SubgraphView.of(graph, graph.layers), None)
    assert views.untouched == []  # the whole model captured: its steps are the run
    return graph, [sub.replacement[0] for sub in views.substitutions]


@pytest.mark.parametrize("name", sorted(NORMS))
def test_each_exported_layernorm_is_one_layer_in_the_graph(name: str) -> None:
    _, captured = _captured(name)
    ops = [lay.op_type for layer in captured for lay in layer.attrs["layers"]]
    assert ops.count("LayerNormalization") == NORMS[name]
    assert "ReduceMean" not in ops and "Sqrt" not in ops


@pytest.mark.parametrize("name", sorted(NORMS))
def test_the_fused_steps_give_onnx_runtimes_values(name: str) -> None:
    """The CudaGraph layers' steps (GpuAcc's fusions, CpuAcc's kernels) run on the CPU in order."""
    graph, captured = _captured(name)
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    env = {n: torch.from_numpy(feeds[n]) for n in graph.inputs}
    backend = types.SimpleNamespace(kernel_for=registry.create("CpuAcc").kernel_for, options={})
    for layer in captured:
        inner = layer.attrs["layers"]
        env.update(cuda._upload(inner, dict(layer.attrs["constants"]), torch.device("cpu")))
        for work, names_in, names_out in cuda.inner_steps(inner, backend, layer.attrs["outputs"],
                                                          layer.attrs["constants"]):
            env.update(zip(names_out, work(*[env[n] if n else None for n in names_in])))
    want = ort.InferenceSession(_static(name).SerializeToString()).run(None, feeds)
    for out, expected in zip(graph.outputs, want):
        np.testing.assert_allclose(env[out].numpy(), expected, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("name", sorted(NORMS))
def test_gpuacc_with_the_fused_norms_matches_cpuref(name: str) -> None:
    gpuacc_matches_cpuref(name, 1e-4)
