"""CpuAcc's RNN, GRU and LSTM through torch's fused kernels (``torch.lstm``, ``torch.gru``,
``torch.rnn_tanh``, ``torch.rnn_relu``: ``recurrent._native``) where ONNX's attributes are what they
compute, and step by step (``recurrent._run``) elsewhere: one-node models against CpuRef and ONNX
Runtime, with a spy on both paths that fails where the expected one did not run.

    python -m pytest tests/backends/torch/test_recurrent_native.py -q -p no:cacheprovider
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.kernels import recurrent  # noqa: E402

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
SEQ, BATCH, WIDTH, HIDDEN = 5, 3, 4, 6
DIRECTIONS = ["forward", "reverse", "bidirectional"]
LENGTHS = {"absent": None, "full": [SEQ] * BATCH, "short": [SEQ, 2, 4]}
"""sequence_lens: none, all as long as X (the fused kernel's case), some shorter (steps)."""
ACC = ["CpuAcc", "CpuRef"]


def recurrent_model(op: str, direction: str = "forward", layout: int = 0, states: bool = True,
                    lengths: list[int] | None = None, attrs: dict[str, Any] | None = None,
                    peepholes: np.ndarray | None = None, dtype: Any = np.float32,
                    seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One ``op`` node: W, R, B (and P) as initializers, X, sequence_lens and the initial states as
    inputs; its feeds, weights at a scale that keeps the gates off saturation."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates = GATES[op] * HIDDEN
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def values(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(dtype)

    weights = {"W": values(dirs, gates, WIDTH, scale=0.5),
               "R": values(dirs, gates, HIDDEN, scale=0.4), "B": values(dirs, 2 * gates, scale=0.3)}
    if peepholes is not None:
        weights["P"] = peepholes.astype(dtype)
    state = (BATCH, dirs, HIDDEN) if layout else (dirs, BATCH, HIDDEN)
    feeds = {"X": values(*((BATCH, SEQ, WIDTH) if layout else (SEQ, BATCH, WIDTH)))}
    if lengths is not None:
        feeds["sequence_lens"] = np.array(lengths, np.int32)
    if states:
        feeds["initial_h"] = values(*state, scale=0.5)
        if op == "LSTM":
            feeds["initial_c"] = values(*state, scale=0.5)
    order = ["X", "W", "R", "B", "sequence_lens", "initial_h"] + \
        (["initial_c", "P"] if op == "LSTM" else [])
    names = [n if n in feeds or n in weights else "" for n in order]
    while not names[-1]:
        names.pop()
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, names, outputs, direction=direction, hidden_size=HIDDEN,
                            layout=layout, **(attrs or {}))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "sequence_lens" else elem,
                                            v.shape) for n, v in feeds.items()]
    graph = helper.make_graph([node], op.lower(), inputs,
                              [helper.make_tensor_value_info(n, elem, None) for n in outputs],
                              [numpy_helper.from_array(v, n) for n, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model, feeds


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], providers: list[str]) \
        -> list[np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback notices
        session = InferenceSession(model.SerializeToString(), providers=providers)
        return [np.asarray(o) for o in session.run(None, feeds)]


def onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime's outputs. It runs layout 0 only: a layout-1 node runs as its layout-0 twin on
    the feeds transposed, its outputs transposed back."""
    node = model.graph.node[0]
    layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
    if layout:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        twin = model.graph.node[0]
        next(a for a in twin.attribute if a.name == "layout").i = 0
        del model.graph.input[:]  # shapes change: let them be inferred from the feeds
        model.graph.input.extend(helper.make_tensor_value_info(
            n, helper.np_dtype_to_tensor_dtype(v.dtype), None) for n, v in feeds.items())
        feeds = {n: v if n == "sequence_lens" else np.ascontiguousarray(v.swapaxes(0, 1))
                 for n, v in feeds.items()}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = session.run(None, feeds)
    if layout:  # Y (seq, dirs, batch, hidden) -> (batch, seq, dirs, hidden); states batch first
        outputs = [outputs[0].transpose(2, 0, 1, 3), *(o.swapaxes(0, 1) for o in outputs[1:])]
    return outputs


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How many layers each path ran: "native" (one fused torch call, or a GRU with
    linear_before_reset=0 by ``recurrent._reset_first``) and "steps"."""
    calls: Counter = Counter()
    native, steps, reset_first = recurrent._native, recurrent._run, recurrent._reset_first

    def spy_native(*args: Any) -> Any:
        calls["native"] += 1
        return native(*args)

    def spy_reset_first(*args: Any) -> Any:
        calls["native"] += 1
        return reset_first(*args)

    def spy_steps(*args: Any) -> Any:
        calls["steps"] += 1
        return steps(*args)

    monkeypatch.setattr(recurrent, "_native", spy_native)
    monkeypatch.setattr(recurrent, "_run", spy_steps)
    monkeypatch.setattr(recurrent, "_reset_first", spy_reset_first)
    return calls


def assert_path(paths: Counter, native: bool) -> None:
    """The layer ran (on CpuAcc: a fallback to CpuRef runs neither) by the path expected only."""
    want, other = ("native", "steps") if native else ("steps", "native")
    assert paths[want] >= 1 and not paths[other], \
        f"expected the {'native' if native else 'step-by-step'} path, ran {dict(paths)}"


def check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], paths: Counter,
          native: bool) -> list[np.ndarray]:
    """CpuAcc's outputs as CpuRef's and ONNX Runtime's, by the path expected; CpuAcc's outputs."""
    got = run(model, feeds, ACC)
    assert_path(paths, native)
    for name, want in (("CpuRef", run(model, feeds, ["CpuRef"])),
                       ("ONNX Runtime", onnxruntime(model, feeds))):
        assert len(got) == len(want)
        for index, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, f"output {index}: shape {g.shape}, {name}'s {w.shape}"
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5,
                                       err_msg=f"output {index} against {name}")
    return got


