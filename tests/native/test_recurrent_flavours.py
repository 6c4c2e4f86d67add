"""The other flavours of the recurrent and Linear products, built and run on this machine: the
session's own build is ``-march=native`` (AVX-512's 16-float tiles where the CPU has them), so
AVX2's path (``-march=haswell``: AVX2 and FMA, no AVX-512) and the generic vectors' path
(``-march=x86-64``) would go untested on an AVX-512 machine. Each flavour this CPU can run is
built into a temporary folder and held to the same references: ``panel_product.h``'s tile (through
linear.c) against float64 NumPy, recurrent.c's layers against CpuRef (every direction, batch,
sequence_lens, hidden sizes across blocks of 64 and 128), the corpus's recurrent plans
(``recurrent_net.h``) against the session's own build. Also: a dense copy is
one run of floats, the constants start on a 64-byte line.

    python -m pytest -o addopts="" -q -p no:cacheprovider tests/native/test_recurrent_flavours.py
"""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.native import build  # noqa: E402
from backplane.native import recurrent as in_c  # noqa: E402
from backplane.native import recurrent_net  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.native import flavours  # noqa: E402

from .test_recurrent import _both, _layer  # noqa: E402

CORPUS = Path(__file__).parents[1] / "data" / "corpus"
X86 = platform.machine() in ("x86_64", "AMD64")
needs_compiler = pytest.mark.skipif(not build.available("recurrent") or not build.available(
    "linear"), reason="no native libraries (no C compiler)")


def _cpu_has(*flags: str) -> bool:
    return all(flag in build._cpu_flags() for flag in flags)


