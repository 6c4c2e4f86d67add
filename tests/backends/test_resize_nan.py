"""A NaN pixel stays where interpolation reads it (issue 32, item 3): Resize weighed every input
of a row by a dense matrix, and 0 * NaN spread one NaN pixel over its whole row and column (64 of
64 outputs of a 4x4 image resized x2; ONNX Runtime: 4), and made an Inf NaN everywhere."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from backplane import InferenceSession
from tests.conftest import host_backend_lists

ort = pytest.importorskip("onnxruntime")


def _model(mode: str, transform: str) -> bytes:
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], mode=mode,
                            coordinate_transformation_mode=transform)
    graph = helper.make_graph(
        [node], "resize", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("scales", TensorProto.FLOAT, [4], [1, 1, 2, 2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)],
                             ir_version=8).SerializeToString()


@pytest.mark.parametrize("backends", host_backend_lists(), ids=",".join)
@pytest.mark.parametrize("mode, transform, as_ort", [
    ("nearest", "asymmetric", True), ("cubic", "half_pixel", True),
    ("linear", "half_pixel", False), ("linear", "align_corners", False)])
def test_a_nan_pixel_reaches_only_the_outputs_that_read_it(backends, mode, transform,
                                                           as_ort) -> None:
    """Nearest and cubic: ONNX Runtime's NaN outputs exactly. Linear: those whose taps weigh the
    NaN pixel above 0 (ONNX Runtime also gives NaN where a tap's weight is 0: 20 against 16)."""
    model = _model(mode, transform)
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    x[0, 0, 1, 2] = np.nan
    (want,) = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    (got,) = InferenceSession(model, backends=backends).run(None, {"x": x})
    if as_ort:
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    else:
        assert np.isnan(got).sum() <= np.isnan(want).sum()
        assert not (np.isnan(got) & ~np.isnan(want)).any()
    assert 0 < np.isnan(got).sum() < got.size  # the product made all 64 NaN
    finite = np.isfinite(got) & np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backends", host_backend_lists(), ids=",".join)
def test_an_inf_pixel_stays_inf_under_nearest(backends) -> None:
    model = _model("nearest", "asymmetric")
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    x[0, 0, 3, 0] = np.inf
    (got,) = InferenceSession(model, backends=backends).run(None, {"x": x})
    assert np.isinf(got).sum() == 4 and not np.isnan(got).any()
