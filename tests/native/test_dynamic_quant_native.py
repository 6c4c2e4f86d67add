"""``backplane::dynamic_quant_matmul_c``: the dynamically quantized product as a torch op whose
kernel is ``dynquant.c`` itself (``backplane_dynquant_op``, a boxed kernel of torch's stable C ABI),
against the op in Python (``backplane::dynamic_quant_matmul``) bit for bit; the x it does not take
handed on to that op; every tensor handle it is given released (no tensor kept alive by a call);
the same kernel built for AVX2 and for plain x86-64 (a CI machine's builds), registered as ops of
their own, giving the same bits, and the corpus's quantized GPT on those builds; a torch without
the stable ABI running the Python op."""

from __future__ import annotations

import platform

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane.native import build, dynquant  # noqa: E402

RNG = np.random.default_rng(2121)
pytestmark = pytest.mark.skipif(not dynquant.in_c(), reason="no C compiler or no stable ABI here")
NO_BIAS = torch.empty(0)


def c_op(x, weight, w_scale, bias, depth, cols, residual=NO_BIAS):
    return torch.ops.backplane.dynamic_quant_matmul_c(x, weight, w_scale, bias, residual, depth,
                                                      cols)


def python_op(x, weight, w_scale, bias, depth, cols, residual=NO_BIAS):
    return torch.ops.backplane.dynamic_quant_matmul(x, weight, w_scale, bias, residual, depth,
                                                    cols)


def layer(depth: int, cols: int, packed: bool, with_bias: bool):
    """(weight as the op reads it, w_scale, bias): a float32 (depth, cols) or packed bytes."""
    centred = RNG.integers(-127, 128, (cols, depth))  # the fusion's (N, K)
    weight = dynquant.pack(centred) if packed else \
        torch.from_numpy(centred.T.astype(np.float32)).contiguous()
    w_scale = torch.from_numpy(RNG.uniform(0.01, 0.03, cols).astype(np.float32))
    bias = torch.from_numpy(RNG.standard_normal(cols).astype(np.float32)) if with_bias else NO_BIAS
    return weight, w_scale, bias


WEIGHTS = [False, pytest.param(True, marks=pytest.mark.skipif(
    not dynquant.on_bytes(), reason="the library here has no AVX-512 VNNI"))]


