"""The inputs of ``backplane run``: from .npy files, else made up, shaped by ``--shape`` and
``--dim``, each said with the free dimensions it set (issue 31, item 5)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from backplane.ir.graph import TensorInfo
from backplane.runtime.runtime import InvalidInputError
from backplane.session import InferenceSession


def key_value(text: str, option: str) -> tuple[str, str]:
    """``NAME=VALUE`` of a command-line option as (NAME, VALUE), or a ValueError naming it."""
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise ValueError(f"{option} expects NAME=VALUE, got '{text}'")
    return key, value


def feeds(session: InferenceSession, files: dict[str, str], seed: int,
           shapes: dict[str, tuple[int, ...]] | None = None, dims: dict[str, int] | None = None,
           ) -> tuple[dict[str, Any], list[str]]:
    """The run's inputs: from --input files, else made up (shaped by --shape and --dim); and a
    line per made-up input saying what it is and which free dimension was set how."""
    rng = np.random.default_rng(seed)
    shapes, dims = shapes or {}, dims or {}
    feeds: dict[str, Any] = {}
    known = [arg.name for arg in session.get_inputs()]
    for option, names in (("--input", files), ("--shape", shapes)):
        for name in names:
            if name not in known:
                raise InvalidInputError(f"{option} {name}: not an input of the model; its inputs "
                                        f"are: {', '.join(known)}")
    symbols = {d for name in known for d in (session.graph.info(name).shape or ())
               if isinstance(d, str)}
    unknown = sorted(set(dims) - symbols)
    if unknown:
        raise InvalidInputError(f"--dim {unknown[0]}: no input has a free dimension of that name; "
                                f"the free dimensions are: {', '.join(sorted(symbols)) or 'none'}")
    made = []
    for name in known:
        if name in files:
            feeds[name] = _load_npy(name, files[name])
            continue
        info = session.graph.info(name)
        shape, notes = made_shape(name, info, shapes.get(name), dims)
        feeds[name] = random_input(TensorInfo(shape, info.dtype), rng)
        made.append(f"input '{name}': made {_describe_made(feeds[name])}{notes}")
    return feeds, made


def made_shape(name: str, info: TensorInfo, given: tuple[int, ...] | None,
               dims: dict[str, int]) -> tuple[tuple[int, ...], str]:
    """The shape of a made-up input and what was chosen for its free dimensions."""
    declared = info.shape or ()
    if given is not None:
        if len(given) != len(declared) or any(isinstance(d, int) and d != g
                                              for d, g in zip(declared, given)):
            raise InvalidInputError(f"--shape {name}={','.join(map(str, given))}: the model "
                                    f"declares {name}: {info}")
        return given, ""
    shape, chosen = [], []
    for axis, d in enumerate(declared):
        if isinstance(d, int):
            shape.append(d)
        elif isinstance(d, str) and d in dims:
            shape.append(dims[d])
        else:
            shape.append(1)
            chosen.append(f"'{d}'" if isinstance(d, str) else f"axis {axis}")
    notes = (f" (free {', '.join(chosen)} set to 1: --dim NAME=SIZE or --shape "
             f"{name}=... to choose)") if chosen else ""
    return tuple(shape), notes


def _describe_made(value: np.ndarray) -> str:
    if value.size == 0 or value.dtype.kind not in "biuf":
        return f"{value.dtype}{list(value.shape)}"
    low, high = value.min(), value.max()
    return f"{value.dtype}{list(value.shape)} in [{low:.3g}, {high:.3g}]"


def shapes(items: Sequence[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for item in items:
        name, text = key_value(item, "--shape")
        try:
            shapes[name] = tuple(int(d) for d in text.split(",") if d.strip()) if text else ()
        except ValueError:
            raise InvalidInputError(f"--shape {item}: sizes are integers separated by commas "
                                    f"(--shape input=1,3,224,224)") from None
        if any(d < 0 for d in shapes[name]):
            raise InvalidInputError(f"--shape {item}: a size is >= 0")
    return shapes


def dims(items: Sequence[str]) -> dict[str, int]:
    dims = {}
    for item in items:
        name, text = key_value(item, "--dim")
        if not text.isdigit():
            raise InvalidInputError(f"--dim {item}: the size is an integer >= 0 (--dim batch=8)")
        dims[name] = int(text)
    return dims


def _load_npy(name: str, path: str) -> Any:
    """An input's array from a .npy file; a missing or unreadable file is a user error naming it."""
    if not os.path.isfile(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise InvalidInputError(f"--input {name}={path}: the file {what} (give a .npy file, "
                                f"written by numpy.save)")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"--input {name}={path}: not a readable .npy file ({exc}); write "
                                f"it with numpy.save") from exc


def random_input(info: TensorInfo, rng: np.random.Generator) -> np.ndarray:
    """Data for an input: normal floats, zeros for integers (valid ids and masks alike), False."""
    shape = tuple(d if isinstance(d, int) else 1 for d in (info.shape or ()))
    dtype = info.dtype if info.dtype is not None else np.dtype(np.float32)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)
