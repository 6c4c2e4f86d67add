"""A Traced partition of recurrent layers and the moves around them as one C call
(``native/recurrent_net.py``, ``fusion/recurrent_net.py``): the corpus's recurrent partitions one
call a run, against CpuRef and ONNX Runtime; nets written with onnx.helper (LSTM or GRU, every
direction, one or two layers as exporters stack them, initial states or none, a head, a Softmax)
against both, by hypothesis; NaN in -> NaN out; fresh outputs; "off" and no compiler keep the
trace.

    python -m pytest -o addopts="" -q -p no:cacheprovider tests/native/test_recurrent_net.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

needs_library = pytest.mark.skipif(not build.available("recurrent"),
                                   reason="no native recurrent library (no C compiler)")
CORPUS = Path(__file__).parents[1] / "data" / "corpus"
GATES = {"LSTM": 4, "GRU": 3}


@pytest.fixture
def calls(monkeypatch):
    """The native recurrent nets' calls, counted."""
    from backplane.native import recurrent_net

    made = []
    run = recurrent_net.Executor.run

    def counted(self, pointers):
        made.append(self)
        return run(self, pointers)

    monkeypatch.setattr(recurrent_net.Executor, "run", counted)
    return made


def _session(path, mode="auto"):
    options = {"CpuAcc.native": mode, "CpuAcc.threads": 1}
    return InferenceSession(str(path), backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _close(got, want, atol=1e-5):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol, equal_nan=True)


CORPUS_NETS = {"lstm_bi2_ts14": ("s0", "s1"), "lstm_bi2_dyn18": ("s0", "s1"),
               "gru_tm3_ts13": ("s0", "s1"), "gru_bi2_dyn19": ("s0", "s1"),
               "vad_lstm_if_ts16": ("s0", "s1"), "crnn_paddle_ts12": ("s0",)}
"""The corpus's recurrent models -> the samples whose recurrent partition runs natively (the
CRNN's after its convolutions where the native CNN plan takes them: its s1, batch 2, is past
``native_cnn.SMALL`` and stays traced whole)."""


@needs_library
@pytest.mark.parametrize("name", CORPUS_NETS)
def test_corpus_recurrent_partitions_one_call_a_run(name, calls):
    """Each model's recurrent partition (the VAD's and the CRNN's after their convolutions) is
    one native call a run, within 1e-5 of CpuRef and ONNX Runtime."""
    ort = pytest.importorskip("onnxruntime")
    path = CORPUS / f"{name}.onnx"
    session, ref = _session(path), InferenceSession(str(path), providers=["CpuRef"])
    theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for sample in CORPUS_NETS[name]:
        feeds = dict(np.load(CORPUS / f"{name}.{sample}.npz"))
        session.run(None, feeds)
        calls.clear()
        got = session.run(None, feeds)
        assert len(calls) == 1
        _close(got, ref.run(None, feeds))
        _close(got, theirs.run(None, feeds))


@pytest.mark.parametrize("name", ["lstm_bi2_ts14", "vad_lstm_if_ts16"])
def test_off_keeps_the_trace(name, calls):
    """``CpuAcc.native`` "off": no native net, CpuRef's values."""
    path = CORPUS / f"{name}.onnx"
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    session = _session(path, "off")
    for _ in range(2):
        got = session.run(None, feeds)
    _close(got, InferenceSession(str(path), providers=["CpuRef"]).run(None, feeds))
    assert not calls


def test_without_a_compiler_the_trace_stays(tmp_path, monkeypatch, calls):
    monkeypatch.setenv("BACKPLANE_NATIVE_CACHE", str(tmp_path / "native"))
    monkeypatch.setattr(build, "_loaded", {})
    monkeypatch.setattr(build, "compiler", lambda: None)
    path = CORPUS / "gru_tm3_ts13.onnx"
    feeds = dict(np.load(CORPUS / "gru_tm3_ts13.s0.npz"))
    got = _session(path).run(None, feeds)
    _close(got, InferenceSession(str(path), providers=["CpuRef"]).run(None, feeds))
    assert not calls


