"""builtin's control flow: If, Loop and Scan bodies placed like any layers, matched against ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from backplane import InferenceSession
from tests.conftest import float_input, make_model

ort = pytest.importorskip("onnxruntime")


def ort_run(model: onnx.ModelProto, feeds: dict) -> list:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def scalar(name: str, elem: int, shape=()) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, list(shape))


def if_model() -> onnx.ModelProto:
    """y = cond ? relu(x * w) : -(x + w); both branches read outer tensors x and w."""
    then = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["t0"], name="t_mul"),
                              helper.make_node("Relu", ["t0"], ["t"], name="t_relu")],
                             "then", [], [float_input("t", [4])])
    other = helper.make_graph([helper.make_node("Add", ["x", "w"], ["e0"], name="e_add"),
                               helper.make_node("Neg", ["e0"], ["e"], name="e_neg")],
                              "else", [], [float_input("e", [4])])
    w = numpy_helper.from_array(np.array([1, -2, 3, -4], np.float32), "w")
    node = helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other)
    return make_model([node], [scalar("cond", TensorProto.BOOL), float_input("x", [4])],
                      [float_input("y", [4])], [w])


@pytest.mark.parametrize("cond", [True, False])
def test_if_runs_the_chosen_branch_with_outer_tensors(cond: bool) -> None:
    feeds = {"cond": np.array(cond), "x": np.array([1, 2, -3, 4], np.float32)}
    session = InferenceSession(if_model(), ["CpuRef"])
    np.testing.assert_allclose(session.run(None, feeds)[0], ort_run(if_model(), feeds)[0])
    assert session.report.backend_of("branch") == "builtin"
    assert session.report.backend_of("branch/then_branch/t_mul") == "CpuRef"


def loop_model() -> onnx.ModelProto:
    """Loop carrying (acc, k) with a scan output, a condition computed in the body (acc < limit)
    and an outer tensor (step) read inside the body."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "step"], ["acc_out"], name="b_add"),
         helper.make_node("Mul", ["acc_out", "acc_out"], ["sq"], name="b_square"),
         helper.make_node("ReduceSum", ["acc_out"], ["total"], name="b_sum", keepdims=0),
         helper.make_node("Less", ["total", "limit"], ["cond_out"], name="b_less"),
         helper.make_node("Cast", ["i"], ["k_out"], name="b_cast", to=TensorProto.FLOAT)],
        "body",
        [scalar("i", TensorProto.INT64), scalar("cond_in", TensorProto.BOOL),
         float_input("acc_in", [3]), float_input("k_in", [])],
        [scalar("cond_out", TensorProto.BOOL), float_input("acc_out", [3]), float_input("k_out", []),
         float_input("sq", [3])])
    node = helper.make_node("Loop", ["M", "cond", "acc0", "k0"], ["acc", "k", "squares"], name="loop",
                            body=body)
    step = numpy_helper.from_array(np.array([1, 2, 3], np.float32), "step")
    limit = numpy_helper.from_array(np.array(40, np.float32), "limit")
    return make_model([node], [scalar("M", TensorProto.INT64), scalar("cond", TensorProto.BOOL),
                               float_input("acc0", [3]), float_input("k0", [])],
                      [float_input("acc", [3]), float_input("k", []), float_input("squares", [None, 3])],
                      [step, limit])


@pytest.mark.parametrize("trips, cond", [(10, True), (2, True), (0, True), (10, False)])
def test_loop_carries_state_and_stacks_scan_outputs(trips: int, cond: bool) -> None:
    feeds = {"M": np.array(trips, np.int64), "cond": np.array(cond),
             "acc0": np.zeros(3, np.float32), "k0": np.array(-1, np.float32)}
    got = InferenceSession(loop_model(), ["CpuRef"]).run(None, feeds)
    want = ort_run(loop_model(), feeds)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b)


def test_loop_body_layers_go_to_two_backends(partial_backends) -> None:
    session = InferenceSession(loop_model(), backends=["TestPartial", "CpuRef"])
    report = session.report
    assert report.backend_of("loop") == "builtin"
    assert report.backend_of("loop/body/b_add") == "TestPartial"
    assert report.backend_of("loop/body/b_sum") == "CpuRef"
    assert report.layers["loop/body/b_sum"].refusals[0][0] == "TestPartial"
    feeds = {"M": np.array(5, np.int64), "cond": np.array(True), "acc0": np.ones(3, np.float32),
             "k0": np.array(0, np.float32)}
    for a, b in zip(session.run(None, feeds), ort_run(loop_model(), feeds)):
        np.testing.assert_allclose(a, b)


