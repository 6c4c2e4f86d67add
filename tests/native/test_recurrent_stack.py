"""Stacked LSTM and GRU layers in one op (``backplane/native/recurrent_stack.py``) and the LSTM
stacks torch's exporters write as one ``LstmStack`` layer (``fusion/recurrent_stack.py``):
against CpuRef layer by layer (both kinds, every direction, initial states or none,
sequence_lens, a large layer's projection first, Y merged or in ONNX's layout), NaN in -> NaN
out, fresh outputs; the corpus's LSTM stacks one op a run against CpuRef and ONNX Runtime, and
"off" the same values through CpuAcc's LSTM kernel.

    python -m pytest -o addopts="" -q -p no:cacheprovider tests/native/test_recurrent_stack.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.reference.kernels import rnn as reference  # noqa: E402
from backplane.native import build  # noqa: E402
from backplane.native import recurrent as in_c  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

needs_library = pytest.mark.skipif(not build.available("recurrent"),
                                   reason="no native recurrent library (no C compiler)")
CORPUS = Path(__file__).parents[1] / "data" / "corpus"
GATES = {"lstm": 4, "gru": 3}


@pytest.fixture
def ops(monkeypatch):
    """The stack ops run (one ``_plan`` each) and the C calls they made, counted."""
    from backplane.native import recurrent_stack

    made = {"ops": 0, "calls": 0}
    plan = recurrent_stack._plan

    def counted_plan(*args):
        made["ops"] += 1
        return plan(*args)

    def counting(function):
        def call(*args):
            made["calls"] += 1
            return function(*args)
        return call

    monkeypatch.setattr(recurrent_stack, "_plan", counted_plan)
    if build.available("recurrent"):
        monkeypatch.setattr(in_c, "_FUNCTIONS", [counting(f) for f in in_c._functions()])
    return made


def _weights(kind, layers, inputs, hidden, dirs, rng, scale=0.4):
    gates, width, found = GATES[kind] * hidden, inputs, []
    for _ in range(layers):
        found.append([(rng.standard_normal(shape) * scale).astype(np.float32) for shape in
                      ((dirs, gates, width), (dirs, gates, hidden), (dirs, 2 * gates))])
        width = dirs * hidden
    return found


def _cpuref(kind, weights, x, lens, h0, c0, direction, merged):
    """Layer by layer as the export computes it, each Y made (seq, batch, dirs * H) for the next."""
    y, finals = x, []
    for index, (w, r, b) in enumerate(weights):
        extra = {"linear_before_reset": 1} if kind == "gru" else {"initial_c": c0[index]}
        outputs = getattr(reference, kind)(y, w, r, b, lens, h0[index], direction=direction,
                                           n_outputs=3 if kind == "lstm" else 2, **extra)
        y = outputs[0]
        if index < len(weights) - 1 or merged:
            y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], y.shape[2], -1)
        finals.append(outputs[1:])
    return y, finals


def _stacked(kind, weights, x, lens, h0, c0, direction, merged):
    from backplane.native.recurrent_stack import Stack

    def tensor(v):
        return None if v is None else torch.from_numpy(v)

    tensors = [[tensor(v) for v in w] for w in weights]
    stack = Stack(kind, [in_c.prepared(kind, *w, 1 if kind == "gru" else 0) for w in tensors],
                  weights[0][1].shape[-1], direction, 1 if kind == "gru" else 0)
    y, hs, cs = stack(torch.from_numpy(x), tensor(lens), [tensor(h) for h in h0],
                      [tensor(c) for c in c0], merged)
    dirs = weights[0][0].shape[0]
    assert hs.shape[0] == len(weights) * dirs
    assert cs.shape[0] == (len(weights) * dirs if kind == "lstm" else 0)
    return y.numpy(), [[hs[i * dirs:(i + 1) * dirs].numpy()] +
                       ([cs[i * dirs:(i + 1) * dirs].numpy()] if kind == "lstm" else [])
                       for i in range(len(weights))]


@needs_library
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["lstm", "gru"]),
       direction=st.sampled_from(["forward", "reverse", "bidirectional"]),
       layers=st.integers(1, 3), seq=st.integers(1, 5), batch=st.integers(1, 3),
       inputs=st.integers(1, 9), hidden=st.sampled_from([1, 5, 24, 65]),
       states=st.sampled_from(["none", "some", "all"]), short=st.booleans(),
       merged=st.booleans(), seed=st.integers(0, 2**16))
def test_against_cpuref(kind, direction, layers, seq, batch, inputs, hidden, states, short,
                        merged, seed):
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    weights = _weights(kind, layers, inputs, hidden, dirs, rng)
    x = rng.standard_normal((seq, batch, inputs)).astype(np.float32)
    lens = np.array([max(0, seq - b) for b in range(batch)], np.int32) if short else None

    def state(index):
        wanted = states == "all" or (states == "some" and index % 2 == 0)
        return rng.standard_normal((dirs, batch, hidden)).astype(np.float32) if wanted else None

    h0, c0 = [state(i) for i in range(layers)], [state(i + 1) for i in range(layers)]
    want_y, want_finals = _cpuref(kind, weights, x, lens, h0, c0, direction, merged)
    got_y, got_finals = _stacked(kind, weights, x, lens, h0, c0, direction, merged)
    assert got_y.shape == want_y.shape
    # a layer's error (the C's rational tanh and exp-based sigmoid, ~1e-6 against NumPy's) is
    # the next layer's input: up to 6.4e-6 after three GRU layers of 65 (hypothesis, seed 0)
    atol = 2e-6 * 2 ** (layers - 1)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-4, atol=atol)
    for got, want in zip(got_finals, want_finals):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


@needs_library
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("by", ["tile", "torch"])
def test_a_large_layer_projects_its_input_first(kind, by, ops, monkeypatch):
    """Past ``STACKED_BYTES`` a layer's input is projected first inside the op, by linear.c's
    tile where it is AVX-512's (else torch's F.linear); within CpuRef's values either way, one op
    of two C calls."""
    from backplane.native import linear, recurrent_stack

    made = []
    real = recurrent_stack._panels
    if by == "torch":
        monkeypatch.setattr(recurrent_stack, "_panels", lambda weight, bias: None)
    elif linear.rows() < linear.WIDE_ROWS:
        pytest.skip("this CPU builds AVX2's tile: the projection is torch's")
    else:
        monkeypatch.setattr(recurrent_stack, "_panels",
                            lambda weight, bias: made.append(real(weight, bias)) or made[-1])
    rng = np.random.default_rng(4)
    weights = _weights(kind, 2, 200, 96, 2, rng, scale=0.1)
    assert in_c.prepared(kind, *map(torch.from_numpy, weights[1]))[2] is not None
    x = rng.standard_normal((3, 2, 200)).astype(np.float32)
    lens = np.array([3, 1], np.int32)
    want_y, want_finals = _cpuref(kind, weights, x, lens, [None, None], [None, None],
                                  "bidirectional", False)
    got_y, got_finals = _stacked(kind, weights, x, lens, [None, None], [None, None],
                                 "bidirectional", False)
    assert ops == {"ops": 1, "calls": 2}
    assert len(made) == (2 if by == "tile" else 0) and all(p is not None for p in made)
    np.testing.assert_allclose(got_y, want_y, rtol=1e-4, atol=2e-6)
    for got, want in zip(got_finals, want_finals):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


@needs_library
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_nan_in_nan_out_and_fresh_outputs(kind):
    """A NaN in one row's input at step 2 reaches that row of every layer from step 2 on
    (forward), the other row stays a number; two calls give separate outputs, the same values."""
    rng = np.random.default_rng(5)
    weights = _weights(kind, 2, 3, 20, 1, rng)
    x = rng.standard_normal((5, 2, 3)).astype(np.float32)
    x[2, 1, 0] = np.nan
    none = [None, None]
    want_y, _ = _cpuref(kind, weights, x, None, none, none, "forward", True)
    first, _ = _stacked(kind, weights, x, None, none, none, "forward", True)
    second, _ = _stacked(kind, weights, x, None, none, none, "forward", True)
    assert np.isnan(first[2:, 1]).all() and not np.isnan(first[:2, 1]).any()
    assert not np.isnan(first[:, 0]).any()
    np.testing.assert_allclose(first, want_y, rtol=1e-4, atol=2e-6, equal_nan=True)
    assert first.ctypes.data != second.ctypes.data
    np.testing.assert_array_equal(first, second)


def _session(name, mode):
    options = {"CpuAcc.native": mode, "CpuAcc.threads": 1,
               "CpuAcc.compile": "onednn_graph"}  # the trace kept whenever there is one
    return InferenceSession(str(CORPUS / f"{name}.onnx"), backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


STACKS = {"lstm_bi2_ts14": 2, "lstm_bi2_dyn18": 2, "crnn_paddle_ts12": 2, "gru_tm3_ts13": 3}
"""The corpus's models whose recurrent layers are one stack -> its layers."""


