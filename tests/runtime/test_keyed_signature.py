"""A Specialized layer called from the direct run finds its built signature by the NumPy shapes the
run's check read already (``specialize``'s ``keyed``, ``prepared_run._one_call``), not by torch's
``.shape`` and ``.dtype`` of each input: while one signature is built. With more, the least
recently used goes first as before, and each shape runs what was built for it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from backplane import InferenceSession
from backplane.backends.torch import specialize
from tests.conftest import float_input, make_model

torch = pytest.importorskip("torch")
RNG = np.random.default_rng(5)


def _session(**options: object) -> InferenceSession:
    """y = Relu(a) + b, z = a - b over a free N: one Specialized layer on CpuAcc."""
    nodes = [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Add", ["r", "b"], ["y"]),
             helper.make_node("Sub", ["a", "b"], ["z"])]
    model = make_model(nodes, [float_input("a", ["N", 4]), float_input("b", ["N", 4])],
                       [float_input("y", ["N", 4]), float_input("z", ["N", 4])])
    return InferenceSession(model.SerializeToString(),
                            [("CpuAcc", {"background": False, **options}), "CpuRef"])


def _workload(session: InferenceSession):  # noqa: ANN202
    return session.runtime.network(session.network_id).execute_owned.parts[1]


def _feeds(n: int) -> dict[str, np.ndarray]:
    return {"a": RNG.standard_normal((n, 4)).astype(np.float32),
            "b": RNG.standard_normal((n, 4)).astype(np.float32)}


def _check(got: list[np.ndarray], feeds: dict[str, np.ndarray]) -> None:
    a, b = feeds["a"], feeds["b"]
    np.testing.assert_allclose(got[0], np.maximum(a, 0) + b, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got[1], a - b, rtol=1e-6, atol=1e-6)


def test_a_built_signature_is_found_without_torchs_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[int] = []
    real = specialize.SIGNATURE

    def counted(value: object) -> object:
        read.append(1)
        return real(value)

    monkeypatch.setattr(specialize, "SIGNATURE", counted)
    session = _session()
    assert hasattr(_workload(session), "keyed")
    feeds = _feeds(3)
    session.run(None, feeds)
    read.clear()
    got = session.run(None, feeds)
    assert read == []  # fails before: each run read both inputs' torch shape and dtype
    _check(got, feeds)
    for value in got:
        value[...] = np.nan  # the caller's to write
    again = session.run(None, feeds)
    _check(again, feeds)
    assert not any(np.shares_memory(x, y) for x in again for y in (*got, *feeds.values()))


@pytest.mark.parametrize("limit", [1, 8])
def test_each_shape_runs_its_own_build_and_the_lru_holds(limit: int) -> None:
    session = _session(specialize=limit)
    built = _workload(session).built
    sizes = [2, 3, 2, 5, 3, 2]
    for n in sizes:
        feeds = _feeds(n)
        _check(session.run(None, feeds), feeds)
        assert len(built) <= limit
        last = next(reversed(built))  # the most recently used: this run's
        assert tuple(last[0][0]) == (n, 4)
    assert len(built) == min(limit, len(set(sizes)))


def test_nan_in_gives_nan_out() -> None:
    session = _session()
    feeds = _feeds(2)
    session.run(None, feeds)
    feeds["a"][0, 1] = np.nan
    y, z = session.run(None, feeds)
    assert np.isnan(y[0, 1]) and np.isnan(z[0, 1])
    assert np.isfinite(np.delete(y.ravel(), 1)).all()
