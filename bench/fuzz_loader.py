"""The long run of the loader fuzzer (tests/frontends/test_fuzz_loader.py): many thousands of mutants.

    python bench/fuzz_loader.py --cases 5000 [--seed 1] [--jobs 2] [--timeout 20] [--ort-always]
                                [--out /tmp/fuzz_findings]

Each mutant is loaded and run in a process of its own (see the test module), ``--jobs`` at a time.
Prints the outcomes by kind (each error class of backplane's, correct runs, runs ORT refused,
mutants backplane refused that ORT ran with ``--ort-always``) and the findings grouped by where
they arise; each finding's model is saved as OUT/<seed>-<case>.onnx with OUT/<seed>-<case>.txt
beside it (the mutations, the exception and its traceback). Exit status 1 when there are findings.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.frontends.fuzz_cases import Case, Outcome, describe, generate, run_case, summarize  # noqa: E402

_options: argparse.Namespace


def _run(case: Case) -> tuple[Case, Outcome]:
    return case, run_case(case.blob, _options.timeout, ort_always=_options.ort_always)


def _init(options: argparse.Namespace) -> None:
    global _options
    _options = options


def _where(outcome: Outcome) -> str:
    frames = re.findall(r'File "([^"]+)", line \d+, in (\w+)', outcome.detail)
    if frames:
        return f"{outcome.error} in {frames[-1][0].rsplit('/', 1)[-1]}:{frames[-1][1]}"
    return outcome.detail.splitlines()[0][:80] if outcome.detail else ""


def _template(text: str) -> str:
    """A message with its names and numbers left out: one line per kind of message."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'*'", text.splitlines()[0] if text else ""))[:120]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per case and runtime")
    parser.add_argument("--ort-always", action="store_true",
                        help="ask ORT about every mutant, also those backplane refuses")
    parser.add_argument("--out", type=Path, default=Path("/tmp/fuzz_findings"))
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)

    start = time.monotonic()
    results: list[tuple[Case, Outcome]] = []
    context = multiprocessing.get_context("fork")
    with context.Pool(options.jobs, initializer=_init, initargs=(options,), maxtasksperchild=200) as pool:
        for case, outcome in pool.imap(_run, generate(options.seed, options.cases), chunksize=4):
            results.append((case, outcome))
            if outcome.finding:
                stem = options.out / f"{options.seed}-{case.index}"
                stem.with_suffix(".onnx").write_bytes(case.blob)
                stem.with_suffix(".txt").write_text(describe(case, outcome) + "\n")
            if len(results) % 250 == 0:
                print(f"{len(results)} cases, {time.monotonic() - start:.0f} s", file=sys.stderr)
    seconds = time.monotonic() - start

    print(f"seed {options.seed}: {len(results)} cases in {seconds:.0f} s "
          f"({seconds / max(1, len(results)) * 1e3:.0f} ms a case, {options.jobs} jobs)")
    print("\noutcomes:")
    for kind, count in summarize(results).most_common():
        print(f"  {count:6d}  {kind}")
    findings = collections.defaultdict(list)
    notes = collections.defaultdict(list)
    refused = collections.defaultdict(list)
    for case, outcome in results:
        if outcome.finding:
            findings[(outcome.kind, _where(outcome))].append(case.index)
        elif outcome.kind == "ran" and outcome.ort != "ran":
            notes[_template(outcome.ort)].append(case)
        elif outcome.kind == "error" and outcome.ort in ("ran", "loaded"):
            refused[f"{outcome.error} (ORT {outcome.ort}): {_template(outcome.message)}"].append(case)
    print(f"\nfindings ({sum(map(len, findings.values()))}, saved under {options.out}):")
    for (kind, where), indices in sorted(findings.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(indices):6d}  {kind}: {where}  cases {indices[:8]}")
    print("\nbackplane ran, ONNX Runtime did not (check that the answer is sensible):")
    for why, cases in sorted(notes.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(cases):6d}  {why}\n          e.g. case {cases[0].index}: {'; '.join(cases[0].mutations)[:150]}")
    if options.ort_always:
        print("\nbackplane refused, ONNX Runtime loaded (at load) or ran (at run):")
        for why, cases in sorted(refused.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(cases):6d}  {why}\n          e.g. case {cases[0].index}: "
                  f"{'; '.join(cases[0].mutations)[:150]}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
