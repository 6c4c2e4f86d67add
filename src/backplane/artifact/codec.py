"""The optimized network as JSON, its tensors in one aligned binary section: explicit, no pickle.

Every value a layer's attributes hold has one encoding here, or encoding fails naming the layer and
the attribute. JSON's own values (None, bool, int, float, str, lists, dicts with str keys) are kept
as they are; every other value is an object with one key that starts with "$":

====================  ================================================================
``$tensor``           index into the tensor table (the array's bytes in the constants section)
``$tuple``            a tuple's items
``$map``              a dict with keys that are not str (or start with "$"): [[key, value], ...]
``$scalar``           a NumPy scalar: [dtype, value]
``$dtype``            a NumPy dtype's name
``$bytes``            bytes, base64
``$proto``            an onnx protobuf message (a TensorProto attribute): [type, base64]
``$info``             a TensorInfo: [shape, dtype]
``$layer``            a Layer (the layers a fused or delegated layer holds)
``$graph``            a Graph
``$network``          an OptimizedNetwork (a control-flow layer's body, as optimized)
``$factory``          a tensor-handle factory, by id: made again by the network's backends at load
``$blob``             a delegated partition's blob, by section name
====================  ================================================================

An array is stored once however many layers hold it (by identity): the fused layers' weights and
a compiled partition's constants are the graph's own arrays.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from backplane.artifact.container import ALIGNMENT, ArtifactError
from backplane.backends.api.memory import TensorHandleFactory
from backplane.ir.graph import Graph, Layer, TensorInfo
from backplane.optimizer.optimize import OptimizedNetwork, OptimizerOptions
from backplane.optimizer.report import PlacementReport


class Blob(bytes):
    """A delegated partition's blob as a layer attribute (stored as a section of its own)."""


# -- encoding ---------------------------------------------------------------------------------------------
@dataclass
class Encoder:
    """Collects the arrays (each once) and blobs while turning a network into JSON-ready data."""

    tensors: list[np.ndarray] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)
    _index: dict[int, int] = field(default_factory=dict)
    _where: str = ""

    def network(self, net: OptimizedNetwork) -> dict[str, Any]:
        return {"graph": self.graph(net.graph), "backends": list(net.backends),
                "report": net.report.to_dict(), "input_names": list(net.input_names),
                "output_names": list(net.output_names), "options": asdict(net.options),
                "backend_options": self.value(dict(net.backend_options)),
                "exclusions": net.exclusions}

    def graph(self, graph: Graph) -> dict[str, Any]:
        used = _used_names(graph)
        return {"name": graph.name, "inputs": list(graph.inputs), "outputs": list(graph.outputs),
                "tensors": {n: _info(i) for n, i in graph.tensors.items()},
                "constants": {n: self.tensor(v) for n, v in graph.constants.items() if n in used},
                "opsets": dict(graph.opsets), "layers": [self.layer(lay) for lay in graph.layers]}

    def layer(self, layer: Layer) -> dict[str, Any]:
        where, self._where = self._where, layer.describe()
        attrs = {}
        for key, value in layer.attrs.items():
            try:
                attrs[key] = self.value(value)
            except TypeError as exc:
                raise ArtifactError(f"{layer.describe()}: attribute '{key}' cannot be stored: "
                                    f"{exc}") from None
        self._where = where
        return {"name": layer.name, "op": layer.op_type, "inputs": list(layer.inputs),
                "outputs": list(layer.outputs), "attrs": attrs, "domain": layer.domain,
                "opset": layer.opset, "backend": layer.backend}

    def tensor(self, array: np.ndarray) -> dict[str, int]:
        if id(array) not in self._index:
            self._index[id(array)] = len(self.tensors)
            self.tensors.append(array)
        return {"$tensor": self._index[id(array)]}

    def value(self, value: Any) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        encode = _ENCODERS.get(type(value))
        if encode is not None:
            return encode(self, value)
        for kind, encode in _ENCODERS.items():
            if isinstance(value, kind):
                return encode(self, value)
        if hasattr(value, "DESCRIPTOR") and value.DESCRIPTOR.name in PROTO_TYPES:
            return {"$proto": [value.DESCRIPTOR.name,
                               base64.b64encode(value.SerializeToString()).decode()]}
        raise TypeError(f"{type(value).__module__}.{type(value).__name__} has no encoding (known: "
                        f"{', '.join(t.__name__ for t in _ENCODERS)}, onnx's "
                        f"{', '.join(PROTO_TYPES)})")


