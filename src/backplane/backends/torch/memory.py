"""CpuAcc's freed tensor memory kept in the process for the next run (``CpuAcc.keep_memory``).

Why: torch's CPU tensors come from malloc, and glibc's malloc gives a block of 128 KB or more (a
threshold it raises to the largest block freed, up to 32 MB) its own ``mmap`` and returns it to
the system when freed, and returns the free top of its heap beyond twice that. A CNN at an image
size users run allocates tensors of megabytes every run, so every run maps them again and the
kernel zeroes each 4 KB page at its first touch: ``unet_resize_dyn20`` (256x256) took 2,950 page
faults a run, 24.0 -> 18.2 ms CPU a run at 1 thread with them gone (ONNX Runtime, which keeps its
buffers in an arena, 13.8 and no fault; this 2-core AMD EPYC, load 3-4). With the thresholds set
here, a freed block up to ``MMAP_BELOW`` stays in malloc's heap and the next run's tensors reuse it,
as ONNX Runtime's arena does: the process keeps its largest run's memory (trimmed back only beyond
``TRIM_ABOVE`` free at the heap's top).

The setting is process-wide and, once made, stays for the process (glibc has no call that gives
back its adaptive thresholds); it is made at the first CpuAcc session that does not turn it off.
Other C libraries (musl, macOS, Windows) are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import threading

MMAP_BELOW = 256 << 20
"""Blocks below this size (bytes) come from malloc's heap, freed or not, never a mapping of their own."""
TRIM_ABOVE = 1 << 30
"""malloc gives memory back to the system only where more than this is free at its heap's top."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h

_lock = threading.Lock()
_done: bool | None = None
log = logging.getLogger(__name__)


def keep_freed_memory(setting: object = True) -> bool:
    """Sets glibc's malloc thresholds once for the process where ``setting`` (``CpuAcc.keep_memory``)
    is true; returns whether they are set (False on another C library, or where it failed)."""
    global _done
    if not _enabled(setting):
        return bool(_done)
    with _lock:
        if _done is None:
            _done = _set_thresholds()
        return _done


def _enabled(setting: object) -> bool:
    if isinstance(setting, str):
        if setting.strip().lower() not in ("true", "false", "1", "0", "on", "off"):
            raise ValueError(f"CpuAcc.keep_memory must be True or False, not {setting!r}")
        return setting.strip().lower() in ("true", "1", "on")
    return bool(setting)


def _set_thresholds() -> bool:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_BELOW) == 1
                and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_ABOVE) == 1)
    except (OSError, AttributeError) as exc:  # no libc to load, or one without mallopt
        log.info("CpuAcc.keep_memory: malloc's thresholds left as they are (%s)", exc)
        return False
    return done
