"""Fuzzing the loader: damaged and hostile ONNX models, each loaded and run in a process of its own.

Seed models (the committed tiny models, the demo model and small hand-made ones) are mutated, by
bytes (bit flips, truncations, overwrites, insertions, deletions of the serialized protobuf) and by
fields (dims, names, dtypes, domains, opsets, attributes, duplicate outputs, cycles, empty graphs,
initializers whose data disagrees with their dims, ...), and each mutant goes through
``InferenceSession(bytes, backends=["CpuRef"])`` and, where it loads, a run with zero inputs of the
declared shapes. Every outcome must be one of backplane's own errors with a message, or a run whose
outputs match ONNX Runtime's (where ORT runs the model too) within 1e-4 relative. Anything else is a
finding: another exception type, an empty message, a crash of the process, a hang past the time
limit, or memory growing past the limit.

Each case runs in a forked child (the parent has imported everything once) under an address-space
limit, killed past its time limit; ONNX Runtime runs in a second child, so a crash of ORT is never
taken for one of backplane's. The same seed gives the same cases on any machine.

The CI slice is ``test_fuzz_slice`` below (a fixed seed, a few hundred cases); the long run is
``python bench/fuzz_loader.py --cases 5000`` (same machinery, findings saved under
/tmp/fuzz_findings/). The machinery: ``fuzz_seeds.py`` (the seeds), ``fuzz_mutations.py`` (the
mutations), ``fuzz_cases.py`` (the cases and how each is run).
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tests.frontends.fuzz_cases import (
    MEMORY_BUDGET, Case, _backplane_work, _in_child, compare, describe, fuzz, generate, run_case,
    summarize)
from tests.frontends.fuzz_seeds import HAND_MADE, SEED_FILES, seed_models

# -- the CI slice -------------------------------------------------------------------------------------

CI_SEED = 20240510
CI_CASES = 300


@pytest.mark.parametrize("name", sorted(HAND_MADE) + [p.stem for p in SEED_FILES])
def test_every_seed_model_runs_and_matches_ort(name: str) -> None:
    """The seeds themselves: loaded, run on zeros and equal to ORT, so a mutant's failure is its own."""
    model = seed_models()[name]
    outcome = run_case(model.SerializeToString(), timeout=60)
    assert outcome.kind == "ran", describe(Case(0, name, [], b""), outcome)
    assert outcome.ort == "ran", outcome.ort


def test_the_harness_tells_findings_from_answers() -> None:
    """An own error with a message is an answer; a crash, a hang or memory past the limit is not."""
    status, result, _, _ = _in_child(_backplane_work(b"\x08"), 20, MEMORY_BUDGET)  # not a model
    assert status == "ok" and result["kind"] == "error" and result["error"] == "ModelError"
    assert _in_child(lambda post: os.kill(os.getpid(), signal.SIGSEGV), 10, MEMORY_BUDGET)[0] == "crash"
    status, _, _, posted = _in_child(lambda post: (post("loaded"), time.sleep(30)), 0.5, MEMORY_BUDGET)
    assert (status, posted) == ("hang", "loaded")
    assert _in_child(lambda post: bytearray(3 << 30), 10, MEMORY_BUDGET)[0] == "crash"  # MemoryError
    assert compare([np.ones(3, np.float32)], [np.ones(3, np.float32) * (1 + 1e-3)])
    assert not compare([np.ones(3, np.float32)], [np.ones(3, np.float32) * (1 + 1e-6)])
    assert compare([np.ones(3, np.float32)], [np.ones(3, np.float64)])  # dtype


def test_generation_is_deterministic() -> None:
    first = [(c.seed_name, c.mutations, c.blob) for c in generate(7, 20)]
    assert first == [(c.seed_name, c.mutations, c.blob) for c in generate(7, 20)]


@pytest.mark.slow  # a few hundred mutants, a forked child each: `python -m pytest -m slow`
def test_fuzz_slice() -> None:
    """A fixed seed and a few hundred mutants: every one an own error with a message or a right run."""
    results = fuzz(CI_SEED, CI_CASES, timeout=20)
    findings = [describe(case, outcome) for case, outcome in results if outcome.finding]
    assert not findings, f"{len(findings)} findings:\n\n" + "\n\n".join(findings[:5])
    counts = summarize(results)
    # the mutants must reach every stage: refused at import, loaded and run, compared with ORT
    assert counts["error ModelError"] >= CI_CASES // 10, counts
    assert counts["ran, matches ORT"] >= CI_CASES // 20, counts
    assert sum(v for k, v in counts.items() if k.startswith("error ") and k != "error ModelError") \
        >= 5, counts

