"""CpuAcc's blob keeps the weights its oneDNN routes packed: an artifact load reorders none."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

import backplane
from backplane import InferenceSession
from backplane.artifact import container
from backplane.backends.api.backend import DELEGATE_DOMAIN
from tests.artifact.conftest import model_and_feeds

ONEDNN_LAYERS = {"CpuAcc.linear_route": "onednn", "CpuAcc.compile": "layers"}
"""oneDNN's packed linears, layer by layer: traced (fusion/traced.py), tiny_bert's would use MKL's."""

torch = pytest.importorskip("torch")
prepacked = pytest.importorskip("backplane.backends.torch.prepacked")
pytestmark = pytest.mark.skipif(not prepacked.available(),
                                reason="this torch cannot make a oneDNN tensor from its bytes")


def _aligned_copy(data: bytes) -> memoryview:
    room = np.zeros(len(data) + 64, np.uint8)
    start = -room.ctypes.data % 64
    room[start:start + len(data)] = np.frombuffer(data, np.uint8)
    return memoryview(room[start:start + len(data)])


def test_a_packed_linear_weight_is_made_again_from_its_bytes_without_a_copy() -> None:
    weight, x = torch.randn(96, 40), torch.randn(8, 40)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    descriptor, data, sizes, dtype = prepacked.to_bytes(packed)
    assert sizes == [96, 40] and dtype == "float32"
    memory = _aligned_copy(data)
    again = prepacked.from_bytes(descriptor, memory, sizes, dtype)
    assert again.is_mkldnn and list(again.shape) == sizes
    address = np.frombuffer(memory, np.uint8).ctypes.data
    assert torch.ops.mkldnn.data_ptr(again) == address  # it reads the bytes where they lie
    want = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], None)
    got = torch.ops.mkldnn._linear_pointwise(x, again, None, "none", [], None)
    assert torch.equal(got, want)
    # read-only bytes (a blob given as bytes) are copied once into aligned memory
    from_bytes = prepacked.from_bytes(descriptor, memoryview(bytes(data)), sizes, dtype)
    assert torch.equal(torch.ops.mkldnn._linear_pointwise(x, from_bytes, None, "none", [], None),
                       want)


@pytest.mark.parametrize("groups, channels_in", [(1, 16), (16, 1), (4, 4)])
def test_a_packed_convolution_weight_is_made_again_from_its_bytes(groups: int,
                                                                  channels_in: int) -> None:
    weight = torch.randn(16, channels_in, 3, 3)
    x = torch.randn(1, 16, 10, 10).contiguous(memory_format=torch.channels_last)
    packed = torch.ops.mkldnn._reorder_convolution_weight(weight, [1, 1], [1, 1], [1, 1], groups,
                                                          [1, 16, 10, 10])
    descriptor, data, sizes, dtype = prepacked.to_bytes(packed)
    again = prepacked.from_bytes(descriptor, _aligned_copy(data), sizes, dtype)
    conv = torch.ops.mkldnn._convolution_pointwise
    args = (None, [1, 1], [1, 1], [1, 1], groups, "none", [], None)
    assert torch.equal(conv(x, again, *args), conv(x, packed, *args))


def _packed_entries(artifact: Path) -> dict[str, dict]:
    contents = container.read(artifact)
    entries = {}
    for name, blob in contents.sections.items():
        if name.startswith("blob:"):
            length = int.from_bytes(blob[:8], "little")
            entries.update(json.loads(bytes(blob[8:8 + length])).get("packed", {}))
    return entries


@pytest.mark.parametrize("name, options", [
    ("tiny_bert", ONEDNN_LAYERS),
    ("tiny_mobilenet_v3", {"CpuAcc.compile": "layers", "CpuAcc.conv_route": "onednn"})])
