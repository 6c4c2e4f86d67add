"""The native CNN plan's sequence layers (native/cnn_seq.py, cnn_seq.h): a GELU written out in
Erf folded into one GeluChain (the exporters' three orders), an Erf of its own, int32, int64 and
bool inputs as indices, an embedding's Gather of a constant table (with its mask's Mul and the
Transpose to (N, C, L)), CpuAcc's WindowedConv; against CpuRef and ONNX Runtime, NaN and
infinities in, an index out of range an error as CpuRef's; the corpus's audio_conv1d_dyn19 and
bytes_int32_dyn20 whole in C at both of their sizes (s0, s1) through their free dimensions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402
from backplane.native import cnn_seq  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.native.test_cnn import CORPUS, _session, needs_compiler  # noqa: E402
from tests.native.test_cnn_moves import _partition_routes  # noqa: E402

SQRT2 = np.float32(math.sqrt(2))


def _gelu_nodes(form: str, x: str, y: str, inits: list) -> list:
    """GELU of ``x`` as the exporters write it: dynamo's x * ((erf(x / sqrt 2) + 1) * 0.5),
    torchscript's (x * (1 + erf)) * 0.5, (x * 0.5) * (1 + erf), or by x * (1 / sqrt 2)."""
    inits += [numpy_helper.from_array(v, n) for n, v in (
        ("s2", SQRT2), ("r2", np.float32(1 / math.sqrt(2))), ("one", np.float32(1)),
        ("half", np.float32(0.5))) if n not in {i.name for i in inits}]
    scale = helper.make_node("Mul", [x, "r2"], [y + "_t"]) if form == "times" else \
        helper.make_node("Div", [x, "s2"], [y + "_t"])
    head = [scale, helper.make_node("Erf", [y + "_t"], [y + "_e"]),
            helper.make_node("Add", [y + "_e", "one"], [y + "_a"])]
    if form in ("dynamo", "times"):
        return head + [helper.make_node("Mul", ["half", y + "_a"], [y + "_h"]),
                       helper.make_node("Mul", [x, y + "_h"], [y])]
    if form == "torchscript":
        return head + [helper.make_node("Mul", [x, y + "_a"], [y + "_m"]),
                       helper.make_node("Mul", [y + "_m", "half"], [y])]
    return [helper.make_node("Mul", [x, "half"], [y + "_x"])] + head + [
        helper.make_node("Mul", [y + "_x", y + "_a"], [y])]


def _run_both(model, feeds, **kwargs):
    session = _session(model, **kwargs)
    got = session.run(None, feeds)
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    return session, got, want


def _close(got, want, rtol=1e-5):
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        finite = np.abs(w[np.isfinite(w)]).max(initial=1.0)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6 * finite)


def _plan_ops(session) -> list[str]:
    loaded = session.runtime.network(session.network_id)
    return [op for step in loaded.steps
            if getattr(step.workload, "executor", None) is not None
            for _, op in step.workload.executor.plan.names]


