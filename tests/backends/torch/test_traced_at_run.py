"""A Specialized signature's build is made at a run (specialize._build), so a Traced layer that
a load would trace at its first run (traced._deferred: its route known) is traced at once there:
the build's one step is the trace itself, with no wrapper between its calls and the trace."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import traced  # noqa: E402
from tests.models.test_models import DATA  # noqa: E402

MODEL = DATA / "corpus" / "vad_lstm_if_ts16.onnx"


def _runners(session: InferenceSession) -> list:
    """The built signatures of the Specialized layers of the session's decided If's versions."""
    loaded = session.runtime.network(session.network_id)
    runners = []
    for step in loaded.steps:
        for version in getattr(step.workload, "versions", {}).values():
            for inner in version.steps:
                runners += list(getattr(inner.workload, "built", {}).values())
    assert runners
    return runners


def test_a_trace_known_from_its_route_is_traced_at_the_build(monkeypatch) -> None:
    monkeypatch.setattr(traced, "remembered", lambda *args: "traced")  # as the route cache says
    session = InferenceSession(str(MODEL), providers=["CpuAcc", "CpuRef"],  # its CNN traced too
                               provider_options=[{"CpuAcc.native": "off"}, {}])
    reference = InferenceSession(str(MODEL), providers=["CpuRef"])
    feeds = dict(np.load(DATA / "corpus" / "vad_lstm_if_ts16.s0.npz"))
    got = session.run(None, feeds)
    for value, wanted in zip(got, reference.run(None, feeds)):
        np.testing.assert_allclose(value, wanted, rtol=1e-4, atol=1e-5)
    runners = _runners(session)
    for runner in runners:
        (layer,) = runner.graph.layers
        assert layer.op_type == "Traced"
        assert hasattr(runner.alone, "module")  # the trace's own call (fails before: _deferred's)
