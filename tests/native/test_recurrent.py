"""ONNX's LSTM and GRU as one call of C (``backplane/native/recurrent.py``): the layer against
CpuRef and the ONNX node suite's expected outputs, over hypothesis's shapes (directions, layouts,
batch, hidden sizes across the C loop's blocks of 64, initial states, sequence_lens), NaN in ->
NaN out; the corpus's recurrent models on the route (pinned by ``CpuAcc.native`` and
``CpuAcc.compile``) against CpuRef; "off" and no compiler keep torch's routes.

    python -m pytest -o addopts="" -q -p no:cacheprovider tests/native/test_recurrent.py
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.reference.kernels import rnn as reference  # noqa: E402
from backplane.backends.torch.kernels import recurrent  # noqa: E402
from backplane.native import build  # noqa: E402
from backplane.native import recurrent as in_c  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

needs_library = pytest.mark.skipif(not build.available("recurrent"),
                                   reason="no native recurrent library (no C compiler)")
CORPUS = Path(__file__).parents[1] / "data" / "corpus"
GATES = {"LSTM": 4, "GRU": 3}


@pytest.fixture
def calls(monkeypatch):
    """The native calls made (one per layer run, a stack's too), counted."""
    made: list[int] = []

    def counting(function):
        def call(*args):
            made.append(1)
            return function(*args)
        return call

    if build.available("recurrent"):
        monkeypatch.setattr(in_c, "_FUNCTIONS", [counting(f) for f in in_c._functions()])
    return made


@pytest.fixture
def auto():
    """``MODE`` "auto", as while a CpuAcc trace is made under ``CpuAcc.native`` "auto"."""
    token = in_c.MODE.set("auto")
    yield
    in_c.MODE.reset(token)


def _node_cases():
    """The node suite's LSTM and GRU cases but peepholes (not the C loop's: torch's routes)."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ("lstm", "gru"):
            importlib.import_module(f"onnx.backend.test.case.node.{op}")
        from onnx.backend.test.case.node import _NodeTestCases
    return {case.name: case for case in _NodeTestCases
            if case.name.startswith(("test_lstm", "test_gru")) and "peephole" not in case.name}


NODE_CASES = _node_cases()


@needs_library
@pytest.mark.parametrize("name", sorted(NODE_CASES))
def test_node_suite_cases(name):
    """The suite's cases within its tolerance of its expected outputs and of CpuRef's."""
    case = NODE_CASES[name]
    (node,) = case.model.graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    direction = attrs.get("direction", b"forward").decode()
    feeds = dict(zip([i.name for i in case.model.graph.input], case.data_sets[0][0]))
    values = [feeds.get(n) if n else None for n in node.input] + [None] * 8
    tensors = _tensors(values)
    ours = in_c.layer(node.op_type.lower(), *tensors[:6], tensors[6] if node.op_type == "LSTM"
                      else None, direction, attrs.get("layout", 0),
                      attrs.get("linear_before_reset", 0))
    extra = {k: v for k, v in attrs.items() if k in ("layout", "linear_before_reset")}
    theirs = getattr(reference, node.op_type.lower())(*values[:len(node.input)],
                                                      direction=direction, **extra,
                                                      n_outputs=len(node.output))
    wanted = [value for name, value in zip(node.output, ours) if name]  # ("": not an output)
    theirs = [value for name, value in zip(node.output, theirs) if name]
    for got, want, ref in zip(wanted, case.data_sets[0][1], theirs, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=case.rtol, atol=case.atol)
        np.testing.assert_allclose(got.numpy(), ref, rtol=case.rtol, atol=case.atol)


@needs_library
def test_the_kernel_takes_the_loop_where_it_computes_the_layer(auto, calls):
    """CpuAcc's LSTM and GRU kernels call C under ``MODE`` "auto" for more than one step of the
    default activations; one step (torch's cell), peepholes, clip and "off" keep torch's."""
    lstm = _tensors(_layer("LSTM", 4, 2, 3, 8, "forward", 0, seed=1))
    gru = _tensors(_layer("GRU", 4, 2, 3, 8, "forward", 0, seed=2))
    recurrent.lstm(*lstm[:7])
    recurrent.gru(*gru[:6], linear_before_reset=1)
    assert len(calls) == 2
    recurrent.lstm(lstm[0][:1], *lstm[1:7])
    recurrent.lstm(*lstm[:7], P=torch.ones(1, 24))
    recurrent.gru(*gru[:6], clip=5.0)
    token = in_c.MODE.set("off")
    try:
        recurrent.lstm(*lstm[:7])
    finally:
        in_c.MODE.reset(token)
    assert len(calls) == 2


def _layer(op, seq, batch, inputs, hidden, direction, layout, seed, bias=True, states=True,
           lengths=None):
    rng = np.random.default_rng(seed)
    dirs, gates = 2 if direction == "bidirectional" else 1, GATES[op] * hidden

    def values(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    x = values(*((batch, seq, inputs) if layout else (seq, batch, inputs)))
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    args = [x, values(dirs, gates, inputs, scale=0.5), values(dirs, gates, hidden, scale=0.4),
            values(dirs, 2 * gates, scale=0.3) if bias else None,
            None if lengths is None else np.array(lengths, np.int32),
            values(*state) if states else None]
    if op == "LSTM":
        args.append(values(*state) if states else None)
    return args


def _tensors(values):
    return [None if v is None else torch.from_numpy(np.asarray(v)) for v in values]


def _both(op, args, direction, layout, linear_before_reset=0):
    """The native layer's outputs and CpuRef's."""
    extra = {"linear_before_reset": linear_before_reset} if op == "GRU" else {}
    X, W, R, B, lens, h0, *c0 = _tensors(args)
    ours = in_c.layer(op.lower(), X, W, R, B, lens, h0, c0[0] if c0 else None, direction, layout,
                      *extra.values())
    theirs = getattr(reference, op.lower())(*args, direction=direction, layout=layout, **extra,
                                            n_outputs=3 if op == "LSTM" else 2)
    return [o.numpy() for o in ours], theirs


@needs_library
@settings(max_examples=60, deadline=None)
@given(op=st.sampled_from(["LSTM", "GRU"]),
       direction=st.sampled_from(["forward", "reverse", "bidirectional"]),
       layout=st.sampled_from([0, 1]), seq=st.integers(1, 6), batch=st.integers(1, 3),
       inputs=st.integers(1, 9), hidden=st.sampled_from([1, 5, 16, 24, 64, 65, 130]),
       bias=st.booleans(), states=st.booleans(), short=st.booleans(),
       linear_before_reset=st.sampled_from([0, 1]), seed=st.integers(0, 2**16))
def test_against_cpuref(op, direction, layout, seq, batch, inputs, hidden, bias, states, short,
                        linear_before_reset, seed):
    lengths = [max(0, seq - b) for b in range(batch)] if short else None
    args = _layer(op, seq, batch, inputs, hidden, direction, layout, seed, bias, states, lengths)
    ours, theirs = _both(op, args, direction, layout, linear_before_reset)
    assert [o.shape for o in ours] == [t.shape for t in theirs]
    # float32 sums of up to 139 products in two orders (the C's registers, AVX-512's even and odd
    # k apart; NumPy's BLAS): 2.3e-6 apart at hidden 130 near zero
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=4e-6)


@needs_library
@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_nan_in_nan_out(op):
    """A NaN in one row's input at step 2 makes that row's states NaN from step 2 on, forward,
    and up to it, backward; the other row, and the steps before it, stay as CpuRef's."""
    args = _layer(op, 5, 2, 3, 70, "bidirectional", 0, seed=3)
    args[0][2, 1, 0] = np.nan
    ours, theirs = _both(op, args, "bidirectional", 0)
    y = ours[0]
    assert np.isnan(y[2:, 0, 1]).all() and not np.isnan(y[:2, 0, 1]).any()
    assert np.isnan(y[:3, 1, 1]).all() and not np.isnan(y[3:, 1, 1]).any()
    assert not np.isnan(y[:, :, 0]).any()
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6, equal_nan=True)


@needs_library
def test_outputs_are_fresh_and_weights_packed_once():
    """Two calls give separate outputs (the caller's alone), the same values; the packing is C's
    layout (its own count of floats): blocks of 64 outputs, each input + hidden rows."""
    args = _layer("LSTM", 4, 1, 3, 24, "forward", 0, seed=5)
    tensors = _tensors(args)
    token = in_c.MODE.set("auto")
    try:
        first = in_c.layer("lstm", *tensors[:6], tensors[6], "forward", 0)
        second = in_c.layer("lstm", *tensors[:6], tensors[6], "forward", 0)
    finally:
        in_c.MODE.reset(token)
    for a, b in zip(first, second):
        assert a.data_ptr() != b.data_ptr()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    R, W = tensors[2], tensors[1]
    packed, bias, w_in, b_in = in_c.prepared("lstm", W, R, tensors[3])
    assert w_in is None and b_in is None  # [W, R] small: read in the loop
    count = in_c._library().backplane_packed_floats
    assert packed.shape == (1, count(3, 24, 0, 0, 0)) == (1, 2 * (3 + 24) * in_c.BW)
    assert bias.shape == (1, count(3, 24, 0, 0, 1)) == (1, 2 * in_c.BW)
    # the first block: the rows of [W, R] (27) over the gates' first 64 outputs
    blocks = packed.reshape(2, 27, in_c.BW)
    torch.testing.assert_close(blocks[0], torch.cat([W[0], R[0]], 1)[:64].T)
    assert not blocks[1, :, 32:].any()  # 96 outputs: the second block padded with zeros


@needs_library
def test_a_large_layer_projects_its_input_first():
    """Past ``STACKED_BYTES`` the loop reads R alone (the library's count for no input rows),
    the input projection one product before it; within CpuRef's values either way."""
    args = _layer("LSTM", 3, 2, 200, 96, "bidirectional", 1, seed=7, lengths=[3, 1])
    tensors = _tensors(args)
    packed, bias, w_in, b_in = in_c.prepared("lstm", *tensors[1:4])
    count = in_c._library().backplane_packed_floats
    assert w_in.shape == (2 * 4 * 96, 200) and packed.shape == (2, count(0, 96, 0, 0, 0))
    ours, theirs = _both("LSTM", args, "bidirectional", 1)
    for got, want in zip(ours, theirs):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-6)