@needs_compiler
@pytest.mark.parametrize("form", ["dynamo", "torchscript", "half_first", "times"])
@pytest.mark.parametrize("where", ["after_conv", "first"])
def test_a_gelu_written_out_is_one_layer_of_the_plan_and_matches_cpuref(form, where):
    """After a convolution the GELU is its post-op; first, over the input, a pass of its own:
    NaN, +Inf and -Inf in give CpuRef's NaN, +Inf and NaN (-Inf * 0)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3)).astype(np.float32), "w0"),
             numpy_helper.from_array(rng.standard_normal((5, 4, 2)).astype(np.float32), "w1")]
    if where == "after_conv":
        nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], strides=[2]),
                 *_gelu_nodes(form, "c0", "g", inits),
                 helper.make_node("Conv", ["g", "w1"], ["y"])]

    else:
        nodes = [*_gelu_nodes(form, "x", "g", inits),
                 helper.make_node("Conv", ["g", "w0"], ["c0"], strides=[2]),
                 helper.make_node("Conv", ["c0", "w1"], ["y"])]

    x = (rng.standard_normal((2, 3, 41)) * 3).astype(np.float32)
    x[0, 0, [3, 9, 20]] = [np.nan, np.inf, -np.inf]
    model = make_model(nodes, [float_input("x", [2, 3, 41])], [float_input("y", None)], inits,
                       opset=17)
    session, got, want = _run_both(model, {"x": x})
    assert _partition_routes(session) == ["native"]
    ops = _plan_ops(session)
    assert "Erf" not in ops and ops.count("GeluChain") == (where == "first"), ops
    _close(got, want)
    assert np.isnan(got[0]).any() and np.isfinite(got[0][1]).all()


@needs_compiler
def test_an_erf_of_its_own_matches_cpuref():
    """An Erf that is no GELU's, after a Tanh (a record of its own; after the convolution it
    would be its post-op): the 8-lane erf, within 5e-7 of CpuRef's; NaN in -> NaN out."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3)).astype(np.float32), "w0")]
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"]),
             helper.make_node("Tanh", ["c0"], ["t"]), helper.make_node("Erf", ["t"], ["e"]),
             helper.make_node("Mul", ["e", "c0"], ["y"])]
    x = rng.standard_normal((1, 3, 30)).astype(np.float32)
    x[0, 1, 4], x[0, 2, 17] = np.nan, np.inf
    model = make_model(nodes, [float_input("x", [1, 3, 30])], [float_input("y", None)], inits,
                       opset=17)
    session, got, want = _run_both(model, {"x": x})
    assert _partition_routes(session) == ["native"] and "Erf" in _plan_ops(session)
    _close(got, want)


@needs_compiler
@pytest.mark.parametrize("op", ["Relu", "Clip", "HardSwish", "HardSigmoid", "Sigmoid",
                                "LeakyRelu", "Tanh", "Erf"])
