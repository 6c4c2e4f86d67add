"""OpenVINO: a compiling CPU backend over Intel's OpenVINO runtime (``pip install openvino``).

Support is OpenVINO's own answer. ``is_layer_supported`` refuses what it can tell from a layer alone:
element types the CPU plugin does not compute as they are (float64 runs as float32 there), sub-graphs
(If, Loop, Scan stay with builtin), and ops OpenVINO's ONNX frontend has no rule for. Then
``optimize_subgraph`` builds each partition as an ONNX model in memory, reads it with that frontend and
asks the CPU plugin which of its ops it takes (``Core.query_model``): a partition taken whole becomes
one ``CompiledModel`` layer, and a layer it refuses goes to the next backend with OpenVINO's reason
(``partition.py``). The layer is compiled, and its infer request made, when the network loads.

Tensors are NumPy arrays in host memory, shared with OpenVINO without copies (``workload.py``): edges
to CpuRef are direct, edges to CpuAcc imports.

Options: ``OpenVINO.threads`` (INFERENCE_NUM_THREADS of each compiled partition; default: OpenVINO's
choice), ``OpenVINO.precision`` ("fp32", the default; "bf16" or "fp16": float32 computed in that type
where the CPU has it, the name and values of GpuAcc's option), ``OpenVINO.performance_hint``
("LATENCY", the default; "THROUGHPUT", "CUMULATIVE_THROUGHPUT").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from backplane.backends.api.backend import (
    DELEGATE_DOMAIN,
    SUPPORTED,
    Backend,
    BackendContext,
    BackendOptions,
    Support,
    Workload,
    WorkloadFactory,
    is_numpy_native,
    unsupported,
)
from backplane.backends.api.kernels import UnsupportedError
from backplane.backends.api.optimization import OptimizationViews
from backplane.install_hints import hint
from backplane.ir.graph import Graph, Layer, SubgraphView, TensorInfo

INSTALL = hint("openvino")
QUANTIZED_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
    "MatMulInteger", "ConvInteger", "QLinearAdd", "QLinearMul", "QLinearGlobalAveragePool",
    "QLinearAveragePool", "QLinearConcat", "QLinearLeakyRelu", "QLinearSigmoid", "QLinearSoftmax"})
"""Refused: OpenVINO runs quantized graphs through its own int8 transformations, whose rounding is
not the graph's (the corpus's resnet_qlinear_ort15 moved by a quarter of its logits' scale)."""
NAN_WRONG_OPS = {"ThresholdedRelu": "x * (x > alpha)", "Shrink": "a product with x's sign"}
"""Refused: OpenVINO computes them in a form that makes NaN of -inf and of +inf (ThresholdedRelu of
-inf, Shrink of either), where ONNX gives 0 or the infinity (nan_forms.py keeps NaN for the rest)."""



def openvino_missing() -> str | None:
    """Why OpenVINO cannot be used here, or None."""
    if importlib.util.find_spec("openvino") is None:
        return f"OpenVINO is not installed ({INSTALL})"
    try:
        from backplane.backends.openvino.query import DEVICE, core

        devices = core().available_devices
    except Exception as exc:  # noqa: BLE001 - a broken install: say what it raised
        return f"OpenVINO does not load: {type(exc).__name__}: {exc}"
    if DEVICE not in devices:
        return f"OpenVINO has no {DEVICE} device here (its devices: {', '.join(devices) or 'none'})"
    return None


