"""Torch kernels of the side domains: ai.onnx.ml's Binarizer, ArrayFeatureExtractor and TreeEnsemble;
ai.onnx.preview.training's Adagrad, Adam and Momentum; and MelWeightMatrix.

TreeEnsemble walks every row down every tree at once: one step moves each (row, tree) pair from its
node to a child, by a gather of the node's feature, split and mode, until all pairs stand on leaves
(at most as many steps as the deepest tree is deep). The optimizer steps compute as CpuRef: the
learning rate and step count are read on the host, the arithmetic runs in the tensors' type.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from backplane.backends.api.kernels import KernelTable
from backplane.backends.reference.kernels.ml import check_tree_ensemble
from backplane.backends.reference.kernels.training import check_momentum
from backplane.backends.torch.kernels.common import FLOATS, NUMBERS, scalar, torch_dtype
from backplane.frontends.onnx_types import onnx_to_numpy_dtype
from backplane.ir.graph import Layer, TensorInfo

ML = "ai.onnx.ml::"
TRAINING = "ai.onnx.preview.training::"


# -- ai.onnx.ml ------------------------------------------------------------------------------------
def binarizer(X, threshold=0.0):
    return ((X > threshold).to(X.dtype),)


def array_feature_extractor(X, Y):
    # the chosen columns of the last axis; a 1-D X gives one row
    Z = X[..., Y.reshape(-1)]
    return (Z.reshape(1, -1) if X.dim() == 1 else Z,)


_AVERAGE, _SUM, _MIN, _MAX = 0, 1, 2, 3
_MEMBER = 6


def tree_ensemble(X, leaf_targetids, leaf_weights, n_targets, nodes_falseleafs,
                  nodes_falsenodeids, nodes_featureids, nodes_modes, nodes_splits,
                  nodes_trueleafs, nodes_truenodeids, tree_roots, aggregate_function=1,
                  membership_values=None, nodes_hitrates=None,
                  nodes_missing_value_tracks_true=None, post_transform=0):
    device = X.device
    table = _tree_table(nodes_falseleafs, nodes_falsenodeids, nodes_featureids, nodes_modes,
                        nodes_splits, nodes_trueleafs, nodes_truenodeids, membership_values,
                        nodes_missing_value_tracks_true, X.dtype, device)
    rows = X.shape[0]
    roots = torch.tensor([int(r) for r in tree_roots], dtype=torch.int64, device=device)
    single = table["true_leaf"][roots] & table["false_leaf"][roots] & \
        (table["true_id"][roots] == table["false_id"][roots])  # a tree that is one leaf
    node = roots.expand(rows, -1).clone()  # (rows, trees)
    at_leaf = single.expand(rows, -1).clone()
    for _ in range(len(nodes_modes) + 1):
        if bool(at_leaf.all()):
            break
        inner = torch.where(at_leaf, 0, node)  # a pair on a leaf holds a leaf index: looked past
        goes_true = _goes_true(X, inner, table)
        child = torch.where(goes_true, table["true_id"][inner], table["false_id"][inner])
        leaf = torch.where(goes_true, table["true_leaf"][inner], table["false_leaf"][inner])
        node = torch.where(at_leaf, node, child)
        at_leaf = at_leaf | leaf
    targets = torch.tensor(list(leaf_targetids), dtype=torch.int64, device=device)[node]
    weights = leaf_weights.to(X.dtype) if isinstance(leaf_weights, torch.Tensor) else \
        torch.tensor(np.asarray(leaf_weights), dtype=X.dtype, device=device)
    values = weights[node]  # (rows, trees)
    return (_aggregate(values, targets, int(n_targets), aggregate_function, len(tree_roots)),)


def _tree_table(falseleafs, falsenodeids, featureids, modes, splits, trueleafs, truenodeids,
                membership_values, tracks_true, dtype, device) -> dict[str, torch.Tensor]:
    """The nodes' attributes as tensors, and each membership node's set as a (nodes, members)
    matrix padded with NaN (which matches nothing)."""
    def ints(values):
        return torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)

    modes = [int(m) for m in modes]
    sets: list[list[float]] = [[]]
    for value in [] if membership_values is None else np.asarray(membership_values).tolist():
        if math.isnan(value):
            sets.append([])
        else:
            sets[-1].append(value)
    members = [[] for _ in modes]
    for index, values in zip([i for i, m in enumerate(modes) if m == _MEMBER], sets):
        members[index] = values
    width = max([1, *map(len, members)])
    member_table = torch.tensor([m + [math.nan] * (width - len(m)) for m in members],
                                dtype=torch.float64, device=device)
    split = splits if isinstance(splits, torch.Tensor) else torch.tensor(np.asarray(splits))
    return {"false_leaf": ints(falseleafs).bool(), "true_leaf": ints(trueleafs).bool(),
            "false_id": ints(falsenodeids), "true_id": ints(truenodeids),
            "feature": ints(featureids), "mode": ints(modes), "split": split.to(device, dtype),
            "members": member_table,
            "tracks_true": ints(tracks_true or [0] * len(modes)).bool()}


def _goes_true(X, node, table) -> torch.Tensor:
    """Whether each (row, tree)'s node sends it to its true child."""
    rows = torch.arange(X.shape[0], device=X.device)[:, None]
    value = X[rows, table["feature"][node]]  # (rows, trees)
    split, mode = table["split"][node], table["mode"][node]
    compared = torch.stack([value <= split, value < split, value >= split, value > split,
                            value == split, value != split])
    result = torch.gather(compared, 0, mode.clamp(max=5)[None]).squeeze(0)
    member = (value.to(torch.float64)[..., None] == table["members"][node]).any(dim=-1)
    result = torch.where(mode == _MEMBER, member, result)
    return torch.where(torch.isnan(value), table["tracks_true"][node], result)


