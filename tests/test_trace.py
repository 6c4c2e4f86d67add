"""Profiles as Chrome traces (the Trace Event Format): SessionOptions.enable_profiling and
end_profiling, checked for the format's structure and for one complete event per layer run."""

from __future__ import annotations

import json
import os
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession, SessionOptions
from tests.conftest import small_cnn_model

MOBILENET = Path(__file__).parent / "data" / "tiny_mobilenet_v3.onnx"
X = np.random.default_rng(4).standard_normal((1, 3, 8, 8)).astype(np.float32)
LAYER_CATEGORIES = {"layer", "copy", "import"}


def load_trace(path: str) -> list[dict]:
    """The trace's events, after checking the Trace Event Format's rules for the ones written."""
    document = json.loads(Path(path).read_text())
    assert isinstance(document, dict) and document["displayTimeUnit"] in ("ms", "ns")
    events = document["traceEvents"]
    assert isinstance(events, list) and events
    for event in events:
        assert isinstance(event["name"], str) and event["name"]
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert event["ph"] in ("X", "M"), event
        assert isinstance(event.get("args", {}), dict)
        if event["ph"] == "X":
            assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0
            assert isinstance(event["cat"], str)
        else:
            assert event["name"] in ("process_name", "thread_name", "thread_sort_index")
            assert "ts" not in event or event["ts"] == 0
    assert {e["pid"] for e in events} == {os.getpid()}
    named = {e["tid"] for e in events if e["name"] == "thread_name"}
    assert {e["tid"] for e in events if e["ph"] == "X"} <= named  # every track has a name
    return events


def thread_names(events: list[dict]) -> dict[int, str]:
    return {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}


@pytest.fixture(scope="module")
def mobilenet_trace(tmp_path_factory):
    """tiny_mobilenet_v3 on CpuAcc, CpuRef with HardSigmoid pinned to CpuRef (imports between the
    two), CpuAcc's OneDnnGraph run layer by layer (its layers timed inside it): two runs."""
    pytest.importorskip("torch")
    folder = tmp_path_factory.mktemp("profiles")
    options = SessionOptions(enable_profiling=True, profile_file_prefix=str(folder / "mnv3"),
                             pins={"HardSigmoid": "CpuRef"})
    backends = [("CpuAcc", {"compile": "layers", "conv_route": "onednn", "linear_route": "mkl"}),
                "CpuRef"]
    session = InferenceSession(MOBILENET, backends=backends, sess_options=options)
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    _, first = session.run_profiled(None, {"input": x})
    session.run(None, {"input": x})
    path = session.end_profiling()
    return session, first, path


def test_one_complete_event_per_layer_run(mobilenet_trace) -> None:
    session, first, path = mobilenet_trace
    assert Path(path).parent.name.startswith("profiles") and Path(path).name.startswith("mnv3_")
    events = load_trace(path)
    layers = [e for e in events if e["ph"] == "X" and e["cat"] in LAYER_CATEGORIES]
    runs = [e for e in events if e["ph"] == "X" and e["name"] == "run"]
    assert len(runs) == 2 and len(first) > 60
    assert len(layers) == 2 * len(first)  # both runs, each LayerTiming once
    for run_index in (0, 1):
        mine = [e for e in layers if e["args"]["run"] == run_index]
        assert [e["name"] for e in mine] == [t.layer for t in first]  # in the order they ran
        span = runs[run_index]
        for event in mine:  # inside the run's span, one after the other
            assert span["ts"] - 1 <= event["ts"] and event["ts"] + event["dur"] <= \
                span["ts"] + span["dur"] + 1
        ends = [e["ts"] + e["dur"] for e in mine]
        assert all(later["ts"] >= end - 1 for end, later in zip(ends, mine[1:]))
    assert runs[1]["ts"] >= runs[0]["ts"] + runs[0]["dur"]


def test_one_track_per_backend_named_and_the_layers_on_their_backends_track(mobilenet_trace) -> None:
    _, _, path = mobilenet_trace
    events = load_trace(path)
    names = thread_names(events)
    assert sorted(names.values()) == ["CpuAcc", "CpuRef", "builtin (copies, imports, control flow)",
                                      "session"]
    for event in events:
        if event["ph"] == "X" and event["cat"] in LAYER_CATEGORIES:
            assert names[event["tid"]].split(" ")[0] == event["args"]["backend"]
    order = {e["tid"]: e["args"]["sort_index"] for e in events if e["name"] == "thread_sort_index"}
    by_name = {names[tid]: rank for tid, rank in order.items()}
    assert by_name["session"] < by_name["CpuAcc"] < by_name["CpuRef"]
    session_spans = [e["name"] for e in events if e["ph"] == "X" and e["cat"] == "session"]
    assert session_spans[:3] == ["import", "optimize", "load"]