def cases() -> list[Any]:
    grid = [(op, lbr) for op in GATES for lbr in ((0, 1) if op == "GRU" else (None,))]
    return [pytest.param(op, lbr, d, layout, states, lengths,
                         id=f"{op}{'' if lbr is None else f'-lbr{lbr}'}-{d}-layout{layout}"
                            f"-{'states' if states else 'zeros'}-lens_{lengths}")
            for op, lbr in grid for d in DIRECTIONS for layout in (0, 1)
            for states in (True, False) for lengths in LENGTHS]


@pytest.mark.parametrize("op, lbr, direction, layout, states, lengths", cases())
def test_against_cpuref_and_onnxruntime(op: str, lbr: int | None, direction: str, layout: int,
                                        states: bool, lengths: str, paths: Counter) -> None:
    attrs = {} if lbr is None else {"linear_before_reset": lbr}
    model, feeds = recurrent_model(op, direction, layout, states, LENGTHS[lengths], attrs)
    # torch's GRU resets after the recurrent product (linear_before_reset=1); 0: _reset_first
    check(model, feeds, paths, native=lengths != "short")


@pytest.mark.parametrize("attrs, native", [
    ({"activations": ["Relu", "Relu"]}, True),          # torch.rnn_relu
    ({"activations": ["Tanh", "Tanh"]}, True),          # the defaults, written out
    ({"activations": ["Tanh", "Relu"]}, False),         # one kernel per call: not both
    ({"activations": ["Sigmoid", "Sigmoid"]}, False),
    ({"clip": 0.5}, False),
])
def test_rnn_activations_and_clip(attrs: dict[str, Any], native: bool, paths: Counter) -> None:
    model, feeds = recurrent_model("RNN", "bidirectional", attrs=attrs)
    check(model, feeds, paths, native)


@pytest.mark.parametrize("attrs, peepholes, native", [
    ({}, "zeros", True),                                # all-zero peepholes change nothing
    ({}, "values", False),
    ({"input_forget": 1}, None, False),
    ({"clip": 0.5}, None, False),
    ({"activations": ["Sigmoid", "Tanh", "Tanh"] * 2}, None, True),
    ({"activations": ["Sigmoid", "Tanh", "Relu"] * 2}, None, False),
])
def test_lstm_options(attrs: dict[str, Any], peepholes: str | None, native: bool,
                      paths: Counter) -> None:
    p = None if peepholes is None else np.zeros((2, 3 * HIDDEN)) if peepholes == "zeros" else \
        np.random.default_rng(1).standard_normal((2, 3 * HIDDEN)) * 0.5
    model, feeds = recurrent_model("LSTM", "bidirectional", attrs=attrs, peepholes=p)
    check(model, feeds, paths, native)


@pytest.mark.parametrize("attrs, native", [
    ({"linear_before_reset": 1, "activations": ["Sigmoid", "Tanh"] * 2}, True),
    ({"linear_before_reset": 1, "activations": ["Sigmoid", "Softsign"] * 2}, False),
    ({"linear_before_reset": 1, "clip": 0.5}, False),
    ({"activations": ["Sigmoid", "Tanh"] * 2}, True),
    ({"activations": ["Sigmoid", "Softsign"] * 2}, False),
    ({"clip": 0.5}, False),
])
def test_gru_options(attrs: dict[str, Any], native: bool, paths: Counter) -> None:
    model, feeds = recurrent_model("GRU", "bidirectional", attrs=attrs)
    check(model, feeds, paths, native)


