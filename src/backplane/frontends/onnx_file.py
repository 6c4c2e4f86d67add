"""Reading an ONNX model: the proto without its large weights, and those weights one at a time.

``onnx.load`` parses the whole file into one ModelProto: every weight's bytes live in the proto, and
the arrays made from them are a second copy until the proto goes (BERT-base: 437 MB twice at import).
``read_model`` walks the file's protobuf encoding instead: the model is parsed with each large
initializer's ``raw_data`` left out (the bytes are skipped, not read), and each of those weights is
then read from the file straight into an array of its own. The proto holds the graph; the arrays
hold the weights, once. ``WeightFile`` remembers where each weight lies, so that one a load released
can be read again (``backplane.optimizer.release``).

A file whose encoding the walk does not follow (a truncated or malformed file, a graph field given
twice) is parsed by ``onnx.load`` as before, whose errors name the problem.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

from backplane.frontends.onnx_types import onnx_to_numpy_dtype, tensor_to_array

LARGE_INITIALIZER = 1024
"""Elements: an initializer past this is read into its array apart from the proto (and shape
inference needs only its shape)."""
_GRAPH, _INITIALIZER, _RAW_DATA = 7, 5, 9  # ModelProto.graph, GraphProto.initializer, TensorProto.raw_data
_TYPED_DATA = frozenset({4, 5, 6, 7, 10, 11})  # float_data, int32_data, ..., uint64_data
_SEGMENT, _DATA_LOCATION = 3, 14
_PLAIN_TYPES = frozenset({
    TensorProto.FLOAT, TensorProto.UINT8, TensorProto.INT8, TensorProto.UINT16, TensorProto.INT16,
    TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL, TensorProto.FLOAT16, TensorProto.DOUBLE,
    TensorProto.UINT32, TensorProto.UINT64, TensorProto.BFLOAT16})
"""Element types whose raw data is the array's memory as it is (onnx's numpy_helper reads them with
one ``np.frombuffer``); the packed 4-, 2- and 6-bit types and strings are converted by onnx."""


class ModelError(ValueError):
    """The model cannot be imported: malformed, an unknown op, an unsupported opset."""


@dataclass
class ReadModel:
    """A model as ``read_model`` gives it: ``proto`` without the data of its large initializers,
    which ``arrays`` holds by name; ``weights`` says where they lie, for a model read from its path
    (None for one given as bytes or as a ModelProto)."""

    proto: ModelProto
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    weights: WeightFile | None = None
    base_dir: str | None = None


@dataclass(frozen=True)
class _Place:
    offset: int  # of the raw bytes in the model file; -1: in an external file (``tensor`` says where)
    nbytes: int
    tensor: TensorProto  # the initializer without its data


class WeightFile:
    """Where the large initializers of a model file lie, to read one again: ``read(name)`` gives the
    array the import made, read anew. The file (and any external data file) must not have changed
    since: a changed one is a ModelError, not other weights."""

    def __init__(self, path: str, base_dir: str) -> None:
        self.path, self.base_dir = path, base_dir
        self.places: dict[str, _Place] = {}
        self._stamp = _stamp(path)
        self._external: dict[str, tuple[int, int]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.places

    def read(self, name: str) -> np.ndarray:
        place = self.places[name]
        self.check(f"its weight '{name}' cannot be read again")
        return self._array(place)

    def check(self, what: str) -> None:
        """A ModelError saying ``what`` where the file or its external data changed since."""
        if _stamp(self.path) != self._stamp or any(
                _stamp(path) != stamp for path, stamp in self._external.items()):
            raise ModelError(f"'{self.path}' (or its external data) changed since the model was "
                             f"loaded from it: {what}")

    def _array(self, place: _Place) -> np.ndarray:
        if place.offset < 0:
            array = _external_array(place.tensor, self.base_dir)
            if array is None:
                raise ModelError(f"the external data of '{place.tensor.name}' is not of its size")
            return array
        array = np.empty(tuple(place.tensor.dims), onnx_to_numpy_dtype(place.tensor.data_type))
        with open(self.path, "rb") as file:
            file.seek(place.offset)
            if file.readinto(array.reshape(-1).view(np.uint8).data) != place.nbytes:
                raise ModelError(f"'{self.path}' ended inside the data of '{place.tensor.name}'")
        return array

    def note_external(self, tensor: TensorProto) -> None:
        location = {e.key: e.value for e in tensor.external_data}.get("location", "")
        path = os.path.join(self.base_dir, location)
        if os.path.isfile(path):
            self._external[path] = _stamp(path)


def _stamp(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


def read_model(model: str | os.PathLike | bytes | ModelProto | ReadModel) -> ReadModel:
    """The model from a path, bytes or a ModelProto, its large initializers as arrays apart (see
    above; a ModelProto given is the caller's and stays as it is: its weights are read by the
    importer). External data is read from the model file's folder."""
    if isinstance(model, ReadModel):
        return model
    if isinstance(model, ModelProto):
        return ReadModel(model)
    if isinstance(model, bytes):
        return _read_bytes(model)
    path = os.fspath(model)
    if os.path.isdir(path):
        raise ModelError(f"'{path}' is a directory: give the model's .onnx file")
    if not os.path.isfile(path):
        raise ModelError(f"model file '{path}' does not exist")
    base_dir = os.path.dirname(os.path.abspath(path))
    weights = WeightFile(os.path.abspath(path), base_dir)
    try:
        with open(path, "rb") as file:
            proto, places = _light_model(_FileBytes(file))
    except Exception:  # noqa: BLE001 - an encoding the walk does not follow: onnx's own parse
        proto, _ = load_model(path)
        return ReadModel(proto, base_dir=base_dir)
    arrays = _external_arrays(proto, path, base_dir, weights)
    for name, place in places.items():
        weights.places[name] = place
        arrays[name] = weights._array(place)
    try:
        onnx.external_data_helper.load_external_data_for_model(proto, base_dir)
    except Exception as exc:  # OSError, onnx's ValidationError for a missing or unsafe file
        raise ModelError(f"'{path}': its external data could not be read: {exc}") from exc
    return ReadModel(proto, arrays, weights, base_dir)