def _dict(enc: Encoder, value: dict[Any, Any]) -> Any:
    if all(isinstance(k, str) and not k.startswith("$") for k in value):
        return {k: enc.value(v) for k, v in value.items()}
    return {"$map": [[enc.value(k), enc.value(v)] for k, v in value.items()]}


_ENCODERS: dict[type, Callable[[Encoder, Any], Any]] = {
    list: lambda enc, v: [enc.value(x) for x in v],
    tuple: lambda enc, v: {"$tuple": [enc.value(x) for x in v]},
    dict: _dict,
    Blob: lambda enc, v: {"$blob": _blob(enc, v)},
    bytes: lambda enc, v: {"$bytes": base64.b64encode(v).decode()},
    np.ndarray: lambda enc, v: enc.tensor(v),
    np.generic: lambda enc, v: {"$scalar": [_dtype_name(v.dtype), v.item()]},
    np.dtype: lambda enc, v: {"$dtype": _dtype_name(v)},
    TensorInfo: lambda enc, v: {"$info": _info(v)},
    Layer: lambda enc, v: {"$layer": enc.layer(v)},
    Graph: lambda enc, v: {"$graph": enc.graph(v)},
    OptimizedNetwork: lambda enc, v: {"$network": enc.network(v)},
    TensorHandleFactory: lambda enc, v: {"$factory": v.id},
}


def _blob(enc: Encoder, blob: bytes) -> str:
    enc.blobs.append(blob)
    return f"blob:{len(enc.blobs) - 1}"


def _info(info: TensorInfo) -> list[Any]:
    shape = list(info.shape) if info.shape is not None else None
    return [shape, _dtype_name(info.dtype) if info.dtype is not None else None]


def _dtype_name(dtype: np.dtype) -> str:
    return dtype.str if dtype.kind in "OSUV" and dtype.names is None else dtype.name


def _used_names(graph: Graph) -> set[str]:
    """The tensor names read anywhere in ``graph``, the layers that layers hold included: the
    constants nothing reads (the weights a fused layer folded) are not stored."""
    used = set(graph.outputs)
    pending = list(graph.layers)
    while pending:
        layer = pending.pop()
        used.update(layer.inputs)
        for value in layer.attrs.values():
            items = value if isinstance(value, list) else [value]
            pending += [x for x in items if isinstance(x, Layer)]
            if isinstance(value, dict):
                used.update(k for k in value if isinstance(k, str))
    return used


def tensor_section(tensors: list[np.ndarray]) -> tuple[list[dict[str, Any]], list[memoryview]]:
    """The tensor table and the constants section: each array's bytes at an aligned offset; arrays
    of str or object elements as JSON in the table (there are few, and they are small). The section
    is the arrays' own memory in order (a copy only of an array that is not contiguous), written
    piece by piece: never all the weights a second time in one buffer."""
    table: list[dict[str, Any]] = []
    chunks: list[memoryview] = []
    offset = 0
    for array in tensors:
        entry: dict[str, Any] = {"dtype": _dtype_name(array.dtype), "shape": list(array.shape)}
        if array.dtype.kind in "OSU":
            values = array.reshape(-1).tolist()
            if not all(isinstance(x, str) for x in values):
                raise ArtifactError(f"a constant of {array.dtype} elements that are not all str "
                                    f"cannot be stored")
            entry["values"] = values
        else:
            data = memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
            padding = -offset % ALIGNMENT
            chunks += [memoryview(b"\0" * padding), data]
            offset += padding
            entry.update(offset=offset, nbytes=len(data))
            offset += len(data)
        table.append(entry)
    return table, chunks


