"""IOBinding: inputs and outputs bound to memory before a run, as ONNX Runtime's ``io_binding()``.

A GPU pipeline binds a CUDA tensor as an input and asks for an output on the device: the run then
reads the input where it is (imported through DLPack, no copy into the network's first GPU
partition) and leaves the output in device memory, so the data never touches the host::

    binding = session.io_binding()
    binding.bind_input("x", torch_cuda_tensor)        # or a CuPy / JAX array, or a NumPy array
    binding.bind_output("y", "cuda")                  # a device; or bind_output("y", buffer=out)
    session.run_with_iobinding(binding)
    y = binding.get_outputs()[0]                      # a torch CUDA tensor

Inputs may be anything that speaks DLPack; a bound output is either a device (the output is made
there) or a buffer the user allocated (the output is written into it, on its device). Outputs not
bound come back in host memory, as NumPy arrays, as ``run`` returns them.

A host buffer of the output's static shape and type, writable, C-contiguous and apart from the
bound inputs is written by the layer that makes the output (``runtime/user_buffers.py``: NumPy's
and torch's ``out=``), not copied into after the run; another buffer (a free shape, a CUDA tensor,
strided memory) is filled by one copy when the run is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from backplane.backends.api.memory import device_of, host_view, to_host
from backplane.ir.graph import TensorInfo
from backplane.runtime.user_buffers import mismatch

if TYPE_CHECKING:
    from backplane.session import InferenceSession, RunOptions

DEVICE_TYPES = ("cpu", "cuda")


class IOBinding:
    """Inputs and outputs of one session bound to memory (ONNX Runtime's ``SessionIOBinding``)."""

    def __init__(self, session: InferenceSession) -> None:
        self._session = session
        self._inputs: dict[str, Any] = {}
        self._outputs: dict[str, tuple[str, Any]] = {}  # name -> (device, buffer or None)
        self._results: list[Any] | None = None

    # -- inputs ----------------------------------------------------------------------------------------
    def bind_input(self, name: str, value: Any = None, device_type: str | None = None,
                   device_id: int = 0, element_type: Any = None, shape: Sequence[int] | None = None,
                   buffer_ptr: int | None = None) -> None:
        """Bind ``value`` (a NumPy array or anything that speaks DLPack, on the host or a CUDA
        device) to the input ``name``. ONNX Runtime's raw form (``device_type``, ``buffer_ptr``,
        ...) is refused: pass the tensor that owns the memory."""
        self._session_input(name)
        if value is None or buffer_ptr is not None:
            raise TypeError(f"bind_input('{name}', ...) takes the tensor itself (a NumPy array, a "
                            f"torch tensor, anything with __dlpack__), not a raw buffer pointer")
        self._inputs[name] = value

    def bind_cpu_input(self, name: str, value: Any) -> None:
        self._session_input(name)
        self._inputs[name] = host_view(value)

    def bind_ortvalue_input(self, name: str, value: Any) -> None:
        self.bind_input(name, value)

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    # -- outputs ---------------------------------------------------------------------------------------
    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type: Any = None, shape: Sequence[int] | None = None,
                    buffer_ptr: int | None = None, *, buffer: Any = None) -> None:
        """Ask for the output ``name`` on a device (``"cpu"``, ``"cuda"``, with ``device_id``), or
        written into ``buffer``, a tensor the caller allocated (its device is where it is made)."""
        self._session_output(name)
        if buffer_ptr is not None:
            raise TypeError(f"bind_output('{name}', ...) takes buffer=<tensor>, not a raw pointer")
        if buffer is not None:
            self._outputs[name] = (device_of(buffer), buffer)
            return
        kind = str(device_type).lower()
        if kind not in DEVICE_TYPES:
            raise ValueError(f"device_type {device_type!r} is not one of {', '.join(DEVICE_TYPES)}")
        self._outputs[name] = ("cpu" if kind == "cpu" else f"{kind}:{int(device_id)}", None)

    def bind_ortvalue_output(self, name: str, value: Any) -> None:
        self.bind_output(name, buffer=value)

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._results = None

    # -- results ---------------------------------------------------------------------------------------
    def get_outputs(self) -> list[Any]:
        """The bound outputs (all outputs if none were bound) of the last run, in the order they
        were bound: device tensors stay on their device; a buffer given is returned filled."""
        if self._results is None:
            raise RuntimeError("no outputs yet: call session.run_with_iobinding(binding) first")
        return list(self._results)

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        return [to_host(value) for value in self.get_outputs()]

    def synchronize_inputs(self) -> None:
        """Inputs are read on the stream the run is on, which waits for them: nothing to do."""

    def synchronize_outputs(self) -> None:
        """Wait until the outputs of the last run are written (``run_with_iobinding`` does)."""
        for device in {device_of(v) for v in self._results or []} - {"cpu"}:
            import torch

            torch.cuda.current_stream(device).synchronize()

    # -- the run ---------------------------------------------------------------------------------------
    def _run(self, run_options: RunOptions | None) -> None:
        session = self._session
        names = [arg.name for arg in session.get_inputs()]
        missing = [name for name in names if name not in self._inputs]
        if missing:
            raise ValueError(f"input(s) {missing} not bound; bind every input of the model: "
                             f"{', '.join(names)}")
        outputs = [arg.name for arg in session.get_outputs()]
        wanted = [self._outputs.get(name, ("cpu", None)) for name in outputs]
        into = [self._into(name, device, buffer) for name, (device, buffer) in zip(outputs, wanted)]
        results = session._run_on(self._inputs, [None if d == "cpu" else d for d, _ in wanted],
                                  run_options, into if any(b is not None for b in into) else None)
        written = {name for name, b in zip(outputs, into) if b is not None}
        by_name = dict(zip(outputs, results))
        chosen = list(self._outputs) or outputs
        filled = []
        for name in chosen:
            value = by_name[name]
            buffer = self._outputs.get(name, ("cpu", None))[1]
            if buffer is not None:
                value = buffer if name in written else _write(name, buffer, value)
            filled.append(value)
        self._results = filled
        self.synchronize_outputs()

    def _into(self, name: str, device: str, buffer: Any) -> np.ndarray | None:
        """The host array the output ``name`` is written into by its producer, or None where the
        buffer is filled after the run (no buffer, device memory, a free shape, strided or
        read-only memory, memory of a bound input). A buffer that does not fit the output's
        static shape and type is an error, before the run."""
        if buffer is None or device != "cpu":
            return None
        try:
            host = host_view(buffer)
        except (TypeError, ValueError, RuntimeError, BufferError):
            return None  # filled after the run, as any other
        info: TensorInfo = self._session.graph.info(name)
        if not info.is_static or info.dtype is None:
            return None
        if host.shape != tuple(info.shape) or host.dtype != info.dtype:  # type: ignore[arg-type]
            raise ValueError(mismatch(name, info.shape, info.dtype,  # type: ignore[arg-type]
                                      host.shape, host.dtype))
        flags = host.flags
        if not (flags.writeable and flags.c_contiguous and flags.aligned) \
                or any(_shares(host, value) for value in self._inputs.values()):
            return None
        return host

    def _session_input(self, name: str) -> None:
        names = [arg.name for arg in self._session.get_inputs()]
        if name not in names:
            raise ValueError(f"'{name}' is not an input of the model; its inputs are: "
                             f"{', '.join(names)}")

    def _session_output(self, name: str) -> None:
        names = [arg.name for arg in self._session.get_outputs()]
        if name not in names:
            raise ValueError(f"'{name}' is not an output of the model; its outputs are: "
                             f"{', '.join(names)}")


def _write(name: str, buffer: Any, value: Any) -> Any:
    """``value`` copied into the caller's ``buffer`` (same shape and type), on the buffer's device."""
    shape = tuple(int(s) for s in buffer.shape)
    if shape != tuple(int(s) for s in value.shape) or \
            (isinstance(buffer, np.ndarray) and buffer.dtype != to_host(value).dtype):
        raise ValueError(mismatch(name, tuple(value.shape), value.dtype, shape, buffer.dtype))
    if isinstance(buffer, np.ndarray):
        np.copyto(buffer, to_host(value), casting="no")
        return buffer
    import torch

    target = buffer if isinstance(buffer, torch.Tensor) else torch.from_dlpack(buffer)
    source = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    if target.dtype != source.dtype:
        raise ValueError(mismatch(name, tuple(source.shape), source.dtype, shape, target.dtype))
    target.copy_(source)
    return buffer


def _shares(host: np.ndarray, value: Any) -> bool:
    """Whether ``value``, a bound input, may share memory with the host array ``host``."""
    if device_of(value) != "cpu":
        return False
    try:
        return bool(np.may_share_memory(host, host_view(value)))
    except (TypeError, ValueError, RuntimeError, BufferError):
        return True  # unknown: the buffer is filled after the run