def _session(path, mode, threads=1):
    options = {"CpuAcc.native": mode, "CpuAcc.threads": threads,
               "CpuAcc.compile": "onednn_graph"}  # the trace kept whenever there is one
    return InferenceSession(str(path), backends=["CpuAcc", "CpuRef"],  # GpuAcc first where a GPU is
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


CORPUS_ROWS = {"lstm_bi2_ts14": 2, "lstm_bi2_dyn18": 2, "gru_bi2_dyn19": 2,
               "crnn_paddle_ts12": 2, "gru_tm3_ts13": 3}
"""The corpus's models with recurrent layers of more than one step -> their layers (gru_tm3's
three: its GruStack's, ``NativeStack``; lstm_bi2_ts14's and crnn's an LstmStack's)."""


@needs_library
@pytest.mark.parametrize("name", CORPUS_ROWS)
def test_corpus_rows_against_cpuref(name, calls):
    """Each recurrent layer of the corpus's models one native call a run, the outputs within
    1e-5 of CpuRef's on both samples."""
    path = CORPUS / f"{name}.onnx"
    session, ref = _session(path, "auto"), InferenceSession(str(path), providers=["CpuRef"])
    for sample in ("s0", "s1"):
        feeds = dict(np.load(CORPUS / f"{name}.{sample}.npz"))
        session.run(None, feeds)  # (a free-size model builds its signature at its first run)
        calls.clear()
        got, want = session.run(None, feeds), ref.run(None, feeds)
        assert len(calls) == CORPUS_ROWS[name]
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["lstm_bi2_ts14", "gru_bi2_dyn19", "gru_tm3_ts13"])
def test_off_and_no_compiler_keep_torch(name, calls, monkeypatch):
    """``CpuAcc.native`` "off", and "auto" where no library can be built, run no native call, and
    compute what CpuRef does."""
    path = CORPUS / f"{name}.onnx"
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    want = InferenceSession(str(path), providers=["CpuRef"]).run(None, feeds)
    off = _session(path, "off")
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(in_c, "_FUNCTIONS", [])
    missing = _session(path, "auto")
    for session in (off, missing):
        for _ in range(2):
            got = session.run(None, feeds)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not calls