def _net(op, direction, layers, seq, batch, inputs, hidden, states, lbr, softmax, seed):
    """An exporter's stacked net: x batch-first made time-major, each layer's Y made (seq, batch,
    dirs * H) by Transpose and Reshape for the next, then a MatMul + Add head (and a Softmax);
    its final states out. (At least three layers after fusion: a partition CpuAcc traces.)"""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates = GATES[op]
    nodes, inits, graph_inputs, outputs = [], [], [], []

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def info(name, shape):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))

    graph_inputs.append(info("x", (batch, seq, inputs)))
    inits.append(numpy_helper.from_array(np.array([0, 0, -1], np.int64), "merge"))
    nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2]))
    current, width = "xt", inputs
    for layer in range(layers):
        w = const(f"W{layer}", rng.standard_normal((dirs, gates * hidden, width)) * 0.4)
        r = const(f"R{layer}", rng.standard_normal((dirs, gates * hidden, hidden)) * 0.4)
        b = const(f"B{layer}", rng.standard_normal((dirs, 2 * gates * hidden)) * 0.4)
        given = [current, w, r, b, ""]
        for state in (["h", "c"] if op == "LSTM" else ["h"]):
            name = f"{state}0_{layer}"
            if states:
                graph_inputs.append(info(name, (dirs, batch, hidden)))
            given.append(name if states else "")
        while given and not given[-1]:
            given.pop()
        produced = [f"Y{layer}", f"Yh{layer}"] + ([f"Yc{layer}"] if op == "LSTM" else [])
        attrs = {"hidden_size": hidden, "direction": direction}
        if op == "GRU":
            attrs["linear_before_reset"] = lbr
        nodes.append(helper.make_node(op, given, produced, **attrs))
        nodes += [helper.make_node("Transpose", [f"Y{layer}"], [f"T{layer}"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [f"T{layer}", "merge"], [f"M{layer}"])]
        outputs += [info(n, (dirs, batch, hidden)) for n in produced[1:]]
        current, width = f"M{layer}", dirs * hidden
    head = const("head", rng.standard_normal((width, 5)) * 0.4)
    bias = const("bias", rng.standard_normal(5) * 0.4)
    nodes += [helper.make_node("MatMul", [current, head], ["P"]),
              helper.make_node("Add", ["P", bias], ["y" if not softmax else "Q"])]
    if softmax:
        nodes.append(helper.make_node("Softmax", ["Q"], ["y"], axis=-1))
    outputs.insert(0, info("y", (seq, batch, 5)))
    graph = helper.make_graph(nodes, "rnet", graph_inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    feeds = {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim])
             .astype(np.float32) for i in graph_inputs}
    return model, feeds


def _compare(model, feeds, tmp_path, calls, atol, against_ort=True):
    ort = pytest.importorskip("onnxruntime")
    path = tmp_path / "net.onnx"
    onnx.save(model, path)
    session = _session(path)
    calls.clear()
    got = session.run(None, feeds)
    assert len(calls) == 1
    _close(got, InferenceSession(str(path), providers=["CpuRef"]).run(None, feeds), atol)
    if against_ort:
        theirs = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        _close(got, theirs.run(None, feeds), atol)
    return got


@needs_library
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # (calls: cleared a net)
@given(op=st.sampled_from(["LSTM", "GRU"]),
       direction=st.sampled_from(["forward", "reverse", "bidirectional"]),
       layers=st.integers(1, 2), seq=st.integers(1, 5), batch=st.integers(1, 3),
       inputs=st.integers(1, 9), hidden=st.sampled_from([1, 5, 24, 65]),
       states=st.booleans(), lbr=st.integers(0, 1), softmax=st.booleans(),
       seed=st.integers(0, 2**16))
def test_nets_against_cpuref_and_onnxruntime(op, direction, layers, seq, batch, inputs, hidden,
                                             states, lbr, softmax, seed, tmp_path_factory, calls):
    model, feeds = _net(op, direction, layers, seq, batch, inputs, hidden, states, lbr, softmax,
                        seed)
    # a layer's error (the C's rational tanh and exp-based sigmoid) is the next layer's input
    _compare(model, feeds, tmp_path_factory.mktemp("net"), calls, 2e-6 * 4 ** layers)


@needs_library
def test_a_large_layer_projects_its_input_first(tmp_path, calls):
    """Past ``recurrent.STACKED_BYTES`` a layer's input projection is a product record first."""
    from backplane.native import recurrent_net

    model, feeds = _net("LSTM", "bidirectional", 2, 3, 2, 200, 96, True, 0, False, 3)
    _compare(model, feeds, tmp_path, calls, 1e-5)
    (executor,) = set(calls)
    kinds = list(executor.records[:, 0])
    assert kinds.count(recurrent_net.LINEAR) == 3  # both layers' projections and the head
    assert kinds.count(recurrent_net.RNN) == 2


