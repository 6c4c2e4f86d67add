"""Fuzzed models and hostile graphs on every backend list, each held to CpuRef: counts per backend.

    python bench/hostile.py [--fuzz 300] [--seed 1] [--jobs 2] [--timeout 60] [--run-timeout 5]
                            [--ort-timeout 15]
                            [--only NAME ...] [--no-hostile] [--out /tmp/hostile_findings]
                            [--lists GpuAcc,CpuAcc,CpuRef ...]

The cases: every hand-written hostile graph of tests/runtime/hostile_graphs.py (with its inputs),
then ``--fuzz`` mutants of tests/frontends/fuzz_cases.py's generator (``--seed``; run on zeros
of their declared inputs). Each case runs on each backend list of tests/runtime/verdicts.py this
machine has (["CpuRef"], ["CpuAcc", "CpuRef"], ["OpenVINO", "CpuRef"], ["GpuAcc", "CpuRef"] where
CUDA is; or those ``--lists`` names) in a forked process of its own, with
``RunOptions(timeout_s=--run-timeout)`` and killed after ``--timeout`` seconds, and then on ONNX
Runtime; every run but CpuRef's is judged against CpuRef's (verdicts.verdict). Prints the machine,
the versions, a table of verdicts per backend for each set, and each finding (a crash, a hang, a
foreign exception, an empty message, an output sharing memory, a silent difference; ONNX Runtime's
are listed, not counted); each finding's model is saved as OUT/<case>.onnx with
OUT/<case>.<backend>.txt (the verdict, the traceback, the command that repeats it). Exit status 1
when a backplane backend has a finding.

This is a new file rather than more of bench/fuzz_loader.py: that one holds CpuRef to ONNX Runtime
with its own outcome classes (memory growth, mismatches with ORT), this one holds every backend to
CpuRef; both use the fuzz test's child process and generator.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available in the
# parent without starting CUDA there (a forked child could not start it again)
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tests.frontends.fuzz_cases import generate  # noqa: E402
from tests.runtime import verdicts as v  # noqa: E402
from tests.runtime.hostile_graphs import CASES  # noqa: E402

ORT = "ONNX Runtime"


@dataclass
class Case:
    name: str
    blob: bytes
    feeds: dict[str, np.ndarray] | None  # None: zeros of the declared inputs
    about: str = ""  # a fuzz case's mutations


@dataclass
class Result:
    case: Case
    verdicts: dict[str, tuple[str, str]] = field(default_factory=dict)  # backend -> (verdict, about)


_options: argparse.Namespace
_lists: dict[str, list[str]]


def hostile_cases(only: set[str]) -> list[Case]:
    cases = []
    for name, build in CASES.items():
        if only and name not in only:
            continue
        built, feeds = build()
        blob = built if isinstance(built, bytes) else built.SerializeToString()
        cases.append(Case(name, blob, feeds))
    return cases


def fuzz_cases(seed: int, count: int, only: set[str]) -> list[Case]:
    cases = [Case(f"fuzz-{seed}-{c.index}", c.blob, None, f"{c.seed_name}: {'; '.join(c.mutations)}")
             for c in generate(seed, count)]
    return [c for c in cases if not only or c.name in only]


def judge(case: Case) -> Result:
    """The case on CpuRef, then on every other list and ONNX Runtime with CpuRef's inputs."""
    result = Result(case)
    timeout, run_timeout = _options.timeout, _options.run_timeout
    reference = v.run_backend(case.blob, case.feeds, ["CpuRef"], timeout, run_timeout)
    result.verdicts["CpuRef"] = v.verdict(reference, None)
    feeds = case.feeds if case.feeds is not None else reference.feeds
    ort = None
    if feeds is not None:  # CpuRef loaded the model (or the case has inputs): ORT on the same
        ort = v.run_ort(case.blob, feeds, _options.ort_timeout)
        result.verdicts[ORT] = v.verdict(ort, reference)
    for backend, backends in _lists.items():
        if backend != "CpuRef":
            run = v.run_backend(case.blob, feeds, backends, timeout, run_timeout)
            result.verdicts[backend] = v.verdict(run, reference, ort)
    return result


def _init(options: argparse.Namespace, lists: dict[str, list[str]]) -> None:
    global _options, _lists
    _options, _lists = options, lists


def machine() -> str:
    """The CPU, the system and the versions the figures come from."""
    import onnx
    import onnxruntime
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    versions = [f"Python {platform.python_version()}", f"NumPy {np.__version__}",
                f"torch {torch.__version__}", f"onnx {onnx.__version__}",
                f"onnxruntime {onnxruntime.__version__}"]
    try:
        import openvino
        versions.append(f"OpenVINO {openvino.__version__.split('-')[0]}")
    except ImportError:
        pass
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    return (f"CPU: {cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
            f"{platform.system()} {platform.release()}\n{', '.join(versions)}; backplane at {commit}")


