"""Stacked forward GRU layers (GRU -> Squeeze -> GRU ...) as one GruStack on CpuAcc, stepped by
wavefronts (``fusion/recurrent_stack.py``, ``kernels/recurrent_stack.py``): the corpus's
gru_tm3_ts13 and a stack with sequence_lens and initial states given as inputs, against ONNX
Runtime and CpuRef, NaN where they have it; and the chains that are not such a stack left alone.

    python -m pytest tests/backends/torch/test_gru_stack.py -q -p no:cacheprovider
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from tests.backends.torch.test_attention_sdpa import _built  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

CORPUS = os.path.join(os.path.dirname(__file__), "..", "..", "data", "corpus")
HIDDEN, WIDTH, LAYERS = 16, 10, 3


def _stack(lens: bool, initial: bool, layers: int = LAYERS, last: str = "Squeeze",
           middle: str = "") -> onnx.ModelProto:
    """x (seq, batch, WIDTH) -> ``layers`` GRUs (linear_before_reset=1), each Y squeezed for the
    next (then ``middle`` between the first two), the last Y through ``last``; optionally
    sequence_lens and each layer's initial state as inputs; the final states concatenated."""
    rng = np.random.default_rng(5)
    inits, nodes = [numpy_helper.from_array(np.array([1], np.int64), "axis")], []
    inputs = [float_input("x", ["seq", "batch", WIDTH])]
    if lens:
        inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["batch"]))
    x, width = "x", WIDTH
    for layer in range(layers):
        names = [f"W{layer}", f"R{layer}", f"B{layer}"]
        for name, shape in zip(names, [(1, 3 * HIDDEN, width), (1, 3 * HIDDEN, HIDDEN),
                                       (1, 6 * HIDDEN)]):
            inits.append(numpy_helper.from_array(
                (rng.standard_normal(shape) * 0.4).astype(np.float32), name))
        if initial:
            inputs.append(float_input(f"h{layer}", [1, "batch", HIDDEN]))
        gru_in = [x, *names, "lens" if lens else "", f"h{layer}" if initial else ""]
        nodes.append(helper.make_node("GRU", gru_in, [f"y{layer}", f"s{layer}"], name=f"gru{layer}",
                                      hidden_size=HIDDEN, linear_before_reset=1))
        op = last if layer == layers - 1 else "Squeeze"
        nodes.append(helper.make_node(op, [f"y{layer}", "axis"] if op == "Squeeze" else
                                      [f"y{layer}"], [f"q{layer}"], name=f"after{layer}"))
        x, width = f"q{layer}", HIDDEN
        if layer == 0 and middle:
            nodes.append(helper.make_node(middle, [x], ["m"], name="middle"))
            x = "m"
    nodes.append(helper.make_node("Concat", [f"s{i}" for i in range(layers)], ["h"], axis=0))
    inits.append(numpy_helper.from_array(rng.standard_normal((HIDDEN, 4)).astype(np.float32), "w"))
    nodes += [helper.make_node("MatMul", [x, "w"], ["head"]),  # a head: enough layers to trace
              helper.make_node("Sigmoid", ["head"], ["p"])]
    outputs = [float_input(x, None), float_input("h", None), float_input("p", None)]
    return make_model(nodes, inputs, outputs, inits, opset=14)


def _same(got: list[np.ndarray], want: list[np.ndarray], tolerance: float = 2e-6) -> None:
    for g, e in zip(got, want):
        assert g.shape == e.shape
        assert np.array_equal(np.isnan(g), np.isnan(e))
        finite = ~np.isnan(e)
        np.testing.assert_allclose(g[finite], e[finite], rtol=tolerance, atol=tolerance)