def test_an_activation_record_of_its_own_matches_cpuref(op):
    """After a Transpose (a gather: no convolution to take it as its post-op), a pass of its
    own, 16 lanes at a time on AVX-512 and the tail (5 x 7 x 3 = 105 floats) after; NaN, +Inf
    and -Inf in."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(rng.standard_normal((5, 3, 1)).astype(np.float32), "w"),
             numpy_helper.from_array(np.float32(-0.5), "lo"),
             numpy_helper.from_array(np.float32(0.75), "hi")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("Transpose", ["c"], ["t"], perm=[0, 2, 1]),
             helper.make_node(op, ["t", "lo", "hi"] if op == "Clip" else ["t"], ["y"])]
    x = (rng.standard_normal((3, 3, 7)) * 4).astype(np.float32)
    x[0, :, 1], x[1, :, 2], x[2, :, 6] = np.nan, np.inf, -np.inf
    model = make_model(nodes, [float_input("x", [3, 3, 7])], [float_input("y", None)], inits,
                       opset=17)
    session, got, want = _run_both(model, {"x": x})
    assert _partition_routes(session) == ["native"] and op in _plan_ops(session)
    _close(got, want)


@needs_compiler
@pytest.mark.parametrize("tail", ["linear", "linear_relu", "norm", "norm_then_relu"])
@pytest.mark.parametrize("row", [cnn_seq.ROW, 1])
def test_a_norm_over_the_channels_of_a_transposed_line_matches_cpuref(tail, row, monkeypatch):
    """audio_conv1d's tail: Transpose (N, C, L) -> (N, L, C), LayerNormalization over C, the
    product by a constant (CpuAcc's Linear; with a Relu its post-op): one RowNorm over the
    channels-last rows (one rownorm record; rows wider than ``ROW`` an lnorm and a linear), the
    product's rows exported as they are; the norm's own output (a partition output, or read by
    a Relu: a copy in channels-last first); NaN in one step, +Inf in another (its rows NaN)."""
    monkeypatch.setattr(cnn_seq, "ROW", row)
    rng = np.random.default_rng(5)
    c, o = 6, 10
    inits = [numpy_helper.from_array(rng.standard_normal((c, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "g"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((c, o)).astype(np.float32), "m"),
             numpy_helper.from_array(rng.standard_normal(o).astype(np.float32), "mb")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["cv"], strides=[2]),
             helper.make_node("Transpose", ["cv"], ["t"], perm=[0, 2, 1]),
             helper.make_node("LayerNormalization", ["t", "g", "b"], ["n"], axis=-1,
                              epsilon=1e-5)]
    if tail.startswith("linear"):
        nodes += [helper.make_node("MatMul", ["n", "m"], ["p"]),
                  helper.make_node("Add", ["p", "mb"], ["y" if tail == "linear" else "q"])]
    if tail.endswith("relu"):
        nodes.append(helper.make_node("Relu", ["q" if tail == "linear_relu" else "n"], ["y"]))
    outputs = ["n"] if tail == "norm" else ["y"]
    x = rng.standard_normal((2, 3, 23)).astype(np.float32)
    x[1, 0, 5], x[1, 2, 17] = np.nan, np.inf
    model = make_model(nodes, [float_input("x", [2, 3, 23])],
                       [float_input(name, None) for name in outputs], inits, opset=17)
    session, got, want = _run_both(model, {"x": x})
    ops = _plan_ops(session)
    assert _partition_routes(session) == ["native"] and "RowNorm" in ops
    assert "Linear" not in ops and "Transpose" not in ops and "LayerNormalization" not in ops
    assert np.isnan(got[0][1]).any() and not np.isnan(got[0][0]).any()
    _close(got, want)
    _close(got, [__import__("onnxruntime").InferenceSession(model.SerializeToString())
                 .run(None, {"x": x})[0]], rtol=1e-4)


def _layer(op, inputs, outputs, **attrs):
    return Layer(f"{op}_{outputs[0]}", op, list(inputs), list(outputs), attrs, "", 17)


def test_a_gelu_whose_parts_are_read_elsewhere_is_not_folded():
    constants = {"s2": SQRT2, "one": np.float32(1), "half": np.float32(0.5),
                 "h4": np.float32(0.4)}
    chain = [_layer("Div", ["x", "s2"], ["t"]), _layer("Erf", ["t"], ["e"]),
             _layer("Add", ["e", "one"], ["a"]), _layer("Mul", ["half", "a"], ["h"]),
             _layer("Mul", ["x", "h"], ["y"])]
    (fused,) = cnn_seq.fold(chain, constants, ["y"])
    assert (fused.op_type, fused.inputs, fused.outputs) == ("GeluChain", ["x"], ["y"])
    assert [lay.op_type for lay in cnn_seq.fold(chain, constants, ["y", "e"])] == \
        ["Div", "Erf", "Add", "Mul", "Mul"]  # e an output of the partition
    other = [*chain, _layer("Relu", ["a"], ["r"])]
    assert len(cnn_seq.fold(other, constants, ["y", "r"])) == 6  # a read by a Relu too
    wrong = [*chain[:3], _layer("Mul", ["h4", "a"], ["h"]), chain[4]]
    assert len(cnn_seq.fold(wrong, constants, ["y"])) == 5  # 0.4: not a GELU


def _embedding_model(index_type, mask: bool, transposed: bool, n=2, length=37):
    """(N, L) indices and a bool mask -> Gather of a (V, E) table -> Mul by the mask ->
    Transpose to (N, E, L) -> Conv1d stride 2 (or, untransposed, a Conv1d over L's channels)
    -> Conv1d 1x1."""
    rng = np.random.default_rng(2)
    vocab, width = 11, 6
    table = rng.standard_normal((vocab, width)).astype(np.float32)
    table[3, 2], table[5, 0] = np.nan, np.inf
    inits = [numpy_helper.from_array(table, "table"),
             numpy_helper.from_array(np.array([-1], np.int64), "axis")]
    nodes = [helper.make_node("Gather", ["table", "idx"], ["emb"], axis=0)]
    source = "emb"
    if mask:
        nodes += [helper.make_node("Unsqueeze", ["valid", "axis"], ["v3"]),
                  helper.make_node("Cast", ["v3"], ["vf"], to=TensorProto.FLOAT),
                  helper.make_node("Mul", ["emb", "vf"], ["masked"])]
        source = "masked"
    if transposed:
        nodes.append(helper.make_node("Transpose", [source], ["t"], perm=[0, 2, 1]))
        weight = rng.standard_normal((4, width, 5)).astype(np.float32)
    else:
        nodes.append(helper.make_node("Identity", [source], ["t"]))
        weight = rng.standard_normal((4, length, 3)).astype(np.float32)
    inits += [numpy_helper.from_array(weight, "w"),
              numpy_helper.from_array(rng.standard_normal((3, 4, 1)).astype(np.float32), "w1")]
    nodes += [helper.make_node("Conv", ["t", "w"], ["c"], strides=[2]),
              helper.make_node("Conv", ["c", "w1"], ["y"])]  # a partition of 3 layers at least
    inputs = [helper.make_tensor_value_info("idx", index_type, [n, length])]
    index = rng.integers(-vocab, vocab, (n, length))
    feeds = {"idx": index.astype(np.int32 if index_type == TensorProto.INT32 else np.int64)}
    if mask:
        inputs.append(helper.make_tensor_value_info("valid", TensorProto.BOOL, [n, length]))
        feeds["valid"] = rng.random((n, length)) < 0.7
        feeds["valid"][0, np.flatnonzero(feeds["idx"][0] % vocab == 5)] = False  # 0 * inf
    return make_model(nodes, inputs, [float_input("y", None)], inits, opset=17), feeds


@needs_compiler
@pytest.mark.parametrize("index_type", [TensorProto.INT32, TensorProto.INT64])
@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("transposed", [True, False])
def test_an_embedding_by_integer_inputs_is_one_record_and_matches_cpuref(index_type, mask,
                                                                        transposed):
    """Negative indices count from the end; a NaN or an infinity in the table, and 0 * inf
    where the mask is off, give CpuRef's NaN."""
    model, feeds = _embedding_model(index_type, mask, transposed)
    session, got, want = _run_both(model, feeds)
    assert _partition_routes(session) == ["native"]
    ops = _plan_ops(session)
    assert ops.count("Embedding") == 1 and "Gather" not in ops and "Mul" not in ops, ops
    _close(got, want)
    assert np.isnan(got[0]).any()


@needs_compiler
@pytest.mark.parametrize("bad", [11, -12, 1 << 30])
def test_an_index_outside_the_table_fails_the_run_as_cpurefs_does(bad):
    """11 and -12 are outside a table of 11 rows; 2^30 has no exact float (the import fails)."""
    model, feeds = _embedding_model(TensorProto.INT64, True, True)
    feeds["idx"][1, 7] = bad
    session = _session(model)
    assert _partition_routes(session) == ["native"]
    with pytest.raises(Exception):
        InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    with pytest.raises(Exception, match="out of range|index|failed"):
        session.run(None, feeds)


@needs_compiler
@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMean"])
@pytest.mark.parametrize("rank", [3, 4])
@pytest.mark.parametrize("keepdims", [0, 1])
def test_a_max_or_mean_over_the_length_is_a_global_pool_and_matches_cpuref(op, rank, keepdims):
    """bytes_int32's ReduceMax over L of (N, C, L) (or an image's H and W): the global pool's
    record, channels innermost; a NaN in one channel's length gives that channel NaN, -Inf
    stays out of a max."""
    rng = np.random.default_rng(3)
    spatial = [9] if rank == 3 else [4, 5]
    inits = [numpy_helper.from_array(rng.standard_normal((6, 3, *[1] * len(spatial)))
                                     .astype(np.float32), "w"),
             numpy_helper.from_array(np.arange(2, rank, dtype=np.int64), "axes")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node(op, ["c", "axes"], ["m"], keepdims=keepdims),
             helper.make_node("Add", ["m", "m"], ["y"])]
    x = rng.standard_normal((2, 3, *spatial)).astype(np.float32)
    x[1, 0].reshape(-1)[2] = np.nan
    x[0, 1].reshape(-1)[0] = -np.inf
    model = make_model(nodes, [float_input("x", [2, 3, *spatial])], [float_input("y", None)],
                       inits, opset=18)
    session, got, want = _run_both(model, {"x": x})
    assert _partition_routes(session) == ["native"]
    assert op in _plan_ops(session) and np.isnan(got[0]).any()
    loaded = session.runtime.network(session.network_id)
    (executor,) = [s.workload.executor for s in loaded.steps if hasattr(s.workload, "executor")]
    from backplane.native import cnn

    assert (cnn.OPS["gmp" if op == "ReduceMax" else "gap"] in executor.plan.records[:, 0])
    _close(got, want)


@needs_compiler
def test_an_integer_input_read_other_than_as_indices_is_left_to_torch():
    """An int64 input Cast to float and added: not planned (a value above 2^24 has no exact
    float in the arena: the plan reads int32 and int64 inputs only as a gather's indices, where
    such a value is out of range anyway); torch's route gives CpuRef's rounding of 2^25 + 1."""
    rng = np.random.default_rng(6)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3)).astype(np.float32), "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["c", "kf"], ["s"]), helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, [float_input("x", [1, 3, 10]),
                               helper.make_tensor_value_info("k", TensorProto.INT64, [1, 4, 8])],
                       [float_input("y", None)], inits, opset=17)
    feeds = {"x": rng.standard_normal((1, 3, 10)).astype(np.float32),
             "k": rng.integers(-3, 3, (1, 4, 8))}
    feeds["k"][0, 1, 2] = (1 << 25) + 1
    session, got, want = _run_both(model, feeds)
    assert "native" not in _partition_routes(session)
    _close(got, want)


