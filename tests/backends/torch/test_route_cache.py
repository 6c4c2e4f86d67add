"""CpuAcc's measured routes kept on disk: a second load measures nothing, a changed key measures
again, a broken cache file is an empty cache."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import route_cache  # noqa: E402
from backplane.backends.torch.fusion import patterns  # noqa: E402
from tests.backends.torch.test_fusion import conv_model  # noqa: E402


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(route_cache.CACHE_VARIABLE, str(tmp_path))
    return tmp_path / route_cache.FILE_NAME


@pytest.fixture
def measured(monkeypatch) -> list[object]:
    """Every route timing made, recorded."""
    calls: list[object] = []
    timed = patterns.seconds

    def counting(run, *sample, **kwargs):
        calls.append(run)
        return timed(run, *sample, **kwargs)

    monkeypatch.setattr(patterns, "seconds", counting)
    return calls


def _routes(session: InferenceSession) -> list[str]:
    loaded = session.runtime.network(session.network_id)
    return [step.workload.route for step, layer in zip(loaded.steps, loaded.layers)
            if layer.op_type == "FusedConv"]


def test_a_second_load_takes_the_remembered_route_without_measuring(cache, measured) -> None:
    first = _routes(InferenceSession(conv_model("add_relu"), backends=["CpuAcc"]))
    assert measured and cache.is_file() and len(json.loads(cache.read_text())) == 1
    measured.clear()
    again = _routes(InferenceSession(conv_model("add_relu"), backends=["CpuAcc"]))
    assert measured == [] and again == first


def test_a_changed_key_measures_again(cache, measured, monkeypatch) -> None:
    InferenceSession(conv_model("relu"), backends=["CpuAcc"])
    measured.clear()
    monkeypatch.setattr(route_cache, "_processor", lambda: "another processor")
    InferenceSession(conv_model("relu"), backends=["CpuAcc"])
    assert measured and len(json.loads(cache.read_text())) == 2


def test_a_corrupt_cache_is_an_empty_one_and_the_option_turns_it_off(cache, measured) -> None:
    from backplane.runtime.runtime import Runtime, RuntimeOptions

    cache.write_text("{not json")
    InferenceSession(conv_model("relu"), backends=["CpuAcc"])
    assert measured and len(json.loads(cache.read_text())) == 1
    cache.unlink()
    off = RuntimeOptions(backend_options={"CpuAcc.route_cache": False})
    InferenceSession(conv_model("relu"), backends=["CpuAcc"], runtime=Runtime(off))
    assert not cache.exists()