def table(results: list[Result], columns: list[str]) -> str:
    """A Markdown table: one row per backend, one column per verdict that occurs."""
    counts = {c: collections.Counter(r.verdicts[c][0] for r in results if c in r.verdicts)
              for c in columns}
    seen = [k for k in v.VERDICTS if any(counts[c][k] for c in columns)]
    shown = [*[k for k in (v.CRASH, v.HANG, v.FOREIGN, v.DIFFERS) if k not in seen], *seen]
    shown.sort(key=v.VERDICTS.index)
    lines = ["| backend | cases | " + " | ".join(shown) + " |", "|---|---:|" + "---:|" * len(shown)]
    for c in columns:
        label = ", ".join(_lists[c]) if c in _lists else c
        lines.append(f"| {label} | {sum(counts[c].values())} | "
                     + " | ".join(str(counts[c][k]) for k in shown) + " |")
    return "\n".join(lines)


def save(result: Result, backend: str, verdict: str, about: str, out: Path) -> Path:
    case = result.case
    out.joinpath(f"{case.name}.onnx").write_bytes(case.blob)
    if case.feeds is not None:
        np.savez(out / f"{case.name}.npz", **case.feeds)
    text = out / f"{case.name}.{backend.replace(' ', '_')}.txt"
    repeat = f"python bench/hostile.py --only {case.name}" + (
        f" --fuzz {int(case.name.split('-')[2]) + 1} --seed {case.name.split('-')[1]} --no-hostile"
        if case.name.startswith("fuzz-") else "")
    text.write_text(f"{case.name} on {backend}: {verdict}\n{case.about}\nrepeat: {repeat}\n\n{about}\n")
    return text


def report(results: list[Result], columns: list[str], options: argparse.Namespace) -> int:
    failed = 0
    fuzzed = [r for r in results if r.case.name.startswith("fuzz-")]
    for title, group in (("hostile graphs", [r for r in results if r not in fuzzed]),
                         (f"fuzzed models (seed {options.seed})", fuzzed)):
        if group:
            print(f"\n{title}: {len(group)} cases\n\n{table(group, columns)}")
    print(f"\nfindings (models and tracebacks under {options.out}):")
    for result in results:
        for backend, (verdict, about) in result.verdicts.items():
            if verdict in v.FINDINGS:
                failed += backend != ORT
                path = save(result, backend, verdict, about, options.out)
                first = about.splitlines()[0][:150] if about else ""
                print(f"  {result.case.name} on {backend}: {verdict}: {first}\n      {path}")
    print("\nnotes (refused where CpuRef ran; ran where CpuRef did not; differs from CpuRef as ORT):")
    for result in results:
        for backend, (verdict, about) in result.verdicts.items():
            if verdict in (v.REFUSED_REF_RAN, v.RAN_REF_NOT, v.AS_ORT):
                print(f"  {result.case.name} on {backend}: {verdict}: {about.splitlines()[0][:200]}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz", type=int, default=300, help="fuzzed models (0: none)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a child may take")
    parser.add_argument("--run-timeout", type=float, default=5.0, help="RunOptions.timeout_s")
    parser.add_argument("--ort-timeout", type=float, default=15.0,
                        help="seconds ONNX Runtime may take (it has no run timeout)")
    parser.add_argument("--only", nargs="*", default=[],
                        help="case names (fuzz-SEED-INDEX for a mutant)")
    parser.add_argument("--no-hostile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("/tmp/hostile_findings"))
    parser.add_argument("--lists", nargs="*", default=[],
                        help="backend lists to hold to CpuRef, each comma-separated "
                             "(GpuAcc,CpuAcc,CpuRef); default: every list this machine has")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("BACKPLANE_CACHE_DIR", tempfile.mkdtemp(prefix="hostile_cache_"))
    from backplane import against_cpu
    against_cpu.DEFAULT = "off"  # GpuAcc held to CpuRef where it is placed, not CPU's placement
    only = set(options.only)
    cases = [] if options.no_hostile else hostile_cases(only)
    cases += fuzz_cases(options.seed, options.fuzz, only)
    lists = v.available_lists() if not options.lists else \
        {"CpuRef": ["CpuRef"], **{given: given.split(",") for given in options.lists}}
    _init(options, lists)  # the table's labels read them here too
    v.warm_imports()
    print(f"{' '.join(sys.argv)}\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n{machine()}")
    print(f"backend lists: {lists}; {len(cases)} cases, {options.jobs} jobs")
    start = time.monotonic()
    results = []
    context = multiprocessing.get_context("fork")
    with context.Pool(options.jobs, initializer=_init, initargs=(options, lists),
                      maxtasksperchild=50) as pool:
        for result in pool.imap_unordered(judge, cases):
            results.append(result)
            if len(results) % 50 == 0:
                print(f"{len(results)} cases, {time.monotonic() - start:.0f} s", file=sys.stderr)
    results.sort(key=lambda r: [c.name for c in cases].index(r.case.name))
    print(f"\n{len(results)} cases in {time.monotonic() - start:.0f} s")
    return report(results, [*lists, ORT], options)


if __name__ == "__main__":
    sys.exit(main())