@pytest.mark.parametrize("packed", WEIGHTS)
@pytest.mark.parametrize("shape,depth,cols", [((2, 8, 32), 32, 96), ((1, 128), 128, 32),
                                              ((3, 5, 7, 17), 17, 35)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_c_kernel_is_the_python_ops_bit_for_bit(packed, shape, depth, cols, with_bias,
                                                    with_residual):
    weight, w_scale, bias = layer(depth, cols, packed, with_bias)
    residual = torch.from_numpy(RNG.standard_normal((*shape[:-1], cols)).astype(np.float32)) \
        if with_residual else NO_BIAS
    for spread in (0.02, 5.0):
        x = torch.from_numpy((RNG.standard_normal(shape) * spread).astype(np.float32))
        got = c_op(x, weight, w_scale, bias, depth, cols, residual)
        want = python_op(x, weight, w_scale, bias, depth, cols, residual)
        if with_residual:  # the graph's Add after the product, one rounding
            alone = python_op(x, weight, w_scale, bias, depth, cols)
            np.testing.assert_array_equal(want.numpy(), (alone + residual).numpy())
        assert got.shape == (*shape[:-1], cols) and got.dtype == torch.float32
        assert got.is_contiguous()
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def _odd_inputs():
    """x the C does not take, each with the x the Python op is given for it."""
    x = torch.from_numpy(RNG.standard_normal((6, 32)).astype(np.float32))
    strided = torch.from_numpy(RNG.standard_normal((32, 6)).astype(np.float32)).t()
    with_nan, with_inf = x.clone(), x.clone()
    with_nan[2, 3], with_inf[4, 1] = float("nan"), float("inf")
    return [("strided", strided, strided.contiguous()), ("float64", x.double(), x),
            ("empty", torch.empty(0, 32), torch.empty(0, 32)), ("nan", with_nan, with_nan),
            ("inf", with_inf, with_inf)]


@pytest.mark.parametrize("packed", WEIGHTS)
@pytest.mark.parametrize("case", range(5))
def test_the_x_the_c_does_not_take_goes_to_the_python_op(packed, case):
    name, x, as_given = _odd_inputs()[case]
    weight, w_scale, bias = layer(32, 40, packed, True)
    got = c_op(x, weight, w_scale, bias, 32, 40)
    want = python_op(as_given, weight, w_scale, bias, 32, 40)
    assert got.shape == want.shape == (*x.shape[:-1], 40), name
    np.testing.assert_array_equal(got.numpy(), want.numpy())  # NaN where it has NaN


def test_a_residual_the_c_does_not_take_goes_to_the_python_op():
    """A strided or float64 residual: the Python op's sum (torch's add, the same rounding)."""
    weight, w_scale, bias = layer(32, 40, False, True)
    x = torch.from_numpy(RNG.standard_normal((6, 32)).astype(np.float32))
    residual = torch.from_numpy(RNG.standard_normal((40, 6)).astype(np.float32))
    want = python_op(x, weight, w_scale, bias, 32, 40, residual.t().contiguous())
    np.testing.assert_array_equal(c_op(x, weight, w_scale, bias, 32, 40, residual.t()).numpy(),
                                  want.numpy())
    np.testing.assert_array_equal(c_op(x, weight, w_scale, bias, 32, 40,
                                       residual.t().contiguous().double()).numpy(), want.numpy())


@pytest.mark.parametrize("x,residual,message", [
    ((4, 31), None, "for a product of depth 32"),
    ((4, 32), (16, 4), r"a residual of shape \(16, 4\) added to a product of shape \(4, 16\)")])
def test_an_error_of_the_python_op_is_raised_with_its_message(x, residual, message):
    """The Python op's error raised by the C's call of it, as a RuntimeError with its message
    (torch 2.13); torch 2.11's shim (the GPU machine's) logs the message and raises the op's name
    and "failed" in its place."""
    weight, w_scale, bias = layer(32, 16, False, False)
    added = NO_BIAS if residual is None else torch.zeros(residual)
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13):
        message = r"backplane::dynamic_quant_matmul failed|" + message
    with pytest.raises(RuntimeError, match=message):
        c_op(torch.zeros(x), weight, w_scale, bias, 32, 16, added)


@pytest.mark.parametrize("packed", WEIGHTS)
def test_a_call_keeps_no_tensor_alive(packed):
    """Each tensor comes to the kernel as a handle it owns: released on the C's route and on
    the one through the Python op, so each tensor's count of owners is as before the calls, and
    the output's is one (the caller's)."""
    weight, w_scale, bias = layer(32, 48, packed, True)
    fine = torch.from_numpy(RNG.standard_normal((8, 32)).astype(np.float32))
    odd = fine.clone()
    odd[0, 0] = float("nan")
    residual = torch.from_numpy(RNG.standard_normal((8, 48)).astype(np.float32))
    tensors = (fine, odd, weight, w_scale, bias, residual)
    before = [t._use_count() for t in tensors]
    for x in (fine, odd) * 50:
        y = c_op(x, weight, w_scale, bias, 32, 48, residual)
    assert [t._use_count() for t in tensors] == before
    assert y._use_count() == 1


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 build flags")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_kernel_built_for_avx2_and_plain_x86_64_gives_the_same_bits(march, tmp_path):
    """dynquant.c built for another CPU (``tests/native/flavours``) and registered as an op of its
    own: a float weight's product in its C (AVX2's or SSE's vectors), a packed one handed on to
    the Python op (no VNNI in that build): both this machine's op's outputs."""
    from tests.native.flavours import built

    if march == "x86-64-v3" and "avx2" not in build._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    flavour = built("dynquant", march, tmp_path)
    assert flavour.backplane_dynquant_has_bytes() == 0
    namespace, name = "backplane_test_flavour", "matmul_" + march.replace("-", "_")
    definition = torch.library.Library(namespace, "FRAGMENT")
    definition.define(name + dynquant.SCHEMA)
    held = dynquant.register(flavour, namespace, name)
    assert held is not None
    op = getattr(getattr(torch.ops, namespace), name)
    for packed in (False, True) if dynquant.on_bytes() else (False,):
        weight, w_scale, bias = layer(40, 35, packed, True)
        x = torch.from_numpy((RNG.standard_normal((2, 6, 40)) * 3).astype(np.float32))
        residual = torch.from_numpy(RNG.standard_normal((2, 6, 35)).astype(np.float32))
        np.testing.assert_array_equal(op(x, weight, w_scale, bias, residual, 40, 35).numpy(),
                                      c_op(x, weight, w_scale, bias, 40, 35, residual).numpy())


GPT_ON = """
import sys
import numpy as np
from pathlib import Path
from backplane import InferenceSession
from backplane.native import dynquant
from tests.native.flavours import built

flavour = built("dynquant", sys.argv[1], Path(sys.argv[2]))
dynquant.library = lambda name, version=None: flavour  # this process's dynquant: the flavour
assert dynquant.in_c() and not dynquant.on_bytes()
gpt = "tests/data/corpus/gpt_dynquant_ort15.onnx"
for size in ("s0", "s1"):
    feeds = dict(np.load(f"tests/data/corpus/gpt_dynquant_ort15.{size}.npz"))
    got = [InferenceSession(gpt, backends=[("CpuAcc", {"native": native}), "CpuRef"])
           .run(None, feeds)[0] for native in ("auto", "off")]
    np.testing.assert_array_equal(got[0], got[1])
    (want,) = InferenceSession(gpt, backends=["CpuRef"]).run(None, feeds)
    assert float(np.abs(got[0] - want).max()) <= 1e-5 * float(np.abs(want).max())
print("matched")
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 build flags")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_the_quantized_gpt_on_the_avx2_and_plain_builds(march, tmp_path):
    """The corpus's quantized GPT in a process whose dynquant library is the AVX2 build (a CI
    machine without VNNI) or plain x86-64's: its products in that C through the op (float
    weights, no bytes), the torch route's outputs bit for bit, CpuRef's within 1e-5 of the
    largest (torch's GELU)."""
    import subprocess
    import sys
    from pathlib import Path

    if march == "x86-64-v3" and "avx2" not in build._cpu_flags():
        pytest.skip("this CPU has no AVX2")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", GPT_ON, march, str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "matched" in done.stdout, done.stderr[-2000:]


WITHOUT_ABI = """
import numpy as np
from torch.profiler import profile
from backplane import InferenceSession
from backplane.native import dynquant

dynquant.ABI = ("aoti_torch_not_in_this_torch",) + dynquant.ABI[1:]  # a torch before the ABI
assert dynquant.usable("auto") and not dynquant.in_c()
gpt = "tests/data/corpus/gpt_dynquant_ort15.onnx"
feeds = dict(np.load("tests/data/corpus/gpt_dynquant_ort15.s0.npz"))
native = InferenceSession(gpt, backends=[("CpuAcc", {"native": "auto"}), "CpuRef"])
native.run(None, feeds)
with profile() as prof:
    (got,) = native.run(None, feeds)
counts = {e.key: e.count for e in prof.key_averages()}
assert counts.get("backplane::dynamic_quant_matmul", 0) > 0, counts
assert "backplane::dynamic_quant_matmul_c" not in counts, counts
(want,) = InferenceSession(gpt, backends=[("CpuAcc", {"native": "off"}), "CpuRef"]).run(None, feeds)
np.testing.assert_array_equal(got, want)
print("matched")
"""


def test_a_torch_without_the_stable_abi_runs_the_python_op():
    """Where libtorch lacks one of the ABI's functions (a torch before it), no C kernel is
    registered and the trace holds the op in Python: the quantized GPT's outputs unchanged."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", WITHOUT_ABI], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "matched" in done.stdout, done.stderr[-2000:]