def test_imports_are_events_of_their_own_with_their_bytes(mobilenet_trace) -> None:
    session, _, path = mobilenet_trace
    events = load_trace(path)
    imports = [e for e in events if e["ph"] == "X" and e["cat"] == "import"]
    expected = {c.layer: c.nbytes for c in session.report.copies}
    assert len(expected) == 20 and len(imports) == 2 * len(expected)
    for event in imports:
        assert event["args"]["op_type"] == "MemImport"
        assert event["args"]["bytes"] == expected[event["name"]]
    assert {e["args"]["bytes"] for e in imports if e["name"].startswith("MemImport[input]")} \
        == {1 * 3 * 64 * 64 * 4}


def test_layers_a_workload_runs_inside_are_named_as_they_come(mobilenet_trace) -> None:
    session, first, path = mobilenet_trace
    events = load_trace(path)
    outer = {layer.name for layer in session.optimized.graph.layers}
    inner = [e for e in events if e["ph"] == "X" and e["cat"] == "layer" and e["name"] not in outer]
    assert inner, "OneDnnGraph's layers, run one by one, are timed one by one"
    counts = Counter(e["args"]["op_type"] for e in inner)
    assert counts["FusedConv"] > 10  # Conv [+ activation] fused by CpuAcc, as OneDnnGraph names them
    assert any("+" in e["name"] for e in inner)  # a fused layer's name: its layers joined
    assert all(e["args"]["output_bytes"] > 0 for e in inner)  # each layer's own outputs' bytes
    assert not any(e["name"].startswith("OneDnnGraph[") for e in events if e["ph"] == "X")


def test_copies_between_memories_carry_their_bytes(tmp_path, partial_backends) -> None:
    options = SessionOptions(enable_profiling=True, profile_file_prefix=str(tmp_path / "p"))
    session = InferenceSession(small_cnn_model().SerializeToString(), ["TestPrivate", "CpuRef"],
                               options)
    session.run(None, {"x": X})
    events = load_trace(session.end_profiling())
    copies = [e for e in events if e["ph"] == "X" and e["cat"] == "copy"]
    assert {c.strategy for c in session.report.copies} == {"copy"}
    assert len(copies) == len(session.report.copies) == 4
    assert {e["name"]: e["args"]["bytes"] for e in copies}["MemCopy[x](user->TestPrivate)"] == \
        3 * 8 * 8 * 4
    layers = [e for e in events if e["ph"] == "X" and e["cat"] == "layer"]
    assert {e["name"]: e["args"]["output_bytes"] for e in layers}["pool"] == 4 * 4


def test_runs_from_another_thread_get_tracks_of_their_own(tmp_path) -> None:
    options = SessionOptions(enable_profiling=True, profile_file_prefix=str(tmp_path / "p"))
    session = InferenceSession(small_cnn_model().SerializeToString(), ["CpuRef"], sess_options=options)
    session.run(None, {"x": X})
    worker = threading.Thread(target=session.run, args=(None, {"x": X}))
    worker.start()
    worker.join()
    events = load_trace(session.end_profiling())
    names = thread_names(events)
    assert sorted(names.values()) == ["CpuRef", "CpuRef (thread 2)", "session",
                                      "session (thread 2)"]


def test_end_profiling_without_profiling_is_empty_and_profiling_ends(tmp_path) -> None:
    model = small_cnn_model().SerializeToString()
    assert InferenceSession(model, ["CpuRef"]).end_profiling() == ""
    options = SessionOptions(enable_profiling=True, profile_file_prefix=str(tmp_path / "p"))
    session = InferenceSession(model, ["CpuRef"], sess_options=options)
    session.run(None, {"x": X})
    path = session.end_profiling()
    session.run(None, {"x": X})  # not profiled any more
    assert session.end_profiling() == ""
    runs = [e for e in load_trace(path) if e["name"] == "run"]
    assert len(runs) == 1


def test_the_default_placement_one_event_per_layer_run_too(tmp_path) -> None:
    """CpuAcc as it loads by default (routes measured, the subgraph compiled where that is faster)."""
    pytest.importorskip("torch")
    options = SessionOptions(enable_profiling=True, profile_file_prefix=str(tmp_path / "p"))
    session = InferenceSession(MOBILENET, options, providers=["CpuAcc", "CpuRef"])
    x = np.random.default_rng(1).standard_normal((1, 3, 64, 64)).astype(np.float32)
    _, timings = session.run_profiled(None, {"input": x})
    events = load_trace(session.end_profiling())
    layers = [e for e in events if e["ph"] == "X" and e["cat"] in LAYER_CATEGORIES]
    assert [e["name"] for e in layers] == [t.layer for t in timings]
    assert [e["cat"] for e in layers][0] == [e["cat"] for e in layers][-1] == "import"
    assert layers[0]["args"]["bytes"] == 3 * 64 * 64 * 4 and layers[-1]["args"]["bytes"] == 40
    assert {e["args"]["backend"] for e in layers[1:-1]} == {"CpuAcc"}