@needs_compiler
@pytest.mark.parametrize("name", ["audio_conv1d_dyn19", "bytes_int32_dyn20"])
def test_the_corpus_rows_run_whole_in_c_at_both_sizes_and_match_onnx_runtime(name):
    """Their free batch and length: each signature's build (Specialized) one native call."""
    import onnxruntime

    path = f"{CORPUS}/{name}.onnx"
    session = _session(path)
    reference = onnxruntime.InferenceSession(path)
    for size in ("s0", "s1"):
        feeds = dict(np.load(f"{CORPUS}/{name}.{size}.npz"))
        got = session.run(None, feeds)
        want = reference.run(None, feeds)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * max(1.0, abs(w).max()))
    loaded = session.runtime.network(session.network_id)
    (built,) = [step.workload.built for step in loaded.steps if hasattr(step.workload, "built")]
    assert len(built) == 2
    for runner in built.values():
        alone = getattr(runner, "alone", None) or getattr(getattr(runner, "work", None),
                                                          "alone", None)
        assert getattr(alone, "route", None) == "native", alone


FLAVOURS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"],
            "plain": ["-march=x86-64"]}
"""cnn.c as the route builds it (AVX-512 where this CPU has it), as an AVX2-only CPU (a CI
machine) builds it, and without AVX (the generic vectors split)."""


