"""QDQ round trips inside GpuAcc's captured subgraphs in fewer kernels (``gpu_int8.py``,
``gpu_chains.py``): a round trip of the same scale after a MaxPool or Flatten of a
DequantizeLinear is dropped (it gives back what it reads), and a round trip joins the elementwise
tree around it (resnet_qdq_ort17's Add between two round trips: three kernels, one), and a
Conv's bias is added in the tree reading its output (torch adds it after cuDNN's convolution,
a kernel of its own). The values
are the layers' own bit for bit; the steps' grouping and their values through the layers' own
kernels are checked here on the CPU, the one kernel on CUDA (skipped without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch import gpu_chains, gpu_int8  # noqa: E402
from backplane.backends.torch.kernels import quantization  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402

F32 = np.float32
KERNELS = {"QuantizeLinear": quantization.quantize_linear,
           "DequantizeLinear": quantization.dequantize_linear,
           "Add": lambda a, b: (torch.add(a, b),), "Relu": lambda x: (torch.relu(x),),
           "MaxPool": lambda x: (torch.nn.functional.max_pool2d(x, 2),),
           "AveragePool": lambda x: (torch.nn.functional.avg_pool2d(x, 2),),
           "Flatten": lambda x: (torch.flatten(x, 1),),
           "Conv": lambda x, w, b=None: (torch.nn.functional.conv2d(x, w, b),)}
CONSTANTS = {"sa": np.asarray(F32(0.037)), "za": np.asarray(np.uint8(3)),
             "sb": np.asarray(F32(0.05)), "zb": np.asarray(np.uint8(0)),
             "sc": np.asarray(F32(0.011)), "zc": np.asarray(np.int8(-5))}


def _steps(layers: list[Layer], outputs=("y",)):
    """The layers' own steps, then gpu_fusion's int8 and chain passes over them (as
    ``gpu_fusion.inner_steps`` runs them): the steps left, and the layers' own steps."""
    own = [(KERNELS[layer.op_type], layer.inputs, layer.outputs) for layer in layers]
    steps = list(own)
    uses: dict[str, int] = {}
    consumer: dict[str, int] = {}
    for index, layer in enumerate(layers):
        for name in layer.inputs:
            uses[name] = uses.get(name, 0) + 1
            consumer[name] = index
    for name in outputs:
        uses[name] = uses.get(name, 0) + 1
    sole = lambda name: consumer.get(name) if uses.get(name) == 1 else None  # noqa: E731
    gpu_int8.int8_steps(layers, steps, sole, CONSTANTS, uses)
    gpu_chains.chain_steps(layers, steps, [k for k, _, _ in own], sole, outputs, CONSTANTS)
    return [s for s in steps if s is not None], own


def _run(steps, feeds: dict[str, torch.Tensor], device: str = "cpu"):
    known = {**feeds, **{k: torch.from_numpy(v).to(device) for k, v in CONSTANTS.items()}}
    for kernel, names, outs in steps:
        known.update(zip(outs, kernel(*[known[n] if n else None for n in names])))
    return known


def _qdq(x: str, y: str, scale: str, zero: str) -> list[Layer]:
    return [Layer(f"q{y}", "QuantizeLinear", [x, scale, zero], [f"{y}_q"]),
            Layer(f"d{y}", "DequantizeLinear", [f"{y}_q", scale, zero], [y])]


# resnet_qdq_ort17's residual block's end: conv -> QDQ -> Add(skip) -> QDQ
BLOCK = [*_qdq("c", "a", "sa", "za"), Layer("add", "Add", ["a", "skip"], ["s"]),
         *_qdq("s", "y", "sb", "zb")]


def _feeds(device: str = "cpu") -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(0)
    ties = (np.arange(-64, 64, dtype=F32) + 0.5) * F32(0.037)  # rint's ties for "sa"
    c = np.concatenate([ties, rng.standard_normal(120).astype(F32) * 4,
                        F32([np.nan, np.inf, -np.inf, 1e30, -0.0, 0.0, 9.5, -9.5])])
    skip = rng.standard_normal(c.shape).astype(F32)
    skip[:128] = 0.025  # the Add's sums at the second round trip's ties too: 0.05 * k + 0.025
    return {"c": torch.from_numpy(c).to(device), "skip": torch.from_numpy(skip).to(device)}


def test_round_trips_around_an_add_are_one_step() -> None:
    kept, own = _steps(BLOCK)
    assert len(kept) == 1
    kernel, names, outs = kept[0]
    assert outs == ["y"] and names[:2] == ["c", "skip"]
    assert kernel.code.count("__fdiv_rn") == 2 and kernel.code.count("__fmul_rn") == 2
    got, want = _run(kept, _feeds()), _run(own, _feeds())  # on the CPU: the layers' own steps
    torch.testing.assert_close(got["y"], want["y"], rtol=0, atol=0, equal_nan=True)


def test_a_round_trip_read_twice_ends_the_tree() -> None:
    kept, _ = _steps(BLOCK, outputs=("y", "a"))  # "a" leaves the subgraph as well
    assert len(kept) == 2 and kept[0][2] == ["a"] and kept[1][1][:2] == ["a", "skip"]


@pytest.mark.parametrize("middle", ["MaxPool", "Flatten"])
def test_a_round_trip_after_a_maxpool_of_its_own_grid_is_dropped(middle: str) -> None:
    layers = [Layer("d0", "DequantizeLinear", ["q0", "sc", "zc"], ["x"]),
              Layer("m", middle, ["x"], ["p"]), *_qdq("p", "y", "sc", "zc")]
    kept, own = _steps(layers)
    assert [s[2] for s in kept] == [["x"], ["y"]]  # the MaxPool writes the round trip's output
    q0 = np.random.default_rng(1).integers(-128, 128, (2, 3, 6, 6), dtype=np.int8)
    q0[0, 0, 0, :2] = [-128, 127]  # the type's ends
    feeds = {"q0": torch.from_numpy(q0)}
    torch.testing.assert_close(_run(kept, feeds)["y"], _run(own, feeds)["y"], rtol=0, atol=0)