def nested_model() -> onnx.ModelProto:
    """If( cond, then: Loop(M){ If(i < 2, x*2, x+1) }, else: x ) -- If inside Loop inside If."""
    inner_then = helper.make_graph([helper.make_node("Mul", ["v_in", "two"], ["a"], name="i_mul")],
                                   "inner_then", [], [float_input("a", [2])])
    inner_else = helper.make_graph([helper.make_node("Add", ["v_in", "one"], ["b"], name="i_add")],
                                   "inner_else", [], [float_input("b", [2])])
    body = helper.make_graph(
        [helper.make_node("Less", ["i", "two_i"], ["small"], name="l_less"),
         helper.make_node("If", ["small"], ["v_out"], name="inner_if", then_branch=inner_then,
                          else_branch=inner_else),
         helper.make_node("Identity", ["cond_in"], ["cond_out"], name="l_id")],
        "loop_body", [scalar("i", TensorProto.INT64), scalar("cond_in", TensorProto.BOOL),
                      float_input("v_in", [2])],
        [scalar("cond_out", TensorProto.BOOL), float_input("v_out", [2])])
    outer_then = helper.make_graph(
        [helper.make_node("Loop", ["M", "", "x"], ["looped"], name="loop", body=body)],
        "outer_then", [], [float_input("looped", [2])])
    outer_else = helper.make_graph([helper.make_node("Identity", ["x"], ["same"], name="o_id")],
                                   "outer_else", [], [float_input("same", [2])])
    inits = [numpy_helper.from_array(np.array(2, np.float32), "two"),
             numpy_helper.from_array(np.array(1, np.float32), "one"),
             numpy_helper.from_array(np.array(2, np.int64), "two_i")]
    node = helper.make_node("If", ["c"], ["y"], name="outer", then_branch=outer_then,
                            else_branch=outer_else)
    return make_model([node], [scalar("c", TensorProto.BOOL), scalar("M", TensorProto.INT64),
                               float_input("x", [2])], [float_input("y", [2])], inits)


@pytest.mark.parametrize("c, trips", [(True, 4), (True, 0), (False, 3)])
def test_nested_control_flow(c: bool, trips: int) -> None:
    feeds = {"c": np.array(c), "M": np.array(trips, np.int64), "x": np.array([1, -1], np.float32)}
    session = InferenceSession(nested_model(), ["CpuRef"])
    np.testing.assert_allclose(session.run(None, feeds)[0], ort_run(nested_model(), feeds)[0])
    assert session.report.backend_of("outer/then_branch/loop/body/inner_if/then_branch/i_mul") == "CpuRef"


def scan_model(reverse: int) -> onnx.ModelProto:
    """A running sum over rows (state) with the per-step sums as scan output, in either direction."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "row"], ["s_out"], name="s_add"),
         helper.make_node("Mul", ["s_out", "scale"], ["y_t"], name="s_mul")],
        "scan_body", [float_input("s_in", [2]), float_input("row", [2])],
        [float_input("s_out", [2]), float_input("y_t", [2])])
    node = helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], name="scan", body=body,
                            num_scan_inputs=1, scan_input_directions=[reverse],
                            scan_output_axes=[1])
    scale = numpy_helper.from_array(np.array([1, 10], np.float32), "scale")
    return make_model([node], [float_input("s0", [2]), float_input("xs", [5, 2])],
                      [float_input("s", [2]), float_input("ys", [2, 5])], [scale])


@pytest.mark.parametrize("reverse", [0, 1])
def test_scan_matches_onnx_runtime(reverse: int) -> None:
    feeds = {"s0": np.zeros(2, np.float32), "xs": np.arange(10, dtype=np.float32).reshape(5, 2)}
    got = InferenceSession(scan_model(reverse), ["CpuRef"]).run(None, feeds)
    for a, b in zip(got, ort_run(scan_model(reverse), feeds)):
        np.testing.assert_allclose(a, b)


def scan8_model(with_lengths: bool) -> onnx.ModelProto:
    """Scan-8: a batch of 3 running sums (state) over 4 rows each, optionally only the first
    sequence_lens[b] rows of item b."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "row"], ["s_out"], name="s_add"),
         helper.make_node("Identity", ["s_out"], ["y_t"], name="s_copy")],
        "scan_body", [float_input("s_in", [2]), float_input("row", [2])],
        [float_input("s_out", [2]), float_input("y_t", [2])])
    lengths = "lengths" if with_lengths else ""
    node = helper.make_node("Scan", [lengths, "s0", "xs"], ["s", "ys"], name="scan", body=body,
                            num_scan_inputs=1)
    inputs = [float_input("s0", [3, 2]), float_input("xs", [3, 4, 2])]
    if with_lengths:
        inputs.insert(0, scalar("lengths", TensorProto.INT64, [3]))
    return make_model([node], inputs, [float_input("s", [3, 2]), float_input("ys", [3, 4, 2])],
                      opset=8)


