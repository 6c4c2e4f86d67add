"""cnn.c built four ways on one machine: as the route builds it (-march=native: AVX-512 where
this CPU has it, cnn_conv512.h's 16-lane tiles), its AVX2 build (-mno-avx512f: what a CI machine
without AVX-512 runs, cnn_conv.h's 8-lane tiles), a plain x86-64 build (no AVX: the generic
vectors split) and AVX-512 without VL (-mno-avx512vl). Each plan is packed for the width its library says (backplane_cnn_vector_width),
and each library runs a plan packed for the other width too (blocks of 32 and 48 as 16-lane parts,
paired taps one pixel at a time): every pairing gives ONNX Runtime's outputs within the corpus
tests' tolerance, and NaN where CpuRef gives NaN."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build, cnn, cnn_layers  # noqa: E402
from tests.conftest import float_input, make_model  # noqa: E402
from tests.native import flavours  # noqa: E402

CORPUS = "tests/data/corpus"
FLAVOURS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"],
            "plain": ["-march=x86-64"], "no_vl": ["-march=native", "-mno-avx512vl"]}
"""no_vl: AVX-512 F without VL (its 16-lane tiles; 4-tap groups one pixel at a time)."""
pytestmark = pytest.mark.skipif(build.compiler() is None or platform.machine() != "x86_64",
                                reason="needs a C compiler on x86-64")


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    folder = tmp_path_factory.mktemp("cnn_flavours")
    return {name: flavours.built("cnn", march, folder) for name, march in FLAVOURS.items()}


def test_each_build_says_its_vector_width(libraries):
    """16 where the build has AVX-512 (this CPU's -march=native), else 8; the planner's width is
    the route's library's."""
    wide = "avx512f" in build._cpu_flags()
    assert libraries["native"].backplane_cnn_vector_width() == (16 if wide else 8)
    assert libraries["avx2"].backplane_cnn_vector_width() == 8
    assert libraries["plain"].backplane_cnn_vector_width() == 8
    assert libraries["no_vl"].backplane_cnn_vector_width() == (16 if wide else 8)
    assert cnn_layers.vector_width() == build.library("cnn").backplane_cnn_vector_width()


def _plans(monkeypatch, model, shapes=None) -> dict[int, tuple[cnn.Plan, list[str]]]:
    """The route's plan of ``model``'s partition (caught as the session plans it), made again
    packed for widths 8 and 16."""
    caught = []
    real = cnn.plan

    def catch(*args):
        made = real(*args)  # only a plan made: a prefix the planner refused raised
        caught.append(args)
        return made

    monkeypatch.setattr(cnn, "plan", catch)
    InferenceSession(model, backends=["CpuAcc", "CpuRef"], input_shapes=shapes,
                     provider_options=[{"CpuAcc.native": "auto"}, {}])
    monkeypatch.setattr(cnn, "plan", real)
    assert caught, "the partition was not planned natively"
    args = caught[-1]
    plans = {}
    for width in (8, 16):
        monkeypatch.setattr(cnn_layers, "vector_width", lambda width=width: width)
        plans[width] = (real(*args), list(args[2]), list(args[4]))
    return plans


def _check_all(libraries, plans, feeds, want: dict, nan=None):
    for width, (made, names, outputs) in plans.items():
        assert set(outputs) == set(want)
        blocks = set(made.records[made.records[:, 0] == cnn.OPS["conv"],
                                  cnn.FIELDS.index("vb")])
        assert blocks <= ({8, 16} if width == 8 else {8, 16, 32, 48})
        for flavour, library in libraries.items():
            got = cnn.Executor(made, library).numpy(*[feeds[n] for n in names])
            for g, w in zip(got, (want[n] for n in outputs)):
                where = f"{flavour} build, plan for width {width}"
                if nan is not None:
                    np.testing.assert_array_equal(np.isnan(g), np.isnan(w), err_msg=where)
                scale = np.abs(w[np.isfinite(w)]).max(initial=1.0)
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale, err_msg=where)


@pytest.mark.parametrize("name", ["resnet_basic_ts16", "unet_resize_ts13", "mobilenet_dw_dyn18",
                                  "mobilenet_dw_ts13"])
def test_every_build_runs_every_width_of_the_corpus_plans_to_onnx_runtime(libraries, name,
                                                                            monkeypatch):
    path = f"{CORPUS}/{name}.onnx"
    feeds = dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    plans = _plans(monkeypatch, path, {k: list(v.shape) for k, v in feeds.items()})
    reference = ort.InferenceSession(path)
    names = [o.name for o in reference.get_outputs()]
    _check_all(libraries, plans, feeds, dict(zip(names, reference.run(None, feeds))))


@pytest.mark.parametrize("c,oc,groups,k,pad", [(3, 8, 1, 3, 1), (16, 2, 1, 1, 0),
                                               (24, 32, 4, 3, 1), (32, 32, 8, 3, 1),
                                               (3, 3, 1, 3, 1), (7, 4, 1, 1, 0), (10, 6, 2, 2, 0),
                                               (5, 20, 1, 3, 0), (8, 48, 1, 1, 0),
                                               (12, 64, 2, 3, 1), (6, 24, 3, 2, 1)])
def test_blocks_and_paired_taps_match_cpuref_with_nan_in_every_build(libraries, monkeypatch, c,
                                                                     oc, groups, k, pad):
    """Blocks of 8 (taps in pairs or fours on AVX-512, tap counts past a multiple among them), 16,
    32 and 48, grouped
    and dense, a residual and ReLU in the epilogue, one NaN in the input and one in the residual:
    CpuRef's NaNs and values from every build at both widths."""
    rng = np.random.default_rng(c * 100 + oc)
    h, w = 9, 13
    o = h + 2 * pad - k + 1, w + 2 * pad - k + 1
    inits = [numpy_helper.from_array((rng.standard_normal((oc, c // groups, k, k)) * 0.4)
                                     .astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(oc).astype(np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y"], group=groups, kernel_shape=[k, k],
                              pads=[pad] * 4),
             helper.make_node("Add", ["y", "r"], ["s"]),
             helper.make_node("Relu", ["s"], ["out"])]
    inputs = [float_input("x", [2, c, h, w]), float_input("r", [2, oc, *o])]
    model = make_model(nodes, inputs, [float_input("out", None)], inits)
    feeds = {"x": rng.standard_normal((2, c, h, w)).astype(np.float32),
             "r": rng.standard_normal((2, oc, *o)).astype(np.float32)}
    feeds["x"][1, c - 1, 4, 6] = np.nan
    feeds["r"][0, oc - 1, 0, 0] = np.nan
    plans = _plans(monkeypatch, model)
    want = {"out": InferenceSession(model, backends=["CpuRef"]).run(None, feeds)[0]}
    assert np.isnan(want["out"]).any()
    _check_all(libraries, plans, feeds, want, nan=True)