@needs_library
@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_nan_in_nan_out_and_fresh_outputs(op, tmp_path, calls):
    """A NaN in one row at step 2 reaches that row's outputs from step 2 on (forward), as CpuRef
    computes it (ONNX Runtime's LSTM drops it: no NaN out), the other row stays a number; two
    runs give separate outputs, the same values."""
    model, feeds = _net(op, "forward", 2, 5, 2, 3, 8, False, 1, False, 5)
    feeds["x"][1, 2, 0] = np.nan
    first = _compare(model, feeds, tmp_path, calls, 1e-5, against_ort=False)
    assert np.isnan(first[0][2:, 1]).all() and not np.isnan(first[0][:2, 1]).any()
    assert not np.isnan(first[0][:, 0]).any()
    second = _session(tmp_path / "net.onnx").run(None, feeds)
    for a, b in zip(first, second):
        assert a.ctypes.data != b.ctypes.data
        np.testing.assert_array_equal(a, b)


@needs_library
def test_threads_running_one_session_keep_their_own_arena(calls):
    """Two threads running one session at once (ctypes lets the GIL go during the C call): the
    second takes a fresh arena while the first holds the plan's, each its own values."""
    import threading

    path = CORPUS / "lstm_bi2_ts14.onnx"
    session = _session(path)
    first = dict(np.load(CORPUS / "lstm_bi2_ts14.s0.npz"))
    feeds = [first, {k: v[..., ::-1].copy() for k, v in first.items()}]  # one plan, two inputs
    wanted = [session.run(None, f) for f in feeds]
    wrong: list[int] = []

    def work(index):
        for _ in range(200):
            got = session.run(None, feeds[index])
            if not all(np.array_equal(a, b) for a, b in zip(got, wanted[index])):
                wrong.append(index)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls and not wrong


@needs_library
def test_the_largest_product_follows_the_tile():
    """AVX-512's tile (12 rows, built where the CPU has it) takes products of any size; AVX2's
    keeps those past ``LINEAR_MACS`` in the trace."""
    from backplane.native import recurrent_net

    rows = build.library("recurrent").backplane_rnet_rows()
    assert rows == (12 if "avx512f" in build._cpu_flags() else 6)
    wide = recurrent_net.largest_product()
    assert wide == (float("inf") if rows == 12 else recurrent_net.LINEAR_MACS)



@needs_library
def test_no_library_for_a_while_is_not_kept_as_the_tile(monkeypatch):
    """A library unavailable once (``BACKPLANE_NATIVE=0`` in a test, a failed build) answers
    ``LINEAR_MACS`` then, and is not kept: the GPU machine's run of the test files latched AVX2's
    bound in a worker whose library had been switched off in an earlier test."""
    from backplane.native import recurrent_net

    monkeypatch.setattr(recurrent_net, "_WIDE", [])
    real = build.library

    def off(name, version=None):
        raise build.NativeUnavailable("switched off")

    monkeypatch.setattr(build, "library", off)
    assert recurrent_net.largest_product() == recurrent_net.LINEAR_MACS
    assert recurrent_net._WIDE == []
    monkeypatch.setattr(build, "library", real)
    rows = real("recurrent").backplane_rnet_rows()
    assert recurrent_net.largest_product() == (float("inf") if rows == 12
                                               else recurrent_net.LINEAR_MACS)
@needs_library
@pytest.mark.parametrize("wide", [True, False])
def test_a_projection_past_four_million_is_planned_by_the_wide_tile_alone(wide, tmp_path, calls,
                                                                            monkeypatch):
    """A layer whose input projection is 21M multiply-adds (80 rows x 256 x 1024): one native
    call with AVX-512's tile, within CpuRef's and ONNX Runtime's values; the trace with AVX2's."""
    from backplane.native import recurrent_net

    if wide and build.library("recurrent").backplane_rnet_rows() != 12:
        pytest.skip("this CPU builds AVX2's tile")
    monkeypatch.setattr(recurrent_net, "_WIDE", [wide])
    model, feeds = _net("LSTM", "bidirectional", 1, 40, 2, 256, 128, False, 0, False, 11)
    path = tmp_path / "net.onnx"
    onnx.save(model, path)
    got = _session(path).run(None, feeds)
    assert len(calls) == (1 if wide else 0)
    _close(got, InferenceSession(str(path), providers=["CpuRef"]).run(None, feeds), 1e-5)


@needs_library
@pytest.mark.parametrize("name,products", [("crnn_paddle_ts12", 3), ("lstm_bi2_ts14", 1)])
def test_layers_whose_weights_leave_l1_project_their_inputs_first(name, products, calls):
    """The CRNN's layers (80 steps, [W, R] 48 KB a direction) each have their input projection
    as a product record before the loop, beside the head's; lstm_bi2's (8 steps) read [W, R]."""
    from backplane.native import recurrent_net

    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    _session(CORPUS / f"{name}.onnx").run(None, feeds)
    (executor,) = set(calls)
    kinds = list(executor.records[:, 0])
    assert kinds.count(recurrent_net.LINEAR) == products
    assert kinds.count(recurrent_net.RNN) == 2