# -- decoding ---------------------------------------------------------------------------------------------
NUMPY_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                "float16", "float32", "float64", "complex64", "complex128")
"""The dtypes an artifact names by numpy's name (those of ONNX's tensor types numpy has)."""
ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
             "float8_e8m0fnu", "float4_e2m1fn", "float6_e2m3fn", "float6_e3m2fn", "int4", "uint4",
             "int2", "uint2")
"""The dtypes of ONNX's tensor types numpy lacks: ml_dtypes' (installed with onnx)."""
_TEXT_DTYPE = re.compile(r"[<>|=]?[USV][0-9]{1,7}|\|O")  # dtype.str of str, bytes, void, object
PROTO_TYPES = ("TypeProto", "TensorProto", "SparseTensorProto")
"""The onnx messages an attribute may hold (a TYPE_PROTO attribute's TypeProto, ...)."""


def resolve_dtype(name: Any) -> np.dtype:
    """The dtype an artifact names: one of NUMPY_DTYPES, ML_DTYPES or a str/bytes/object dtype's
    ``str``; anything else (a name read from the file) is an ArtifactError listing those."""
    if name in ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))  # a name of ML_DTYPES, not the file's
    if name in NUMPY_DTYPES or (isinstance(name, str) and _TEXT_DTYPE.fullmatch(name)):
        return np.dtype(name)
    raise ArtifactError(f"unknown dtype {str(name)[:100]!r} in the artifact; known: "
                        f"{', '.join(NUMPY_DTYPES + ML_DTYPES)}, and str/bytes/object dtypes")


MAX_DIM = 1 << 62


def tensors_from(table: list[dict[str, Any]], section: memoryview) -> list[np.ndarray]:
    """The arrays of the tensor table, views of the mapped constants section (no copy); each
    entry's shape, offset and size checked against its dtype and the section first."""
    arrays = []
    for k, entry in enumerate(table):
        if not isinstance(entry, dict) or not _shape_ok(entry.get("shape")):
            raise ArtifactError(f"tensor {k} of the artifact has entry {str(entry)[:200]}: a "
                                f"dtype and a shape of sizes >= 0 expected")
        dtype, shape = resolve_dtype(entry.get("dtype")), tuple(entry["shape"])
        count = math.prod(shape)
        if "values" in entry:
            values = entry["values"]
            if not isinstance(values, list) or len(values) != count or \
                    not all(isinstance(x, str) for x in values) or dtype.kind not in "OSU":
                raise ArtifactError(f"tensor {k} of the artifact: {count} str values of a "
                                    f"{dtype} tensor expected, its entry has {str(values)[:200]}")
            arrays.append(np.array(values, dtype=dtype).reshape(shape))
            continue
        offset, nbytes = entry.get("offset"), entry.get("nbytes")
        if not (_natural(offset) and _natural(nbytes)) or dtype.hasobject or \
                nbytes != count * dtype.itemsize or offset + nbytes > len(section):
            raise ArtifactError(f"tensor {k} of the artifact ({dtype}, shape {list(shape)}) "
                                f"says it is {nbytes!r} bytes at offset {offset!r}; it needs "
                                f"{count * dtype.itemsize} bytes within the constants section's "
                                f"{len(section)}")
        if nbytes == 0:
            arrays.append(np.zeros(shape, dtype))
        else:
            arrays.append(np.frombuffer(section, dtype, count, offset).reshape(shape))
    return arrays


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _shape_ok(shape: Any) -> bool:
    """A list of sizes >= 0 whose product stays below MAX_DIM (no overflow in byte counts)."""
    if not isinstance(shape, list) or not all(_natural(d) and d < MAX_DIM for d in shape):
        return False
    return math.prod(shape) < MAX_DIM


