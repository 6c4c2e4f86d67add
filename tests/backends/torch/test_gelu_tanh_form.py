"""The tanh GELU on CpuAcc's CPU float32 path is x * sigmoid(2u) (kernels/common.py: torch's CPU tanh
is the slow part of F.gelu's tanh form): the values of the ONNX graph 0.5 x (1 + tanh(u)), its NaN
and infinities, in a trace too, and end to end against ONNX Runtime on an exported GPT-style MLP."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.backends.torch.kernels import common  # noqa: E402

SIZES = (1, 7, 16, 17, 1000, 4096, 20000)  # from 4096: the sigmoid form


def _onnx_graph(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) in float64, as the exported graph reads."""
    d = x.double()
    return 0.5 * d * (1 + torch.tanh(math.sqrt(2 / math.pi) * (d + 0.044715 * d ** 3)))


def _with_specials(n: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal(n) * 4).float()
    where = rng.choice(n, size=max(1, n // 5), replace=False)
    x[where[0::5]] = math.inf
    x[where[1::5]] = -math.inf
    x[where[2::5]] = math.nan
    x[where[3::5]] = 3e19  # its cube overflows float32: x itself
    x[where[4::5]] = -3e19  # -0.0
    return x


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_tanh_gelu_gives_the_graphs_values(layout: str, threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in SIZES:
            x = _with_specials(n, n)
            if layout == "strided":
                x = torch.stack([x, x], 1)[:, 0]
            kept = x.clone()
            y = common.gelu(x, approximate="tanh")
            want = _onnx_graph(x)
            np.testing.assert_array_equal(x.numpy(), kept.numpy())  # the input untouched
            assert torch.equal(torch.isnan(y), torch.isnan(want)), n  # NaN, and -Inf: -inf * 0
            assert torch.equal(torch.isinf(y), torch.isinf(want)), n
            assert torch.equal(y[torch.isinf(y)], want[torch.isinf(want)].float()), n
            finite = torch.isfinite(want)
            np.testing.assert_allclose(y[finite].double().numpy(), want[finite].numpy(),
                                       rtol=2e-6, atol=1e-6)
    finally:
        torch.set_num_threads(before)


def test_a_trace_holds_sigmoid_not_tanh() -> None:
    """The traced form: no aten::gelu or tanh (torch's slow CPU tanh), and its one tensor constant
    float32 (a Python float would be a double tensor cast at every run)."""
    traced = torch.jit.trace(lambda t: common.gelu(t * 1.0, approximate="tanh"),
                             (torch.ones(common.GELU_TANH_SIGMOID_FROM),))
    kinds = [node.kind() for node in traced.graph.nodes()]
    assert "aten::gelu" not in kinds and "aten::tanh" not in kinds
    assert "aten::sigmoid_" in kinds
    constants = [node.output().toIValue() for node in traced.graph.nodes()
                 if node.kind() == "prim::Constant" and node.output().type().kind() == "TensorType"]
    assert all(c.dtype == torch.float32 for c in constants if isinstance(c, torch.Tensor))
    x = _with_specials(common.GELU_TANH_SIGMOID_FROM, 3)
    np.testing.assert_array_equal(traced(x).numpy(), common.gelu(x, approximate="tanh").numpy())


def test_float64_and_small_tensors_stay_torchs() -> None:
    """Below GELU_TANH_SIGMOID_FROM values torch's one kernel is the faster: a trace holds it."""
    x = torch.randn(100, dtype=torch.float64)
    assert torch.equal(common.gelu(x, approximate="tanh"),
                       torch.nn.functional.gelu(x, approximate="tanh"))
    small = torch.ones(1000)  # a small GPT's (16 tokens x 64)
    assert small.numel() < common.GELU_TANH_SIGMOID_FROM
    traced = torch.jit.trace(lambda t: common.gelu(t * 1.0, approximate="tanh"), (small,))
    kinds = [node.kind() for node in traced.graph.nodes()]
    assert "aten::gelu" in kinds and "aten::sigmoid_" not in kinds


def test_an_exported_tanh_gelu_mlp_against_onnx_runtime(tmp_path) -> None:
    """A GPT block's MLP (Linear -> tanh GELU written out by the TorchScript exporter -> Linear) on
    CpuAcc, against ONNX Runtime and CpuRef, NaN rows included."""
    ort = pytest.importorskip("onnxruntime")
    import backplane

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(approximate="tanh"),
                              torch.nn.Linear(128, 32)).eval()
    path = tmp_path / "mlp.onnx"
    torch.onnx.export(mlp, (torch.randn(1, 16, 32),), str(path), opset_version=15,
                      input_names=["x"], output_names=["y"], dynamo=False)
    x = np.random.default_rng(1).standard_normal((1, 16, 32)).astype(np.float32) * 3
    x[0, 5] = np.nan
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    reference = backplane.InferenceSession(str(path), providers=["CpuRef"]).run(None, {"x": x})[0]
    got = backplane.InferenceSession(str(path), providers=["CpuAcc", "CpuRef"]).run(None, {"x": x})[0]
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got[0, 5]).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)
