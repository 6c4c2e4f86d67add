"""The kernels' inputs read on the host, and the ops that make sizes or tensors from host values
during a run: what a CUDA graph, a trace and a compiled oneDNN Graph partition leave outside.

Why a module of its own: the fusion passes read these tables (``onednn_graph``, ``traced``,
``reduced``), and ``cuda`` imports torch's kernels; here they are read without torch, so CpuAcc's
fusions can plan a model whose partitions are all native C without importing torch
(``backplane.torch_free``, issue 27 item 5)."""

from __future__ import annotations

HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Split": (1,), "Slice": (1, 2, 3, 4),
    "Squeeze": (1,), "Unsqueeze": (1,), "ReduceSum": (1,), "ReduceMean": (1,),
    "ReduceMax": (1,), "ReduceMin": (1,), "Clip": (1, 2),
    # numeric.py's: axes, lengths and steps
    "CumSum": (1,), "CumProd": (1,), "DFT": (1, 2), "STFT": (1, 3), "ReduceProd": (1,),
    "ReduceSumSquare": (1,), "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSum": (1,),
    "ReduceLogSumExp": (1,),
    # indexing.py's and recurrent.py's: pads, counts, diagonals and sizes
    "Pad": (1, 2, 3), "CenterCropPad": (1, 2), "OneHot": (1,), "TopK": (1,), "Trilu": (1,),
    "Col2Im": (1, 2), "MaxUnpool": (2,), "AffineGrid": (1,),
    # vision.py's: Resize's roi, scales and sizes (scales at 1 before opset 11), Upsample's scales
    "Resize": (1, 2, 3), "Upsample": (1,),
    # ml.py's: the optimizers' learning rate and step count
    "Adagrad": (0, 1), "Adam": (0, 1), "Momentum": (0, 1),
}
"""Inputs the kernels read on the host (shapes, axes, bounds): kept as NumPy inside a CUDA graph, since
reading a CUDA tensor on the host would wait for the GPU, which a capture forbids."""
NOT_CAPTURABLE = frozenset({"Shape"})  # makes a tensor from host values during the run
NOT_CAPTURABLE |= {"NonZero", "Compress", "Unique", "NonMaxSuppression"}  # sizes from data
NOT_CAPTURABLE |= {"Size", "ConstantOfShape", "Range"}  # read on the host, or make from host values
NOT_CAPTURABLE |= {"HannWindow", "HammingWindow", "BlackmanWindow"}  # sized by a value read on the host
NOT_CAPTURABLE |= {"RoiAlign"}  # its samples per cell come from the regions' values
NOT_CAPTURABLE |= {"MelWeightMatrix"}  # made from values read on the host
NOT_CAPTURABLE |= {"TreeEnsemble"}  # walks the trees until every row stands on a leaf (a data test)
