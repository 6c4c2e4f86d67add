"""Kernels: plain functions in one explicit table per backend, versions as data.

A kernel follows its ONNX op: inputs positional (``None`` for an absent optional input), attributes as
keyword arguments with the spec's defaults, and it always returns a tuple with one value per output
slot of the layer, ``""`` placeholders included (extra values are ignored). A kernel that needs to
know how many outputs the layer has (Split before opset 18, optional outputs) takes a keyword-only
``n_outputs``; the workload factory passes it.

A table maps an op type to ``{since_version: kernel}``; the newest kernel whose since-version is not
above the model's opset wins::

    KERNELS: KernelTable = {
        "Relu": {6: relu},
        "Softmax": {1: softmax_v1, 13: softmax},
    }
"""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

Kernel = Callable[..., tuple[Any, ...]]
KernelTable = dict[str, dict[int, Kernel]]


class UnsupportedError(NotImplementedError):
    """A kernel or backend cannot run this layer (an attribute value, a dtype, a shape).

    Raised at load time, never for a wrong answer; fallback catches exactly this.
    """


def select_kernel(table: Mapping[str, Mapping[int, Kernel]], op_type: str, opset: int) -> Kernel | None:
    """The kernel of the newest version not above ``opset``, or None."""
    versions = table.get(op_type)
    if not versions:
        return None
    eligible = [v for v in versions if v <= opset]
    return versions[max(eligible)] if eligible else None


_PARAMETERS: weakref.WeakKeyDictionary[Any, Mapping[str, inspect.Parameter]] = \
    weakref.WeakKeyDictionary()


def parameters(kernel: Kernel) -> Mapping[str, inspect.Parameter]:
    """``inspect.signature(kernel).parameters``, read once per kernel: a load checks and binds
    every layer's (the demo's 101 layers made 202 signatures, 0.03 ms each: 8-16 of the 50-64 ms
    of its CpuRef load); a kernel that cannot be weakly referenced is read each time."""
    try:
        return _PARAMETERS[kernel]
    except (KeyError, TypeError):
        pass
    params = inspect.signature(kernel).parameters
    try:
        _PARAMETERS[kernel] = params
    except TypeError:
        pass
    return params


def bind_kernel(kernel: Kernel, attrs: Mapping[str, Any], n_outputs: int) -> Callable[..., tuple[Any, ...]]:
    """Bind a layer's attributes to its kernel once, at load time.

    Attributes the kernel does not know are an UnsupportedError naming them and the known ones.
    """
    params = parameters(kernel)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [name for name in attrs if name not in params and not takes_any]
    if unknown:
        known = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY or p.default
                 is not inspect.Parameter.empty]
        raise UnsupportedError(f"attribute(s) {unknown} not supported by kernel {kernel.__name__}; "
                               f"it knows {known}")
    kwargs = dict(attrs)
    if "n_outputs" in params:
        kwargs["n_outputs"] = n_outputs
    return functools.partial(kernel, **kwargs) if kwargs else kernel


def with_write_into(workload: Callable[..., tuple[Any, ...]],
                    out_kernel: Callable[..., Any]) -> Callable[..., tuple[Any, ...]]:
    """``workload`` (a bound kernel) with a ``write_into(memory, *inputs)``: where ``memory[0]`` is
    given, ``out_kernel(out, *inputs)`` writes the one output into it (NumPy's or torch's ``out=``);
    else the workload runs as it is. The workload returned is a new object (a kernel bound without
    attributes is the table's own function, which the attribute must not reach), called as fast
    as before: a function is copied, not wrapped."""
    if isinstance(workload, types.FunctionType):
        made: Any = types.FunctionType(workload.__code__, workload.__globals__, workload.__name__,
                                       workload.__defaults__, workload.__closure__)
        made.__kwdefaults__ = workload.__kwdefaults__
        made.__dict__.update(workload.__dict__)
    elif isinstance(workload, functools.partial):
        made = functools.partial(workload.func, *workload.args, **workload.keywords)
    else:
        made = functools.partial(workload)

    def write_into(memory: Any, *inputs: Any) -> tuple[Any, ...]:
        out = memory[0]
        if out is None:
            return made(*inputs)  # type: ignore[no-any-return]
        out_kernel(out, *inputs)
        return (out,)

    made.write_into = write_into
    return made  # type: ignore[no-any-return]


def as_tuple(value: Any) -> tuple[Any, ...]:
    return value if isinstance(value, tuple) else (value,)


def numpy_dtype_name(dtype: np.dtype | None) -> str:
    return "?" if dtype is None else dtype.name
