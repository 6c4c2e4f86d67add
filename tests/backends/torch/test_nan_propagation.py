"""NaN and Inf through the torch backends (CpuAcc, and GpuAcc where CUDA is) as through CpuRef.

A NaN input must not become a finite, plausible output (issue 32: an all-NaN frame gave confident
logits on CpuAcc, where CpuRef and ONNX Runtime give NaN). Three parts, each comparing a backend's
outputs with CpuRef's on inputs holding NaN, +Inf and -Inf among finite values: where each output is
NaN, where it is +Inf or -Inf, and (loosely: the values are the differential tests' business) the
finite values.

- every op of the torch kernel table that takes float inputs, as one-node models: the ONNX node
  suite's cases of that op (models made with ``onnx.helper`` by ONNX's own test generator; the
  newest opset among them), their data inputs poisoned;
- the patterns CpuAcc fuses (Conv with its activations, batch norm and residual, Gemm / MatMul with
  theirs, squeeze-and-excitation, pools after convolutions), under each of its routes and compile
  modes, since fused kernels (oneDNN's post-ops, oneDNN Graph's partitions, cuDNN's epilogue) are
  where NaN went missing (test_nan_fused_patterns.py, with this file's helpers);
- whole models: tiny_mobilenet_v3, tiny_bert with a NaN row in its word embeddings, and corpus CNNs,
  with an all-NaN input and with one NaN pixel.

GpuAcc's cases are skipped without CUDA.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.registry import registry  # noqa: E402
from backplane.backends.torch.kernels import KERNELS  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "data"

CPU_CONFIGS: dict[str, dict[str, Any]] = {
    "auto": {},
    "compiled": {"compile": "onednn_graph"},
    "layers-onednn": {"compile": "layers", "conv_route": "onednn", "linear_route": "onednn"},
    "layers-torch": {"compile": "layers", "conv_route": "torch", "linear_route": "mkl"},
    "layers-gemm": {"compile": "layers", "conv_route": "gemm"},
}
"""CpuAcc's compile modes and routes (docs/torch-backends.md): each fused kernel is reached by
one."""
GPU_CONFIGS: dict[str, dict[str, Any]] = {"graphs": {}, "eager": {"cuda_graphs": False},
                                          "unfused": {"fuse_conv_relu": False}}
CONFIGS = [("CpuAcc", name, options) for name, options in CPU_CONFIGS.items()] + \
          [("GpuAcc", name, options) for name, options in GPU_CONFIGS.items()]


@functools.lru_cache(maxsize=None)
def unavailable(backend: str) -> str | None:
    return registry.create(backend).missing


def backends(backend: str, options: dict[str, Any]) -> list[Any]:
    if unavailable(backend):
        pytest.skip(f"{backend}: {unavailable(backend)}")
    return [(backend, {"route_cache": False, **options} if backend == "CpuAcc" else options),
            "CpuRef"]


def run(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray],
        spec: list[Any]) -> list[np.ndarray]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallback notices, invalid values: intended
        return [np.asarray(o) for o in InferenceSession(model, backends=spec).run(None, feeds)]


def assert_same_specials(name: str, got: np.ndarray, want: np.ndarray) -> None:
    """NaN where CpuRef has NaN, the same infinities, finite values close (1e-3)."""
    assert got.shape == want.shape, f"{name}: shape {got.shape}, CpuRef's {want.shape}"
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want, err_msg=name)
        return
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    lost, made = int((nan_want & ~nan_got).sum()), int((nan_got & ~nan_want).sum())
    assert not lost and not made, (f"{name}: {lost} of CpuRef's {int(nan_want.sum())} NaN are "
                                   f"not NaN here, {made} NaN where CpuRef has none "
                                   f"(of {want.size} values)")
    for sign, test in (("+Inf", np.isposinf), ("-Inf", np.isneginf)):
        differ = int((test(got) != test(want)).sum())
        assert not differ, f"{name}: {differ} values differ in being {sign}"
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite].astype(np.float64), want[finite].astype(np.float64),
                               rtol=1e-3, atol=1e-3, err_msg=name)


def compare(model: onnx.ModelProto | str | Path, feeds: dict[str, np.ndarray],
            spec: list[Any]) -> None:
    expected = run(model, feeds, ["CpuRef"])
    for index, (got, want) in enumerate(zip(run(model, feeds, spec), expected)):
        assert_same_specials(f"output {index}", got, want)


# -- poisoned values ----------------------------------------------------------------------------
def poisoned(value: np.ndarray, kind: str) -> np.ndarray:
    """``value`` with NaN ("nan": every 7th and the middle one), or +Inf and -Inf ("inf": every 5th,
    alternating), in place of some of its values."""
    value = np.array(value, copy=True)
    flat = value.reshape(-1)
    if kind == "nan":
        flat[::7] = np.nan
        flat[flat.size // 2] = np.nan
    else:
        flat[1::10] = np.inf
        flat[6::10] = -np.inf
        flat[flat.size // 2] = np.inf
    return value


# -- (a) every op, one node at a time -------------------------------------------------------------
PARAMETERS = {"Resize": {1, 2}, "Upsample": {1}, "GridSample": {1}, "RoiAlign": {1},
              "NonMaxSuppression": {0, 2, 3, 4}, "Clip": {1, 2}}
"""Float inputs that are parameters rather than data (scales, regions of interest, sampling grids,
boxes, bounds): left finite. NaN there makes the op's geometry undefined (CpuRef refuses
NaN scales; a NaN coordinate picks no pixel), which is not what this test is about."""

INF_EXCEPTIONS = {
    "DFT": "the FFT's own algorithm decides which outputs an infinity makes NaN (inf times a "
           "twiddle factor that rounds to zero in one algorithm and not in another, inf - inf in "
           "a butterfly): NumPy's, torch's and ONNX Runtime's DFT each give another pattern (ONNX "
           "Runtime all NaN); with NaN alone their real parts agree",
    "STFT": "as DFT",
}
"""Ops whose infinities this test leaves alone, with the reason; their NaN are still held."""
REAL_PARTS_ONLY = {
    "DFT": "the imaginary part of a real signal's first bin is 0 or NaN as the FFT's code takes "
           "it (NumPy gives 0 along the last axis and NaN along another, torch the reverse in "
           "STFT's frames, ONNX Runtime NaN): the real parts, which every FFT computes as a sum "
           "of the samples, are compared",
    "STFT": "as DFT",
}
"""Ops whose spectra (real, imaginary) are compared by their real parts, with the reason."""


def _float_ops() -> list[str]:
    """The kernel table's ops with an input that may be float (by their ONNX schemas)."""
    ops = []
    for op in KERNELS:
        domain, _, name = str(op).rpartition("::")
        try:
            schema = onnx.defs.get_schema(name, domain=domain)
        except onnx.defs.SchemaError:
            ops.append(str(op))  # no schema to read: checked all the same
            continue
        allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
        if any("tensor(float)" in allowed.get(formal.type_str, [formal.type_str])
               for formal in schema.inputs):
            ops.append(str(op))
    return sorted(ops)


