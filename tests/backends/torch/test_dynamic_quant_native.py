"""quantize_dynamic's product as one C call (``native/dynquant``, under ``CpuAcc.native`` "auto"):
the same outputs as the torch route's, bit for bit (exact sums, CpuRef's grid and rounding), on
the float product's weight and on the bytes' (AVX-512 VNNI's vpdpbusd, where the library has it),
one op in the quantized GPT's trace for each of its nine products, its kernel the C itself
(torch's stable C ABI: no Python at the call), and torch's route where x's range is not finite."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.native import dynquant  # noqa: E402
from backplane.backends.torch.kernels.contrib_quant import dynamic_grid  # noqa: E402

ort = pytest.importorskip("onnxruntime")
CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
GPT = CORPUS / "gpt_dynquant_ort15.onnx"
RNG = np.random.default_rng(2727)
needs_library = pytest.mark.skipif(not dynquant.usable("auto"), reason="no C compiler here")
FORMS = ["float", pytest.param("bytes", marks=pytest.mark.skipif(
    not dynquant.on_bytes(), reason="the library here has no AVX-512 VNNI"))]
"""The weight as the C reads it: (K, N) float32, or packed signed bytes (``dynquant.pack``)."""


def torch_route(x, weight, w_scale, bias):
    """The fusion's torch route on the same tensors: CpuRef's grid, the float product, the scales
    multiplied first, then the bias."""
    centred, scale = dynamic_grid(x)
    y = torch.matmul(centred, weight).mul_(w_scale * scale)
    return y.add_(bias) if bias is not None else y


def layer(rows: int, depth: int, cols: int, per_column: bool, with_bias: bool):
    weight = torch.from_numpy(RNG.integers(-127, 128, (depth, cols)).astype(np.float32))
    w_scale = torch.from_numpy(RNG.uniform(0.01, 0.03, cols if per_column else 1)
                               .astype(np.float32))
    bias = torch.from_numpy(RNG.standard_normal(cols).astype(np.float32)) if with_bias else None
    return weight, w_scale, bias


def as_read(weight: torch.Tensor, form: str):
    """``weight`` (K, N) as ``dynquant.weight_by_columns`` makes it from the fusion's (N, K)."""
    if form == "float":
        return weight
    made = dynquant.weight_by_columns(weight.t().numpy().astype(np.int64))
    assert isinstance(made, tuple)  # the bytes' form
    return made


@needs_library
@pytest.mark.parametrize("rows,depth,cols", [(8, 64, 192), (5, 64, 256), (3, 17, 35), (1, 1, 1),
                                             (12, 40, 16)])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_the_c_product_is_the_torch_routes_bit_for_bit(rows, depth, cols, per_column, with_bias,
                                                       form):
    weight, w_scale, bias = layer(rows, depth, cols, per_column, with_bias)
    read = as_read(weight, form)
    for spread in (0.01, 3.0, 400.0):
        x = torch.from_numpy((RNG.standard_normal((2, rows, depth)) * spread).astype(np.float32))
        x[0, 0, 0] = spread * 5  # a long positive tail: the zero point away from the middle
        got = dynquant.matmul(x, read, w_scale, bias)
        want = torch_route(x, weight, w_scale, bias)
        assert got.shape == want.shape == (2, rows, cols)
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@needs_library
@pytest.mark.parametrize("form", FORMS)
def test_ties_round_half_to_even_as_cpuref(form):
    """x's range 0..255 makes the scale 1, so x / scale lands on halves: 0.5 -> 0, 1.5 -> 2,
    2.5 -> 2 (CpuRef's rint), and the zero point 0 keeps them unclamped."""
    x = torch.tensor([[0.0, 255.0, 0.5, 1.5, 2.5, 3.5, 254.5, 100.5]])
    weight = torch.eye(8)
    got = dynquant.matmul(x, as_read(weight, form), torch.tensor([1.0]), None)
    np.testing.assert_array_equal(got.numpy(), [[0, 255, 0, 2, 2, 4, 254, 100]])
    np.testing.assert_array_equal(got.numpy(), torch_route(x, weight, torch.tensor([1.0]),
                                                           None).numpy())