@pytest.fixture(scope="module")
def flavours(tmp_path_factory):
    import platform

    from backplane.native import build

    if build.compiler() is None or platform.machine() != "x86_64":
        pytest.skip("needs a C compiler on x86-64")
    from tests.native.flavours import built

    folder = tmp_path_factory.mktemp("cnn_seq_flavours")
    return {name: built("cnn", march, folder) for name, march in FLAVOURS.items()}


@pytest.mark.parametrize("name", ["audio_conv1d_dyn19", "bytes_int32_dyn20"])
def test_every_build_runs_the_corpus_rows_plans_to_onnx_runtime(flavours, name, monkeypatch):
    """The plans the route made at s1 (its batch of 3), run by each build of cnn.c."""
    import onnxruntime

    from backplane.native import cnn

    caught, real = [], cnn.plan

    def catch(*args):
        made = real(*args)
        caught.append((made, list(args[2])))
        return made

    monkeypatch.setattr(cnn, "plan", catch)
    path = f"{CORPUS}/{name}.onnx"
    feeds = dict(np.load(f"{CORPUS}/{name}.s1.npz"))
    _session(path).run(None, feeds)
    assert caught, "not planned natively"
    made, names = caught[-1]
    (want,) = onnxruntime.InferenceSession(path).run(None, feeds)
    for flavour, library in flavours.items():
        (got,) = cnn.Executor(made, library).numpy(*[feeds[n] for n in names])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * abs(want).max(),
                                   err_msg=flavour)
