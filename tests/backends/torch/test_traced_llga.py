"""A Traced layer with 2-d convolutions is also measured compiled by oneDNN Graph's fuser (route
"llga", ``traced._fusable``): its convolutions become partitions and the ops the fuser does not
take stay in TorchScript's interpreter (crnn_paddle_ts12's trace: CNN, LSTMs and head). Where that
route is kept, the values are CpuRef's, NaN kept."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import threads  # noqa: E402
from backplane.backends.torch.fusion import traced, windowed  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_traced_conv_packed import RNG, _cnn, _gated_1d  # noqa: E402


def _session(model, monkeypatch, take: str) -> tuple[InferenceSession, list[list[str]]]:
    """A CpuAcc session whose Traced layer keeps route ``take``; the routes it was offered."""
    offered: list[list[str]] = []

    def chosen(kind, description, routes, make_sample, backend):
        offered.append(list(routes))
        return routes[take]()

    monkeypatch.setattr(threads, "crowded", lambda: False)
    monkeypatch.setattr(windowed, "PRODUCT_MACS", -1)  # FusedConvs, not one WindowedConv
    monkeypatch.setattr(traced, "fastest", chosen)
    session = InferenceSession(model, backends=["CpuAcc"], runtime=Runtime(RuntimeOptions(
        backend_options={"CpuAcc.route_cache": False, "CpuAcc.native": "off"})))  # traced
    return session, offered


def test_a_trace_of_convolutions_compiled_by_onednn_graph_keeps_cpurefs_values(monkeypatch):
    model, shape = _cnn()
    session, offered = _session(model, monkeypatch, "llga")
    assert offered == [["traced", "layers", "llga"]]
    loaded = session.runtime.network(session.network_id)
    (run,) = [getattr(step.workload, "work", step.workload)
              for step, layer in zip(loaded.steps, loaded.layers) if layer.op_type == "Traced"]
    assert getattr(run, "route", None) == "onednn_graph"
    for special in (np.nan, np.inf, -np.inf):
        x = RNG.standard_normal(shape).astype(np.float32)
        x.reshape(-1)[37] = special
        (got,) = session.run(None, {"x": x})
        (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
        assert np.array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_trace_of_1d_convolutions_is_not_offered_to_the_fuser(monkeypatch) -> None:
    model, _ = _gated_1d()
    _, offered = _session(model, monkeypatch, "traced")
    assert offered == [["traced", "layers"]]


def test_a_remembered_llga_route_is_compiled_without_a_trace(monkeypatch) -> None:
    model, shape = _cnn()
    monkeypatch.setattr(traced, "remembered", lambda kind, description, backend: "llga")
    traces: list[object] = []
    monkeypatch.setattr(traced, "compile_traced", lambda *args: traces.append(args))
    session, _ = _session(model, monkeypatch, "traced")
    assert traces == []
    x = RNG.standard_normal(shape).astype(np.float32)
    (want,) = InferenceSession(model, backends=["CpuRef"]).run(None, {"x": x})
    np.testing.assert_allclose(session.run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)