@functools.lru_cache(maxsize=1)
def _node_cases() -> dict[str, list[Any]]:
    """op -> the node suite's one-node cases of that op at the newest opset among them (at most
    three), that have a float input to poison."""
    from tests.backends.torch.node_cases import single_op_cases
    from tests.conformance.test_node_suite import cases

    chosen: dict[str, list[Any]] = {}
    for op in _float_ops():
        domain, _, name = op.rpartition("::")
        found = []
        for case_name in single_op_cases().get(name, []):
            case = cases()[case_name]
            node = case.model.graph.node[0]
            if node.domain not in ("", "ai.onnx") and node.domain != domain:
                continue
            if _poisonable(case, op):
                version = max(o.version for o in case.model.opset_import
                              if o.domain in (node.domain, "ai.onnx" if not node.domain else ""))
                found.append((version, case_name, case))
        if found:
            newest = max(v for v, _, _ in found)
            chosen[op] = [c for v, _, c in sorted(found, key=lambda f: f[1]) if v == newest][:3]
    chosen.update({op: [make()] for op, make in OWN_CASES.items()})
    return chosen


def _own_case(op: str, inputs: list[np.ndarray], opset: int, n_outputs: int = 1,
              domain: str = "", **attrs: Any) -> Any:
    """A one-node case of ``op`` (of ``domain``, version 1 there) at ``opset`` made here, where
    the node suite has none with float data: the shape of the suite's cases (``name``, ``model``,
    ``data_sets``)."""
    from types import SimpleNamespace

    names = [f"x{i}" for i in range(len(inputs))]
    outputs = [f"y{i}" for i in range(n_outputs)]
    graph = helper.make_graph(
        [helper.make_node(op, names, outputs, domain=domain or None, **attrs)], op,
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in zip(names, inputs)],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in outputs])
    imports = [helper.make_opsetid("", opset), *([helper.make_opsetid(domain, 1)] if domain else [])]
    model = helper.make_model(graph, opset_imports=imports)
    return SimpleNamespace(name=f"own_{op.lower()}", model=model, data_sets=[(inputs, None)])