class OpenVINO(Backend):
    """Partitions compiled by OpenVINO for the CPU, on NumPy arrays it shares."""

    id = "OpenVINO"
    version = "0.1.0"
    OPTIONS = {
        "OpenVINO.threads": "inference threads of each compiled partition (OpenVINO's choice)",
        "OpenVINO.precision": "fp32, bf16 or fp16 for float32 math (fp32)",
        "OpenVINO.performance_hint": "LATENCY, THROUGHPUT or CUMULATIVE_THROUGHPUT (LATENCY)",
    }

    def __init__(self) -> None:
        self.options = BackendOptions()
        self.missing = openvino_missing()

    def availability(self) -> Support:
        return unsupported(self.missing) if self.missing else SUPPORTED

    def capabilities(self) -> dict[str, Any]:
        return {**super().capabilities(), "ZeroCopyNumPy": True, "CompiledPartitions": True,
                "HostThreads": "tbb"}

    def is_layer_supported(self, layer: Layer, inputs: Sequence[TensorInfo],
                           outputs: Sequence[TensorInfo]) -> Support:
        if self.missing:
            return unsupported(self.missing)
        reason = _layer_reason(layer, inputs, outputs)
        if reason is None:
            from backplane.backends.openvino import query

            reason = query.no_conversion_rule(layer, inputs, outputs)
        return unsupported(reason) if reason else SUPPORTED

    def optimize_subgraph(self, view: SubgraphView) -> OptimizationViews:
        if self.missing:
            return OptimizationViews(untouched=[view])
        from backplane.backends.openvino import partition, workload

        workload.compile_config(self.options)  # a wrong option value fails here, not at load
        return partition.optimize(view)

    def create_workload_factory(self, memory_manager: Any = None) -> WorkloadFactory:
        return OpenVINOWorkloadFactory(self, memory_manager)

    # -- ahead of time: each compiled partition exported by OpenVINO (delegate.py) -------------------
    def machine_facts(self) -> dict[str, str]:
        from backplane.backends.openvino import delegate

        return {} if self.missing else delegate.machine_facts()

    def preprocess(self, graph: Any, compile_specs: Any) -> Any:
        from backplane.backends.openvino import delegate

        return None if self.missing else delegate.preprocess(self, graph)

    def init(self, processed: Any, compile_specs: Any, context: Any) -> Any:
        from backplane.backends.openvino import delegate

        return delegate.init(self, processed, context)

    def execute(self, handle: Any, *inputs: Any) -> tuple[Any, ...]:
        return handle(*inputs)

    def create_backend_context(self, options: BackendOptions) -> BackendContext | None:
        """Checks the runtime's OpenVINO options (a wrong value is an error at the first load)."""
        if not self.missing:
            from backplane.backends.openvino import workload

            workload.compile_config(options)
        return None


class OpenVINOWorkloadFactory(WorkloadFactory):
    def create_workload(self, layer: Layer, inputs: Sequence[TensorInfo],
                        outputs: Sequence[TensorInfo]) -> Workload:
        from backplane.backends.openvino import partition, workload

        if layer.domain == DELEGATE_DOMAIN:  # a partition of an artifact: its blob, imported
            return super().create_workload(layer, inputs, outputs)
        if layer.domain != partition.DOMAIN or layer.op_type != partition.OP:
            raise UnsupportedError(f"OpenVINO runs only the partitions it compiled, not "
                                   f"{layer.describe()}")
        options = self.backend.options
        compiled = workload.compile_model(layer.attrs["model"], options)
        nan_model = layer.attrs.get("nan_model")
        nan_compiled = None if nan_model is None else \
            (lambda: workload.compile_model(nan_model(), options))
        return workload.CompiledPartition(compiled, outputs, nan_compiled,
                                          layer.attrs.get("checks", ()))


def _layer_reason(layer: Layer, inputs: Sequence[TensorInfo],
                  outputs: Sequence[TensorInfo]) -> str | None:
    """What refuses ``layer`` before OpenVINO is asked, or None."""
    if layer.op_type in QUANTIZED_OPS:
        return (f"{layer.op_type}: OpenVINO's int8 transformations round otherwise than the graph "
                f"says; quantized layers stay with the backends that follow it")
    if layer.op_type in NAN_WRONG_OPS:
        return (f"{layer.op_type}: OpenVINO computes it as {NAN_WRONG_OPS[layer.op_type]}, which "
                f"turns an infinite input into NaN")
    if any(isinstance(v, Graph) or (isinstance(v, list) and v and isinstance(v[0], Graph))
           for v in layer.attrs.values()):
        return "a layer with a sub-graph (its body) is not converted; builtin runs control flow"
    known = [info for info in outputs if info.dtype is not None]  # an unused mask may be unknown
    for info in (*inputs, *known):
        reason = _dtype_reason(info)
        if reason:
            return reason
    return None


def _dtype_reason(info: TensorInfo) -> str | None:
    dtype = info.dtype
    if dtype is None:
        return "a tensor of unknown type (or a sequence or optional) is not converted"
    if not is_numpy_native(dtype):
        return f"data type {dtype.name} is not shared with NumPy"
    if dtype.kind == "f" and dtype.itemsize == 8:
        return "float64: OpenVINO's CPU plugin computes it as float32"
    if dtype.kind in "cOSU":
        return f"data type {dtype.name} is not supported by OpenVINO's CPU plugin"
    return None
