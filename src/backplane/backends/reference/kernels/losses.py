"""Losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss.

Scores are (N, C) or (N, C, d1, ..., dk) and targets (N) or (N, d1, ..., dk) class indices. A
target equal to ``ignore_index`` contributes nothing, to the loss nor to the weights a mean
divides by.
"""

from __future__ import annotations

import numpy as np

from backplane.backends.api.kernels import KernelTable


def negative_log_likelihood_loss(input, target, weight=None, ignore_index=None,  # noqa: A002
                                 reduction="mean"):
    return (_nll(input, target, weight, ignore_index, reduction),)


def softmax_cross_entropy_loss(scores, labels, weights=None, ignore_index=None, reduction="mean",
                               *, n_outputs):
    # log(softmax) along the classes, as exp / sum then log (not log-sum-exp), like the spec.
    exp = np.exp(scores - np.max(scores, axis=1, keepdims=True))
    log_prob = np.log(exp / np.sum(exp, axis=1, keepdims=True))
    return (_nll(log_prob, labels, weights, ignore_index, reduction), log_prob)[:n_outputs]


def _nll(log_prob, target, weight, ignore_index, reduction):
    dtype = log_prob.dtype
    ignored = target == ignore_index if ignore_index is not None else np.zeros(target.shape, bool)
    target = np.where(ignored, 0, target)  # any valid class: its loss and weight become 0
    picked = np.take_along_axis(log_prob, target[:, None], axis=1)[:, 0]  # (N, d1, ..., dk)
    weights = np.ones(target.shape, dtype) if weight is None else weight[target]
    weights = np.where(ignored, 0, weights).astype(dtype)
    loss = -picked * weights
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.asarray(loss.sum(), dtype)
    return np.asarray(loss.sum() / weights.sum(), dtype)  # "mean": weighted by the weights


KERNELS: KernelTable = {
    "NegativeLogLikelihoodLoss": {12: negative_log_likelihood_loss},
    "SoftmaxCrossEntropyLoss": {12: softmax_cross_entropy_loss},
}
