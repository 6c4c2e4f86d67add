"""A Traced partition whose every layer is a recurrent layer or a move around one (and a Linear
head), run as one C call over buffers planned at load (``native/recurrent_net.py``): the route
"native" of lstm_bi2_ts14's, gru_tm3_ts13's partitions and the VAD's after its convolutions.

Why: traced, each recurrent op cost 10-15 us of Python dispatch (``backplane::native_stack``, a
custom op whose kernel is Python) and each other op of the trace 2-5 us, where the layers'
arithmetic is 5-20 us a run; ONNX Runtime runs these nets in 60-100 us.

``CpuAcc.native`` "auto" (the default) takes it, under ``CpuAcc.compile=auto``, for a float32
partition of static shapes with a recurrent layer that ``recurrent_net.plan`` covers whole; "off",
a pinned compile mode, or no C compiler (``NativeUnavailable``) keeps the trace.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from backplane.backends.api.backend import Workload
from backplane.ir.graph import Layer, TensorInfo

log = logging.getLogger("backplane.torch")
ROUTE = "native"


def traced_whole(layer: Layer, backend: Any, inputs: Sequence[TensorInfo]) -> Workload | None:
    """The Traced ``layer`` as one native call, or None (see above)."""
    from backplane.native import NativeUnavailable, build, library

    from backplane.backends.torch.fusion.native_cnn import traced_float32

    a = layer.attrs
    if not traced_float32(layer, backend, inputs):
        return None
    from backplane.native.recurrent_layers import RECURRENT
    from backplane.native.recurrent_net import Executor, Unplannable, plan

    if not any(lay.op_type in RECURRENT for lay in a["layers"]):
        return None
    try:
        planned = plan(a["layers"], a["constants"], a["inputs"], [i.shape for i in inputs],
                       a["outputs"])
    except Unplannable as why:
        log.debug("%s: not a native recurrent net (%s)", layer.name, why)
        return None
    try:
        executor = Executor(planned, library("recurrent"))
    except NativeUnavailable:
        return None
    from backplane.backends.torch.fusion.native_cnn import _workload

    return _workload(executor, [(layer.name, "RecurrentNet")],
                     f"{ROUTE}: CpuAcc.native={build.mode(backend.options)}, the whole partition "
                     f"one call ({len(planned.rows)} records, {planned.flops} multiply-adds)")
