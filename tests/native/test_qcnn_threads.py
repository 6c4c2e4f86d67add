"""The int8 plan on more than one thread (``native/qcnn_pool.h``) and its byte glue
(``native/qcnn_lookup.py``: a single-source chain of float glue as a 256-byte table, ``lut8``; a
residual Add of two byte tensors in one pass, ``qadd8``): the outputs are the one-thread, untabled
plan's bit for bit, on every build this CPU runs (plain x86-64: the scalar loops; x86-64-v3: AVX2;
native), on the small tier's int8 ResNets and ONNX Runtime's QDQ and QOperator quantizations of
the small mobilenet_dw_ts13 (hard-swishes, residual Adds, a grouped convolution), and the
crew's workers took items of the split records."""

from __future__ import annotations

import ctypes
import platform
import time

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("onnxruntime.quantization")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build, library, qcnn, qcnn_bytes  # noqa: E402
from tests.native import flavours  # noqa: E402
from tests.native.test_qcnn_mobilenet import _quantize  # noqa: E402

CORPUS = "tests/data/corpus"
pytestmark = [pytest.mark.skipif(build.compiler() is None, reason="no C compiler"),
              pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 build flags")]
MODELS = ("resnet_qdq_ort17", "resnet_qlinear_ort15", "mobilenet_qdq", "mobilenet_qop")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, list[dict[str, np.ndarray]]]]:
    """Each model's path and inputs (a NaN in one)."""
    folder = tmp_path_factory.mktemp("int8")
    found = {}
    for name in MODELS[:2]:
        feeds = [dict(np.load(f"{CORPUS}/{name}.s{i}.npz")) for i in (0, 1)]
        found[name] = (f"{CORPUS}/{name}.onnx", feeds)
    for fmt in ("QDQ", "QOperator"):
        path = str(folder / f"mobilenet_{fmt}.onnx")
        found[f"mobilenet_{'qdq' if fmt == 'QDQ' else 'qop'}"] = (
            path, _quantize("mobilenet_dw_ts13", path, fmt))
    for _, feeds in found.values():
        poked = {k: v.copy() for k, v in feeds[0].items()}
        next(iter(poked.values())).reshape(-1)[::97] = np.nan
        feeds.append(poked)
    return found


def _arguments(path: str, feeds: dict[str, np.ndarray], monkeypatch, on_bytes: bool):
    """The arguments the session's load gave ``qcnn.plan`` (caught as it plans)."""
    monkeypatch.setattr(qcnn_bytes, "available", lambda: on_bytes)
    caught = []
    real = qcnn.plan

    def catching(*args):
        caught.append(args)
        return real(*args)

    monkeypatch.setattr(qcnn, "plan", catching)
    InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                     input_shapes={k: list(v.shape) for k, v in feeds.items()})
    monkeypatch.setattr(qcnn, "plan", real)
    assert caught
    return caught[-1]


def _plan(args, monkeypatch, tables: bool, split_all: bool = False) -> qcnn.Plan:
    monkeypatch.setattr(qcnn, "TABLES", tables)
    planned = qcnn.plan(*args)
    if split_all:
        qcnn.split(planned.records, 0, 0)
    return planned


def _outputs(planned: qcnn.Plan, lib: ctypes.CDLL, feeds, threads: int = 1):
    executor = qcnn.Executor(planned, lib, threads)
    return [executor.numpy(*feed.values()) for feed in feeds]


def _same(got, want) -> None:
    for run_got, run_want in zip(got, want, strict=True):
        for a, b in zip(run_got, run_want, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "native"])
@pytest.mark.parametrize("name", MODELS)
def test_the_tabled_glue_gives_the_records_own_bytes(name, march, models, tmp_path, monkeypatch):
    if march == "x86-64-v3" and "avx2" not in build._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    path, feeds = models[name]
    args = _arguments(path, feeds[0], monkeypatch, qcnn_bytes.available())
    plain, tabled = _plan(args, monkeypatch, False), _plan(args, monkeypatch, True)
    assert not {"lut8", "qadd8"} & set(plain.ops)
    if name.startswith("mobilenet"):  # four hard-swishes, residual Adds
        assert tabled.ops.count("lut8") == 4 and "qadd8" in tabled.ops
        assert "hsig_f" not in tabled.ops and "mul_f" not in tabled.ops
        assert len(tabled.records) < len(plain.records) - 20
    lib = library("qcnn") if march == "native" else flavours.built("qcnn", march, tmp_path)
    _same(_outputs(tabled, lib, feeds), _outputs(plain, lib, feeds))


@pytest.mark.parametrize("on_bytes", [True, False])
@pytest.mark.parametrize("name", MODELS)
def test_split_records_on_more_threads_give_the_one_thread_bytes(name, on_bytes, models,
                                                                 monkeypatch):
    if on_bytes and not qcnn_bytes.available():
        pytest.skip("this CPU's build has no byte products (AVX-512 VNNI)")
    path, feeds = models[name]
    args = _arguments(path, feeds[0], monkeypatch, on_bytes)
    lib = library("qcnn")
    one = _outputs(_plan(args, monkeypatch, False), lib, feeds)
    split = _plan(args, monkeypatch, True, split_all=True)
    assert ({"qconv8", "qconv"} & set(split.ops)) == {"qconv8" if on_bytes else "qconv"}
    taken = lib.backplane_qcnn_crew_items
    taken.restype = ctypes.c_int64
    for threads in (2, 3):
        before, until = taken(), time.monotonic() + 20
        _same(_outputs(split, lib, feeds, threads), one)
        while taken() == before and time.monotonic() < until:  # on a busy machine a woken
            _same(_outputs(split, lib, feeds, threads), one)  # worker may wait for a CPU longer
        assert taken() > before, f"no worker ran any item at {threads} threads"  # than a run