BackendMaker = Callable[[list[str], Mapping[str, Any]], dict[str, Any]]
"""Backend ids and the network's options -> the network's backends, made and configured."""


@dataclass
class Decoder:
    """Rebuilds the network from the header's JSON, the arrays and the blobs."""

    tensors: list[np.ndarray]
    blobs: Mapping[str, memoryview]
    make_backends: BackendMaker
    _factories: dict[str, TensorHandleFactory] = field(default_factory=dict)
    _backends: tuple[str, ...] = ()

    def network(self, data: dict[str, Any]) -> OptimizedNetwork:
        from backplane.backends.api.memory import HOST_FACTORY

        backend_options = self.value(data["backend_options"])
        backends = self.make_backends(data["backends"], backend_options)
        outer = self._factories, self._backends
        self._factories, self._backends = {HOST_FACTORY.id: HOST_FACTORY}, tuple(backends)
        for backend in backends.values():
            self._factories.update((f.id, f) for f in backend.tensor_handle_factories())
        graph = self.graph(data["graph"])
        self._factories, self._backends = outer
        return OptimizedNetwork(graph, backends, report_from(data["report"]),
                                list(data["input_names"]), list(data["output_names"]),
                                OptimizerOptions(**data["options"]), backend_options,
                                data["exclusions"], None)

    def graph(self, data: dict[str, Any]) -> Graph:
        _require(data, "graph", GRAPH_FIELDS)
        if not all(isinstance(k, str) and _natural(v) for k, v in data["opsets"].items()):
            raise ArtifactError(f"graph '{data['name']}' of the artifact has opsets "
                                f"{str(data['opsets'])[:200]}, not domain -> version")
        return Graph(data["name"], [self.layer(lay) for lay in data["layers"]], list(data["inputs"]),
                     list(data["outputs"]), {n: _info_from(i) for n, i in data["tensors"].items()},
                     {n: self.value(v) for n, v in data["constants"].items()}, dict(data["opsets"]))

    def layer(self, data: dict[str, Any]) -> Layer:
        _require(data, "layer", LAYER_FIELDS)
        if data["backend"] is not None and data["backend"] not in self._backends:
            raise ArtifactError(f"layer '{data['name']}' of the artifact runs on backend "
                                f"{data['backend']!r}, not one of its network's: "
                                f"{', '.join(self._backends)}")
        return Layer(data["name"], data["op"], list(data["inputs"]), list(data["outputs"]),
                     {k: self.value(v) for k, v in data["attrs"].items()}, data["domain"],
                     data["opset"], data["backend"])

    def value(self, data: Any) -> Any:
        if isinstance(data, list):
            return [self.value(x) for x in data]
        if not isinstance(data, dict):
            return data
        tag = next(iter(data), "")
        if not tag.startswith("$"):
            return {k: self.value(v) for k, v in data.items()}
        decode = _DECODERS.get(tag)
        if decode is None:
            raise ArtifactError(f"unknown value encoding '{tag}' (known: {', '.join(_DECODERS)}): "
                                f"the artifact was written by a newer backplane")
        return decode(self, data[tag])

    def tensor(self, index: Any) -> np.ndarray:
        if not _natural(index) or index >= len(self.tensors):
            raise ArtifactError(f"tensor {str(index)[:50]} of the artifact does not exist: its "
                                f"table has {len(self.tensors)}")
        return self.tensors[index]

    def blob(self, name: Any) -> memoryview:
        if not isinstance(name, str) or name not in self.blobs:
            raise ArtifactError(f"blob {str(name)[:50]!r} is not a section of the artifact; its "
                                f"blobs are: {', '.join(self.blobs) or 'none'}")
        return self.blobs[name]

    def factory(self, factory_id: str) -> TensorHandleFactory:
        if factory_id not in self._factories:
            raise ArtifactError(f"no backend of the network makes tensor handles '{factory_id}'; "
                                f"its backends make: {', '.join(self._factories)}")
        return self._factories[factory_id]