@pytest.mark.parametrize("case", ["other scale", "averaged", "no zero point"])
def test_a_round_trip_that_may_change_its_values_stays(case: str) -> None:
    zero = [] if case == "no zero point" else ["zc"]  # an int32 q0 would pass the clamp
    layers = [Layer("d0", "DequantizeLinear", ["q0", "sc", *zero], ["x"]),
              Layer("m", "AveragePool" if case == "averaged" else "MaxPool", ["x"], ["p"]),
              *_qdq("p", "y", "sa" if case == "other scale" else "sc", "zc")]
    kept, _ = _steps(layers)
    assert len(kept) == 3 and kept[2][1][0] == "p"  # the pool, then the round trip (one step)


CONV = [Layer("conv", "Conv", ["x", "w", "bias"], ["c"]), *BLOCK]


def _conv_feeds(device: str = "cpu") -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 3, 6, 6)).astype(F32)
    x[0, 0, 0, 0] = np.nan
    skip = rng.standard_normal((1, 4, 4, 4)).astype(F32)
    return {"x": torch.from_numpy(x).to(device), "skip": torch.from_numpy(skip).to(device)}


def test_a_conv_s_bias_is_added_in_the_tree_reading_its_output() -> None:
    rng = np.random.default_rng(3)
    CONSTANTS.update(w=rng.standard_normal((4, 3, 3, 3)).astype(F32),
                     bias=rng.standard_normal(4).astype(F32))
    kept, own = _steps(CONV)
    assert [s[1][:3] for s in kept] == [["x", "w", ""], ["c", "bias", "skip"]]
    assert "b1 = (float)in0 + (float)in1;" in kept[1][0].code
    got, want = _run(kept, _conv_feeds()), _run(own, _conv_feeds())  # the layers' own steps
    torch.testing.assert_close(got["y"], want["y"], rtol=0, atol=0, equal_nan=True)
    kept, _ = _steps(CONV, outputs=("y", "c"))  # the Conv's output leaves: it keeps its bias
    assert kept[0][1] == ["x", "w", "bias"]


def _centred_steps():
    """Add -> Relu -> QuantizeLinear whose integers, less their zero point, a QLinearConv reads
    (resnet_qlinear_ort15's blocks; the step ``gpu_int8._int8_chains`` makes for it)."""
    layers = [Layer("add", "Add", ["c", "skip"], ["s"]), Layer("r", "Relu", ["s"], ["r"]),
              Layer("q", "QuantizeLinear", ["r", "sc", "zc"], ["y"])]
    own = [KERNELS[layer.op_type] for layer in layers]
    centred = gpu_int8._quantize_centred(own[2], 0.011, -5.0, -128, 127)
    steps = [(k, layer.inputs, layer.outputs) for k, layer in zip(own, layers)]
    steps[2] = (centred, layers[2].inputs, layers[2].outputs)
    sequential = list(steps)
    sole = {"s": 1, "r": 2}.get
    gpu_chains.chain_steps(layers, steps, own, sole, ["y"], CONSTANTS)
    return [s for s in steps if s is not None], sequential


def test_a_quantize_for_a_product_joins_the_tree_before_it(on_cpu) -> None:
    kept, sequential = _centred_steps()
    assert len(kept) == 1 and kept[0][1][:2] == ["c", "skip"] and kept[0][2] == ["y"]
    assert "rintf(__fdiv_rn(" in kept[0][0].code
    got, want = _run(kept, _feeds()), _run(sequential, _feeds())  # the layers' own steps
    assert got["y"].dtype == torch.float32
    torch.testing.assert_close(got["y"], want["y"], rtol=0, atol=0, equal_nan=True)


@pytest.fixture
def on_cpu(monkeypatch):
    from backplane.backends.torch import gpu_qlinear

    monkeypatch.setattr(gpu_qlinear, "on_gpu", lambda tensor: True)  # the float32 form here


# -- on a GPU ----------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@cuda
def test_on_cuda_the_block_is_one_kernel_and_the_layers_values() -> None:
    kept, own = _steps(BLOCK)
    got = _run(kept, _feeds("cuda"), "cuda")["y"]
    want = _run(own, _feeds(), "cpu")["y"]  # the layers' own kernels, on the CPU
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    feeds = _feeds("cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _run(kept, feeds, "cuda")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    assert len(kernels) == 1, kernels


@cuda
def test_on_cuda_a_conv_s_bias_in_the_tree_is_the_layers_values() -> None:
    rng = np.random.default_rng(3)
    CONSTANTS.update(w=rng.standard_normal((4, 3, 3, 3)).astype(F32),
                     bias=rng.standard_normal(4).astype(F32))
    kept, own = _steps(CONV)
    got = _run(kept, _conv_feeds("cuda"), "cuda")["y"]
    want = _run(own, _conv_feeds("cuda"), "cuda")["y"]  # cuDNN's convolution, then the bias
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@cuda
def test_on_cuda_a_quantize_for_a_product_in_the_tree_is_its_kernel_s() -> None:
    kept, sequential = _centred_steps()
    got = _run(kept, _feeds("cuda"), "cuda")["y"]
    want = _run(sequential, _feeds("cuda"), "cuda")["y"]  # Add, Relu, QUANTIZE_CENTRED's kernel
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
