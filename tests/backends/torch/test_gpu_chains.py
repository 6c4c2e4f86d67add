"""Trees of elementwise layers as one CUDA kernel (``backends/torch/gpu_chains.py``): which
layers group, the code written, the layers' own steps where the kernel cannot run (here, on the
CPU), and on CUDA one kernel giving the layers' values within float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch import gpu_chains  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402

OPS = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div, "Erf": torch.erf,
       "Tanh": torch.tanh, "Sqrt": torch.sqrt, "Pow": torch.pow, "Sigmoid": torch.sigmoid,
       "Clip": torch.clamp, "Relu": torch.relu,
       "HardSigmoid": lambda x: torch.clamp(x * 0.2 + 0.5, 0, 1), "Where": torch.where}
F32 = np.float32


def _steps(layers: list[Layer], constants: dict[str, np.ndarray], outputs=("y",)):
    """Each layer's step (torch's op, constants as 0-d tensors), grouped by chain_steps."""
    kernels = [(lambda op: lambda *v: (OPS[op](*v),))(layer.op_type) for layer in layers]
    steps = [(k, layer.inputs, layer.outputs) for k, layer in zip(kernels, layers)]
    readers: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        for name in layer.inputs:
            readers.setdefault(name, []).append(i)
    for name in outputs:
        readers.setdefault(name, []).append(-1)
    sole = lambda name: readers[name][0] if len(readers.get(name, [])) == 1 else None  # noqa: E731
    gpu_chains.chain_steps(layers, steps, kernels, sole, outputs, constants)
    return [s for s in steps if s is not None], steps


def _run(steps, feeds: dict[str, torch.Tensor], constants: dict[str, np.ndarray], device="cpu"):
    known = {**feeds, **{k: torch.from_numpy(v).to(device) for k, v in constants.items()}}
    for kernel, names, outs in steps:
        known.update(zip(outs, kernel(*[known[n] for n in names])))
    return known


GELU = [Layer("d", "Div", ["x", "sqrt2"], ["d"]), Layer("e", "Erf", ["d"], ["e"]),
        Layer("a", "Add", ["e", "one"], ["a"]), Layer("m", "Mul", ["x", "a"], ["m"]),
        Layer("h", "Mul", ["m", "half"], ["g"]),
        # a LayerNorm's tail after it: (g - mean) / std * gamma + beta
        Layer("s", "Sub", ["g", "mean"], ["c"]), Layer("v", "Div", ["c", "std"], ["n"]),
        Layer("w", "Mul", ["n", "gamma"], ["w"]), Layer("b", "Add", ["w", "beta"], ["y"])]
CONSTANTS = {"sqrt2": np.asarray(F32(1.4142135)), "one": np.asarray(F32(1)),
             "half": np.asarray(F32(0.5)), "gamma": np.linspace(0.5, 2, 16, dtype=F32),
             "beta": np.linspace(-1, 1, 16, dtype=F32)}


TREES = {  # other exported activations: hard-swish at opset 11, SiLU, x * hard_sigmoid(x)
    "hardswish": [Layer("a", "Add", ["x", "three"], ["a"]), Layer("c", "Clip", ["a", "zero", "six"],
                                                                   ["c"]),
                  Layer("m", "Mul", ["x", "c"], ["m"]), Layer("d", "Div", ["m", "six"], ["y"])],
    "silu": [Layer("s", "Sigmoid", ["x"], ["s"]), Layer("m", "Mul", ["x", "s"], ["r"]),
             Layer("r", "Relu", ["r"], ["y"])],
    "hardsigmoid": [Layer("h", "HardSigmoid", ["x"], ["h"]), Layer("m", "Mul", ["h", "x"], ["y"])]}
CONSTANTS.update(three=np.asarray(F32(3)), zero=np.asarray(F32(0)), six=np.asarray(F32(6)))


def _sequential(layers: list[Layer]):
    return [((lambda op: lambda *v: (OPS[op](*v),))(layer.op_type), layer.inputs, layer.outputs)
            for layer in layers]


@pytest.mark.parametrize("tree", TREES)
def test_other_activations_are_one_step(tree: str) -> None:
    kept, _ = _steps(TREES[tree], CONSTANTS)
    assert len(kept) == 1 and kept[0][1][0] == "x"
    fused, sequential = (_run(s, _feeds(), CONSTANTS) for s in (kept, _sequential(TREES[tree])))
    torch.testing.assert_close(fused["y"], sequential["y"], rtol=0, atol=0, equal_nan=True)


def _feeds(device: str = "cpu") -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 16)).astype(F32) * 3
    x[0, 0, :3] = [np.nan, np.inf, -np.inf]
    return {"x": torch.from_numpy(x).to(device),
            "mean": torch.from_numpy(rng.standard_normal((3, 5, 1)).astype(F32)).to(device),
            "std": torch.from_numpy(rng.random((3, 5, 1)).astype(F32) + 0.5).to(device)}


def test_a_gelu_and_a_layernorm_tail_are_one_step() -> None:
    kept, _ = _steps(GELU, CONSTANTS)
    assert len(kept) == 1
    kernel, names, outs = kept[0]
    assert outs == ["y"] and names[:5] == ["x", "mean", "std", "gamma", "beta"]
    assert "erff(" in kernel.code and f"{float(F32(1.4142135)).hex()}f" in kernel.code
    sequential = _run([(k, layer.inputs, layer.outputs) for k, layer in zip(
        [(lambda op: lambda *v: (OPS[op](*v),))(layer.op_type) for layer in GELU], GELU)],
        _feeds(), CONSTANTS)
    fused = _run(kept, _feeds(), CONSTANTS)  # on the CPU: the layers' own steps
    torch.testing.assert_close(fused["y"], sequential["y"], rtol=0, atol=0, equal_nan=True)


def test_a_value_read_twice_or_read_outside_ends_a_tree() -> None:
    layers = [Layer("t", "Tanh", ["x"], ["t"]), Layer("a", "Add", ["t", "t"], ["a"]),
              Layer("s", "Sqrt", ["a"], ["s"]), Layer("p", "Pow", ["s", "two"], ["y"])]
    kept, steps = _steps(layers, {"two": np.asarray(F32(2))}, outputs=("y", "s"))
    assert steps[0] is not None  # t is read twice (by one layer): not folded into the Add
    assert steps[2] is not None  # s leaves the subgraph: its tree ends there
    assert [len(s[1]) for s in kept] == [1, 1, 2]  # Tanh; Add+Sqrt over t; Pow over s (and "two")
    kept, _ = _steps(layers[:3] + [Layer("p", "Pow", ["s", "x"], ["y"])], {})
    assert len(kept) == 3  # a Pow by a tensor is no elementwise layer here


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
def test_on_cuda_a_tree_is_one_kernel_within_rounding_of_the_layers() -> None:
    from torch.profiler import ProfilerActivity, profile

    kept, _ = _steps(GELU, CONSTANTS)
    sequential = _run([(k, layer.inputs, layer.outputs) for k, layer in zip(
        [(lambda op: lambda *v: (OPS[op](*v),))(layer.op_type) for layer in GELU], GELU)],
        _feeds("cuda"), CONSTANTS, "cuda")
    fused = _run(kept, _feeds("cuda"), CONSTANTS, "cuda")
    assert fused["y"].dtype == torch.float32 and fused["y"].shape == (3, 5, 16)
    torch.testing.assert_close(fused["y"], sequential["y"], rtol=1e-6, atol=1e-6, equal_nan=True)
    edge = fused["y"][0, 0, :3].tolist()  # NaN in, NaN out; GELU(-inf) is -inf * 0
    assert np.isnan(edge[0]) and edge[1] == np.inf and np.isnan(edge[2])
    known = {**_feeds("cuda"), **{k: torch.from_numpy(v).cuda() for k, v in CONSTANTS.items()}}
    kernel, names, _ = kept[0]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        kernel(*[known[n] for n in names])  # gamma and beta read, the scalars in the code
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


@cuda
@pytest.mark.parametrize("tree", TREES)
def test_on_cuda_other_activations_are_the_layers_within_rounding(tree: str) -> None:
    kept, _ = _steps(TREES[tree], CONSTANTS)
    fused, sequential = (_run(s, _feeds("cuda"), CONSTANTS, "cuda")
                         for s in (kept, _sequential(TREES[tree])))
    assert len(kept) == 1 and "backplane_ew" in kept[0][0].code
    torch.testing.assert_close(fused["y"], sequential["y"], rtol=1e-6, atol=1e-6, equal_nan=True)


@cuda
def test_an_exported_gelu_on_gpuacc_is_cpuref_s(tmp_path) -> None:
    from onnx import TensorProto, helper, numpy_helper

    from backplane import InferenceSession
    from tests.conftest import make_model

    inits = [numpy_helper.from_array(v, k) for k, v in CONSTANTS.items()]
    info = helper.make_tensor_value_info
    nodes = [helper.make_node(layer.op_type, layer.inputs, layer.outputs) for layer in GELU]
    model = make_model(nodes, [info(n, TensorProto.FLOAT, s) for n, s in
                               (("x", [3, 5, 16]), ("mean", [3, 5, 1]), ("std", [3, 5, 1]))],
                       [info("y", TensorProto.FLOAT, [3, 5, 16])], inits)
    path = tmp_path / "gelu.onnx"
    path.write_bytes(model.SerializeToString())
    feeds = {k: v.numpy() for k, v in _feeds().items()}
    want = InferenceSession(str(path), providers=["CpuRef"]).run(None, feeds)[0]
    session = InferenceSession(str(path), providers=[("GpuAcc", {"against_cpu": "off"}), "CpuRef"])
    assert set(session.report.counts()) == {"GpuAcc"}
    for _ in range(2):  # the second a replay of the captured graph
        got = session.run(None, feeds)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tree", ["gelu", *TREES])
def test_on_cuda_a_half_tree_is_one_kernel_and_the_layers_per_layer_rounding(tree, dtype) -> None:
    """Each layer computed in float and rounded to the type, as torch's half kernels: the
    layers' own values but where a constant divisor is taken as its reciprocal (GELU's 1/sqrt2,
    hard-swish's 1/6 in torch), an ulp of the type there (which the LayerNorm tail's
    subtraction and division carry on: within a few ulps of the output's largest value)."""
    from torch.profiler import ProfilerActivity, profile

    layers = GELU if tree == "gelu" else TREES[tree]
    constants = {k: v.astype(np.float16) if v.ndim == 0 else v for k, v in CONSTANTS.items()}
    kept, _ = _steps(layers, constants)
    feeds = {k: v.to(dtype) for k, v in _feeds("cuda").items()}
    known = {**feeds, **{k: torch.from_numpy(v).cuda().to(dtype) for k, v in constants.items()}}
    fused = dict(known)  # every tensor of the type (GELU's gamma and beta too)
    for kernel, names, outs in kept:
        fused.update(zip(outs, kernel(*[fused[n] for n in names])))
    fused = fused["y"]
    sequential = dict(known)
    for kernel, names, outs in _sequential(layers):
        sequential.update(zip(outs, kernel(*[sequential[n] for n in names])))
    assert fused.dtype == dtype
    ulp = 2.0 ** (-10 if dtype == torch.float16 else -7)
    want = sequential["y"]
    scale = float(want[torch.isfinite(want)].abs().max())  # an ulp early, the LayerNorm's
    torch.testing.assert_close(fused, want, rtol=ulp, atol=4 * ulp * scale, equal_nan=True)
    kernel, names, _ = kept[0]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        kernel(*[known[n] for n in names])
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels


MASKED = [Layer("m", "Mul", ["x", "scale"], ["m"]), Layer("w", "Where", ["mask", "low", "m"], ["y"])]
"""An exported attention's scale and causal mask: Where(mask, -inf, scores * scale)."""


def _masked(low: float) -> dict[str, np.ndarray]:
    mask = np.random.default_rng(1).random((1, 5, 16)) > 0.5
    return {"scale": np.asarray(F32(0.125)), "low": np.asarray(F32(low)), "mask": mask}


@pytest.mark.parametrize("low", [-np.inf, -1e4])  # -inf a tensor of the kernel, -1e4 a literal
def test_a_scale_and_a_constant_mask_s_where_are_one_step(low: float) -> None:
    constants = _masked(low)
    kept, _ = _steps(MASKED, constants)
    assert len(kept) == 1 and kept[0][1][:2] == ["x", "mask"]
    assert ("T in2" in kept[0][0].code) == (low == -np.inf)  # a third tensor, or a literal
    fused, sequential = (_run(s, _feeds(), constants) for s in (kept, _sequential(MASKED)))
    torch.testing.assert_close(fused["y"], sequential["y"], rtol=0, atol=0, equal_nan=True)


def test_a_where_of_a_computed_or_tensor_condition_is_its_own_step() -> None:
    constants = _masked(-np.inf)
    computed = [MASKED[0], Layer("w", "Where", ["c", "low", "m"], ["y"])]
    assert len(_steps(computed, constants)[0]) == 2  # the condition is a value of the run
    ints = {**constants, "mask": constants["mask"].astype(np.int64)}
    assert len(_steps(MASKED, ints)[0]) == 2  # Where's condition is boolean


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("low", [-np.inf, -1e4])
def test_on_cuda_a_masked_scale_is_one_kernel_and_the_layers_values(low, dtype) -> None:
    """Exact: the product rounded once to the type and a selection, as the two layers' kernels;
    the condition made the tree's type at the first call and kept, so a later call (a captured
    graph's replay) launches the one kernel alone."""
    from torch.profiler import ProfilerActivity, profile

    constants = _masked(low)
    kept, _ = _steps(MASKED, constants)
    feeds = {k: v.to(dtype) for k, v in _feeds("cuda").items()}
    known = {**feeds, **{k: torch.from_numpy(v).cuda() for k, v in constants.items()}}
    known = {k: v.to(dtype) if v.dtype == torch.float32 else v for k, v in known.items()}
    kernel, names, _ = kept[0]
    (fused,) = kernel(*[known[n] for n in names])
    want = torch.where(known["mask"], known["low"], known["x"] * known["scale"])
    assert fused.dtype == dtype and fused.shape == want.shape
    torch.testing.assert_close(fused, want, rtol=0, atol=0, equal_nan=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        kernel(*[known[n] for n in names])
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and kernels[0].startswith("backplane_ew"), kernels