@needs_library
@pytest.mark.parametrize("odd", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("form", FORMS)
def test_a_range_not_finite_takes_the_torch_route(odd, form):
    weight, w_scale, bias = layer(4, 16, 16, False, True)
    x = torch.from_numpy(RNG.standard_normal((4, 16)).astype(np.float32))
    x[2, 5] = odd
    got = dynquant.matmul(x, as_read(weight, form), w_scale, bias)
    want = torch_route(x, weight, w_scale, bias)
    np.testing.assert_array_equal(got.numpy(), want.numpy())  # NaN where it has NaN


@needs_library
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("depth", [1, 7, 8, 9, 16, 21])
def test_the_range_read_eight_at_once_is_cpurefs(form, depth):
    """x's range is read eight values at once, then the rest one by one: a NaN or an infinity at
    any place (in the lanes or in the rest) takes the torch route; -0.0, a range all below or
    all above 0, and one value alone give the torch route's grid, bit for bit."""
    weight, w_scale, bias = layer(2, depth, 19, True, True)
    read = as_read(weight, form)
    base = torch.from_numpy(RNG.standard_normal((2, depth)).astype(np.float32))
    cases = [base, -base.abs(), base.abs(), torch.full((2, depth), -0.0), base * 0]
    for place in range(2 * depth):
        for odd in (float("nan"), float("inf"), -float("inf")):
            x = base.clone()
            x.view(-1)[place] = odd
            cases.append(x)
        x = base.clone()
        x.view(-1)[place] = -7.5  # the lowest at each place in turn
        cases.append(x)
    for x in cases:
        got = dynquant.matmul(x, read, w_scale, bias)
        np.testing.assert_array_equal(got.numpy(), torch_route(x, weight, w_scale, bias).numpy())


@needs_library
def test_the_bytes_layout_and_where_it_is_taken():
    """pack: [ceil(N / 16)][ceil(K / 4)][16][4] signed bytes, zero past K and N, then each
    column's int32 sum; unpack gives the float weight back. A weight past a signed byte, or a
    product deeper than BYTES_DEPTH, keeps the float form."""
    weight = RNG.integers(-128, 128, (21, 7))  # the fusion's (N, K)
    packed = dynquant.pack(weight).numpy()
    assert packed.size == 2 * 2 * 64 + 32 * 4
    tiles = packed[:256].reshape(2, 2, 16, 4)
    assert tiles[1, 1, 4, 2] == weight[20, 6] and tiles[1, 1, 4, 3] == 0 and tiles[1, 0, 5, 0] == 0
    np.testing.assert_array_equal(packed[256:].view(np.int32)[:21], weight.sum(1))
    np.testing.assert_array_equal(dynquant.unpack(torch.from_numpy(packed), 7, 21).numpy(),
                                  weight.T.astype(np.float32))
    wide = dynquant.weight_by_columns(np.full((4, 3), 200))
    assert isinstance(wide, torch.Tensor) and wide.dtype == torch.float32
    if dynquant.on_bytes():
        assert isinstance(dynquant.weight_by_columns(weight), tuple)
        deep = np.ones((2, dynquant.BYTES_DEPTH + 1), np.int64)
        assert isinstance(dynquant.weight_by_columns(deep), torch.Tensor)


def _run(native: str, feeds):
    session = InferenceSession(str(GPT), backends=[("CpuAcc", {"native": native, "threads": 1}),
                                                   "CpuRef"])
    session.run(None, feeds)  # the first run builds the free-dimension signature's trace
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (logits,) = session.run(None, feeds)
    counts = {e.key: e.count for e in prof.key_averages()}
    return logits, [counts.get(f"backplane::{op}", 0) for op in OPS]


OPS = ("dynamic_quant_matmul_c", "dynamic_quant_matmul")
"""The op whose kernel is the C (``backplane_dynquant_op``), and the one in Python."""


@needs_library
@pytest.mark.parametrize("size", ["s0", "s1"])
def test_the_quantized_gpt_runs_its_nine_products_in_c(size):
    feeds = dict(np.load(CORPUS / f"gpt_dynquant_ort15.{size}.npz"))
    native, calls = _run("auto", feeds)
    torch_only, none = _run("off", feeds)
    # with torch's stable ABI the C is the kernel (no call of the Python op), else the Python op
    assert (calls, none) == (([9, 0] if dynquant.in_c() else [0, 9]), [0, 0])
    np.testing.assert_array_equal(native, torch_only)
    (want,) = InferenceSession(str(GPT), backends=["CpuRef"]).run(None, feeds)
    (theirs,) = ort.InferenceSession(str(GPT)).run(None, feeds)
    scale = float(np.abs(want).max())
    assert float(np.abs(native - want).max()) <= 1e-5 * scale
    assert float(np.abs(native - theirs).max()) <= 1e-5 * scale


@needs_library
@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="an x86-64 build flag")
def test_a_build_without_vnni_has_no_bytes_and_the_float_product_stays(tmp_path):
    """dynquant.c built for AVX2 only (-march=x86-64-v3; x86-64 where the CPU has no AVX2): no
    product on bytes (backplane_dynquant_bytes answers 3, has_bytes 0), and its float product is
    this library's, bit for bit: the path a CI machine without VNNI takes."""
    import ctypes

    from backplane.native import build

    march = "x86-64-v3" if "avx2" in build._cpu_flags() else "x86-64"
    from tests.native.flavours import built

    plain = built("dynquant", march, tmp_path)
    assert plain.backplane_dynquant_version() == dynquant.VERSION
    assert plain.backplane_dynquant_has_bytes() == 0
    pointer, size = ctypes.c_void_p, ctypes.c_long
    for name in ("backplane_dynquant_matmul", "backplane_dynquant_bytes"):
        getattr(plain, name).argtypes = [pointer, size, size, pointer, size, pointer, size,
                                         pointer, pointer]
    weight, w_scale, bias = layer(6, 40, 35, True, True)
    x = torch.from_numpy((RNG.standard_normal((6, 40)) * 3).astype(np.float32))
    y = torch.empty(6, 35)
    args = (x.data_ptr(), 6, 40, weight.data_ptr(), 35, w_scale.data_ptr(), 35, bias.data_ptr(),
            y.data_ptr())
    assert plain.backplane_dynquant_bytes(*args) == 3
    assert plain.backplane_dynquant_matmul(*args) == 0
    np.testing.assert_array_equal(y.numpy(), dynquant.matmul(x, weight, w_scale, bias).numpy())
    np.testing.assert_array_equal(y.numpy(), torch_route(x, weight, w_scale, bias).numpy())