FLAVOURS = {"native": True, "haswell": X86 and _cpu_has("avx2", "fma"), "x86-64": X86}
"""-march values -> whether this CPU runs what they build (haswell: AVX2's path; x86-64: the
generic vectors', SSE2 underneath)."""
RUNNABLE = [pytest.param(m, marks=pytest.mark.skipif(not ok, reason=f"this CPU lacks {m}"))
            for m, ok in FLAVOURS.items()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(source, march) -> the library built from the package's source with that -march."""
    folder, made = tmp_path_factory.mktemp("flavours"), {}

    def get(name: str, march: str) -> ctypes.CDLL:
        if (name, march) not in made:
            made[name, march] = flavours.built(name, march, folder)
        return made[name, march]
    return get


def _product(lib, x, weight, bias):
    """``backplane_linear`` of ``lib``: y = x weight^T + bias over the packed weight."""
    m, k = x.shape
    n = weight.shape[0]
    panels = -(-n // 16)
    packed = np.empty(panels * k * 16, np.float32)
    long, pointer = ctypes.c_long, ctypes.c_void_p
    lib.backplane_linear_pack.argtypes = [pointer, long, long, pointer]
    lib.backplane_linear.argtypes = [pointer, long, long, pointer, long, pointer, pointer]
    lib.backplane_linear_pack(weight.ctypes.data, n, k, packed.ctypes.data)
    padded = None
    if bias is not None:
        padded = np.zeros(panels * 16, np.float32)
        padded[:n] = bias
    y = np.full((m, n), np.nan, np.float32)
    lib.backplane_linear(x.ctypes.data, m, k, packed.ctypes.data, n,
                         None if padded is None else padded.ctypes.data, y.ctypes.data)
    return y


@needs_compiler
@pytest.mark.parametrize("march", RUNNABLE)
def test_each_flavours_tile_is_the_product(march, built):
    """Every remainder of rows (1-25: the AVX-512 tile's 12, AVX2's 6) and of outputs (a panel,
    two, one and a part), with and without a bias, within float32 summation of float64's."""
    lib = built("linear", march)
    rows = lib.backplane_linear_rows()
    assert rows == (12 if march == "native" and _cpu_has("avx512f") else 6)
    rng = np.random.default_rng(27)
    for m in range(1, 26):
        for n, k in [(1, 3), (16, 8), (17, 64), (32, 5), (40, 64), (100, 33)]:
            x = rng.standard_normal((m, k)).astype(np.float32)
            weight = rng.standard_normal((n, k)).astype(np.float32)
            bias = rng.standard_normal(n).astype(np.float32) if (m + n) % 2 else None
            want = x.astype(np.float64) @ weight.T.astype(np.float64) + (
                0.0 if bias is None else bias)
            got = _product(lib, x, weight, bias)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * k)


@needs_compiler
@pytest.mark.parametrize("march", RUNNABLE)
def test_each_flavours_tile_keeps_nan_and_inf(march, built):
    lib = built("linear", march)
    x = np.zeros((14, 8), np.float32)
    x[0, 2], x[13, 5] = np.nan, np.inf
    got = _product(lib, x, np.ones((40, 8), np.float32), None)
    assert np.isnan(got[0]).all() and np.isinf(got[13]).all() and (got[1:13] == 0).all()


@pytest.fixture
def flavour(monkeypatch, built):
    """recurrent.py's LSTM and GRU calls made on the given flavour's library."""
    def use(march: str) -> None:
        lib = built("recurrent", march)
        pointers = [ctypes.c_void_p] * 9
        for function, count in ((lib.backplane_lstm, 9), (lib.backplane_gru, 7)):
            function.argtypes = [ctypes.POINTER(in_c._Shape)] + pointers[:count]
            function.restype = ctypes.c_int
        in_c._functions()  # the session's library loaded first (its packed sizes are the same)
        monkeypatch.setattr(in_c, "_FUNCTIONS", [lib.backplane_lstm, lib.backplane_gru])
    return use


LAYERS = [("LSTM", "bidirectional", 0, 7, 2, 5, 24, None, 0),
          ("LSTM", "forward", 1, 9, 3, 64, 32, [9, 4, 0], 0),  # K 96: two blocks at once
          ("LSTM", "reverse", 0, 5, 2, 40, 70, [2, 5], 0),
          ("LSTM", "bidirectional", 0, 4, 1, 200, 96, None, 0),  # projected: R alone
          ("GRU", "bidirectional", 1, 6, 2, 12, 20, [6, 3], 1),
          ("GRU", "forward", 0, 8, 1, 33, 130, None, 0),
          ("GRU", "bidirectional", 0, 3, 3, 7, 65, None, 1)]


@needs_compiler
@pytest.mark.parametrize("march", RUNNABLE)
@pytest.mark.parametrize("case", LAYERS, ids=lambda c: f"{c[0]}-{c[1]}-h{c[6]}")
def test_each_flavours_layers_are_cpurefs(march, case, flavour):
    op, direction, layout, seq, batch, inputs, hidden, lengths, lbr = case
    flavour(march)
    args = _layer(op, seq, batch, inputs, hidden, direction, layout, seed=hidden, lengths=lengths)
    ours, theirs = _both(op, args, direction, layout, lbr)
    for got, want in zip(ours, theirs):  # (hidden 130's sums of 163: 4e-6 from CpuRef's)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("march", RUNNABLE)
def test_each_flavour_keeps_nan_in_its_row(march, flavour):
    flavour(march)
    args = _layer("LSTM", 5, 2, 3, 40, "bidirectional", 0, seed=3)
    args[0][2, 1, 0] = np.nan
    (y, *_), _ = _both("LSTM", args, "bidirectional", 0)
    assert np.isnan(y[2:, 0, 1]).all() and not np.isnan(y[:2, 0, 1]).any()
    assert not np.isnan(y[:, :, 0]).any()


def _planned(name, monkeypatch):
    """The model's recurrent plan as its session makes it (1 thread)."""
    made = []
    real = recurrent_net.plan

    def caught(*args):
        made.append(real(*args))
        return made[-1]

    monkeypatch.setattr(recurrent_net, "plan", caught)
    options = {"CpuAcc.threads": 1}
    session = InferenceSession(str(CORPUS / f"{name}.onnx"), backends=["CpuAcc", "CpuRef"],
                               runtime=Runtime(RuntimeOptions(backend_options=options)))
    feeds = dict(np.load(CORPUS / f"{name}.s0.npz"))
    session.run(None, feeds)
    assert made
    return made[-1]


@needs_compiler
@pytest.mark.parametrize("march", RUNNABLE)
@pytest.mark.parametrize("name", ["lstm_bi2_ts14", "gru_tm3_ts13", "crnn_paddle_ts12"])
def test_each_flavour_runs_the_corpus_plans(name, march, built, monkeypatch):
    """The plan on the flavour's library gives the session's build's outputs (within float32
    summation orders; that build is held to ONNX Runtime's by test_recurrent_net)."""
    plan = _planned(name, monkeypatch)
    rng = np.random.default_rng(5)
    given = [rng.standard_normal(s).astype(np.float32) for s in plan.input_shapes]
    want = recurrent_net.Executor(plan, build.library("recurrent")).numpy(*given)
    got = recurrent_net.Executor(plan, built("recurrent", march)).numpy(*given)
    assert len(got) == len(want) == len(plan.output_shapes)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_dense_copy_is_one_run_and_a_strided_one_keeps_its_steps():
    merged = recurrent_net._merged
    assert merged((80, 1, 40), (40, 40, 1), (40, 40, 1)) == ([3200], [1], [1])
    # a transpose's copy: (seq, dirs, batch, H) read as (seq, batch, dirs, H)
    assert merged((5, 2, 3, 8), (48, 8, 16, 1), (48, 24, 8, 1)) == (
        [5, 2, 3, 8], [48, 8, 16, 1], [48, 24, 8, 1])
    assert merged((4, 6), (12, 2), (6, 1)) == ([24], [2], [1])  # every other float
    assert merged((4, 6), (14, 2), (6, 1)) == ([4, 6], [14, 2], [6, 1])
    assert merged((1, 1), (1, 1), (1, 1)) == ([1], [1], [1])


@needs_compiler
def test_the_constants_and_the_arena_start_on_a_line(monkeypatch):
    plan = _planned("lstm_bi2_ts14", monkeypatch)
    executor = recurrent_net.Executor(plan, build.library("recurrent"))
    assert executor.params.ctypes.data % 64 == 0 and executor.address % 64 == 0
    np.testing.assert_array_equal(executor.params, plan.params)