def test_an_artifact_load_packs_nothing(name: str, options: dict, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The blob keeps each weight the kept oneDNN routes packed (by layer name); loading the
    artifact makes them from those bytes, calls no reorder, and runs as the ONNX session does,
    bit for bit."""
    path, feeds = model_and_feeds(name)
    backends = [("CpuAcc", options), "CpuRef"]
    artifact = tmp_path / f"{name}.bpl"
    backplane.compile(path, backends, artifact)
    entries = _packed_entries(artifact)
    assert entries, "no packed weight kept"
    expected = InferenceSession(path, backends=backends).run(None, feeds)

    reorders: list[str] = []
    mkldnn = torch.ops.mkldnn
    for op in ("_reorder_linear_weight", "_reorder_convolution_weight"):
        original = getattr(mkldnn, op)

        def counted(*args, op=op, original=original):
            reorders.append(op)
            return original(*args)
        monkeypatch.setattr(mkldnn, op, counted)
    session = InferenceSession(artifact)
    assert reorders == []
    (delegate,) = [lay for lay in session.optimized.graph.layers if lay.domain == DELEGATE_DOMAIN]
    inner = {lay.name for lay in delegate.attrs["graph"].layers}
    inner |= {sub.name for lay in delegate.attrs["graph"].layers
              for sub in lay.attrs.get("layers", []) if hasattr(sub, "name")}
    assert set(entries) <= inner  # kept by the names of the layers that read them
    for a, b in zip(session.run(None, feeds), expected):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert reorders == []


def test_routes_not_kept_leave_no_packed_weight(tmp_path: Path) -> None:
    """With every linear on MKL's route nothing is packed, so the blob keeps no packed weight."""
    path, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    backplane.compile(path, [("CpuAcc", {"CpuAcc.linear_route": "mkl"}), "CpuRef"], artifact)
    assert _packed_entries(artifact) == {}


def _set(at: int, fmt: str, *values: int):
    def change(descriptor: bytearray) -> None:
        struct.pack_into(fmt, descriptor, at, *values)
    return change


@pytest.mark.parametrize("change, data_size, named", [
    (lambda d: d.pop(), None, "descriptor of 771 bytes"),
    (lambda d: None, -64, "reads 24576 bytes"),
    (_set(304, "<q", 64), None, "reads 24832 bytes (offset 64"),  # offset0 past the data
    (_set(320, "<q", 3072 * 5), None, "reads 73728 bytes"),  # an outer stride past it
    (_set(424, "<q", 1 << 40), None, "pads dim 1 to 48, not a multiple"),  # a huge inner block
    (_set(4, "<i", 1000), None, "1000 dims"),
    (_set(416, "<i", 13), None, "13 inner blocks"),
    (_set(520, "<q", 100000), None, "inner blocks [16, 64] of dims [100000, 0]"),
    (_set(8, "<q", 97), None, "dims [97, 40]"),
    (_set(104, "<i", 5), None, "data type 5"),
    (_set(312, "<i", 3), None, "format kind 3"),
    (_set(208, "<q", 8), None, "padded offsets [8, 0]"),
    (_set(0, "<i", 7), None, "starts with 7"),
    (_set(768, "<i", 0), None, "in 0 group(s)")])
def test_a_crafted_descriptor_is_refused_before_torch_reads_it(change, data_size, named) -> None:
    """A descriptor changed in one field (or its data cut short): an ArtifactError naming the
    field, where torch would have read past the data (or oneDNN past its own arrays)."""
    from backplane.artifact.container import ArtifactError

    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(96, 40), 8)
    descriptor, data, sizes, dtype = prepacked.to_bytes(packed)
    assert len(descriptor) == 772 and len(data) == 24576  # the fields' offsets are this torch's
    crafted = bytearray(descriptor)
    change(crafted)
    memory = _aligned_copy(data[:len(data) + data_size] if data_size else data)
    with pytest.raises(ArtifactError, match=re.escape(named)):
        prepacked.from_bytes(bytes(crafted), memory, sizes, dtype)


def test_a_packed_type_outside_the_table_is_refused() -> None:
    from backplane.artifact.container import ArtifactError

    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(96, 40), 8)
    descriptor, data, sizes, _ = prepacked.to_bytes(packed)
    for dtype in ("float64", "__class__", "bfloat16"):
        with pytest.raises(ArtifactError, match="type"):
            prepacked.from_bytes(descriptor, _aligned_copy(data), sizes, dtype)


@pytest.mark.parametrize("field, value, named", [
    ("data", lambda where, n: [where[0], where[1] - 64], "reads"),
    ("data", lambda where, n: [where[0], n], "inside its payload"),
    ("data", lambda where, n: [-64, where[1]], "inside its payload"),
    ("descriptor", lambda where, n: [where[0] + 64, where[1]], "descriptor"),
    ("sizes", lambda sizes, n: [sizes[0] * 2, sizes[1]], "its layer's weight has sizes"),
    ("dtype", lambda dtype, n: "float64", "its layer's weight has sizes")])
def test_a_crafted_packed_entry_in_an_artifact_is_refused(tmp_path: Path, field: str, value,
                                                          named: str) -> None:
    """A packed weight's entry pointing past its slice, at another slice or at a weight of other
    sizes or type: the artifact's load is an ArtifactError that names it."""
    from tests.artifact.test_hostile_blob import blob_of, refused, rewrite

    path, _ = model_and_feeds("tiny_bert")
    artifact = tmp_path / "bert.bpl"
    backplane.compile(path, [("CpuAcc", ONEDNN_LAYERS), "CpuRef"], artifact)
    (blob,) = [v for k, v in container.read(artifact).sections.items() if k.startswith("blob:")]
    length = int.from_bytes(blob[:8], "little")
    header, payload = json.loads(bytes(blob[8:8 + length])), bytes(blob[8 + length:])
    name = sorted(header["packed"])[0]
    entry = header["packed"][name]
    entry[field] = value(entry[field], len(payload))
    rewrite(artifact, blob_of(header, payload))
    message = refused(artifact)
    assert named in message and (name in message or field in ("data", "descriptor"))