def test_the_plan_splits_the_large_records_only(models, monkeypatch):
    path, feeds = models["mobilenet_qdq"]
    planned = _plan(_arguments(path, feeds[0], monkeypatch, qcnn_bytes.available()),
                    monkeypatch, True)
    split = planned.records[:, qcnn.FIELDS.index("split")].astype(bool)
    ops = np.array(planned.ops)
    assert not split[np.isin(ops, ["import", "export", "gap_f"])].any()
    qcnn.split(planned.records, 0, 0)
    everything = planned.records[:, qcnn.FIELDS.index("split")].astype(bool)
    assert everything.sum() > split.sum() and (everything | ~split).all()
    assert everything[np.isin(ops, qcnn.SPLIT_CONVS + qcnn.SPLIT_ELEMENTWISE)].all()



@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3", "native"])
@pytest.mark.parametrize("name", ["mobilenet_qdq", "mobilenet_qop"])
def test_the_byte_depthwise_record_gives_the_int16_ones_bytes(name, march, models, tmp_path,
                                                              monkeypatch):
    """qdw8 (``qcnn_dw8.h``: four taps of 64 channels a vpdpbusd; the scalar loop elsewhere)
    against qdwconv's int16 pairs, each build against this CPU's int16 plan."""
    if not qcnn_bytes.available():
        pytest.skip("this CPU's build has no byte products (AVX-512 VNNI)")
    if march == "x86-64-v3" and "avx2" not in build._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    path, feeds = models[name]
    on_bytes = _plan(_arguments(path, feeds[0], monkeypatch, True), monkeypatch, True)
    pairs = _plan(_arguments(path, feeds[0], monkeypatch, False), monkeypatch, True)
    assert on_bytes.ops.count("qdw8") == pairs.ops.count("qdwconv") >= 3
    assert "qdwconv" not in on_bytes.ops and "qdw8" not in pairs.ops
    lib = library("qcnn") if march == "native" else flavours.built("qcnn", march, tmp_path)
    _same(_outputs(on_bytes, lib, feeds), _outputs(pairs, library("qcnn"), feeds))


def test_the_depthwise_weights_are_packed_as_the_unpacking_orders_the_channels():
    rng = np.random.default_rng(2)
    centred = rng.integers(-128, 128, (70, 1, 3, 3)).astype(np.int32)
    packed, folded = qcnn_bytes.pack_depthwise(centred, np.arange(70), 5, False)
    assert packed.shape == (2, 3, 4, 4, 4, 4) and packed.dtype == np.int8  # [g][q][r][L][j][i]
    np.testing.assert_array_equal(folded, np.arange(70) - 5 * centred.sum((1, 2, 3)))
    # channel 64 g + 16 L + 4 r + j, tap 4 q + i
    assert packed[0, 1, 2, 3, 1, 0] == centred[16 * 3 + 4 * 2 + 1, 0, 1, 1]  # ch 57, tap 4
    assert packed[1, 0, 1, 0, 1, 3] == centred[64 + 4 + 1, 0, 1, 0]  # ch 69, tap 3
    assert (packed[:, 2, :, :, :, 1:] == 0).all()  # taps 9-11
    assert (packed[1, :, :, 1:] == 0).all() and (packed[1, :, 2:] == 0).all()  # channels past 70
    assert qcnn_bytes.pack_depthwise(centred + 200, np.zeros(70), 0, False) is None


def _wide_model():
    """QuantizeLinear -> a 3x3 QLinearConv of 64 channels at 64x64 (151M multiply-adds: split)
    -> DequantizeLinear."""
    from onnx import helper, numpy_helper

    from tests.conftest import float_input, make_model

    rng = np.random.default_rng(6)
    inits = [numpy_helper.from_array(np.float32(0.03), "s"),
             numpy_helper.from_array(np.uint8(128), "z"),
             numpy_helper.from_array(rng.integers(-60, 60, (64, 64, 3, 3)).astype(np.int8), "w"),
             numpy_helper.from_array(np.float32(0.002), "ws"),
             numpy_helper.from_array(np.int8(0), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
             helper.make_node("QLinearConv", ["xq", "s", "z", "w", "ws", "wz", "s", "z"], ["c"],
                              kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("DequantizeLinear", ["c", "s", "z"], ["y"])]
    shape = [1, 64, 64, 64]
    return make_model(nodes, [float_input("x", shape)], [float_input("y", shape)], inits,
                      opset=13)


def test_a_two_thread_session_runs_its_split_plan_on_the_crew():
    """The session's int8 workload asks for torch's thread count before each call
    (``native_cnn._workload``): a 2-thread session's runs use the crew, a 1-thread one's never,
    and both give the same bytes."""
    lib = library("qcnn")
    taken = lib.backplane_qcnn_crew_items
    taken.restype = ctypes.c_int64
    x = np.random.default_rng(7).standard_normal((1, 64, 64, 64)).astype(np.float32)
    outputs = {}
    for threads in (1, 2):
        session = InferenceSession(_wide_model(), backends=[("CpuAcc", {"threads": threads}),
                                                            "CpuRef"],
                                   input_shapes={"x": [1, 64, 64, 64]})
        loaded = session.runtime.network(session.network_id)
        assert [lay.op_type for lay in loaded.layers if lay.backend == "CpuAcc"] == ["NativeInt8"]
        before = taken()
        outputs[threads] = session.run(None, {"x": x})[0]
        until = time.monotonic() + 20
        while threads > 1 and taken() == before and time.monotonic() < until:
            session.run(None, {"x": x})  # a busy machine: the worker may not have had a CPU
        assert (taken() > before) is (threads > 1)
    np.testing.assert_array_equal(outputs[2], outputs[1])