@pytest.mark.parametrize("op", list(GATES))
def test_float64_against_cpuref(op: str, paths: Counter) -> None:
    attrs = {"linear_before_reset": 1} if op == "GRU" else {}
    model, feeds = recurrent_model(op, "bidirectional", layout=1, attrs=attrs, dtype=np.float64)
    got = run(model, feeds, ACC)
    assert_path(paths, native=True)
    for g, w in zip(got, run(model, feeds, ["CpuRef"])):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", list(GATES))
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_nan_in_nan_out(op: str, direction: str, paths: Counter) -> None:
    attrs = {"linear_before_reset": 1} if op == "GRU" else {}
    model, feeds = recurrent_model(op, direction, attrs=attrs)
    feeds["X"][2, 1, 0] = np.nan  # step 2 of sequence 1
    got = run(model, feeds, ACC)
    assert_path(paths, native=True)
    want = run(model, feeds, ["CpuRef"])
    for index, (g, w) in enumerate(zip(got, want)):
        assert np.isnan(w).any(), f"output {index}: CpuRef has no NaN (a wrong case)"
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=f"output {index}'s NaN")
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)
    y = got[0]  # (seq, dirs, batch, hidden): sequence 1 is NaN from step 2 on, the others finite
    assert np.isnan(y[:, :, 1]).any() and np.isfinite(np.delete(y, 1, axis=2)).all()


def test_weights_changed_in_place_are_read_again() -> None:
    """The kernel keeps torch's reordered weights with W: changing W, R or B in place (their
    version counters) must not leave the old ones in use."""
    rng = np.random.default_rng(2)
    X, W, R, B = (torch.from_numpy(rng.standard_normal(s).astype(np.float32) * 0.5) for s in
                  ((SEQ, BATCH, WIDTH), (1, 4 * HIDDEN, WIDTH), (1, 4 * HIDDEN, HIDDEN),
                   (1, 8 * HIDDEN)))
    before = recurrent.lstm(X, W, R, B)[0].clone()
    for tensor in (W, R, B):
        tensor.mul_(1.5)
        fresh = recurrent.lstm(X, W.clone(), R.clone(), B.clone())[0]
        again = recurrent.lstm(X, W, R, B)[0]
        torch.testing.assert_close(again, fresh, rtol=0, atol=0)
        assert not torch.equal(again, before)
        before = again.clone()


@pytest.mark.parametrize("tracer", ["jit.trace", "make_fx"])
def test_a_trace_reads_the_weights_it_is_given(tracer: str) -> None:
    """Traced (CpuAcc's Traced layers, GpuAcc's compiled captures), the kernel must compute torch's
    weights from the W it is given, not bake in the list kept from an earlier call."""
    from torch.fx.experimental.proxy_tensor import make_fx

    rng = np.random.default_rng(3)
    X, W, R, B = (torch.from_numpy(rng.standard_normal(s).astype(np.float32) * 0.5) for s in
                  ((SEQ, BATCH, WIDTH), (2, 4 * HIDDEN, WIDTH), (2, 4 * HIDDEN, HIDDEN),
                   (2, 8 * HIDDEN)))

    def layer(x: Any, w: Any, r: Any, b: Any) -> Any:
        return recurrent.lstm(x, w, r, b, direction="bidirectional")[0]

    layer(X, W, R, B)  # keeps torch's list for this W
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation and tracer warnings
        traced = torch.jit.trace(layer, (X, W, R, B)) if tracer == "jit.trace" else \
            make_fx(layer, tracing_mode="real")(X, W, R, B)
    other = W * -1.5
    torch.testing.assert_close(traced(X, other, R, B), layer(X, other, R, B))


@pytest.mark.parametrize("hidden, inside", [(HIDDEN, 1), (256, 1), (384, 2)])
def test_a_small_recurrence_runs_on_one_thread(hidden: int, inside: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused kernel with a small recurrent product (``ONE_THREAD_BELOW``) runs on one thread, a
    larger one on the caller's; the caller's count is put back either way."""
    seen = []
    lstm = torch.lstm

    def spy(*args: Any) -> Any:
        seen.append(torch.get_num_threads())
        return lstm(*args)

    monkeypatch.setattr(torch, "lstm", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        W, R = torch.zeros(1, 4 * hidden, WIDTH), torch.zeros(1, 4 * hidden, hidden)
        recurrent.lstm(torch.zeros(SEQ, 1, WIDTH), W, R)
        assert (seen, torch.get_num_threads()) == ([inside], 2)
    finally:
        torch.set_num_threads(before)