@needs_library
@pytest.mark.parametrize("name", STACKS)
def test_corpus_stacks_one_op_a_run(name, ops):
    """The stack one op a run of a C call a layer, within 1e-5 of CpuRef and ONNX Runtime."""
    ort = pytest.importorskip("onnxruntime")
    path = CORPUS / f"{name}.onnx"
    session, ref = _session(name, "auto"), InferenceSession(str(path), providers=["CpuRef"])
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for sample in ("s0", "s1"):
        feeds = dict(np.load(CORPUS / f"{name}.{sample}.npz"))
        session.run(None, feeds)
        ops.update(ops=0, calls=0)
        got = session.run(None, feeds)
        assert ops == {"ops": 1, "calls": STACKS[name]}
        for a, b, c in zip(got, ref.run(None, feeds), theirs.run(None, feeds)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["lstm_bi2_ts14", "crnn_paddle_ts12"])
def test_off_computes_the_stack_by_torch(name, ops):
    """``CpuAcc.native`` "off": the LstmStack's layers by CpuAcc's LSTM kernel, no native op,
    CpuRef's values."""
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    want = InferenceSession(str(CORPUS / f"{name}.onnx"), providers=["CpuRef"]).run(None, feeds)
    session = _session(name, "off")
    for _ in range(2):
        got = session.run(None, feeds)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert ops == {"ops": 0, "calls": 0}


