"""A OneDnnGraph compiled with oneDNN's own ReLU, clamp and max pool for inputs within a bound that
keeps NaN out of it, and with the NaN-keeping spellings for any other input
(``fusion/nan_free.py``): NaN in, NaN out either way."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.backend import FUSED_DOMAIN  # noqa: E402
from backplane.backends.torch.fusion import nan_free  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.models.test_models import DATA, assert_close, ort_outputs  # noqa: E402

MOBILENET = DATA / "corpus" / "mobilenet_dw_ts13.onnx"  # ReLU6 after its convolutions
RESNET = DATA / "corpus" / "resnet_basic_ts16.onnx"  # ReLU and a padded max pool, small maps


def _session(path) -> InferenceSession:
    return InferenceSession(path, backends=["CpuAcc", "CpuRef"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.compile": "onednn_graph"})))


def _workload(session: InferenceSession):
    """The OneDnnGraph's workload: the session's own, or its Specialized layer's (a free batch
    size), built for the shapes run."""
    loaded = session.runtime.network(session.network_id)
    for step, layer in zip(loaded.steps, loaded.layers):
        if layer.op_type == "OneDnnGraph":
            return step.workload
        if layer.op_type == "Specialized":
            return next(iter(step.workload.built.values())).alone
    raise AssertionError("no OneDnnGraph")


def _feeds(path) -> dict[str, np.ndarray]:
    return dict(np.load(str(path).replace(".onnx", ".s0.npz")))


def _ran() -> str:
    return str(torch.jit.last_executed_optimized_graph())


def test_relu6_runs_inside_the_partitions_for_finite_inputs() -> None:
    feeds = _feeds(MOBILENET)
    session = _session(MOBILENET)
    outputs = session.run(None, feeds)
    workload = _workload(session)
    assert workload.nan_free_limit >= 1e3
    assert workload.nan_keeping.built is None  # no input beyond the bound yet: not compiled
    session.run(None, feeds)
    ran = _ran()
    assert "aten::clamp_max" not in ran and "aten::elu" not in ran
    assert "oneDNNFusionGroup" in ran
    assert_close(outputs, ort_outputs(MOBILENET, feeds))


def _specials(x: np.ndarray) -> dict[str, np.ndarray]:
    one_nan, one_inf, minus_inf = x.copy(), x.copy(), x.copy()
    one_nan.reshape(-1)[37] = np.nan
    one_inf.reshape(-1)[5] = np.inf
    minus_inf.reshape(-1)[700] = -np.inf
    return {"one NaN": one_nan, "all NaN": np.full_like(x, np.nan), "+Inf": one_inf,
            "-Inf": minus_inf, "beyond the bound": x * np.float32(1e16)}


@pytest.mark.parametrize("case", ["one NaN", "all NaN", "+Inf", "-Inf", "beyond the bound"])
def test_other_inputs_take_the_nan_keeping_compile(case: str) -> None:
    feeds = _feeds(MOBILENET)
    name = next(iter(feeds))
    special = {**feeds, name: _specials(feeds[name])[case]}
    session = _session(MOBILENET)
    session.run(None, feeds)
    got = session.run(None, special)
    assert _workload(session).nan_keeping.built is not None
    ran = _ran()
    assert "aten::clamp_max" in ran and "aten::elu" in ran  # the NaN-keeping module ran
    want = InferenceSession(MOBILENET, backends=["CpuRef"]).run(None, special)
    for g, w in zip(got, want):
        assert np.array_equal(np.isnan(g), np.isnan(w))
        assert np.array_equal(np.isinf(g), np.isinf(w))
        finite = np.isfinite(w)
        scale = max(1.0, float(np.abs(w[finite]).max(initial=0)))
        assert np.allclose(g[finite], w[finite], rtol=1e-3, atol=1e-3 * scale)
    assert any(np.isnan(w).any() for w in want) or case in ("+Inf", "-Inf", "beyond the bound")
    assert_close(session.run(None, feeds), ort_outputs(MOBILENET, feeds))  # finite again: fast
    assert "aten::clamp_max" not in _ran()


def test_small_relu_maps_keep_one_compile() -> None:
    """resnet_basic_ts16's ReLUs make about 8000 values a run: the ELU's exp there costs less than
    the inputs' check, and no clamp splits its partitions (``nan_free.FUSED_VOLUME``)."""
    session = _session(RESNET)
    session.run(None, _feeds(RESNET))
    assert not hasattr(_workload(session), "nan_free_limit")


