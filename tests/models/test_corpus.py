"""The corpus of real-world exports (tests/data/corpus, made by scripts/export_corpus.py) matches
ONNX Runtime on CpuRef alone and on CpuAcc before CpuRef, at two sizes of every free axis.

Each model file was written by one of torch's exporters (TorchScript or dynamo), at opsets 13 to 21,
some quantized afterwards by onnxruntime.quantization; manifest.json says which and what each one
exercises. The inputs are the `.s0.npz` and `.s1.npz` files beside each model: every free axis has
a different size in the two (batch 1 and 3, sequence 8 and 13, 32x32 and 40x24 images, ...).

What "matches" means (`compare_outputs`): same number of outputs, and for each the same dtype and
shape; integer and boolean outputs (NonMaxSuppression's selected indices, labels, loop counts)
exactly equal; float outputs within TOLERANCE of the output's scale, max |got - want| <=
TOLERANCE * max |want|, with an absolute floor of ABS_FLOOR where outputs are near zero, NaN where
ONNX Runtime has NaN. float16 outputs cannot be compared at 1e-4 (float16's own resolution is 9.8e-4
of a value): they are held to FP16_ULPS units in the last place of float16 at the output's scale.

A float output that a DequantizeLinear makes may also differ by one quantum (`quanta` says why).

ONNX Runtime is the reference with its graph optimizations off (`ort_outputs` says why). Where
backplane fails on a model, its test fails: nothing here is skipped or expected to fail.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backplane import InferenceSession

ort = pytest.importorskip("onnxruntime")

CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus"
MANIFEST: dict[str, dict[str, Any]] = json.loads((CORPUS / "manifest.json").read_text())
BACKEND_LISTS = {"cpuref": ["CpuRef"], "cpuacc+cpuref": ["CpuAcc", "CpuRef"]}
TOLERANCE = 1e-4   # max |got - want| relative to the output's max |want|
ABS_FLOOR = 1e-6   # ... but never less than this, where an output is (near) zero
FP16_ULPS = 4      # float16 outputs: units in the last place at the output's scale


def feeds(name: str, size: int) -> dict[str, np.ndarray]:
    return dict(np.load(CORPUS / MANIFEST[name]["inputs_files"][size]))


def size_text(name: str, size: int) -> str:
    return " ".join(f"{axis}={n}" for axis, n in MANIFEST[name]["sizes"][size].items())


def ort_outputs(path: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    """ONNX Runtime's outputs for the graph as written: its graph optimizations are off. With them
    on it rewrites DequantizeLinear -> Conv -> QuantizeLinear into its integer QLinearConv, whose
    rounding is not the graph's: fakequant_qdq_ts13's logits move by 5.7e-3 of their scale, where
    the graph run as written (ONNX Runtime unoptimized, onnx's ReferenceEvaluator) agree to 1e-7."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def tolerance(want: np.ndarray) -> float:
    """The largest |got - want| allowed for a float output."""
    finite = want[np.isfinite(want)].astype(np.float64)
    scale = float(np.max(np.abs(finite), initial=0.0))
    if want.dtype == np.float16:
        ulp = float(np.spacing(np.float16(min(scale, 65504.0))))
        return max(TOLERANCE * scale, FP16_ULPS * ulp, ABS_FLOOR)
    return max(TOLERANCE * scale, ABS_FLOOR)


def quanta(name: str) -> dict[str, float]:
    """Output name -> one quantum of it, for outputs a DequantizeLinear with a constant scale makes.

    Such an output may differ from ONNX Runtime's by one quantum: a QuantizeLinear input that lies
    on a rounding tie (x / scale = 35.5 to the last bit, seen in resnet_qdq_ort17's AveragePool ->
    QuantizeLinear) is decided by the last bit of a float32 sum whose order the spec leaves to the
    implementation (ONNX Runtime and CpuRef round that average one float32 step apart)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(CORPUS / MANIFEST[name]["file"])
    scales = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[1] in scales:
            found[node.output[0]] = float(np.max(np.abs(scales[node.input[1]])))
    return found


def difference(got: Any, want: np.ndarray, quantum: float = 0.0) -> tuple[float, str | None]:
    """(worst difference relative to the output's scale, a description of the mismatch or None);
    ``quantum``: one quantum of a quantized output, a difference allowed besides (``quanta``)."""
    got = np.asarray(got)
    if got.dtype != want.dtype:
        return float("inf"), f"dtype {got.dtype}, ONNX Runtime {want.dtype}"
    if got.shape != want.shape:
        return float("inf"), f"shape {list(got.shape)}, ONNX Runtime {list(want.shape)}"
    if want.size == 0:
        return 0.0, None
    if want.dtype.kind in "iub":
        wrong = got != want
        if wrong.any():
            first = tuple(int(i) for i in np.argwhere(wrong)[0])
            return float("inf"), (f"{int(wrong.sum())} of {want.size} integers differ, first at {first}: "
                                  f"{got[first]} vs {want[first]}")
        return 0.0, None
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    if (nan_got != nan_want).any():
        return float("inf"), f"NaN at {int((nan_got & ~nan_want).sum())} places where ONNX Runtime has none " \
                             f"(and none at {int((nan_want & ~nan_got).sum())} where it has NaN)"
    g, w = got[~nan_want].astype(np.float64), want[~nan_want].astype(np.float64)
    diff = np.abs(g - w)
    diff[(g == w)] = 0.0  # equal infinities
    worst = float(np.max(diff, initial=0.0))
    scale = max(float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0)), 1e-30)
    allowed = max(tolerance(want), quantum * 1.001)  # the quantum, and the float32 steps around it
    if not worst <= allowed:
        i = int(np.argmax(diff))
        return worst / scale, (f"max |diff| {worst:.3g} = {worst / scale:.2e} of the scale {scale:.3g} "
                               f"(allowed {allowed:.3g}); {int((diff > allowed).sum())} of {diff.size} "
                               f"elements over; worst: {g[i]:.7g} vs {w[i]:.7g}")
    return worst / scale, None


def compare_outputs(actual: Sequence[Any], expected: Sequence[np.ndarray],
                    names: Sequence[str], quantum: dict[str, float] | None = None,
                    ) -> tuple[float, list[str]]:
    """(worst relative difference over the outputs, the mismatches as lines)."""
    if len(actual) != len(expected):
        return float("inf"), [f"{len(actual)} outputs, ONNX Runtime {len(expected)}"]
    worst, problems = 0.0, []
    for name, got, want in zip(names, actual, expected):
        rel, problem = difference(got, want, (quantum or {}).get(name, 0.0))
        worst = max(worst, rel)
        if problem:
            problems.append(f"{name}: {problem}")
    return worst, problems


_sessions: dict[tuple[str, str], InferenceSession | BaseException] = {}
_expected: dict[tuple[str, int], list[np.ndarray]] = {}


def session_for(name: str, backends_id: str) -> InferenceSession:
    """One session per model and backend list for the test run (both sizes run in it, as a user's
    session would); a load that failed fails every test that needs it, with its error."""
    key = (name, backends_id)
    if key not in _sessions:
        try:
            _sessions[key] = InferenceSession(CORPUS / MANIFEST[name]["file"], backends=BACKEND_LISTS[backends_id])
        except Exception as e:  # noqa: BLE001 - kept, raised in each test of this model
            _sessions[key] = e
    session = _sessions[key]
    if isinstance(session, BaseException):
        raise RuntimeError(f"{name} does not load on {BACKEND_LISTS[backends_id]}: "
                           f"{type(session).__name__}: {session}") from session
    return session


def expected_for(name: str, size: int) -> list[np.ndarray]:
    if (name, size) not in _expected:
        _expected[(name, size)] = ort_outputs(CORPUS / MANIFEST[name]["file"], feeds(name, size))
    return _expected[(name, size)]


def test_corpus_is_what_the_manifest_says() -> None:
    total = 0
    for name, entry in MANIFEST.items():
        path = CORPUS / entry["file"]
        assert path.stat().st_size == entry["bytes"] < 1_000_000, name
        total += entry["bytes"]
        for size in (0, 1):
            shapes = {k: v.shape for k, v in feeds(name, size).items()}
            assert list(shapes) == [i["name"] for i in entry["inputs"]], name
            for vi in entry["inputs"]:
                dims = [entry["sizes"][size].get(d, d) if isinstance(d, str) else d for d in vi["shape"]]
                assert list(shapes[vi["name"]]) == dims, (name, vi["name"])
        assert all(entry["sizes"][0][a] != entry["sizes"][1][a] for a in entry["free_axes"]), name
    assert 15 <= len(MANIFEST) <= 40 and total < 8_000_000
    opsets = {entry["opset"] for entry in MANIFEST.values()}
    assert opsets == set(range(11, 22)), opsets
    assert {entry["exporter"].split("+")[0] for entry in MANIFEST.values()} == {"torchscript", "dynamo"}


@pytest.mark.parametrize("size", [0, 1], ids=["s0", "s1"])
@pytest.mark.parametrize("backends_id", BACKEND_LISTS)
@pytest.mark.parametrize("name", MANIFEST)
def test_corpus_model_matches_onnx_runtime(name: str, backends_id: str, size: int) -> None:
    session = session_for(name, backends_id)
    actual = session.run(None, feeds(name, size))
    names = [o["name"] for o in MANIFEST[name]["outputs"]]
    _, problems = compare_outputs(actual, expected_for(name, size), names, quanta(name))
    assert not problems, (f"{name} on {BACKEND_LISTS[backends_id]} at {size_text(name, size)} "
                          f"(placement {session.report.counts()}):\n  " + "\n  ".join(problems))
