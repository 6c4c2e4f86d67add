"""A compiled partition at run time: the options as OpenVINO's compile configuration, and the workload.

The workload is one infer call on NumPy arrays shared with OpenVINO both ways: each input wraps the
caller's array (``openvino.Tensor(..., shared_memory=True)``), and each output of a static shape is a
fresh ``np.empty`` array that OpenVINO writes into, so no run's outputs are overwritten by the next.
An output whose shape is known only after the run (free dimensions) is copied: OpenVINO keeps it in
the infer request's own memory, which the next run reuses. So is an output that is one of the
partition's inputs (``passed_through``): OpenVINO never writes it. Infer requests are pooled: runs of
one network from several threads each take one, so the workload is not ``exclusive``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from backplane.backends.api.backend import BackendOptions, OptionError
from backplane.ir.graph import TensorInfo

log = logging.getLogger("backplane.openvino")

PRECISIONS = {"fp32": "f32", "bf16": "bf16", "fp16": "f16"}
"""``OpenVINO.precision`` (the name and values of GpuAcc's option) -> OpenVINO's inference precision."""
HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")


def compile_config(options: BackendOptions) -> dict[str, str]:
    """OpenVINO's compile configuration from a network's options; OptionError for a value it does
    not take. fp32 unless asked: OpenVINO's own default on a CPU with bf16 is bf16."""
    precision = options.get("OpenVINO.precision", "fp32")
    if precision not in PRECISIONS:
        raise OptionError(f"OpenVINO.precision {precision!r} is not one of "
                          f"{', '.join(PRECISIONS)}")
    hint = options.get("OpenVINO.performance_hint", "LATENCY")
    if not isinstance(hint, str) or hint.upper() not in HINTS:
        raise OptionError(f"OpenVINO.performance_hint {hint!r} is not one of {', '.join(HINTS)}")
    config = {"INFERENCE_PRECISION_HINT": PRECISIONS[precision], "PERFORMANCE_HINT": hint.upper()}
    threads = options.get("OpenVINO.threads")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, (int, str)) \
                or not str(threads).isdigit() or int(threads) < 1:
            raise OptionError(f"OpenVINO.threads {threads!r} is not a positive whole number")
        config["INFERENCE_NUM_THREADS"] = str(int(threads))
    return config


def compile_model(model: Any, options: BackendOptions) -> Any:
    """``model`` compiled for OpenVINO's CPU plugin as ``options`` say; a precision the CPU does not
    have (bf16 without AVX512-BF16 or AMX) is computed in f32, with a warning."""
    from backplane.backends.openvino.query import DEVICE, core

    config = compile_config(options)
    compiled = core().compile_model(model, DEVICE, config)
    got = precision_of(compiled)
    if got != config["INFERENCE_PRECISION_HINT"]:
        capabilities = core().get_property(DEVICE, "OPTIMIZATION_CAPABILITIES")
        log.warning("OpenVINO.precision %s: this CPU computes in %s (OpenVINO's capabilities here: "
                    "%s)", options.get("OpenVINO.precision", "fp32"), got, ", ".join(capabilities))
    return compiled


def precision_of(compiled: Any) -> str:
    """The precision ``compiled`` computes float32 math in, as OpenVINO names it ("f32", "bf16")."""
    return str(compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name())


