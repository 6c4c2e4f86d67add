"""What a trace of CpuAcc's layers runs in place of their own workloads (``onednn_graph`` and
``traced`` trace through ``Forced``): the routes TorchScript can hold, forced, and the kernels of
``TRACEABLE_KERNELS``, which compute the same values as CpuAcc's own without reading a computed
value on the host, and in a form oneDNN Graph's fuser takes."""

from __future__ import annotations

from typing import Any

from backplane.backends.api.backend import BackendOptions
from backplane.ir.graph import Layer


class Forced:
    """``backend`` with some options replaced (the routes a trace can use), and the kernels a
    trace can hold (``TRACEABLE_KERNELS``) in place of its own."""

    def __init__(self, backend: Any, forced: dict[str, Any]) -> None:
        self._backend = backend
        self.options = BackendOptions({**backend.options.values, **forced})

    def kernel_for(self, layer: Layer) -> Any:
        if not layer.domain and layer.op_type in TRACEABLE_KERNELS:
            return TRACEABLE_KERNELS[layer.op_type]
        return self._backend.kernel_for(layer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def _gather(data: Any, indices: Any, axis: int = 0) -> tuple[Any, ...]:
    """ONNX Gather without reading the indices on the host: negative ones counted from the end by
    ``torch.where`` always (CpuAcc's own Gather reads the smallest index to skip that, a value
    a trace would keep: an embedding's Gather of token ids kept every transformer of the corpus
    layer by layer). Indices that are constants of the trace are counted from the end outside
    it, and one such index is a ``select``."""
    import torch

    from backplane.backends.torch.kernels.recurrent_fused import trace_constants, untraced

    axis = axis % data.dim()
    constant = trace_constants([indices])  # the trace's own (a state's row): known now
    with untraced(constant):  # computed once, outside the trace, where the indices are constant
        flat = indices.reshape(-1).long()
        flat = torch.where(flat < 0, flat + data.shape[axis], flat)
        one = int(flat[0]) if constant and indices.dim() == 0 else None
    if one is not None:  # a view: no call a run (the VAD's state rows: 8 calls a run before)
        return (data.select(axis, one),)
    picked = torch.index_select(data, axis, flat)
    return (picked.reshape((*data.shape[:axis], *indices.shape, *data.shape[axis + 1:])),)


def _gemm(A: Any, B: Any, C: Any = None, alpha: float = 1.0, beta: float = 1.0, transA: int = 0,
          transB: int = 0) -> tuple[Any, ...]:  # noqa: N803
    """ONNX Gemm as ``F.linear`` where it is one (B transposed, no scaling, C absent or a bias of
    the outputs), else CpuAcc's own: oneDNN Graph's fuser failed on the ``addmm`` of a frozen
    transposed weight ("vector::_M_range_check", mobilenet_fp16_ts17's head in float32) and takes
    ``aten::linear``."""
    import torch.nn.functional as F

    from backplane.backends.torch.kernels.nn import gemm

    if (transB and not transA and alpha == 1.0 and A.dim() == 2
            and (C is None or beta == 1.0 and C.dim() == 1 and C.shape[0] == B.shape[0])):
        return (F.linear(A, B, C),)
    return gemm(A, B, C, alpha, beta, transA, transB)


TRACEABLE_KERNELS = {"Gather": _gather, "Gemm": _gemm}
"""ONNX ops whose CpuAcc kernel reads a computed value on the host, or that oneDNN Graph's fuser
fails on, and the kernel a trace takes instead (the same values)."""