def _floats(*shape: int) -> np.ndarray:
    return np.random.default_rng(7).standard_normal(shape).astype(np.float32)


OWN_CASES = {
    "Equal": lambda: _own_case("Equal", [_floats(3, 4), _floats(3, 4)], 19),
    "NonZero": lambda: _own_case("NonZero", [_floats(3, 4)], 13),
    "Trilu": lambda: _own_case("Trilu", [_floats(2, 4, 5)], 14, upper=0),
    "GlobalLpPool": lambda: _own_case("GlobalLpPool", [_floats(1, 3, 4, 5)], 22),
    "AffineGrid": lambda: _own_case("AffineGrid", [_floats(2, 2, 3),
                                                   np.array([2, 3, 4, 5], np.int64)], 20),
    # ONNX Runtime's saved fusions (its optimizer writes them): a product and its activation
    "com.microsoft::FusedMatMul": lambda: _own_case(
        "FusedMatMul", [_floats(2, 3, 4), _floats(5, 4)], 17, domain="com.microsoft",
        transB=1, alpha=0.5),
    "com.microsoft::FusedGemm": lambda: _own_case(
        "FusedGemm", [_floats(3, 4), _floats(4, 5), _floats(5)], 17, domain="com.microsoft",
        activation="Relu"),
    "com.microsoft::FusedConv": lambda: _own_case(
        "FusedConv", [_floats(1, 3, 6, 6), _floats(4, 3, 3, 3), _floats(4)], 17,
        domain="com.microsoft", activation="Relu", pads=[1, 1, 1, 1]),
}
"""Float ops the node suite has no case with float data for: one-node models made here."""


def _poisonable(case: Any, op: str) -> list[int]:
    """The indices of the case's float inputs (with two values or more) that hold data."""
    from tests.backends.test_reference_kernels import _value

    skip = PARAMETERS.get(op.rpartition("::")[2], set())
    inputs, _ = case.data_sets[0]
    return [i for i, v in enumerate(map(_value, inputs)) if isinstance(v, np.ndarray)
            and v.dtype.kind == "f" and v.dtype.itemsize >= 2 and v.size >= 2 and i not in skip
            and v.dtype in (np.float16, np.float32, np.float64)]


def _feeds(case: Any, op: str, kind: str) -> dict[str, np.ndarray]:
    from tests.backends.test_reference_kernels import _value

    inputs, _ = case.data_sets[0]
    initialized = {init.name for init in case.model.graph.initializer}
    names = [i.name for i in case.model.graph.input if i.name not in initialized]
    targets = set(_poisonable(case, op))
    return {name: poisoned(_value(v), kind) if i in targets else _value(v)
            for i, (name, v) in enumerate(zip(names, inputs))}


