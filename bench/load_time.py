"""Session creation against ONNX Runtime's: load, first call and steady state, cold (issue 27, item 5).

Usage:
    python bench/load_time.py                                  # the demo and a few corpus models
    python bench/load_time.py --models demo,gpt_causal_ts15 --rounds 5
    python bench/load_time.py --tier full --models mobilenet_dw_ts13
    python bench/load_time.py --src before=/tmp/old/src        # another backplane tree beside this one
    python bench/load_time.py --quiet-path                     # a busy machine's load measured as a quiet one's
    python bench/load_time.py --burn 2 --models demo           # beside two CPU-burning processes
    python bench/load_time.py --torch 1 --threads 0 --models demo  # default sessions beside a torch job

Each figure comes from a fresh process (the runtime's module imported and timed apart from the
session: ``import onnxruntime``, ``import backplane``; torch is not imported apart, a user's script
pays it where backplane imports it: in the load, or in the background and the first run where the
load defers CpuAcc, ``backplane.deferred_load``), the runtimes alternating within a round
(backplane, each ``--src`` tree, ONNX Runtime), ``--rounds`` rounds:

- ONNX Runtime: ``InferenceSession(path)`` on the CPU provider, ORT_ENABLE_ALL, ``--threads`` intra-op;
- backplane: ``InferenceSession(path, SessionOptions(intra_op_num_threads=threads))``, its default
  backends, with an empty route cache (``$BACKPLANE_CACHE_DIR`` and ``$XDG_CACHE_HOME`` a new
  temporary folder per process; the native libraries built once per machine kept, as
  ``bench/wild.py`` keeps them: gcc's 2-6 s is an install's, paid once) and no compile cache
  (``$BACKPLANE_COMPILE_CACHE`` unset: where it is set, as ``bench/wild.py`` sets it to an empty
  folder, a load compiles the model into an artifact and loads that: another path than a user's
  plain session).

A process loads, makes one first call (timed apart: what a load leaves to the first run is paid
there), waits for a load left to the background (``deferred_load.wait``: runs until then may
bridge it on the native plan, ``torch_free``) and makes one call, the two timed as "settled s",
then ``--calls`` calls whose median is its steady state; it says whether torch was
imported by then (a default session of a model CpuAcc plans whole in C never imports it:
``backplane.torch_free``) and its CPU seconds (all its threads) from the import's start to the
first call's outputs. Per model and runtime: the best
load of the rounds (and the median), the least CPU seconds a load took (all its threads: less
touched by neighbours than the wall time, but ONNX Runtime's and torch's spinning threads count), the
median first call and its least CPU milliseconds, the best steady median, the import and the load
together (best and median) and the median from the import's start to the first call's outputs;
how many of backplane's loads deferred CpuAcc (returned with its load in the background); and
whether backplane's load found the machine busy (``threads.crowded``: routes then taken by rule, nothing
timed nor compiled). ``--quiet-path`` makes backplane's workers take the quiet machine's path
whatever the load average (``threads.CROWDED_CHECK`` off, as the test suite does): on a shared
machine that is the only way to time it, and its figures then carry the others' load. The CPU,
the versions and the load average (start, end and per process) are printed beside the figures.
``--burn N`` starts N processes that spin on the CPU before each timed process (both runtimes)
and stops them after it: the busy machine of issue 27's done-when (the demo's load under 1 s).
``--torch N`` starts N torch processes instead, each at ``--threads`` threads (2 where 0) looping
over convolutions (``wild.TORCH``): OpenMP pools contending with the session's. ``--threads 0``
loads the runtimes' default sessions (backplane's CpuAcc.threads "auto", ONNX Runtime's own count).

The workers read their modules' bytecode, as an installed package's are: ``PYTHONPYCACHEPREFIX`` a
temporary folder per tree, written by an untimed process per model first (this repository's
environment sets ``PYTHONDONTWRITEBYTECODE``, and compiling the 44 modules a CpuAcc load imports
from source was 0.33 of mobilenet_dw_ts13's 0.46 s load at load average 7); ``--no-bytecode``
leaves the environment as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "mobilenet_v2_w020_c10.onnx"
CORPUS = {"small": ROOT / "tests" / "data" / "corpus",
          "full": Path("~/.cache/backplane/corpus-full").expanduser()}
DEFAULT_MODELS = "demo,mobilenet_dw_ts13,resnet_basic_dyn21,unet_resize_dyn20,gpt_causal_ts15"


def worker(args: argparse.Namespace) -> None:
    """One process of one runtime: import, load, first call, ``--calls`` calls; one JSON line."""
    root = os.environ.get("BACKPLANE_CACHE_DIR") or os.path.join(  # the native libraries stay:
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "backplane")
    os.environ.setdefault("BACKPLANE_NATIVE_CACHE", os.path.join(root, "native"))  # wild's reason
    for variable in ("BACKPLANE_CACHE_DIR", "XDG_CACHE_HOME"):
        os.environ[variable] = tempfile.mkdtemp(prefix="load_time_")
    os.environ.pop("BACKPLANE_COMPILE_CACHE", None)  # set, a load compiles an artifact, then loads it
    start, began = time.perf_counter(), time.process_time()
    run, crowded, deferred, settle = _loader(args)
    imported = time.perf_counter() - start
    feeds = _feeds(args.model, args.feeds)
    start, cpu = time.perf_counter(), time.process_time()
    call = run(feeds)
    load, load_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    call()
    first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
    to_first_cpu = time.process_time() - began  # all threads: a background load's import too
    start = time.perf_counter()
    settle()  # runs bridging a background load (torch_free) are not the steady state
    call()
    settled = time.perf_counter() - start
    times = []
    for _ in range(args.calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    print(json.dumps({"import_s": imported, "load_s": load, "load_cpu_s": load_cpu, "first_ms": first * 1e3,
                      "first_cpu_ms": first_cpu * 1e3,
                      "steady_ms": statistics.median(times) * 1e3, "crowded": crowded(),
                      "deferred": deferred(), "loadavg": os.getloadavg()[0],
                      "to_first_cpu_s": to_first_cpu, "torch": "torch" in sys.modules,
                      "settled_s": settled}))


def _loader(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """The runtime imported: a function from feeds to a call of a new session, one saying
    whether backplane found the machine busy, one whether its session returned with CpuAcc's
    load deferred to the background (``deferred_load``; both always False for ONNX Runtime) and
    one waiting for that load (``deferred_load.wait``: runs before it may bridge it)."""
    if args.runtime == "onnxruntime":
        import onnxruntime as ort

        def load(feeds: dict[str, np.ndarray]) -> Any:
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
            session = ort.InferenceSession(args.model, options, providers=["CPUExecutionProvider"])
            return lambda: session.run(None, feeds)
        return load, lambda: False, lambda: False, lambda: None
    from backplane import InferenceSession, SessionOptions
    from backplane.backends.torch import threads

    if args.quiet_path:
        threads.CROWDED_CHECK = False
    said = []

    def load(feeds: dict[str, np.ndarray]) -> Any:
        said.append(threads.crowded())
        session = InferenceSession(args.model, SessionOptions(intra_op_num_threads=args.threads))
        said.append(getattr(session, "_later", None) is not None)  # a tree before it: none
        return lambda: session.run(None, feeds)
    from backplane import deferred_load

    return load, lambda: said[0], lambda: said[1], lambda: deferred_load.wait(600)


def _feeds(model: str, feeds: str) -> dict[str, np.ndarray]:
    """The model's feeds: its corpus ``.s0.npz``, or random values of its static input shapes."""
    if feeds:
        return dict(np.load(feeds))
    import onnx

    values = {}
    for value in onnx.load(model, load_external_data=False).graph.input:
        shape = [d.dim_value or 1 for d in value.type.tensor_type.shape.dim]
        values[value.name] = np.random.default_rng(0).random(shape, dtype=np.float32)
    return values


