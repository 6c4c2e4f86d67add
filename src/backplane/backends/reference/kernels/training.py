"""Optimizer steps of the training domain (ai.onnx.preview.training): Adagrad, Adam, Momentum.

Inputs are the learning rate R, the step count T, then n tensors X, their n gradients G and their
n accumulators (Adagrad: H; Momentum: V; Adam: V then H); outputs are the n new X followed by
the new accumulators, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.ir.graph import Layer, TensorInfo

TRAINING = "ai.onnx.preview.training::"


def adagrad(R, T, *inputs, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0):
    n = len(inputs) // 3
    r = R / (1 + T * decay_factor)  # the decayed learning rate
    xs, hs = [], []
    for x, g, h in zip(inputs[:n], inputs[n:2 * n], inputs[2 * n:]):
        g = norm_coefficient * x + g  # with the gradient of the L2 regularization
        h = h + g * g
        xs.append((x - r * g / (np.sqrt(h) + epsilon)).astype(x.dtype))
        hs.append(h.astype(x.dtype))
    return (*xs, *hs)


def adam(R, T, *inputs, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
         norm_coefficient_post=0.0):
    n = len(inputs) // 4
    t = float(T)
    # From the second step on, the rate corrects the bias of the moments (both start at 0).
    r = R * math.sqrt(1 - beta**t) / (1 - alpha**t) if t > 0 else R
    xs, vs, hs = [], [], []
    for x, g, v, h in zip(inputs[:n], inputs[n:2 * n], inputs[2 * n:3 * n], inputs[3 * n:]):
        g = norm_coefficient * x + g
        v = alpha * v + (1 - alpha) * g
        h = beta * h + (1 - beta) * (g * g)
        x_new = (1 - norm_coefficient_post) * (x - r * (v / (np.sqrt(h) + epsilon)))
        xs.append(x_new.astype(x.dtype))
        vs.append(v.astype(x.dtype))
        hs.append(h.astype(x.dtype))
    return (*xs, *vs, *hs)


def momentum(R, T, *inputs, alpha, beta, mode, norm_coefficient):
    n = len(inputs) // 3
    gain = beta if T > 0 else 1  # the first step takes the whole gradient
    xs, vs = [], []
    for x, g, v in zip(inputs[:n], inputs[n:2 * n], inputs[2 * n:]):
        g = norm_coefficient * x + g
        v = alpha * v + gain * g
        step = g + alpha * v if mode == "nesterov" else v
        xs.append((x - R * step).astype(x.dtype))
        vs.append(v.astype(x.dtype))
    return (*xs, *vs)


def check_momentum(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    mode = layer.attrs.get("mode")
    return None if mode in ("standard", "nesterov") else f"Momentum mode {mode!r} not known"


KERNELS: KernelTable = {
    TRAINING + "Adagrad": {1: adagrad},
    TRAINING + "Adam": {1: adam},
    TRAINING + "Momentum": {1: momentum},
}

CHECKS = {TRAINING + "Momentum": check_momentum}
