"""torch's stable C ABI (the LibTorch Stable ABI: ``aoti_torch_*``, exported by libtorch) for
backplane's C kernels: the addresses of its functions, handed to a library's C, and the
registration of a C function as a torch op's CPU kernel.

Why: a torch op whose kernel is Python costs ~5 us a call in a trace (torch's call into Python,
its argument checks, the tensors' wrappers) around C that runs in well under a microsecond on the
small models' tensors (the quantized GPT's products: ``native/dynquant.py``). A boxed kernel of
this ABI, a C function over a stack of 64-bit values (each tensor an owned handle, each int its
value), is called by torch's dispatcher without Python. The C still includes no torch header (its
build takes a second, ``native/build.py``'s rule): it calls the ABI through the addresses this
module reads from the libtorch the process imported. Where that libtorch lacks a function (a
torch before the ABI), nothing is registered and the op keeps its Python kernel.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger("backplane.native")
_FILE = __file__.encode()
"""The file name a torch::Library keeps (a pointer: it must outlive the library)."""
_LIBTORCH: list[ctypes.CDLL] = []


def libtorch() -> ctypes.CDLL | None:
    """The libtorch (its CPU part) this process's torch loaded, or None where it is not found."""
    if not _LIBTORCH:
        folder = Path(torch.__file__).parent / "lib"
        found = [folder / file for file in ("libtorch_cpu.so", "libtorch_cpu.dylib",
                                            "torch_cpu.dll") if (folder / file).exists()]
        try:
            _LIBTORCH.append(ctypes.CDLL(str(found[0])))
        except (IndexError, OSError) as exc:
            log.debug("no libtorch to call: %s", exc)
            return None
    return _LIBTORCH[0]


def addresses(names: Sequence[str], optional: Sequence[str] = ()) -> list[int] | None:
    """The addresses of the ABI's functions ``names`` then ``optional`` (0 for one this torch
    lacks), or None where it lacks one of ``names``."""
    found = libtorch()
    try:
        required = [_address(getattr(found, name)) for name in names]
    except AttributeError as exc:
        log.debug("this torch has no stable ABI: %s", exc)
        return None
    return required + [_address(getattr(found, name, None)) for name in optional]


def codes(names: Sequence[str]) -> list[int] | None:
    """The values of the ABI's code functions ``names`` (``aoti_torch_dtype_float32``,
    ``aoti_torch_device_type_cpu``: how a tensor's dtype and device read), or None."""
    found = libtorch()
    try:
        return [int(getattr(found, name)()) for name in names]
    except AttributeError as exc:
        log.debug("this torch has no stable ABI: %s", exc)
        return None


def register(kernel: int, namespace: str, name: str) -> ctypes.c_void_p | None:
    """The C function at ``kernel`` (``void (uint64_t *stack, uint64_t arguments, uint64_t
    results)``) as the CPU kernel of the op ``namespace::name`` (defined first, with its schema):
    the torch::Library holding it (keep it: freeing it drops the kernel), or None where torch
    refuses it or lacks the ABI."""
    found = libtorch()
    init = getattr(found, "aoti_torch_library_init_impl", None)
    impl = getattr(found, "aoti_torch_library_impl", None)
    if init is None or impl is None:
        log.debug("%s::%s keeps its Python kernel: this torch has no stable ABI", namespace, name)
        return None
    init.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint32,
                     ctypes.POINTER(ctypes.c_void_p)]
    impl.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    handle = ctypes.c_void_p()
    if init(namespace.encode(), b"CPU", _FILE, 0, ctypes.byref(handle)) \
            or impl(handle, name.encode(), ctypes.c_void_p(kernel)):
        log.debug("%s::%s keeps its Python kernel: torch refused the registration", namespace,
                  name)
        return None
    return handle


def _address(function: object) -> int:
    if function is None:
        return 0
    return ctypes.cast(function, ctypes.c_void_p).value or 0
