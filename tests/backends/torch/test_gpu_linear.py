"""A MatMul by a constant matrix and the Add of its constant bias as one addmm inside a captured
subgraph (``backends/torch/gpu_linear.py``): which pairs join, the values against the two layers'
kernels (on the CPU; the fused form runs on any device), the layers' kernels where the values do
not fit, the corpus transformers' captured steps against ONNX Runtime, and on CUDA the sessions
against CpuRef."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import import_onnx  # noqa: E402
from backplane.backends.registry import registry  # noqa: E402
from backplane.backends.torch import cuda, gpu_linear  # noqa: E402
from backplane.ir.graph import Layer, SubgraphView  # noqa: E402
from backplane.optimizer import passes  # noqa: E402
from tests.backends.torch.gpu_corpus import gpuacc_matches_cpuref  # noqa: E402
from tests.backends.torch.test_gpu_layernorm import _static  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
F32 = np.float32
RNG = np.random.default_rng(7)
W = RNG.standard_normal((16, 24)).astype(F32)
BIAS = RNG.standard_normal(24).astype(F32)


def _matmul(A, B):  # noqa: N803
    return (torch.matmul(A, B),)


def _add(A, B):  # noqa: N803
    return (torch.add(A, B),)


def _steps(layers: list[Layer], constants: dict[str, np.ndarray], outputs=("y",)):
    """Each layer's own step (MatMul, Add, Relu), then ``linear_steps``."""
    kernels = [{"MatMul": _matmul, "Add": _add, "Relu": lambda x: (torch.relu(x),)}[lay.op_type]
               for lay in layers]
    steps = [(k, lay.inputs, lay.outputs) for k, lay in zip(kernels, layers)]
    readers: dict[str, list[int]] = {}
    for i, lay in enumerate(layers):
        for name in lay.inputs:
            readers.setdefault(name, []).append(i)
    for name in outputs:
        readers.setdefault(name, []).append(-1)
    sole = lambda name: readers[name][0] if len(readers.get(name, [])) == 1 else None  # noqa: E731
    gpu_linear.linear_steps(layers, steps, kernels, sole, constants)
    return [s for s in steps if s is not None]


def _run(steps, feeds: dict[str, np.ndarray], constants: dict[str, np.ndarray]):
    known = {k: torch.from_numpy(v) for k, v in {**feeds, **constants}.items()}
    for kernel, names, outs in steps:
        known.update(zip(outs, kernel(*[known[n] for n in names])))
    return known


LINEAR = [Layer("m", "MatMul", ["x", "w"], ["p"]), Layer("a", "Add", ["p", "b"], ["y"])]


@pytest.mark.parametrize("bias_shape", [(24,), (1, 24), (1, 1, 24)])
@pytest.mark.parametrize("order", ["product first", "bias first"])
def test_a_matmul_and_its_bias_are_one_step_with_the_layers_values(bias_shape, order) -> None:
    layers = LINEAR if order == "product first" else \
        [LINEAR[0], Layer("a", "Add", ["b", "p"], ["y"])]
    constants = {"w": W, "b": BIAS.reshape(bias_shape)}
    steps = _steps(layers, constants)
    assert len(steps) == 1 and getattr(steps[0][0], "code", "") == gpu_linear.CODE
    x = RNG.standard_normal((2, 5, 16)).astype(F32)
    x[0, 1, 3] = np.nan  # NaN in, NaN out: its row of the product
    got = _run(steps, {"x": x}, constants)["y"].numpy()
    want = x @ W + BIAS.reshape(bias_shape) if order == "product first" else \
        BIAS.reshape(bias_shape) + x @ W
    assert got.shape == want.shape and got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.isnan(got[0, 1]).all() and not np.isnan(got[1]).any()


def test_a_float16_linear_layer_is_one_product_within_its_rounding() -> None:
    """An fp16 export's (gpt_fp16_dyn19's) weights and bias: the product adds the bias to its
    float sums and rounds once, where the layers rounded the product, then the sum."""
    constants = {"w": W.astype(np.float16), "b": BIAS.astype(np.float16)}
    steps = _steps(LINEAR, constants)
    x = RNG.standard_normal((6, 16)).astype(np.float16)
    w, b = (torch.from_numpy(constants[n]) for n in ("w", "b"))
    assert gpu_linear.fits(torch.from_numpy(x), w, b)
    got = _run(steps, {"x": x}, constants)["y"].numpy()
    want = x.astype(np.float64) @ W.astype(np.float16).astype(np.float64) \
        + BIAS.astype(np.float16).astype(np.float64)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-2)