OPS = _float_ops()
FUSED_ALONE = ("Conv", "Gemm", "MatMul")
"""Ops CpuAcc fuses even alone (a FusedConv or Linear, with its routes): run under its other
routes too; the rest run under each backend's default."""


def _op_params() -> list[Any]:
    params = []
    for backend, config, options in CONFIGS:
        for op in OPS:
            if op in NO_CASE or config not in ("auto", "graphs") and (
                    config != "layers-onednn" or op not in FUSED_ALONE):
                continue
            for kind in ("nan", "inf"):
                params.append(pytest.param(backend, options, op, kind,
                                           id=f"{backend}-{config}-{op}-{kind}"))
    return params


def test_every_float_op_has_a_case() -> None:
    """Each float op of the kernel table is checked here, or listed with the reason it is not:
    a kernel added later is not left out unseen."""
    missing = sorted(set(OPS) - set(_node_cases()) - set(NO_CASE))
    assert not missing, f"no one-node case with a float data input for {missing}"


NO_CASE = {
    "ConstantOfShape": "its float is an attribute; its input is a shape",
    "EyeLike": "makes a matrix of the input's shape; its values are not read",
    "Range": "float start, limit and delta are scalars: a NaN one is a NaN size, refused",
    "Shape": "reads no values", "Size": "reads no values",
    "BlackmanWindow": "its input is a size", "HammingWindow": "its input is a size",
    "HannWindow": "its input is a size",
    "DynamicQuantizeLinear": "NaN or Inf has no uint8 value (ONNX Runtime gives an infinite "
                             "scale): undefined",
    "MelWeightMatrix": "its float inputs are two frequencies, parameters of the matrix",
    "QLinearConv": "its float inputs are quantization scales; its data are integers",
    "QLinearMatMul": "its float inputs are quantization scales; its data are integers",
    "ai.onnx.ml::Binarizer": "ONNX Runtime refuses NaN input ('Input data with index: 0 is NaN')",
    **{f"com.microsoft::{op}": "its float inputs are quantization scales; its data are integers "
       "(test_contrib_quant.py)" for op in ("QLinearAdd", "QLinearMul", "QLinearSigmoid",
                                            "QLinearLeakyRelu", "QLinearConcat", "QLinearSoftmax",
                                            "QLinearGlobalAveragePool", "QLinearAveragePool",
                                            "QGemm", "MatMulIntegerToFloat")},
    **{op: "NaN and +-Inf against CpuRef in test_contrib_transformer.py (no node-suite case)"
       for op in ("com.microsoft::SkipLayerNormalization",
                  "com.microsoft::SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization",
                  "com.microsoft::Gelu", "com.microsoft::BiasGelu", "com.microsoft::FastGelu",
                  "com.microsoft::QuickGelu", "com.microsoft::BiasAdd",
                  "com.microsoft::Attention", "com.microsoft::MultiHeadAttention",
                  "com.microsoft::GroupQueryAttention", "com.microsoft::RotaryEmbedding")},
    "com.microsoft::QAttention": "its input is integers; its float inputs are quantization scales",
    "com.microsoft::EmbedLayerNormalization": "its data are token ids; its float inputs are the "
                                              "tables",
    "com.microsoft::MatMulNBits": "its weight is integer blocks; NaN in A against CpuRef in "
                                  "test_contrib_quant.py",
    "com.microsoft::DynamicQuantizeMatMul": "its input is quantized as by DynamicQuantizeLinear "
                                            "(NaN or Inf: undefined, as there)",
}
"""Float ops without a case here, and why."""


@pytest.mark.parametrize("backend,options,op,kind", _op_params())
def test_op(backend: str, options: dict[str, Any], op: str, kind: str) -> None:
    spec = backends(backend, options)
    if kind == "inf" and op in INF_EXCEPTIONS:
        pytest.skip(f"{op} with Inf: {INF_EXCEPTIONS[op]}")
    cases = _node_cases().get(op)
    assert cases, f"{op}: no case (test_every_float_op_has_a_case names it)"
    for case in cases:
        feeds = _feeds(case, op, kind)
        expected = run(case.model, feeds, ["CpuRef"])
        for index, (got, want) in enumerate(zip(run(case.model, feeds, spec), expected)):
            if op in REAL_PARTS_ONLY:
                got, want = got[..., 0], want[..., 0]
            assert_same_specials(f"{case.name} output {index}", got, want)