def _aggregate(values, targets, n_targets, function, n_trees):
    rows = values.shape[0]
    if function in (_MIN, _MAX):
        info = torch.finfo(values.dtype)
        start = info.max if function == _MIN else info.min
        Y = torch.full((rows, n_targets), start, dtype=values.dtype, device=values.device)
        return Y.scatter_reduce(1, targets, values, "amin" if function == _MIN else "amax")
    # sums tree by tree in order, as CpuRef adds them
    Y = torch.zeros((rows, n_targets), dtype=values.dtype, device=values.device)
    for tree in range(values.shape[1]):
        Y = Y.scatter_add(1, targets[:, tree:tree + 1], values[:, tree:tree + 1])
    return Y / n_trees if function == _AVERAGE else Y


# -- ai.onnx.preview.training ----------------------------------------------------------------------
def adagrad(R, T, *inputs, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0):
    n = len(inputs) // 3
    r = float(_host(R) / (1 + _host(T) * decay_factor))  # decayed, in NumPy's types as CpuRef
    xs, hs = [], []
    for x, g, h in zip(inputs[:n], inputs[n:2 * n], inputs[2 * n:]):
        x64, g = x.double(), norm_coefficient * x.double() + g.double()
        h = h.double() + g * g
        xs.append((x64 - r * g / (torch.sqrt(h) + epsilon)).to(x.dtype))
        hs.append(h.to(x.dtype))
    return (*xs, *hs)


def adam(R, T, *inputs, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
         norm_coefficient_post=0.0):
    n = len(inputs) // 4
    rate, t = _host(R), float(scalar(T))
    # bias-corrected, in R's type as CpuRef computes it
    r = float(rate * math.sqrt(1 - beta**t) / (1 - alpha**t) if t > 0 else rate)
    xs, vs, hs = [], [], []
    for x, g, v, h in zip(inputs[:n], inputs[n:2 * n], inputs[2 * n:3 * n], inputs[3 * n:]):
        x64, g = x.double(), norm_coefficient * x.double() + g.double()
        v = alpha * v.double() + (1 - alpha) * g
        h = beta * h.double() + (1 - beta) * (g * g)
        xs.append(((1 - norm_coefficient_post) * (x64 - r * (v / (torch.sqrt(h) + epsilon))))
                  .to(x.dtype))
        vs.append(v.to(x.dtype))
        hs.append(h.to(x.dtype))
    return (*xs, *vs, *hs)