def _conv(name: str, x: str, y: str, scale: float, unary=None) -> Layer:
    attrs = {"weight": np.full((4, 4, 3, 3), scale, np.float32), "bias": np.zeros(4, np.float32),
             "binary": False, "unary": unary, "output_shape": [1, 4, 8, 8]}
    return Layer(name, "FusedConv", [x], [y], attrs, FUSED_DOMAIN, 1)


def _graph(layers: list[Layer], constants: dict | None = None) -> Layer:
    attrs = {"layers": layers, "constants": constants or {}, "inputs": ["x"],
             "outputs": [layers[-1].outputs[0]], "shapes": [[lay.op_type] for lay in layers]}
    return Layer("g", "OneDnnGraph", ["x"], attrs["outputs"], attrs, FUSED_DOMAIN, 1)


SAMPLE = [torch.zeros(1, 4, 8, 8)]
RELU6 = ("hardtanh", [0.0, 6.0], None)


def test_the_bound_is_the_largest_that_cannot_overflow() -> None:
    # each convolution multiplies a bound by 36 * 1e10 (its output channel's absolute weights)
    two = [_conv("a", "x", "y", 1e10), _conv("b", "y", "z", 1e10, RELU6)]
    assert nan_free.input_limit(_graph(two), SAMPLE) == 1e12  # 1.3e23 * 1e12 <= 1e36
    three = [_conv("a", "x", "y", 1e10), _conv("b", "y", "z", 1e10),
             _conv("c", "z", "w", 1e10, RELU6)]
    assert nan_free.input_limit(_graph(three), SAMPLE) is None  # 4.7e34 * 1e3 > 1e36
    clipped = [_conv("a", "x", "y", 1e10, RELU6), _conv("b", "y", "z", 1e10),
               _conv("c", "z", "w", 1e10, RELU6)]
    assert nan_free.input_limit(_graph(clipped), SAMPLE) == 1e15  # ReLU6 bounds the first's output


def test_no_bound_no_nan_free_compile() -> None:
    divided = [_conv("a", "x", "y", 1.0, RELU6), Layer("d", "Div", ["y", "x"], ["z"], {}, "", 14)]
    assert nan_free.input_limit(_graph(divided), SAMPLE) is None  # by a computed value
    by_zero = [_conv("a", "x", "y", 1.0, RELU6), Layer("d", "Div", ["y", "c"], ["z"], {}, "", 14)]
    zero = {"c": np.zeros(1, np.float32)}
    assert nan_free.input_limit(_graph(by_zero, zero), SAMPLE) is None
    plain = [_conv("a", "x", "y", 1.0), _conv("b", "y", "z", 1.0)]  # no ReLU, no clamp: no gain
    assert nan_free.input_limit(_graph(plain), SAMPLE) is None
    half = [_conv("a", "x", "y", 1.0, RELU6)]
    assert nan_free.input_limit(_graph(half), [SAMPLE[0].half()]) is None


def test_the_guard_checks_every_input() -> None:
    run = nan_free.guarded(lambda *v: "fast", 10.0, lambda: lambda *v: "safe")
    assert run(torch.ones(2), torch.full((3,), -10.0)) == "fast"
    assert run(torch.empty(0, 4), torch.ones(1)) == "fast"  # nothing to check in an empty one
    for beyond in (11.0, -10.5, float("nan"), float("inf"), float("-inf")):
        assert run(torch.ones(2), torch.tensor([0.0, beyond])) == "safe"
    assert run.nan_keeping.built is not None and run.nan_free_limit == 10.0
