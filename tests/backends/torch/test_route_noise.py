"""A route measured beside other work is not kept for good (``route_cache.watched``; issue 27,
item 5): where the process's threads waited for a CPU during the measurement, the load runs the
route it measured fastest but writes nothing to the route cache, and says why."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from backplane.backends.torch import route_cache, threads  # noqa: E402
from tests.backends.torch.test_fusion import conv_model, inner_workloads  # noqa: E402
from tests.backends.torch.test_route_cache import _session  # noqa: E402


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty route cache; the load looking at the machine's other work (the suite's conftest
    turns that off), the load average saying the machine is quiet."""
    monkeypatch.setenv(route_cache.CACHE_VARIABLE, str(tmp_path))
    monkeypatch.setattr(threads, "CROWDED_CHECK", True)
    monkeypatch.setattr(threads, "crowded", lambda: False)
    return tmp_path / route_cache.FILE_NAME


def _waits(monkeypatch: pytest.MonkeyPatch, step: float) -> None:
    """``waited_for_cpus`` growing by ``step`` seconds at each reading."""
    counter = itertools.count()
    monkeypatch.setattr(threads, "waited_for_cpus", lambda: step * next(counter))


def test_a_route_measured_beside_other_work_is_not_kept(cache: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _waits(monkeypatch, 5.0)  # its threads waited 5 s for a CPU while it was timed
    (work,) = inner_workloads(_session(conv_model("relu")), "FusedConv")
    assert not cache.exists()
    assert "not kept: measured beside other work" in work.why


def test_a_route_measured_alone_is_kept(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _waits(monkeypatch, 0.0)
    (work,) = inner_workloads(_session(conv_model("relu")), "FusedConv")
    assert list(json.loads(cache.read_text()).values()) == [work.route]
    assert "not kept" not in work.why


def test_without_schedstats_a_route_is_kept_as_before(cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "waited_for_cpus", lambda: None)
    _session(conv_model("relu"))
    assert len(json.loads(cache.read_text())) == 1


def test_the_waits_are_each_threads_run_queue_delay_summed(tmp_path: Path) -> None:
    for task, line in (("101", "900 2500000000 7\n"), ("102", "5 500000000 1\n")):
        (tmp_path / task).mkdir()
        (tmp_path / task / "schedstat").write_text(line)
    (tmp_path / "103").mkdir()  # a thread that ended between the listing and the reading
    assert threads.waited_for_cpus(str(tmp_path)) == pytest.approx(3.0)
    assert threads.waited_for_cpus(str(tmp_path / "missing")) is None
