"""The classic-ML domain (ai.onnx.ml): LabelEncoder, Binarizer, ArrayFeatureExtractor, TreeEnsemble.

Table keys carry the domain ("ai.onnx.ml::LabelEncoder"); versions are the ai.onnx.ml opset's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo

ML = "ai.onnx.ml::"


# -- LabelEncoder ------------------------------------------------------------------------------
def label_encoder(X, default_float=-0.0, default_int64=-1, default_string="_Unused",
                  default_tensor=None, keys_floats=None, keys_int64s=None, keys_strings=None,
                  keys_tensor=None, values_floats=None, values_int64s=None, values_strings=None,
                  values_tensor=None):
    keys = _first(keys_floats, keys_int64s, keys_strings, keys_tensor)
    if values_tensor is not None:
        values, dtype = values_tensor, values_tensor.dtype
        default = default_tensor.reshape(-1)[0] if default_tensor is not None else None
    elif values_floats is not None:
        values, dtype, default = values_floats, np.dtype(np.float32), default_float
    elif values_int64s is not None:
        values, dtype, default = values_int64s, np.dtype(np.int64), default_int64
    else:
        values, dtype, default = values_strings, np.dtype(object), default_string
    # Keys compare in X's type (a float32 key is not the Python float it came from); NaN finds NaN.
    table = {_key(k): v for k, v in zip(np.asarray(keys, X.dtype).tolist(), list(values))}
    Y = [table.get(_key(x), default) for x in X.reshape(-1).tolist()]
    return (np.array(Y, dtype=dtype).reshape(X.shape),)


def _first(*candidates):
    return next(c for c in candidates if c is not None)


_NAN = object()


def _key(value):
    return _NAN if isinstance(value, float) and math.isnan(value) else value


# -- small ones --------------------------------------------------------------------------------
def binarizer(X, threshold=0.0):
    return ((X > threshold).astype(X.dtype),)


def array_feature_extractor(X, Y):
    # The chosen columns of the last axis; a 1-D X gives one row.
    Z = X[..., Y.reshape(-1)]
    return (Z.reshape(1, -1) if X.ndim == 1 else Z,)


# -- TreeEnsemble ------------------------------------------------------------------------------
_COMPARE = {0: np.less_equal, 1: np.less, 2: np.greater_equal, 3: np.greater, 4: np.equal,
            5: np.not_equal}
_MEMBER = 6
_AVERAGE, _SUM, _MIN, _MAX = 0, 1, 2, 3


def tree_ensemble(X, leaf_targetids, leaf_weights, n_targets, nodes_falseleafs,
                  nodes_falsenodeids, nodes_featureids, nodes_modes, nodes_splits,
                  nodes_trueleafs, nodes_truenodeids, tree_roots, aggregate_function=1,
                  membership_values=None, nodes_hitrates=None,
                  nodes_missing_value_tracks_true=None, post_transform=0):
    members = _membership_sets(nodes_modes, membership_values)
    tracks_true = nodes_missing_value_tracks_true or [0] * len(nodes_modes)

    def goes_true(node: int, x) -> bool:
        value = x[nodes_featureids[node]]
        if np.isnan(value):
            return bool(tracks_true[node])
        if nodes_modes[node] == _MEMBER:
            return float(value) in members[node]
        return bool(_COMPARE[int(nodes_modes[node])](value, nodes_splits[node]))

    def leaf_of(root: int, x) -> int:
        if nodes_trueleafs[root] and nodes_falseleafs[root] and \
                nodes_truenodeids[root] == nodes_falsenodeids[root]:
            return root  # a tree that is a single leaf: the root indexes the leaves
        node, is_leaf = root, False
        while not is_leaf:
            if goes_true(node, x):
                node, is_leaf = nodes_truenodeids[node], nodes_trueleafs[node]
            else:
                node, is_leaf = nodes_falsenodeids[node], nodes_falseleafs[node]
        return node

    start = {_MIN: np.finfo(X.dtype).max, _MAX: np.finfo(X.dtype).min}.get(aggregate_function, 0)
    Y = np.full((len(X), n_targets), start, dtype=X.dtype)
    combine = {_MIN: min, _MAX: max}.get(aggregate_function, lambda a, b: a + b)
    for n, x in enumerate(X):
        for root in tree_roots:
            leaf = leaf_of(root, x)
            target = leaf_targetids[leaf]
            Y[n, target] = combine(Y[n, target], leaf_weights[leaf])
    if aggregate_function == _AVERAGE:
        Y = Y / len(tree_roots)
    return (Y.astype(X.dtype),)


def _membership_sets(modes, values) -> dict[int, set[float]]:
    """The set of each BRANCH_MEMBER node, in node order: runs of membership_values between NaNs."""
    runs: list[set[float]] = [set()]
    for value in [] if values is None else values.tolist():
        if math.isnan(value):
            runs.append(set())
        else:
            runs[-1].add(value)
    member_nodes = [i for i, mode in enumerate(modes) if mode == _MEMBER]
    return dict(zip(member_nodes, runs))


def check_tree_ensemble(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if layer.attrs.get("post_transform", 0) != 0:
        return f"TreeEnsemble post_transform {layer.attrs['post_transform']} not supported (NONE only)"
    if layer.attrs.get("aggregate_function", 1) not in (_AVERAGE, _SUM, _MIN, _MAX):
        return f"TreeEnsemble aggregate_function {layer.attrs['aggregate_function']} not known"
    return None


KERNELS: KernelTable = {
    ML + "LabelEncoder": {2: label_encoder},  # keys_tensor / values_tensor (4) default to absent
    ML + "Binarizer": {1: binarizer},
    ML + "ArrayFeatureExtractor": {1: array_feature_extractor},
    ML + "TreeEnsemble": {5: tree_ensemble},
}

CHECKS = {ML + "TreeEnsemble": check_tree_ensemble}