def _lstm_graph(seq=5, clip=None, activations=None, peepholes=None):
    """One bidirectional LSTM (input 3, hidden 4) as the importer makes its graph."""
    from backplane.frontends.onnx import import_onnx

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("W", (2, 16, 3)), ("R", (2, 16, 4)))]
    inputs = ["x", "W", "R"]
    if peepholes is not None:
        inits.append(numpy_helper.from_array(np.full((2, 12), peepholes, np.float32), "P"))
        inputs += ["", "", "", "", "P"]
    attrs = {"hidden_size": 4, "direction": "bidirectional"}
    if clip is not None:
        attrs["clip"] = clip
    if activations:
        attrs["activations"] = activations
    node = helper.make_node("LSTM", inputs, ["y"], **attrs)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, 1, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([node], "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    return import_onnx(model)


@needs_library
def test_steps_in_c_says_which_layers_a_trace_runs_natively():
    """``steps_in_c``: a plain LSTM of more than one step under "auto" (zero peepholes too); not
    under "off", nor with a clip, other activations, nonzero peepholes or one step."""
    def says(native="auto", **given):
        graph = _lstm_graph(**given)
        (layer,) = [lay for lay in graph.layers if lay.op_type == "LSTM"]
        return in_c.steps_in_c(layer, graph, native)

    assert says() and says(peepholes=0.0)
    assert not says("off")
    assert not says(clip=3.0)
    assert not says(activations=["Sigmoid", "Tanh", "Relu"] * 2)
    assert not says(peepholes=0.5)
    assert not says(seq=1)
