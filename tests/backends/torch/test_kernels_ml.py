"""Differential tests of the torch kernels of the side domains (``kernels/ml.py``: ai.onnx.ml's
Binarizer, ArrayFeatureExtractor and TreeEnsemble, the training domain's Adagrad, Adam and Momentum,
MelWeightMatrix) against CpuRef, over cases that hypothesis generates, in the harness of
``test_differential.py``; then the node suite's single-op cases of each op.

The harness builds a layer of the default domain; an op of another domain is named by its table key
("ai.onnx.ml::Binarizer"), which is the key the layer of that domain selects its kernel by.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backplane.backends.torch.kernels import ml  # noqa: E402
from tests.backends.torch.node_cases import case_names, check_case  # noqa: E402
from tests.backends.torch.differential import (  # noqa: E402
    F16,
    F32,
    F64,
    I32,
    I64,
    SETTINGS,
    differential,
    place,
    run,
    shapes,
    tensor,
)

ML, TRAINING = "ai.onnx.ml::", "ai.onnx.preview.training::"


@SETTINGS
@given(data=st.data())
def _binarizer(op: str, data: Any) -> None:
    draw = data.draw
    x = tensor(draw, draw(st.sampled_from([F32, F64])), draw(shapes()))
    attrs = {"threshold": draw(st.sampled_from([0.0, 0.5, -1.0]))} if draw(st.booleans()) else {}
    differential(op, [x], attrs, opset=1, exact=True)


def test_binarizer() -> None:
    run(_binarizer, ML + "Binarizer")


@SETTINGS
@given(data=st.data())
def _feature_extractor(op: str, data: Any) -> None:
    draw = data.draw
    shape = list(draw(shapes(min_dims=1, min_side=1, max_side=4)))
    x = tensor(draw, draw(st.sampled_from([F32, F64, I32, I64])), shape)
    picks = draw(st.lists(st.integers(-shape[-1], shape[-1] - 1), min_size=1, max_size=4))
    differential(op, [x, place(np.array(picks, I64))], opset=1, exact=True)


def test_array_feature_extractor() -> None:
    run(_feature_extractor, ML + "ArrayFeatureExtractor")


SPLITS = (-1.0, 0.0, 0.5, 2.0)


def _trees(draw: Any, features: int, trees: int, targets: int) -> dict[str, Any]:
    """TreeEnsemble's attributes for ``trees`` random trees of depth 1 to 3."""
    nodes: list[dict[str, Any]] = []
    leaves: list[tuple[int, float]] = []

    def build(depth: int) -> tuple[bool, int]:  # (is a leaf, its index)
        if depth == 0 or (depth < 3 and draw(st.integers(0, 2)) == 0):
            leaves.append((draw(st.integers(0, targets - 1)), draw(st.sampled_from(SPLITS))))
            return True, len(leaves) - 1
        index = len(nodes)
        nodes.append({"feature": draw(st.integers(0, features - 1)), "mode": draw(
            st.integers(0, 6)), "split": draw(st.sampled_from(SPLITS)), "missing": draw(
            st.integers(0, 1)), "members": draw(st.sets(st.sampled_from(SPLITS), min_size=1))})
        nodes[index]["true"], nodes[index]["false"] = build(depth - 1), build(depth - 1)
        return False, index

    built = [build(3) for _ in range(trees)]
    roots = [index for _, index in built]
    if any(is_leaf for is_leaf, _ in built):
        roots = []  # a root that is a leaf is another encoding: the caller leaves such cases out
    members = [v for n in nodes if n["mode"] == 6 for v in [*sorted(n["members"]), math.nan]]
    return {
        "leaf_targetids": [t for t, _ in leaves], "leaf_weights": np.array([w for _, w in leaves]),
        "n_targets": targets, "nodes_featureids": [n["feature"] for n in nodes],
        "nodes_modes": np.array([n["mode"] for n in nodes], np.uint8),
        "nodes_splits": np.array([n["split"] for n in nodes]),
        "nodes_truenodeids": [n["true"][1] for n in nodes],
        "nodes_trueleafs": [int(n["true"][0]) for n in nodes],
        "nodes_falsenodeids": [n["false"][1] for n in nodes],
        "nodes_falseleafs": [int(n["false"][0]) for n in nodes],
        "nodes_missing_value_tracks_true": [n["missing"] for n in nodes],
        "membership_values": np.array(members[:-1] if members else [], np.float64),
        "tree_roots": roots, "aggregate_function": draw(st.integers(0, 3)),
    }


