"""The corpus's full tier (scripts/export_corpus.py --tier full) is built by script and matches ONNX
Runtime on backplane's CpuAcc,CpuRef.

The full tier is not in the repository (51 MB): this test builds its cheapest model, the
VAD at Silero's widths (a TorchScript export, about a second), into tmp_path with the script's own
export and checks (ONNX Runtime against eager torch at both sizes), then runs it on CpuAcc before
CpuRef at both sizes (16 kHz and 8 kHz: both branches of its If) against ONNX Runtime, as
test_corpus.py does for the small tier.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from backplane import InferenceSession
from tests.models.test_corpus import compare_outputs, ort_outputs

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
CHEAPEST = "vad_lstm_if_ts16"


@pytest.fixture(scope="module")
def exporter():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import export_corpus
    finally:
        sys.path.remove(str(SCRIPTS))
    return export_corpus


@pytest.mark.slow
def test_full_tier_model_builds_and_matches_onnx_runtime(exporter, tmp_path: Path) -> None:
    spec = exporter.full_specs()[CHEAPEST]
    entry = exporter.export(spec, tmp_path, exporter.FULL_MAX_FILE_BYTES, "full")
    assert entry["tier"] == "full" and entry["opset"] == exporter.specs()[CHEAPEST].opset
    # the full tier's VAD: Silero's widths (state 128, a 258-channel front end), over the small tier's 1 MB
    assert entry["bytes"] > 1_000_000, entry["bytes"]
    state = next(vi for vi in entry["inputs"] if vi["name"] == "state")
    assert state["shape"] == [2, "batch", 128]
    path = tmp_path / entry["file"]
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"])
    assert session.report.counts().get("CpuAcc", 0) > 0, session.report.counts()
    names = [o["name"] for o in entry["outputs"]]
    for size, inputs_file in enumerate(entry["inputs_files"]):
        feeds = dict(np.load(tmp_path / inputs_file))
        _, problems = compare_outputs(session.run(None, feeds), ort_outputs(path, feeds), names)
        assert not problems, f"{CHEAPEST} (full tier) at size {size}:\n  " + "\n  ".join(problems)