@needs_library
def test_threads_running_one_stack_keep_their_own_scratch():
    """Two threads running one stack at once (ctypes lets the GIL go during each C call) each
    get their own values: the scratch buffers kept between calls are taken whole."""
    import threading

    rng = np.random.default_rng(6)
    weights = _weights("lstm", 3, 5, 24, 2, rng)
    xs = [rng.standard_normal((6, 2, 5)).astype(np.float32) for _ in range(2)]
    none = [None] * 3
    wanted = [_cpuref("lstm", weights, x, None, none, none, "bidirectional", True)[0] for x in xs]
    from backplane.native.recurrent_stack import Stack

    tensors = [[torch.from_numpy(v) for v in w] for w in weights]
    stack = Stack("lstm", [in_c.prepared("lstm", *w) for w in tensors], 24, "bidirectional")
    wrong: list[int] = []

    def work(index):
        x = torch.from_numpy(xs[index])
        for _ in range(200):
            y = stack(x, None, none, none, True)[0].numpy()
            if not np.allclose(y, wanted[index], rtol=1e-4, atol=2e-6):
                wrong.append(index)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong


@pytest.mark.parametrize("name, joined", [("lstm_bi2_ts14", [True, True]),
                                          ("crnn_paddle_ts12", [False, False])])
def test_the_states_concat_joins_the_stack(name, joined, monkeypatch):
    """lstm_bi2_ts14's h and c (a Concat of each layer's Y_h, Y_c) are the stack's states as
    they are: the Concats are in the fused layer; crnn reads no state."""
    from backplane.backends.torch import fusion

    found = []
    matcher = fusion.MATCHERS["LSTM"]

    def spy(layer, ctx):
        match = matcher(layer, ctx)
        if match is not None:
            found.append(match)
        return match

    for table in (fusion.MATCHERS, fusion.INT8_MATCHERS):
        monkeypatch.setitem(table, "LSTM", spy)
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    _session(name, "off").run(None, feeds)
    assert found and all(fused.attrs["joined"] == joined for _, fused in found)
    concats = [lay for group, _ in found for lay in group if lay.op_type == "Concat"]
    assert len(concats) == sum(joined) * len(found)


@needs_library
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_outputs_are_torchs_own_memory(kind):
    """The op's outputs are torch's allocations (resizable, held by nothing else): a run that
    hands them over as they are (lstm_bi2_ts14's h and c) does not search the inputs for them
    (``runtime/fresh_outputs.fresh``; with NumPy's memory it did, about 6 us an output)."""
    from backplane.native.recurrent_stack import Stack
    from backplane.runtime.fresh_outputs import fresh

    rng = np.random.default_rng(8)
    weights = [[torch.from_numpy(v) for v in w] for w in _weights(kind, 2, 4, 8, 2, rng)]
    lbr = 1 if kind == "gru" else 0
    stack = Stack(kind, [in_c.prepared(kind, *w, lbr) for w in weights], 8, "bidirectional", lbr)
    results = stack(torch.randn(3, 1, 4), None, [None, None], [None, None], True)
    for index in range(2 if kind == "gru" else 3):
        value = results[index]
        assert fresh(value)
        del value
