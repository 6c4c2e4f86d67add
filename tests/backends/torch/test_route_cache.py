"""CpuAcc's measured routes kept on disk: a second load measures nothing, a changed key measures
again, a broken cache file is an empty cache."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import route_cache  # noqa: E402
from backplane.backends.torch.fusion import patterns  # noqa: E402
from tests.backends.torch.test_fusion import conv_model, inner_workloads  # noqa: E402


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
    return [workload.route for workload in inner_workloads(session, "FusedConv")]


def _session(model, **options) -> InferenceSession:
    """CpuAcc's layers one by one (``CpuAcc.compile`` "layers"): only the convolution's routes."""
    from backplane.runtime.runtime import Runtime, RuntimeOptions

    chosen = RuntimeOptions(backend_options={"CpuAcc.compile": "layers", **options})
    return InferenceSession(model, backends=["CpuAcc"], runtime=Runtime(chosen))


def test_a_second_load_takes_the_remembered_route_without_measuring(cache, measured) -> None:
    first = _routes(_session(conv_model("add_relu")))
    assert measured and cache.is_file() and len(json.loads(cache.read_text())) == 1
    measured.clear()
    again = _routes(_session(conv_model("add_relu")))
    assert measured == [] and again == first


def test_a_changed_key_measures_again(cache, measured, monkeypatch) -> None:
    _session(conv_model("relu"))
    measured.clear()
    monkeypatch.setattr(route_cache, "_processor", lambda: "another processor")
    _session(conv_model("relu"))
    assert measured and len(json.loads(cache.read_text())) == 2


def test_a_corrupt_cache_is_an_empty_one_and_the_option_turns_it_off(cache, measured) -> None:
    cache.write_text("{not json")
    _session(conv_model("relu"))
    assert measured and len(json.loads(cache.read_text())) == 1
    cache.unlink()
    _session(conv_model("relu"), **{"CpuAcc.route_cache": False})
    assert not cache.exists()


def test_a_remembered_route_is_the_only_one_built(cache, monkeypatch) -> None:
    """A load with its routes known builds (copies and packs the weights of) only the routes it
    keeps: the artifact's load and a warm load pay for nothing else."""
    from backplane.backends.torch.fusion import conv

    first = _routes(_session(conv_model("add_relu")))
    made: list[str] = []
    for name in ("_onednn_conv", "_torch_conv", "_gemm_conv"):
        original = getattr(conv, name)

        def counted(*args, original=original, name=name):
            made.append(name)
            return original(*args)
        monkeypatch.setattr(conv, name, counted)
    again = _routes(_session(conv_model("add_relu")))
    assert again == first and made == [f"_{first[0]}_conv"]
