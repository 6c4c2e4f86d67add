"""native/cnn.c's compute kernels at the sizes their register tiles split: the convolution's flat
tiles of 6 or 8 pixels (AVX2; 14, 12, 8 on AVX-512, paired taps for 8 channels or fewer)
crossing rows and images, its epilogue in registers (residual, ReLU, Clip on whole blocks of 8 or
16 channels; on AVX-512 every activation but Tanh, part blocks too), a window row read as one loop
(groups 1, dilation 1) or tap by tap; the depthwise rows' tiles of 6, 2 and 1 pixels (8, 2, 1 by
16 channels on AVX-512) and their paired side pixels, 3x3 weights held in registers or any kernel
read from memory; max pooling 8 (16) channels at a time. The AVX2 build of the same source runs
beside this one in test_cnn_widths.py.
Against CpuRef (hypothesis), NaN in -> NaN out; the route pinned by option, never measured."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


@st.composite
def cases(draw):
    depthwise = draw(st.booleans())
    c = draw(st.sampled_from([8, 16, 24, 32, 3, 12, 20]))
    oc = c if depthwise else draw(st.sampled_from([8, 16, 32, 48, 2, 12, 20, 24, 64, 5]))
    k = draw(st.sampled_from([3, 3, 1, 5, 2]))
    dilation = draw(st.sampled_from([1, 1, 2]))
    span = (k - 1) * dilation + 1
    pad = draw(st.integers(0, span // 2))
    return dict(depthwise=depthwise, c=c, oc=oc, k=k, dilation=dilation, pad=pad,
                stride=draw(st.sampled_from([1, 1, 2])), n=draw(st.integers(1, 2)),
                h=draw(st.integers(max(1, span - 2 * pad), 19)),
                w=draw(st.integers(max(1, span - 2 * pad), 23)),
                act=draw(st.sampled_from(["", "Relu", "Clip", "Sigmoid"])),
                residual=draw(st.booleans()), pool=draw(st.booleans()),
                nan=draw(st.sampled_from(["", "x", "r"])), seed=draw(st.integers(0, 2**16)))


def _model(case: dict):
    rng = np.random.default_rng(case["seed"])
    k, d, p, s = case["k"], case["dilation"], case["pad"], case["stride"]
    n, c, oc, h, w = case["n"], case["c"], case["oc"], case["h"], case["w"]
    groups = c if case["depthwise"] else 1
    oh, ow = ((size + 2 * p - (k - 1) * d - 1) // s + 1 for size in (h, w))
    inits = [numpy_helper.from_array((rng.standard_normal((oc, c // groups, k, k)) * 0.4)
                                     .astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(oc).astype(np.float32), "b")]
    inputs = [float_input("x", [n, c, h, w])]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=groups, kernel_shape=[k, k],
                              strides=[s, s], dilations=[d, d], pads=[p] * 4)]
    last = "y"
    if case["residual"]:
        inputs.append(float_input("r", [n, oc, oh, ow]))
        nodes.append(helper.make_node("Add", ["y", "r"], ["sum"]))
        last = "sum"
    if case["act"] == "Clip":
        inits += [numpy_helper.from_array(np.float32(-0.5), "lo"),
                  numpy_helper.from_array(np.float32(1.5), "hi")]
        nodes.append(helper.make_node("Clip", [last, "lo", "hi"], ["a"]))
        last = "a"
    elif case["act"]:
        nodes.append(helper.make_node(case["act"], [last], ["a"]))
        last = "a"
    if case["pool"]:
        nodes.append(helper.make_node("MaxPool", [last], ["out"], kernel_shape=[3, 3],
                                      strides=[2, 2], pads=[1, 1, 1, 1]))
    else:
        nodes.append(helper.make_node("Identity", [last], ["out"]))
    feeds = {i.name: rng.standard_normal([dim.dim_value for dim in i.type.tensor_type.shape.dim])
             .astype(np.float32) for i in inputs}
    if case["nan"] in feeds:  # NaN in, NaN out: one element, somewhere in the tiles
        feeds[case["nan"]].reshape(-1)[case["seed"] % feeds[case["nan"]].size] = np.nan
    return make_model(nodes, inputs, [float_input("out", None)], inits), feeds


def _native(model) -> InferenceSession:
    """The session, its one partition the native plan whole (route "native", not a prefix's)."""
    session = InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                               provider_options=[{"CpuAcc.native": "auto"}, {}])
    loaded = session.runtime.network(session.network_id)
    routes = [getattr(step.workload, "route", None) for step, layer in
              zip(loaded.steps, loaded.layers) if layer.op_type in ("OneDnnGraph", "Traced")]
    assert routes == ["native"], routes
    return session


@needs_compiler
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_the_kernels_tiles_match_cpuref(case):
    model, feeds = _model(case)
    got = _native(model).run(None, feeds)[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    scale = np.abs(want[np.isfinite(want)]).max(initial=1.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)


@needs_compiler
@pytest.mark.parametrize("depthwise", [False, True])
@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 9, 13, 14, 15, 17])
def test_every_row_width_a_tile_can_leave(depthwise, width):
    """Each count of pixels a row leaves after its tiles of 6 or 8 (AVX-512: 14, 8): the depthwise
    sides paired or alone, a flat tile crossing into the next row and image."""
    case = dict(depthwise=depthwise, c=16, oc=16, k=3, dilation=1, pad=1, stride=1, n=2, h=3,
                w=width, act="Relu", residual=True, pool=False, nan="x", seed=width)
    model, feeds = _model(case)
    got = _native(model).run(None, feeds)[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.nanmax(np.abs(want)))


