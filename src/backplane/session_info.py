"""What a session tells of its model, as ONNX Runtime tells it: its inputs and outputs
(``NodeArg``) and its metadata (``ModelMetadata``); out of session.py, which runs the model."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from backplane.ir.graph import TensorInfo

NO_VERSION = 2**63 - 1
"""``ModelMetadata.version`` of a model that sets no model_version (ONNX Runtime's kNoVersion)."""


@dataclass(frozen=True)
class NodeArg:
    """An input or output as ONNX Runtime describes it: name, shape (None / str for free dims), type."""

    name: str
    shape: list[int | str | None] | None
    type: str


@dataclass(frozen=True)
class ModelMetadata:
    """The model's metadata, as ONNX Runtime's ``ModelMetadata`` gives it (``producer_version`` is
    backplane's addition). ``version`` is the model's model_version, ``NO_VERSION`` (2**63 - 1, as in
    ONNX Runtime) where the model sets none."""

    producer_name: str
    producer_version: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


def _node_arg(name: str, info: TensorInfo) -> NodeArg:
    if info.dtype is None:
        return NodeArg(name, None, "unknown")
    elem = onnx.helper.tensor_dtype_to_string(onnx.helper.np_dtype_to_tensor_dtype(info.dtype))
    elem = elem.removeprefix("TensorProto.").lower()
    return NodeArg(name, list(info.shape) if info.shape is not None else None, f"tensor({elem})")


def metadata_of(proto: onnx.ModelProto) -> ModelMetadata:
    return ModelMetadata(
        producer_name=proto.producer_name, producer_version=proto.producer_version,
        graph_name=proto.graph.name, domain=proto.domain, description=proto.doc_string,
        graph_description=proto.graph.doc_string,
        version=proto.model_version if proto.HasField("model_version") else NO_VERSION,
        custom_metadata_map={p.key: p.value for p in proto.metadata_props})
