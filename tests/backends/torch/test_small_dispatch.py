"""A Specialized signature built as one compiled layer is called without the nested network's run
loop (issue 27, item 4: about 5 us of a 0.13 ms run of resnet_basic_ts16); a signature built
already is one dict read, without a lock where no other signature may be evicted."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion.compiled import AtFirstRun  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

from tests.backends.torch.test_small_threads import small_cnn  # noqa: E402
from tests.backends.torch.test_specialize import _specialized  # noqa: E402
from tests.backends.torch.test_traced import _loaded_of  # noqa: E402


def _session(**options) -> InferenceSession:
    return InferenceSession(small_cnn(), backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options={
                                "CpuAcc.compile": "onednn_graph", **options})))


def _feeds(shape) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)}


def test_a_one_layer_build_runs_without_its_network_loop() -> None:
    session = _session()
    reference = InferenceSession(small_cnn(), backends=["CpuRef"])
    shape = (1, 3, 16, 16)
    session.run(None, _feeds(shape))
    (runner,) = _specialized(session).built.values()
    inner = _loaded_of(runner)
    assert [lay.op_type for lay in inner.layers] == ["OneDnnGraph"]

    def not_called(*args, **kwargs):
        raise AssertionError("the nested network's loop ran")

    inner.execute = not_called
    (want,) = reference.run(None, _feeds(shape))
    (got,) = session.run(None, _feeds(shape))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))


def test_a_failing_one_layer_build_names_its_layer(monkeypatch) -> None:
    session = _session()
    session.run(None, _feeds((1, 3, 16, 16)))
    (runner,) = _specialized(session).built.values()
    inner = _loaded_of(runner)
    workload = inner.steps[0].workload  # the OneDnnGraph layer's, made at its first run
    assert isinstance(workload, AtFirstRun) and workload.built is not None

    def broken(*values):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(workload, "built", broken)
    with pytest.raises(Exception, match=r"OneDnnGraph\[.*broken on purpose"):
        session.run(None, _feeds((1, 3, 16, 16)))


def test_signatures_past_the_limit_still_go_least_recently_used_first() -> None:
    session = _session(**{"CpuAcc.specialize": 2})
    shapes = [(1, 3, 16, 16), (1, 3, 8, 8), (1, 3, 16, 16), (1, 3, 12, 12)]
    for shape in shapes:
        session.run(None, _feeds(shape))
    kept = [tuple(key[0][0]) for key in _specialized(session).built]
    assert kept == [(1, 3, 16, 16), (1, 3, 12, 12)]  # (8, 8) went: (16, 16) was used after it