@needs_compiler
@pytest.mark.parametrize("act", ["Sigmoid", "SiLU", "Gelu"])
def test_the_logistic_and_gelu_in_registers_at_their_ends(act):
    """Sigmoid, SiLU and GELU (written out: Div, Erf, Add, Mul) 8 lanes at a time (cnn.c's vexp
    and verf): values across exp's and erf's ranges, their ends (+-87..89, +-100, +-inf: 0, 1,
    SiLU's and GELU's NaN at -inf, as CpuRef's), 1e-8 (erf's series) and NaN, brought in as a
    16-channel 1x1 convolution's residual (an infinite input would make the convolution's
    0 * inf products NaN)."""
    ends = [-np.inf, np.inf, np.nan, -100, 100, -89, 89, -88.5, 88.5, -87.5, 87.5, -87.2, 0.0,
            -0.0, 1e-8, -20, 20, 3, -1e-8, 0.79, 0.81, -6]
    r = np.concatenate([np.array(ends, np.float32),
                        np.linspace(-30, 30, 16 * 6 * 7 - len(ends), dtype=np.float32)])
    r = r.reshape(1, 6, 7, 16).transpose(0, 3, 1, 2).copy()
    x = np.random.default_rng(0).standard_normal((1, 16, 6, 7)).astype(np.float32)
    inits = [numpy_helper.from_array(np.eye(16, dtype=np.float32).reshape(16, 16, 1, 1) * 0.01,
                                     "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("Add", ["c", "r"], ["y"])]
    if act == "SiLU":
        nodes += [helper.make_node("Sigmoid", ["y"], ["s"]),
                  helper.make_node("Mul", ["y", "s"], ["out"])]
    elif act == "Gelu":
        inits += [numpy_helper.from_array(np.float32(np.sqrt(2)), "root2"),
                  numpy_helper.from_array(np.float32(1), "one"),
                  numpy_helper.from_array(np.float32(0.5), "half")]
        nodes += [helper.make_node("Div", ["y", "root2"], ["d"]),
                  helper.make_node("Erf", ["d"], ["e"]),
                  helper.make_node("Add", ["e", "one"], ["e1"]),
                  helper.make_node("Mul", ["y", "e1"], ["m"]),
                  helper.make_node("Mul", ["m", "half"], ["g"]),
                  # a depthwise 1x1 of weight 1 after it: one partition (a GELU alone is no
                  # partition), each element its own (a NaN stays where it is)
                  helper.make_node("Conv", ["g", "ones"], ["out"], group=16)]
        inits.append(numpy_helper.from_array(np.ones((16, 1, 1, 1), np.float32), "ones"))
    else:
        nodes.append(helper.make_node("Sigmoid", ["y"], ["out"]))
    model = make_model(nodes, [float_input("x", [1, 16, 6, 7]), float_input("r", [1, 16, 6, 7])],
                       [float_input("out", None)], inits)
    feeds = {"x": x, "r": r}
    # GELU stays written out (Div, Erf, Add, Mul) where this torch's GELU loses +Inf (fusion/gelu.py:
    # torch 2.11 on the GPU machine's Xeon, 2.13 on an AVX-512 EPYC); the plan folds it into the
    # GeluChain post-op or takes the Erf as its own record (cnn_seq.py): the whole partition native
    got = _native(model).run(None, feeds)[0]
    want = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    # GELU's erf within 2.3e-7 away from 0 (Abramowitz and Stegun's, torch's vectorized erf), so
    # |x| / 2 of that absolutely: at most ~1e-6 where 1 + erf(x / sqrt 2) is not yet 0 in float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 if act == "Gelu" else 1e-7)
    assert np.isnan(got).sum() == (1 if act == "Sigmoid" else 2)  # NaN, and SiLU's, GELU's -inf


@needs_compiler
@pytest.mark.parametrize("channels,groups,length", [(16, 16, 79), (16, 4, 33), (12, 1, 9),
                                                    (24, 8, 1), (8, 2, 50)])
def test_a_group_norm_after_a_1d_convolution_matches_cpuref(tmp_path, channels, groups, length):
    """GroupNorm (torch's export: Reshape, InstanceNormalization, Reshape, Mul, Add; cnn_ops.h's
    gnorm summing each channel over the pixels, then each group), from a real torch module;
    a NaN in one channel makes its group NaN, the others not."""
    module = torch.nn.Sequential(torch.nn.Conv1d(3, channels, 5, padding=2),
                                 torch.nn.GroupNorm(groups, channels),
                                 torch.nn.Conv1d(channels, channels, 1, groups=channels)).eval()
    with torch.no_grad():  # the last a depthwise identity: with it, one partition
        module[1].weight.normal_()
        module[1].bias.normal_()
        module[2].weight.fill_(1.0)
        module[2].bias.zero_()
    path = str(tmp_path / "gn.onnx")
    x = torch.randn(2, 3, length)
    torch.onnx.export(module, (x,), path, input_names=["x"], output_names=["out"], dynamo=False,
                      opset_version=17)
    feeds = {"x": x.numpy().copy()}
    feeds["x"][1, 0, length // 2] = np.nan  # the second image's every channel: its groups NaN
    got = _native(path).run(None, feeds)[0]
    want = InferenceSession(path, backends=["CpuRef"]).run(None, feeds)[0]
    assert np.isnan(want[1]).all() and not np.isnan(want[0]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.nanmax(np.abs(want)))