def _host(value):
    """A one-element input as a 0-d NumPy array of its type (the optimizers' R and T)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().reshape(())
    return np.asarray(value).reshape(())


def momentum(R, T, *inputs, alpha, beta, mode, norm_coefficient):
    n = len(inputs) // 3
    rate, gain = scalar(R), beta if scalar(T) > 0 else 1  # the first step takes the whole gradient
    xs, vs = [], []
    for x, g, v in zip(inputs[:n], inputs[n:2 * n], inputs[2 * n:]):
        g = norm_coefficient * x.double() + g.double()
        v = alpha * v.double() + gain * g
        step = g + alpha * v if mode == "nesterov" else v
        xs.append((x.double() - rate * step).to(x.dtype))
        vs.append(v.to(x.dtype))
    return (*xs, *vs)


# -- MelWeightMatrix -------------------------------------------------------------------------------
def mel_weight_matrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz,
                      output_datatype=1):
    # (dft_length // 2 + 1, num_mel_bins): mel bin i is a triangle over the DFT bins, rising from
    # point i to point i + 1 and falling to point i + 2 of num_mel_bins + 2 points spaced evenly on
    # the mel scale, in float64 on the host as the spec's reference (then one upload)
    bins, n_fft, rate = int(scalar(num_mel_bins)), int(scalar(dft_length)), scalar(sample_rate)
    low, high = float(scalar(lower_edge_hertz)), float(scalar(upper_edge_hertz))
    low_mel = 2595 * math.log1p(low / 700) / math.log(10)
    high_mel = 2595 * math.log1p(high / 700) / math.log(10)
    mels = torch.arange(bins + 2, dtype=torch.float64) * ((high_mel - low_mel) / (bins + 2)) \
        + low_mel
    hertz = 700 * torch.expm1(mels / 2595 * math.log(10))
    points = torch.floor((n_fft + 1) * hertz / rate).to(torch.int64).tolist()
    weights = torch.zeros((n_fft // 2 + 1, bins), dtype=torch.float64)
    for i, (left, centre, right) in enumerate(zip(points, points[1:], points[2:])):
        if centre == left:
            weights[centre, i] = 1
        else:
            rising = torch.arange(left, centre + 1)
            weights[rising, i] = (rising - left).double() / (centre - left)
        if right > centre:
            falling = torch.arange(centre, right)
            weights[falling, i] = (right - falling).double() / (right - centre)
    device = num_mel_bins.device if isinstance(num_mel_bins, torch.Tensor) else None
    return (weights.to(device=device, dtype=torch_dtype(output_datatype)),)


def check_mel(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    dtype = onnx_to_numpy_dtype(layer.attrs.get("output_datatype", 1))
    if dtype not in NUMBERS:
        return f"MelWeightMatrix of {dtype} (no torch type for it)"
    return None


KERNELS: KernelTable = {
    ML + "Binarizer": {1: binarizer},
    ML + "ArrayFeatureExtractor": {1: array_feature_extractor},
    ML + "TreeEnsemble": {5: tree_ensemble},
    TRAINING + "Adagrad": {1: adagrad},
    TRAINING + "Adam": {1: adam},
    TRAINING + "Momentum": {1: momentum},
    "MelWeightMatrix": {17: mel_weight_matrix},
}

CHECKS = {ML + "TreeEnsemble": check_tree_ensemble, TRAINING + "Momentum": check_momentum,
          "MelWeightMatrix": check_mel}

INPUT_DTYPES = {
    ML + "Binarizer": FLOATS,
    ML + "ArrayFeatureExtractor": NUMBERS,
    ML + "TreeEnsemble": FLOATS,
    TRAINING + "Adagrad": FLOATS,
    TRAINING + "Adam": FLOATS,
    TRAINING + "Momentum": FLOATS,
    "MelWeightMatrix": NUMBERS - FLOATS,  # the first input is num_mel_bins, an integer
}
"""Per op, the element types its first input may have (other inputs follow ONNX's type rules)."""