def test_scan8_runs_each_batch_item_like_onnx_runtime() -> None:
    rng = np.random.default_rng(3)
    feeds = {"s0": rng.standard_normal((3, 2)).astype(np.float32),
             "xs": rng.standard_normal((3, 4, 2)).astype(np.float32)}
    session = InferenceSession(scan8_model(False), ["CpuRef"])
    assert session.report.backend_of("scan") == "builtin"
    for got, want in zip(session.run(None, feeds), ort_run(scan8_model(False), feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_scan8_sequence_lens_stop_each_item_early() -> None:
    rng = np.random.default_rng(4)
    feeds = {"lengths": np.array([4, 2, 3], np.int64),
             "s0": rng.standard_normal((3, 2)).astype(np.float32),
             "xs": rng.standard_normal((3, 4, 2)).astype(np.float32)}
    final, steps = InferenceSession(scan8_model(True), ["CpuRef"]).run(None, feeds)
    for b, length in enumerate(feeds["lengths"]):
        sums = feeds["s0"][b] + np.cumsum(feeds["xs"][b, :length], axis=0)
        np.testing.assert_allclose(final[b], sums[-1], rtol=1e-6)
        np.testing.assert_allclose(steps[b, :length], sums, rtol=1e-6)
        assert not steps[b, length:].any()  # the rest is padding


def test_optimizing_control_flow_leaves_the_users_graph_alone() -> None:
    from backplane import import_onnx, optimize

    graph = import_onnx(nested_model())
    before = repr(graph), [repr(b) for b in (graph.layers[0].attrs["then_branch"],)]
    optimize(graph, ["CpuRef"])
    assert (repr(graph), [repr(graph.layers[0].attrs["then_branch"])]) == before
    assert graph.layers[0].inputs == ["c"]


def test_a_body_on_a_backend_of_its_own_gets_its_context_and_its_copies_reported() -> None:
    """A backend used only inside a Loop's body: its context hears the load under the network's
    id, and the copies into and out of its memory show in the report (the body's inputs come from
    its "user", the Loop)."""
    from backplane.backends.api.backend import BackendContext
    from backplane.backends.registry import registry
    from tests.conftest import PrivateMemoryBackend

    heard: list[str] = []

    class Heard(BackendContext):
        def before_load_network(self, network_id: int) -> None:
            heard.append(f"load {network_id}")

        def after_unload_network(self, network_id: int) -> None:
            heard.append(f"unload {network_id}")

    class BodyOnly(PrivateMemoryBackend):
        id = "TestBodyOnly"

        def create_backend_context(self, options):
            return Heard()

    with registry.temporarily(BodyOnly.id, BodyOnly):
        session = InferenceSession(loop_model(), backends=["TestBodyOnly", "CpuRef"])
    assert session.report.backend_of("loop/body/b_add") == "TestBodyOnly"
    assert "TestBodyOnly" not in session.optimized.backends  # the top level has only the Loop
    copied = [(c.source, c.target) for c in session.report.copies]
    assert ("user", "TestBodyOnly") in copied and ("TestBodyOnly", "CpuRef") in copied
    feeds = {"M": np.array(3, np.int64), "cond": np.array(True), "acc0": np.ones(3, np.float32),
             "k0": np.array(0, np.float32)}
    for a, b in zip(session.run(None, feeds), ort_run(loop_model(), feeds)):
        np.testing.assert_allclose(a, b)
    session.close()
    assert heard == [f"load {session.network_id}", f"unload {session.network_id}"]
