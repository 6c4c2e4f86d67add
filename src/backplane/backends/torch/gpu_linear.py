"""GpuAcc's MatMul by a constant matrix and the Add of a constant bias after it as one product
inside a captured subgraph: ``torch.addmm`` with the bias as a vector, which on CUDA is one
cuBLASLt call adding the bias in its epilogue.

Why: a small model's replay is bound by its kernel count (``bench/gpu_floor.py``: a whole run 12.2
us plus about 1.1 us a kernel on the H200), and an exported ``nn.Linear`` at batch 1 with a
sequence (the corpus transformers' QKV projection and first MLP product, ``x @ W + b`` in ONNX's
MatMul and Add) ran as two: cuBLAS's product, then an elementwise kernel adding the bias. An Add
that an elementwise tree takes (``gpu_chains``: the bias and a residual in one kernel) stays there;
only an Add still running its own kernel is joined to the product before it. The values are the
layers' within float32 rounding: the epilogue adds the bias to the product's float32 sums, as the
Add did, but cuBLASLt may choose another kernel, summing in another order.

On an H200 (``bench/gpu_profile.py``, against_cpu off, 14271f4 and this in alternating
processes, two rounds, median ms a run, kernels a replay): char_tagger_ts14 0.288, 0.283 -> 0.237,
0.236 (113 -> 87 kernels), gpt_causal_ts15 0.103, 0.098 -> 0.093, 0.093 (42 -> 38); the full
tier's tagger 0.565, 0.550 -> 0.446, 0.452 (188 -> 144).

Where the values do not fit (another type or shape, a one-row input, which addmm sends to a
product and a copy of the bias anyway), the two layers' own kernels run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import Workload
from backplane.backends.torch.gpu_small import Step
from backplane.ir.graph import Layer

CODE = "backplane_linear_bias"
"""The fused step's name, read by ``bench/gpu_census.py`` (a workload's ``code``)."""


def linear_steps(layers: Sequence[Layer], steps: list[Step | None], original: Sequence[Any],
                 sole: Callable[[str], int | None], constants: dict[str, np.ndarray]) -> None:
    """Each MatMul(x, W) whose product an Add of a constant bias alone reads, both still running
    their own kernels (``original``), as one step where the Add was. Rewrites ``steps`` in
    place; run after the elementwise trees, which keep the Adds they take."""
    for index, layer in enumerate(layers):
        step = steps[index]
        if layer.op_type != "MatMul" or layer.domain or len(layer.inputs) != 2 \
                or step is None or step[0] is not original[index]:
            continue
        weight = constants.get(layer.inputs[1])
        if weight is None or weight.ndim != 2 or layer.inputs[0] in constants:
            continue
        after = sole(layer.outputs[0])
        if after is None:
            continue
        add = layers[after]
        if add.op_type != "Add" or add.domain or len(add.inputs) != 2 \
                or add.inputs[0] == add.inputs[1] or steps[after] is None \
                or steps[after][0] is not original[after]:  # type: ignore[index]
            continue  # an Add a tree took (or another step) stays there
        bias_name = add.inputs[1] if add.inputs[0] == layer.outputs[0] else add.inputs[0]
        bias = constants.get(bias_name)
        columns = weight.shape[1]
        if bias is None or bias.dtype != weight.dtype or bias.size != columns \
                or bias.shape[-1:] != (columns,):
            continue
        steps[index] = None
        steps[after] = (_linear(original[index], original[after],
                                product_first=add.inputs[0] == layer.outputs[0]),
                        [layer.inputs[0], layer.inputs[1], bias_name], list(add.outputs))


def _linear(matmul: Workload, add: Workload, product_first: bool) -> Workload:
    """x @ W + b (``linear_product``) where it fits (``fits``); else the MatMul's and the Add's
    own kernels, the Add's operands in the layer's order."""
    def workload(X: Any, W: Any, B: Any) -> tuple[Any]:  # noqa: N803
        if fits(X, W, B):
            return (linear_product(X, W, B),)
        product = matmul(X, W)[0]
        return add(product, B) if product_first else add(B, product)  # type: ignore[no-any-return]

    workload.code = CODE  # type: ignore[attr-defined]
    return workload


def fits(X: Any, W: Any, B: Any) -> bool:  # noqa: N803
    """Whether ``linear_product`` computes MatMul then Add here: one floating type, X of two
    dimensions or more and of more than one row, W (K, N), the bias N values whose dimensions
    before the last are ones and no more than the product's (a longer bias would widen it)."""
    if not (X.is_floating_point() and X.dtype == W.dtype == B.dtype and W.dim() == 2
            and X.dim() >= 2 and X.shape[-1] == W.shape[0] and B.dim() <= X.dim()
            and B.numel() == W.shape[1] and B.shape[-1] == W.shape[1]):
        return False
    rows = X.numel() // max(X.shape[-1], 1)
    return rows > 1 and X.shape[-1] > 1 and W.shape[1] > 1


def linear_product(X: Any, W: Any, B: Any) -> Any:  # noqa: N803
    """X (..., K) @ W (K, N) + B (N values) as one addmm over X's rows, the bias as a vector
    (cuBLASLt's bias epilogue on CUDA), viewed back to (..., N)."""
    import torch

    rows = X.reshape(-1, X.shape[-1])
    out = torch.addmm(B.reshape(-1), rows, W)
    return out.view(*X.shape[:-1], W.shape[1])
