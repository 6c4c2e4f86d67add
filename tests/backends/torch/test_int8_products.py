"""The int8 matrix products by ``torch._int_mm`` (QGemm's with an int8 B, a QDQ Gemm / MatMul's):
``int8_exact.exact_int_mm`` probes the product itself. Where it sums exactly but the convolutions
saturate (this AVX2 EPYC: no VNNI) it is exact but slow (9-36x float32's product), so "auto"
keeps the float products there and "kernels" takes it without a warning; where it saturates no
product takes it.

The probe is held to simulated kernels that add pairs of products in 16 bits, as the saturating
ones do (VPMADDUBSW), directly and with A shifted to uint8."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import int8_exact  # noqa: E402
from tests.backends.contrib_cases import _model  # noqa: E402
from tests.backends.torch.test_contrib_quant import CASES  # noqa: E402
from tests.conftest import inner_workloads  # noqa: E402


def _pairs_in_16_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A x B with each pair of adjacent products added and saturated in 16 bits."""
    products = a.long().unsqueeze(2) * b.long().unsqueeze(0)  # (M, K, N)
    pairs = products.reshape(a.shape[0], -1, 2, b.shape[1]).sum(2).clamp(-32768, 32767)
    return pairs.sum(1).int()


def _shifted_in_16_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A shifted to uint8 (A + 128), multiplied in saturating pairs, less 128 times B's sums."""
    shifted = _pairs_in_16_bits((a.long() + 128), b)
    return shifted - 128 * b.long().sum(0).int()


@pytest.mark.parametrize("kernel", [_pairs_in_16_bits, _shifted_in_16_bits],
                         ids=["pairs", "shifted"])
def test_the_probe_finds_a_saturating_product(kernel, monkeypatch) -> None:
    monkeypatch.setattr(torch, "_int_mm", kernel)
    assert not int8_exact.exact_int_mm.__wrapped__()
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: (a.long() @ b.long()).int())
    assert int8_exact.exact_int_mm.__wrapped__()


@pytest.mark.parametrize("convolutions", [True, False], ids=["vnni", "saturating"])
def test_products_warn_by_their_own_probe(convolutions: bool, monkeypatch) -> None:
    """"kernels" warns of a product's results only where ``_int_mm`` is not exact, whatever the
    convolutions' probe says; "auto" follows the convolutions' probe (speed: no VNNI)."""
    monkeypatch.setattr(int8_exact, "exact_kernels", lambda: convolutions)
    for product in (True, False):
        monkeypatch.setattr(int8_exact, "exact_int_mm", lambda product=product: product)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert int8_exact.mode("auto", product=True) == ("auto" if convolutions else "exact")
            assert int8_exact.mode("kernels", product=True) == "kernels"
        said = [w for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(said) == (0 if product else 1)


@pytest.mark.parametrize("probes", [(True, True), (True, False), (False, True)],
                         ids=["vnni", "saturating-int-mm", "no-vnni"])
@pytest.mark.parametrize("name", ["QGemm-quantized-int8", "QGemm-float-int8"])
def test_qgemm_takes_int_mm_where_exact_and_fast(name: str, probes: tuple[bool, bool],
                                                 monkeypatch) -> None:
    """QGemm with an int8 B: ``torch._int_mm``'s product only where both probes hold (exact,
    and a CPU with VNNI), the float product else; CpuRef's values bit for bit either way (every
    sum below 2^24)."""
    convolutions, int_mm = probes
    if convolutions and int_mm and not int8_exact.exact_int_mm():
        pytest.skip("torch._int_mm saturates on this CPU")
    monkeypatch.setattr(int8_exact, "exact_kernels", lambda: convolutions)
    monkeypatch.setattr(int8_exact, "exact_int_mm", lambda: int_mm)
    model, feeds = _model(CASES[name])
    session = InferenceSession(model, backends=[("CpuAcc", {"compile": "layers",
                                                            "int8": "exact"})])
    routes = [getattr(w, "route", None) for w in inner_workloads(session, "QGemm")]
    assert routes == ["int8" if convolutions and int_mm else "float"]
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, feeds)
    np.testing.assert_array_equal(session.run(None, feeds)[0], want)