class CompiledPartition:
    """One infer call of a compiled model on NumPy arrays shared with OpenVINO."""

    exclusive = False

    def __init__(self, compiled: Any, outputs: Sequence[TensorInfo],
                 nan_compiled: Callable[[], Any] | None = None,
                 checks: Sequence[Mapping[str, Any]] = ()) -> None:
        from backplane.backends.openvino.checks import Check

        self.compiled = compiled
        made = [Check(**check) for check in checks]  # sizes, indices: before the run or after
        self._before = [check for check in made if not check.after]
        self._after = [check for check in made if check.after]
        self._infos = list(outputs)
        self._nan_compiled = nan_compiled  # the model keeping NaN, compiled when first needed
        self._nan: CompiledPartition | None = None
        self._nan_lock = threading.Lock()
        self.precision = precision_of(compiled)
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle.put(compiled.create_infer_request())  # made at load; more if runs overlap
        passed = passed_through(compiled)  # copied after the run, as a shape known only then
        self._outputs = [(_static_shape(info, port) if index not in passed else None,
                          port.get_element_type().to_dtype())
                         for index, (info, port) in enumerate(zip(outputs, compiled.outputs))]

    def __call__(self, *inputs: Any) -> tuple[np.ndarray, ...]:
        for check in self._before:
            check(inputs)
        if self._nan_compiled is not None and not all(_finite(value) for value in inputs):
            return self.keeping_nan()(*inputs)
        return self._infer(inputs)

    def keeping_nan(self) -> CompiledPartition:
        """The workload of the NaN-keeping model (``nan_forms``), compiled at its first use."""
        with self._nan_lock:
            if self._nan is None:
                assert self._nan_compiled is not None
                self._nan = CompiledPartition(self._nan_compiled(), self._infos)
                self._nan._after = self._after  # (the checks before the run are made by this one)
            return self._nan

    def _infer(self, inputs: Sequence[Any]) -> tuple[np.ndarray, ...]:
        import openvino

        try:
            request = self._idle.get_nowait()
        except queue.Empty:
            request = self.compiled.create_infer_request()
        try:
            # the request holds only OpenVINO's side of each tensor: ``held`` keeps the arrays
            # alive until the infer call is over (a copy made by ``_shareable`` has no other owner)
            held = [openvino.Tensor(_shareable(value), shared_memory=True) for value in inputs]
            for index, tensor in enumerate(held):
                request.set_input_tensor(index, tensor)
            results: list[np.ndarray | None] = []
            for index, (shape, dtype) in enumerate(self._outputs):
                array = np.empty(shape, dtype) if shape is not None else None
                if array is not None:
                    request.set_output_tensor(index, openvino.Tensor(array, shared_memory=True))
                results.append(array)
            request.infer()
            del held
            if self._after:  # what they read is computed inside: the compiled model's extra outputs
                added = [request.get_output_tensor(index).data
                         for index in range(len(results), len(self.compiled.outputs))]
                for check in self._after:
                    check(inputs, added)
            return tuple(array if array is not None else request.get_output_tensor(i).data.copy()
                         for i, array in enumerate(results))
        finally:
            self._idle.put(request)


def _static_shape(info: TensorInfo, port: Any) -> tuple[int, ...] | None:
    """The shape of an output both the graph and OpenVINO know before the run, or None. Where the
    graph's is static and OpenVINO's is not (a model declaring an output shape its input's free
    dimension contradicts), OpenVINO writes a smaller tensor into the array it is given and leaves
    the rest as np.empty left it: such an output is copied after the run, in OpenVINO's shape."""
    shape = port.get_partial_shape()
    if not info.is_static or shape.is_dynamic:
        return None
    ours = tuple(int(d) for d in info.shape)  # type: ignore[union-attr]
    return ours if ours == tuple(shape.to_shape()) else None


def passed_through(compiled: Any) -> set[int]:
    """The outputs of ``compiled`` that are one of its inputs (a Dropout, Identity or one-input Sum
    the frontend removed: Parameter -> Result). OpenVINO's CPU plugin never writes an output tensor
    set for those (the array stays as ``np.empty`` left it, another run's freed memory); its own
    output tensor is the input's memory, which the workload copies. The runtime model's results are
    in the compiled model's output order."""
    results = compiled.get_runtime_model().get_results()
    return {index for index, result in enumerate(results)
            if result.input_value(0).get_node().get_rt_info()["layerType"].astype(str) == "Input"}


def _finite(value: Any) -> bool:
    """Whether ``value`` holds no NaN or infinity (an array not of floats holds none)."""
    array = np.asarray(value)
    return array.dtype.kind != "f" or bool(np.isfinite(array).all())


def _shareable(value: Any) -> np.ndarray:
    """``value`` as an array OpenVINO can wrap: C-contiguous and writable (a copy only where it is
    neither: a broadcast view, a read-only buffer)."""
    array = np.asarray(value)
    if array.flags.c_contiguous and array.flags.writeable:
        return array
    return np.array(array, order="C")


def runtime_config(options: Mapping[str, Any]) -> None:
    """Check a runtime's options (an unknown value is an error at the first load)."""
    compile_config(BackendOptions(options))