def _read_bytes(model: bytes) -> ReadModel:
    view = memoryview(model)
    try:
        proto, places = _light_model(_MemoryBytes(view))
    except Exception:  # noqa: BLE001
        proto, _ = load_model(model)
        return ReadModel(proto)
    arrays = {}
    for name, place in places.items():
        dtype = onnx_to_numpy_dtype(place.tensor.data_type)
        raw = view[place.offset:place.offset + place.nbytes]
        arrays[name] = np.frombuffer(raw, dtype).reshape(tuple(place.tensor.dims)).copy()
    return ReadModel(proto, arrays)


def _external_arrays(proto: ModelProto, path: str, base_dir: str,
                     weights: WeightFile) -> dict[str, np.ndarray]:
    """The large initializers that keep their data in external files, each read into its array
    (its tensor in ``proto`` then describes no data: it is read by name)."""
    arrays: dict[str, np.ndarray] = {}
    for init in proto.graph.initializer:
        if not (onnx.external_data_helper.uses_external_data(init) and _large(init)
                and init.data_type in _PLAIN_TYPES):
            continue
        try:
            array = _external_array(init, base_dir)
        except Exception as exc:  # OSError, onnx's ValidationError for a missing or unsafe file
            raise ModelError(f"'{path}': its external data could not be read: {exc}") from exc
        if array is None:
            continue  # data that is not its size: the importer names it
        place = TensorProto()
        place.CopyFrom(init)
        weights.places[init.name] = _Place(-1, array.nbytes, place)
        weights.note_external(init)
        arrays[init.name] = array
        init.data_location = TensorProto.DEFAULT
        del init.external_data[:]
    return arrays


def _external_array(tensor: TensorProto, base_dir: str) -> np.ndarray | None:
    """One tensor's external data as an array of its own, or None where the data is not of the
    tensor's size. It is read into a tensor of its own, which goes with it: a ModelProto's memory
    is freed only with the whole message."""
    alone = TensorProto()
    alone.CopyFrom(tensor)
    onnx.external_data_helper.load_external_data_for_tensor(alone, base_dir)
    dtype = onnx_to_numpy_dtype(alone.data_type)
    if dtype is None or len(alone.raw_data) != math.prod(alone.dims) * dtype.itemsize:
        return None
    return tensor_to_array(alone)


def _large(tensor: TensorProto) -> bool:
    return all(d >= 0 for d in tensor.dims) and math.prod(tensor.dims) > LARGE_INITIALIZER


def load_model(model: str | os.PathLike | bytes | ModelProto) -> tuple[ModelProto, str | None]:
    """Parse a whole model (its weights in the proto) from a path, bytes or a ModelProto; external
    data is loaded from its folder."""
    if isinstance(model, ModelProto):
        return model, None
    if isinstance(model, bytes):
        try:
            return onnx.load_model_from_string(model), None
        except Exception as exc:  # protobuf raises DecodeError and others
            raise ModelError(f"the bytes given are not an ONNX model: {exc}") from exc
    path = os.fspath(model)
    if os.path.isdir(path):
        raise ModelError(f"'{path}' is a directory: give the model's .onnx file")
    if not os.path.isfile(path):
        raise ModelError(f"model file '{path}' does not exist")
    try:
        proto = onnx.load(path, load_external_data=False)
    except Exception as exc:
        raise ModelError(f"'{path}' is not a readable ONNX model: {exc}") from exc
    base_dir = os.path.dirname(os.path.abspath(path))
    try:
        onnx.external_data_helper.load_external_data_for_model(proto, base_dir)
    except Exception as exc:  # OSError, onnx's ValidationError for a missing or unsafe file
        raise ModelError(f"'{path}': its external data could not be read: {exc}") from exc
    return proto, base_dir