@needs_library
@pytest.mark.skipif(not dynquant.on_bytes(), reason="the library here has no AVX-512 VNNI")
def test_a_packed_weight_keeps_its_layers_constants_for_the_calls_after(monkeypatch):
    """The first call of the Python op on a packed weight makes its constants' array
    (dynquant._layer: four arguments a call); later calls with the same w_scale and bias reuse
    it, another w_scale or bias makes another: each call's outputs the torch route's, bit for
    bit."""
    weight, w_scale, bias = layer(5, 24, 40, True, True)
    read = as_read(weight, "bytes")
    made = []
    real = dynquant._layer
    monkeypatch.setattr(dynquant, "_layer", lambda *a: made.append(a) or real(*a))
    x = torch.from_numpy(RNG.standard_normal((5, 24)).astype(np.float32))
    other_scale, none = w_scale * 2, torch.empty(0)
    for scale, added, builds in ((w_scale, bias, 1), (w_scale, bias, 1), (other_scale, bias, 2),
                                 (other_scale, None, 3), (other_scale, None, 3)):
        got = torch.ops.backplane.dynamic_quant_matmul(  # the op in Python, where _layer is
            x, read[0], scale, none if added is None else added, none, read[1], read[2])
        np.testing.assert_array_equal(got.numpy(), torch_route(x, weight, scale, added).numpy())
        assert len(made) == builds