def _model(name: str, tier: str) -> tuple[str, str]:
    """A name's model path and feeds file ("" for random feeds): "demo", a corpus name, a path."""
    if name == "demo":
        return str(DEMO), ""
    if name.endswith(".onnx"):
        return name, ""
    corpus = CORPUS[tier]
    path = corpus / f"{name}.onnx"
    if not path.exists():
        known = sorted(p.stem for p in corpus.glob("*.onnx"))
        raise SystemExit(f"no model {name!r} in {corpus}; known: demo, {', '.join(known)}")
    return str(path), str(corpus / f"{name}.s0.npz")


def _one(runtime: str, src: str, model: str, feeds: str, args: argparse.Namespace) -> dict:
    """One fresh process's figures (``error`` where it failed)."""
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    if args.bytecode:  # each tree's own cache folder: the same file names, other sources
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.join(args.bytecode, runtime + src.replace(os.sep, "_"))
    command = [sys.executable, __file__, "--worker", runtime, "--model", model, "--feeds", feeds,
               "--threads", str(args.threads), "--calls", str(args.calls)]
    command += ["--quiet-path"] if args.quiet_path else []
    from wild import TORCH

    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(args.burn)]
    burners += [subprocess.Popen([sys.executable, "-c", TORCH.format(threads=args.threads or 2)])
                for _ in range(args.torch)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    finally:
        for burner in burners:  # ours alone: stopped by their handles
            burner.kill()
            burner.wait()
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def _row(model: str, label: str, replies: list[dict]) -> str:
    good = [r for r in replies if "error" not in r]
    if not good:
        return f"| {model} | {label} | failed: {replies[0]['error']} | | | | | | | | | | | | | |"
    loads = [r["load_s"] for r in good]
    busy = sum(r["crowded"] for r in good)
    deferred = sum(r.get("deferred", False) for r in good)
    whole = [r["import_s"] + r["load_s"] for r in good]
    first = [r["import_s"] + r["load_s"] + r["first_ms"] / 1e3 for r in good]
    return (f"| {model} | {label} | {min(loads):.3f} ({statistics.median(loads):.3f}) | "
            f"{min(r['load_cpu_s'] for r in good):.3f} | "
            f"{statistics.median(r['first_ms'] for r in good):.2f} | "
            f"{min(r['first_cpu_ms'] for r in good):.1f} | "
            f"{min(r['steady_ms'] for r in good):.3f} | {statistics.median(r['import_s'] for r in good):.2f} | "
            f"{min(whole):.2f} ({statistics.median(whole):.2f}) | {statistics.median(first):.2f} | "
            f"{statistics.median(r.get('to_first_cpu_s', math.nan) for r in good):.2f} | "
            f"{statistics.median(r.get('settled_s', math.nan) for r in good):.2f} | "
            f"{busy}/{len(good)} | {deferred}/{len(good)} | "
            f"{sum(r.get('torch', False) for r in good)}/{len(good)} | "
            f"{min(r['loadavg'] for r in good):.1f}-{max(r['loadavg'] for r in good):.1f} |")


def _header(args: argparse.Namespace) -> list[str]:
    import onnxruntime
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    revision = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
    return [f"CPU: {cpu}, {len(os.sched_getaffinity(0))} CPUs; torch {torch.__version__}, "
            f"onnxruntime {onnxruntime.__version__}, backplane {revision}; {args.threads} threads, "
            f"best of {args.rounds} rounds, {args.calls} steady calls"
            + ("; backplane on the quiet path (--quiet-path)" if args.quiet_path else "")
            + (f"; {args.burn} CPU-burning processes beside each (--burn)" if args.burn else "")
            + (f"; {args.torch} torch processes at {args.threads or 2} threads beside each (--torch)"
               if args.torch else "")
            + ("" if args.bytecode else "; modules compiled from source where "
               "PYTHONDONTWRITEBYTECODE is set (--no-bytecode)"),
            f"load average at the start {os.getloadavg()[0]:.2f}", "",
            "| model | runtime | load s best (median) | load CPU s | first call ms | first CPU ms | "
            "steady ms | import s | import + load s | to first output s | CPU to first output s | "
            "settled s | busy loads | deferred | torch imported | load avg |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: | ---: | --- |"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS)
    parser.add_argument("--tier", choices=sorted(CORPUS), default="small")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--src", action="append", default=[],
                        help="LABEL=PATH: another backplane source tree (its src/) timed beside this one")
    parser.add_argument("--quiet-path", action="store_true")
    parser.add_argument("--burn", type=int, default=0,
                        help="N processes spinning on the CPU beside each timed process")
    parser.add_argument("--torch", type=int, default=0,
                        help="N torch processes (--threads threads) looping over convolutions beside each")
    parser.add_argument("--no-bytecode", action="store_true",
                        help="compile the modules from source where the environment says so")
    parser.add_argument("--worker", choices=["backplane", "onnxruntime"])
    parser.add_argument("--model")
    parser.add_argument("--feeds", default="")
    args = parser.parse_args()
    if args.worker:
        args.runtime = args.worker
        worker(args)
        return 0
    args.bytecode = "" if args.no_bytecode else tempfile.mkdtemp(prefix="load_time_pyc_")
    trees = [("backplane", "")] + [tuple(s.split("=", 1)) for s in args.src]  # type: ignore[misc]
    lines = _header(args)
    print("\n".join(lines), flush=True)
    for name in args.models.split(","):
        model, feeds = _model(name, args.tier)
        replies: dict[str, list[dict]] = {label: [] for label, _ in trees}
        replies["onnxruntime"] = []
        if args.bytecode:  # an untimed process each first: it writes the modules' bytecode
            for label, src in trees:
                _one("backplane", src, model, feeds, args)
            _one("onnxruntime", "", model, feeds, args)
        for _ in range(args.rounds):
            for label, src in trees:
                replies[label].append(_one("backplane", src, model, feeds, args))
            replies["onnxruntime"].append(_one("onnxruntime", "", model, feeds, args))
        for label, got in replies.items():
            print(_row(name, label, got), flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