# -- the protobuf wire format, walked -------------------------------------------------------------
class _FileBytes:
    def __init__(self, file: object) -> None:
        self.file = file
        self.size = os.fstat(file.fileno()).st_size  # type: ignore[attr-defined]

    def at(self, offset: int, count: int) -> bytes:
        self.file.seek(offset)  # type: ignore[attr-defined]
        return self.file.read(count)  # type: ignore[attr-defined]


class _MemoryBytes:
    def __init__(self, view: memoryview) -> None:
        self.view, self.size = view, len(view)

    def at(self, offset: int, count: int) -> bytes:
        return bytes(self.view[offset:offset + count])


class _Malformed(ValueError):
    """An encoding the walk does not follow (onnx's parse then reports it)."""


def _varint(data: _FileBytes | _MemoryBytes, offset: int) -> tuple[int, int]:
    """The varint at ``offset`` and the offset after it."""
    chunk = data.at(offset, 10)
    value = 0
    for k, byte in enumerate(chunk):
        value |= (byte & 0x7F) << (7 * k)
        if byte < 0x80:
            return value, offset + k + 1
    raise _Malformed(f"a varint at byte {offset} does not end")


def _fields(data: _FileBytes | _MemoryBytes, start: int, end: int,
            ) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, key offset, value offset, end offset) of each field in
    ``[start, end)``; the value of a length-delimited field is its bytes after the length."""
    offset = start
    while offset < end:
        key, value = _varint(data, offset)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, after = _varint(data, value)
        elif wire == 1:
            after = value + 8
        elif wire == 5:
            after = value + 4
        elif wire == 2:
            length, value = _varint(data, value)
            after = value + length
        else:  # groups (3, 4) are not in onnx.proto
            raise _Malformed(f"wire type {wire} at byte {offset}")
        if number == 0 or after > end:
            raise _Malformed(f"field {number} at byte {offset} runs past its message")
        yield number, wire, offset, value, after
        offset = after


def _key(number: int, length: int) -> bytes:
    return _encode(number << 3 | 2) + _encode(length)


def _encode(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _light_model(data: _FileBytes | _MemoryBytes) -> tuple[ModelProto, dict[str, _Place]]:
    """The model parsed without the raw data of its large initializers, and where those lie."""
    parts: list[bytes] = []
    places: dict[str, _Place] = {}
    graphs = 0
    for number, wire, key, value, end in _fields(data, 0, data.size):
        if number == _GRAPH and wire == 2:
            graphs += 1
            graph = _light_graph(data, value, end, places)
            parts.append(_key(_GRAPH, len(graph)) + graph)
        else:
            parts.append(data.at(key, end - key))
    if graphs != 1:
        raise _Malformed(f"{graphs} graph fields")  # protobuf merges repeated ones: onnx's parse
    return ModelProto.FromString(b"".join(parts)), places


def _light_graph(data: _FileBytes | _MemoryBytes, start: int, end: int,
                 places: dict[str, _Place]) -> bytes:
    parts: list[bytes] = []
    names: set[str] = set()
    for number, wire, key, value, after in _fields(data, start, end):
        if number != _INITIALIZER or wire != 2:
            parts.append(data.at(key, after - key))
            continue
        light, raw, tensor = _light_tensor(data, value, after)
        if tensor.name in names:
            raise _Malformed(f"initializer '{tensor.name}' twice")  # the importer names the clash
        names.add(tensor.name)
        if raw is None:
            parts.append(data.at(key, after - key))
        else:
            parts.append(_key(_INITIALIZER, len(light)) + light)
            places[tensor.name] = _Place(raw[0], raw[1], tensor)
    return b"".join(parts)


def _light_tensor(data: _FileBytes | _MemoryBytes, start: int, end: int,
                  ) -> tuple[bytes, tuple[int, int] | None, TensorProto]:
    """The tensor's fields but its raw data, where its raw data lies (offset, bytes) or None where
    it is not read apart, and the tensor without its data. A tensor is read apart where it is large,
    of a plain element type, with raw data of exactly its size and nothing else that says where its
    values are (typed data, a segment, a data location)."""
    parts: list[bytes] = []
    raw: tuple[int, int] | None = None
    plain = True
    for number, _, key, value, after in _fields(data, start, end):
        if number == _RAW_DATA:
            raw = (value, after - value)
            continue
        if number in _TYPED_DATA or number in (_SEGMENT, _DATA_LOCATION):
            plain = False
        parts.append(data.at(key, after - key))
    light = b"".join(parts)
    tensor = TensorProto.FromString(light)
    dtype = onnx_to_numpy_dtype(tensor.data_type)
    if raw is None or not plain or sys.byteorder != "little" or dtype is None \
            or tensor.data_type not in _PLAIN_TYPES or not _large(tensor) \
            or math.prod(tensor.dims) * dtype.itemsize != raw[1]:
        return light, None, tensor
    return light, raw, tensor