# -- (b) whole models -----------------------------------------------------------------------------
MODELS = {
    "tiny_mobilenet_v3": DATA / "tiny_mobilenet_v3.onnx",
    "mobilenet_dw_ts13": DATA / "corpus" / "mobilenet_dw_ts13.onnx",
    "mobilenet_dw_dyn18": DATA / "corpus" / "mobilenet_dw_dyn18.onnx",
    "resnet_basic_ts16": DATA / "corpus" / "resnet_basic_ts16.onnx",
    "resnet_basic_dyn21": DATA / "corpus" / "resnet_basic_dyn21.onnx",
    "unet_resize_ts13": DATA / "corpus" / "unet_resize_ts13.onnx",
    "audio_conv1d_dyn19": DATA / "corpus" / "audio_conv1d_dyn19.onnx",
}
MODEL_CONFIGS = [c for c in CONFIGS if c[1] in ("auto", "compiled", "layers-onednn", "graphs")]


def _inputs(path: Path) -> dict[str, np.ndarray]:
    arrays = path.with_suffix(".npz") if path.parent == DATA else path.with_name(
        path.stem + ".s0.npz")
    with np.load(arrays) as data:
        return {name: data[name] for name in data.files}


@pytest.mark.parametrize("kind", ["all-nan", "one-nan"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("backend,config,options", MODEL_CONFIGS,
                         ids=[f"{b}-{n}" for b, n, _ in MODEL_CONFIGS])
def test_model(backend: str, config: str, options: dict[str, Any], name: str, kind: str) -> None:
    spec = backends(backend, options)
    feeds = _inputs(MODELS[name])
    for value in feeds.values():
        if value.dtype.kind == "f":
            if kind == "all-nan":
                value[...] = np.nan
            else:
                value.reshape(-1)[value.size // 3] = np.nan
    expected = run(MODELS[name], feeds, ["CpuRef"])
    assert any(np.isnan(e).any() for e in expected), f"{name}: CpuRef's outputs hold no NaN"
    for index, (got, want) in enumerate(zip(run(MODELS[name], feeds, spec), expected)):
        assert_same_specials(f"{name} output {index}", got, want)


@pytest.fixture(scope="module")
def bert_with_nan_row() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """tiny_bert with one row of its word embeddings NaN (a corrupted weight) and that token in
    the input: NaN enters the float path of a transformer (LayerNorm, attention, GELU)."""
    model = onnx.load(DATA / "tiny_bert.onnx")
    feeds = _inputs(DATA / "tiny_bert.onnx")
    token = int(feeds["input_ids"].reshape(-1)[3])
    table = max((init for init in model.graph.initializer if len(init.dims) == 2),
                key=lambda init: init.dims[0])  # the word embeddings: the longest table
    values = numpy_helper.to_array(table).copy()
    values[token] = np.nan
    table.CopyFrom(numpy_helper.from_array(values, table.name))
    return model, feeds


@pytest.mark.parametrize("backend,config,options", MODEL_CONFIGS,
                         ids=[f"{b}-{n}" for b, n, _ in MODEL_CONFIGS])
def test_bert_nan_embedding(backend: str, config: str, options: dict[str, Any],
                            bert_with_nan_row) -> None:
    spec = backends(backend, options)
    model, feeds = bert_with_nan_row
    expected = run(model, feeds, ["CpuRef"])
    assert any(np.isnan(e).any() for e in expected), "CpuRef's outputs hold no NaN"
    for index, (got, want) in enumerate(zip(run(model, feeds, spec), expected)):
        assert_same_specials(f"tiny_bert output {index}", got, want)
