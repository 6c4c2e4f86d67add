"""GpuAcc's attention fusion (``gpu_fusion.py``), checked on the CPU: the steps a captured
subgraph runs, built as GpuAcc builds them, run on CPU tensors (torch's scaled_dot_product_attention
runs there too). The GPU tests run the same models on CUDA."""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.registry import registry  # noqa: E402
from backplane.backends.torch import cuda  # noqa: E402
from backplane.backends.torch import gpu_fusion as gpu  # noqa: E402
from backplane.frontends.onnx import import_onnx  # noqa: E402
from backplane.optimizer import passes  # noqa: E402
from tests.models.test_models import DATA  # noqa: E402

BLOCKS = {"tiny_bert": 2, "tiny_gpt2": 2}  # attention blocks: one per transformer layer


@pytest.fixture(autouse=True)
def _attention_alone(monkeypatch):
    """The steps counted here are the attention fusion's alone: the elementwise trees
    (``gpu_chains``) would fold the unfused blocks' scale and mask too."""
    monkeypatch.setattr(gpu, "chain_steps", lambda *args: None)


def _graph(name: str):
    graph = import_onnx(DATA / f"{name}.onnx")
    graph = graph[0] if isinstance(graph, tuple) else graph
    return passes.remove_dead_layers(passes.fold_constants(graph))


def _run(name: str, options: dict) -> tuple[list[np.ndarray], int, int]:
    """The folded model's layers as GpuAcc's steps on the CPU: outputs, steps, fused calls made."""
    graph = _graph(name)
    acc = registry.create("CpuAcc")
    backend = types.SimpleNamespace(kernel_for=acc.kernel_for, options=options)
    steps = gpu.inner_steps(graph.layers, backend, graph.outputs, graph.constants)
    env = cuda._upload(graph.layers, dict(graph.constants), torch.device("cpu"))
    feeds = dict(np.load(DATA / f"{name}.npz"))
    env.update({n: torch.from_numpy(feeds[n]) for n in graph.inputs})
    calls = [0]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return sdpa(*args, **kwargs)

    torch.nn.functional.scaled_dot_product_attention = counted
    try:
        for workload, names_in, names_out in steps:
            env.update(zip(names_out, workload(*[env[n] if n else None for n in names_in])))
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
    return [env[n].numpy() for n in graph.outputs], len(steps), calls[0]


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_attention_blocks_become_one_call_with_the_same_answer(name: str) -> None:
    """With TF32 allowed, each exported attention block (MatMul, scale, mask Add, Softmax, [Cast,]
    MatMul) is one scaled_dot_product_attention call, five or six steps fewer, the same outputs."""
    plain, plain_steps, plain_calls = _run(name, {"GpuAcc.tf32": True, "GpuAcc.fuse_attention": False})
    fused, fused_steps, fused_calls = _run(name, {"GpuAcc.tf32": True})
    assert plain_calls == 0 and fused_calls == BLOCKS[name]
    assert plain_steps - fused_steps >= 4 * BLOCKS[name], (plain_steps, fused_steps)
    for got, want in zip(fused, plain):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_strict_float32_keeps_the_layers(name: str) -> None:
    """fp32 means fp32: without TF32 or a reduced precision the fused kernels (which may multiply in
    TF32 on a GPU) are not used."""
    _, plain_steps, calls = _run(name, {})
    _, fused_steps, _ = _run(name, {"GpuAcc.fuse_attention": False})
    assert calls == 0 and plain_steps == fused_steps


def test_the_fused_call_declines_what_it_would_compute_otherwise() -> None:
    """A mask that would enlarge the scores, batch dimensions the MatMuls broadcast, or mixed types:
    the fused call is not made (the layers' own kernels run)."""
    q, kt, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 4, 8)
    assert gpu._sdpa_shapes(q, kt, v, torch.zeros(1, 1, 4, 4))
    assert gpu._sdpa_shapes(q, kt, v, None)
    assert not gpu._sdpa_shapes(q, kt, v, torch.zeros(3, 2, 4, 4))  # enlarges the scores
    assert not gpu._sdpa_shapes(q, kt[:, :1], v, None)  # K broadcast over heads
    assert not gpu._sdpa_shapes(q, kt, v.double(), None)  # mixed types
    assert not gpu._sdpa_shapes(q, kt, v, torch.zeros(1, 1, 4, 4, dtype=torch.float64))