def _proto(payload: Any) -> Any:
    import onnx

    kind = payload[0] if isinstance(payload, list) and len(payload) == 2 else None
    if kind not in PROTO_TYPES:
        raise ArtifactError(f"an onnx message of type {str(kind)[:100]!r} in the artifact; the "
                            f"types an artifact holds are: {', '.join(PROTO_TYPES)}")
    message = {"TypeProto": onnx.TypeProto, "TensorProto": onnx.TensorProto,
               "SparseTensorProto": onnx.SparseTensorProto}[kind]()
    message.ParseFromString(base64.b64decode(payload[1], validate=True))
    return message


_DECODERS: dict[str, Callable[[Decoder, Any], Any]] = {
    "$tensor": lambda dec, i: dec.tensor(i),
    "$tuple": lambda dec, v: tuple(dec.value(x) for x in v),
    "$map": lambda dec, v: {_hashable(dec.value(k)): dec.value(x) for k, x in v},
    "$blob": lambda dec, name: dec.blob(name),
    "$bytes": lambda dec, v: base64.b64decode(v),
    "$scalar": lambda dec, v: _scalar(v),
    "$dtype": lambda dec, v: resolve_dtype(v),
    "$proto": lambda dec, v: _proto(v),
    "$info": lambda dec, v: _info_from(v),
    "$layer": lambda dec, v: dec.layer(v),
    "$graph": lambda dec, v: dec.graph(v),
    "$network": lambda dec, v: dec.network(v),
    "$factory": lambda dec, v: dec.factory(v),
}


def _scalar(payload: Any) -> Any:
    dtype = resolve_dtype(payload[0])
    if dtype.type is np.void:  # np.void(n) is n zero bytes: a number from the file, allocated
        raise ArtifactError(f"a scalar of dtype {dtype} in the artifact: scalars are numbers, "
                            f"bool or text")
    return dtype.type(payload[1])


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _info_from(data: Any) -> TensorInfo:
    shape, dtype = data if isinstance(data, list) and len(data) == 2 else (0, None)
    if shape is not None and not (isinstance(shape, list) and all(
            d is None or isinstance(d, str) or (_natural(d) and d < MAX_DIM) for d in shape)):
        raise ArtifactError(f"a tensor info of the artifact is {str(data)[:200]}: [shape, dtype] "
                            f"expected, a shape of sizes >= 0, names or None")
    return TensorInfo(tuple(shape) if shape is not None else None,
                      resolve_dtype(dtype) if dtype is not None else None)


GRAPH_FIELDS = {"name": str, "inputs": list, "outputs": list, "tensors": dict, "constants": dict,
                "opsets": dict, "layers": list}
LAYER_FIELDS = {"name": str, "op": str, "inputs": list, "outputs": list, "attrs": dict,
                "domain": str, "opset": int, "backend": (str, type(None))}


def _require(data: Any, what: str, fields: dict[str, Any]) -> None:
    """ArtifactError where ``data`` (a graph's or layer's JSON) lacks a field or mistypes one;
    inputs and outputs must be names."""
    wrong = [name for name, kind in fields.items() if not isinstance(data, dict)
             or not isinstance(data.get(name), kind) or isinstance(data.get(name), bool)]
    if not wrong and not all(isinstance(n, str) for n in (*data["inputs"], *data["outputs"])):
        wrong = ["inputs", "outputs"]
    if wrong:
        raise ArtifactError(f"a {what} of the artifact lacks or mistypes {', '.join(wrong)}: "
                            f"{str(data)[:200]}")


def report_from(data: dict[str, Any]) -> PlacementReport:
    return PlacementReport.from_dict(data)
