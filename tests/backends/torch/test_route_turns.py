"""A load's routes are timed taking turns (patterns.taking_turns): a burst of load on the machine
meets every route's calls alike, not one route's calls only."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("torch")

from backplane.backends.torch.fusion import patterns  # noqa: E402


def _routes(burst_calls: int) -> dict:
    calls = []

    def route(ms: float):
        def run(*sample):
            calls.append(1)
            busy = 30 if len(calls) <= burst_calls else 0  # the machine busy for the first calls
            threading.Event().wait((ms + busy) / 1e3)
            return sample
        return run

    return {"fast": route(1), "slow": route(5)}


def test_a_burst_over_one_routes_calls_does_not_choose_the_other() -> None:
    # six calls: all of the first route's calls, were they timed one route after the other
    times = patterns.taking_turns(_routes(burst_calls=6), [])
    assert min(times, key=times.__getitem__) == "fast"
    assert times["fast"] < 0.005 <= times["slow"]


def test_a_failing_route_never_wins() -> None:
    def failing(*sample):
        raise RuntimeError("no kernel")

    times = patterns.taking_turns({"broken": failing, **_routes(burst_calls=0)}, [])
    assert times["broken"] == float("inf") and min(times, key=times.__getitem__) == "fast"