def _references(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[list]:
    data = model if isinstance(model, str) else model.SerializeToString()
    onnxruntime = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return [onnxruntime.run(None, feeds), InferenceSession(data, ["CpuRef"]).run(None, feeds)]


ROUTES = ["onednn_graph", "layers"]
"""``CpuAcc.compile``: the partition traced whenever it traces, or layer by layer."""


def _session(model: onnx.ModelProto | str, route: str) -> InferenceSession:
    data = model if isinstance(model, str) else model.SerializeToString()
    return InferenceSession(data, [("CpuAcc", {"compile": route}), "CpuRef"])


def _stacked(session: InferenceSession, route: str) -> bool:
    """Whether the session's one build holds one GruStack, in a Traced layer where ``route``
    traces, and no GRU."""
    loaded = session.runtime.network(session.network_id)
    (step,) = [s for s, lay in zip(loaded.steps, loaded.layers) if lay.op_type == "Specialized"]
    (runner,) = getattr(step.workload, "work", step.workload).built.values()
    (inner,) = [c.cell_contents for c in runner.__closure__
                if type(c.cell_contents).__name__ == "LoadedNetwork"]
    traced = [lay for lay in inner.layers if lay.op_type == "Traced"]
    return (len(traced) == (route == "onednn_graph") and _built(session, "GruStack") == 1
            and _built(session, "GRU") == 0)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("sample", ["s0", "s1"])
def test_gru_tm3_is_one_stack_with_onnx_runtimes_values(sample: str, route: str) -> None:
    path = os.path.join(CORPUS, "gru_tm3_ts13.onnx")
    feeds = dict(np.load(os.path.join(CORPUS, f"gru_tm3_ts13.{sample}.npz")))
    session = _session(path, route)
    for _ in range(2):  # the second run from the trace's constants, not ones the first wrote
        got = session.run(None, {"x": feeds["x"]})
        for want in _references(path, {"x": feeds["x"]}):
            _same(got, want)
    assert _stacked(session, route)


@pytest.mark.parametrize("route", ROUTES)
def test_sequence_lens_and_initial_states_as_inputs(route: str) -> None:
    model = _stack(lens=True, initial=True)
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((7, 3, WIDTH)).astype(np.float32) * 2,
             "lens": np.array([7, 4, 1], np.int32)}
    feeds.update({f"h{i}": rng.standard_normal((1, 3, HIDDEN)).astype(np.float32) * 0.5
                  for i in range(LAYERS)})
    feeds["x"][5:, 1] = np.nan  # past the second sequence's end: never read
    session = _session(model, route)
    for _ in range(2):
        got = session.run(None, feeds)
        for want in _references(model, feeds):
            _same(got, want)
    assert not np.isnan(got[0]).any() and not got[0][4:, 1].any()  # Y zero past the end
    assert _stacked(session, route)


@pytest.mark.parametrize("route", ROUTES)
def test_nan_and_infinity_in_reach_what_they_reach_in_cpuref(route: str) -> None:
    """CpuRef's NaN exactly; ONNX Runtime's GRU turns a NaN into numbers (its activations clamp
    their input), so it is compared where it has no NaN of CpuRef's."""
    model = _stack(lens=False, initial=False)
    x = np.random.default_rng(7).standard_normal((6, 2, WIDTH)).astype(np.float32)
    x[3, 0, 2] = np.nan  # batch 0: every layer's steps from 3 on
    x[1, 1, 4] = np.inf  # batch 1: finite (no zero block of the product meets it)
    session = _session(model, route)
    got = session.run(None, {"x": x})
    onnxruntime, cpuref = _references(model, {"x": x})
    _same(got, cpuref)
    assert np.isnan(got[0][3:, 0]).all() and not np.isnan(got[0][:3, 0]).any()
    assert np.isfinite(got[0][:, 1]).all()
    _same([got[0][:3], got[0][:, 1]], [onnxruntime[0][:3], onnxruntime[0][:, 1]])
    assert _stacked(session, route)


def test_a_chain_that_is_not_a_stack_is_left_alone() -> None:
    """A Relu between the first two layers: the last two are the stack; two GRUs with nothing
    squeezed after the last keep its Y 4-d."""
    model = _stack(lens=False, initial=False, middle="Relu")
    x = np.random.default_rng(8).standard_normal((5, 1, WIDTH)).astype(np.float32)
    session = InferenceSession(model.SerializeToString(), ["CpuAcc", "CpuRef"])
    for want in _references(model, {"x": x}):
        _same(session.run(None, {"x": x}), want)
    assert _built(session, "GruStack") == 1 and _built(session, "GRU") == 1
    model = _stack(lens=False, initial=False, layers=2, last="Identity")
    session = InferenceSession(model.SerializeToString(), ["CpuAcc", "CpuRef"])
    got = session.run(None, {"x": x})
    for want in _references(model, {"x": x}):
        _same(got, want)
    assert got[0].shape == (5, 1, 1, HIDDEN) and _built(session, "GruStack") == 1


def test_the_kernel_computes_in_its_inputs_type() -> None:
    """A ``CpuAcc.precision`` subgraph hands the layer bfloat16: the weights follow the input."""
    from backplane.backends.torch.kernels.recurrent_stack import GruStack

    rng = np.random.default_rng(9)
    weights = [tuple((rng.standard_normal(shape) * 0.4).astype(np.float32) for shape in
                     [(1, 3 * HIDDEN, width), (1, 3 * HIDDEN, HIDDEN), (1, 6 * HIDDEN)])
               for width in (WIDTH, HIDDEN)]
    stack = GruStack(weights)
    x = torch.from_numpy(rng.standard_normal((4, 2, WIDTH)).astype(np.float32))
    y, final = stack(x, None, [None, None])
    for dtype, tolerance in ((torch.float64, 1e-5), (torch.bfloat16, 0.1)):
        y_typed, final_typed = stack(x.to(dtype), None, [None, None])
        assert y_typed.dtype == final_typed.dtype == dtype
        torch.testing.assert_close(y_typed.float(), y, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(final_typed.float(), final, rtol=tolerance, atol=tolerance)