@SETTINGS
@given(data=st.data())
def _tree_ensemble(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F64]))
    features = draw(st.integers(1, 3))
    attrs = _trees(draw, features, draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    if not attrs["tree_roots"]:
        return
    for key in ("leaf_weights", "nodes_splits", "membership_values"):
        attrs[key] = attrs[key].astype(dtype)
    values = st.sampled_from([*SPLITS, 1.0, -3.0, math.nan])
    x = place(np.array([[draw(values) for _ in range(features)]
                        for _ in range(draw(st.integers(1, 4)))], dtype))
    differential(op, [x], attrs, opset=5, tol=4)


def test_tree_ensemble() -> None:
    run(_tree_ensemble, ML + "TreeEnsemble")


# -- optimizers ------------------------------------------------------------------------------------
ACCUMULATORS = {"Adagrad": 1, "Momentum": 1, "Adam": 2}


@SETTINGS
@given(data=st.data())
def _optimizer(op: str, data: Any) -> None:
    draw = data.draw
    name = op.split("::")[1]
    dtype = draw(st.sampled_from([F32, F64]))
    count = draw(st.integers(1, 2))
    shapes_ = [list(draw(shapes(max_dims=2, max_side=3))) for _ in range(count)]
    args = [place(np.array(draw(st.sampled_from([0.1, 0.01, 1.0])), np.float32)),
            place(np.array(draw(st.integers(0, 3)), I64))]
    args += [tensor(draw, dtype, s, low=-2, high=2, special=False) for s in shapes_]  # X
    args += [tensor(draw, dtype, s, low=-2, high=2, special=False) for s in shapes_]  # G
    for _ in range(ACCUMULATORS[name]):  # V (Momentum, Adam) / H (Adagrad, Adam): H >= 0
        args += [tensor(draw, dtype, s, low=0, high=2, special=False) for s in shapes_]
    attrs: dict[str, Any] = {}
    if name == "Momentum":
        attrs = {"alpha": draw(st.sampled_from([0.9, 0.5])), "beta": draw(st.sampled_from(
            [1.0, 0.1])), "mode": draw(st.sampled_from(["standard", "nesterov"])),
            "norm_coefficient": draw(st.sampled_from([0.0, 0.01]))}
    elif draw(st.booleans()):
        attrs["norm_coefficient"] = draw(st.sampled_from([0.0, 0.01]))
        attrs["epsilon"] = draw(st.sampled_from([1e-6, 1e-2]))
        if name == "Adagrad":
            attrs["decay_factor"] = draw(st.sampled_from([0.0, 0.1]))
        else:
            attrs["alpha"], attrs["beta"] = draw(st.sampled_from([(0.9, 0.999), (0.5, 0.8)]))
            attrs["norm_coefficient_post"] = draw(st.sampled_from([0.0, 0.01]))
    differential(op, args, attrs, opset=1, n_outputs=count * (1 + ACCUMULATORS[name]), tol=64)


@pytest.mark.parametrize("name", sorted(ACCUMULATORS))
def test_optimizer(name: str) -> None:
    run(_optimizer, TRAINING + name)


@SETTINGS
@given(data=st.data())
def _mel(op: str, data: Any) -> None:
    draw = data.draw
    ints = draw(st.sampled_from([I32, I64]))
    floats = draw(st.sampled_from([F32, F64, F16]))
    args = [place(np.array(draw(st.integers(1, 8)), ints)),
            place(np.array(draw(st.integers(8, 64)), ints)),
            place(np.array(draw(st.sampled_from([8000, 16000, 22050])), ints)),
            place(np.array(draw(st.sampled_from([0.0, 20.0, 100.0])), floats)),
            place(np.array(draw(st.sampled_from([3000.0, 4000.0])), floats))]
    dtype = draw(st.sampled_from([1, 11, 10]))  # float, double, float16
    differential(op, args, {"output_datatype": dtype}, opset=17, tol=4)


def test_mel_weight_matrix() -> None:
    run(_mel, "MelWeightMatrix")


OPS = ("Binarizer", "ArrayFeatureExtractor", "TreeEnsemble", "Adagrad", "Adam", "Momentum",
       "MelWeightMatrix")


@pytest.mark.parametrize("name", case_names(OPS))
def test_node_case(name: str) -> None:
    check_case(name)


def test_every_op_has_node_cases() -> None:
    assert [op for op in OPS if not case_names((op,))] == []


def test_every_ml_kernel_is_covered() -> None:
    assert sorted({key.split("::")[-1] for key in ml.KERNELS} - set(OPS)) == []