def test_pairs_that_are_not_a_linear_layer_keep_their_steps() -> None:
    cases = {
        "bias not constant": ({"w": W}, LINEAR),
        "weight not constant": ({"b": BIAS}, LINEAR),
        "bias of another length": ({"w": W, "b": BIAS[:1]}, LINEAR),
        "bias widening the product": ({"w": W, "b": np.tile(BIAS, (2, 1))}, LINEAR),
        "product read twice": ({"w": W, "b": BIAS},
                               [*LINEAR, Layer("r", "Relu", ["p"], ["z"])]),
    }
    for what, (constants, layers) in cases.items():
        steps = _steps(layers, constants, outputs=("y", "z"))
        assert len(steps) == len(layers), what


def test_the_layers_kernels_run_where_the_values_do_not_fit() -> None:
    """One row (addmm would copy the bias and run a product: no kernel saved), a bias of more
    dimensions than the product (Add widens it), another type: the MatMul's and Add's own
    kernels, their values exactly."""
    steps = _steps(LINEAR, {"w": W, "b": BIAS})
    fused = steps[0][0]
    w, b = torch.from_numpy(W), torch.from_numpy(BIAS)
    row = torch.from_numpy(RNG.standard_normal((1, 16)).astype(F32))
    assert not gpu_linear.fits(row, w, b)
    assert torch.equal(fused(row, w, b)[0], torch.matmul(row, w) + b)
    wide = b.reshape(1, 1, 1, 24)
    x = torch.from_numpy(RNG.standard_normal((5, 16)).astype(F32))
    assert not gpu_linear.fits(x, w, wide)
    assert fused(x, w, wide)[0].shape == (1, 1, 5, 24)
    assert torch.equal(fused(x, w, wide)[0], torch.matmul(x, w) + wide)
    assert not gpu_linear.fits(x.double(), w.double(), b)


NAMES = {"gpt_causal_ts15": 4, "char_tagger_ts14": 13}
"""Corpus transformers and their linear layers joined at the first sample's shapes (the QKV and
first MLP products of each block; the tagger's every projection but those its trees take)."""


def _captured(name: str):
    graph = passes.remove_dead_layers(passes.fold_constants(import_onnx(_static(name))))
    views = cuda.capture_views(SubgraphView.of(graph, graph.layers), None)
    assert views.untouched == []
    return graph, [sub.replacement[0] for sub in views.substitutions]


@pytest.mark.parametrize("name", sorted(NAMES))
def test_corpus_transformers_steps_give_onnx_runtimes_values(name: str) -> None:
    """The captured layers' steps (GpuAcc's fusions, CpuAcc's kernels) on the CPU, in order."""
    from tests.backends.torch.gpu_corpus import CORPUS

    graph, captured = _captured(name)
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    env = {n: torch.from_numpy(feeds[n]) for n in graph.inputs}
    backend = types.SimpleNamespace(kernel_for=registry.create("CpuAcc").kernel_for, options={})
    joined = 0
    for layer in captured:
        inner = layer.attrs["layers"]
        env.update(cuda._upload(inner, dict(layer.attrs["constants"]), torch.device("cpu")))
        for work, names_in, names_out in cuda.inner_steps(inner, backend, layer.attrs["outputs"],
                                                          layer.attrs["constants"]):
            joined += getattr(work, "code", "") == gpu_linear.CODE
            env.update(zip(names_out, work(*[env[n] if n else None for n in names_in])))
    assert joined == NAMES[name]
    want = ort.InferenceSession(_static(name).SerializeToString()).run(None, feeds)
    for out, expected in zip(graph.outputs, want):
        np.testing.assert_allclose(env[out].numpy(), expected, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("name", sorted(NAMES))
def test_gpuacc_with_the_joined_products_matches_cpuref(name: str) -> None:
    gpuacc_matches_cpuref(name, 1e-4)
