"""Where a small corpus model's run goes on CpuAcc: the floor and the fixed costs (issue 27, item 4).

Usage:
    python bench/small_floor.py                        # the six models below, 2 threads
    python bench/small_floor.py --models resnet_basic_ts16,gru_tm3_ts13 --threads 1
    python bench/small_floor.py --all --threads 1 --clock cpu   # every small-tier model

For each model of tests/data/corpus (batch 1, its ``.s0.npz`` inputs), in one process, alternating
blocks of calls over ``--rounds`` rounds (best block median of each):

- ``torch eager``: the model's own ``nn.Module`` (scripts/export_corpus.py, the same seeded
  weights the export wrote) called under ``torch.inference_mode``: the floor a layer-by-layer
  runtime in Python can reach with torch's kernels;
- ``session.run``: backplane's default session (CpuAcc, CpuRef; empty route cache, measured at
  load, ``CpuAcc.background`` off so that what is timed is what a quiet load builds);
- then the same call one level down at a time: the loaded network's ``execute`` (no input checks,
  no output ownership; for one partition, ``steps.one_call``), the ``Specialized`` layer's
  workload on tensors made once (no handovers of the inputs and outputs around it), the
  signature's build (no signature lookup), and the compiled partitions inside it (no nested
  network): each difference is what that level costs per call;
- ``ORT``: ONNX Runtime's ``session.run`` (intra-op threads as given), timed last in the process
  (its spinning threads slow what runs after it).

The route each inner partition took (and why) is printed under its model.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "corpus"
MODELS = ("resnet_basic_ts16", "mobilenet_dw_ts13", "audio_conv1d_dyn19", "gru_tm3_ts13",
          "encoder_padmask_dyn17", "fakequant_qdq_ts13")


CLOCK = time.perf_counter  # --clock cpu: time.thread_time (a busy machine's honest figure at 1 thread)


def block_median(call: Callable[[], Any], calls: int) -> float:
    times = []
    clock = CLOCK
    for _ in range(calls):
        start = clock()
        call()
        times.append(clock() - start)
    return statistics.median(times)


def alternate(calls: dict[str, Callable[[], Any]], rounds: int, per_block: int) -> dict[str, float]:
    """Each call's best block median (us), blocks alternating A B C A B C."""
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            block_median(call, per_block // 5)  # warm its caches again after the others ran
            best[name] = min(best[name], block_median(call, per_block))
    return {name: value * 1e6 for name, value in best.items()}


def torch_module(model: str) -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    import export_corpus

    return export_corpus.specs()[model].build()


def levels(session: Any, feeds: dict[str, np.ndarray]) -> tuple[dict[str, Callable[[], Any]],
                                                                 list[str]]:
    """The calls one level down at a time (see above), and a line per inner partition's route."""
    import torch

    from backplane.runtime.loaded_network import LoadedNetwork

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gc's walk touches torch's deprecated names
        networks = [o for o in gc.get_objects() if type(o) is LoadedNetwork]  # (a dead
        # weak proxy's isinstance raises ReferenceError)
    outer = session.runtime.network(session.network_id)  # not another model's, still alive
    values = [feeds[n] for n in outer.network.input_names]
    calls: dict[str, Callable[[], Any]] = {"outer.execute": lambda: outer.execute(values)}
    routes = []
    for step, layer in zip(outer.steps, outer.layers):
        if layer.op_type != "Specialized":
            continue
        work = _unwrapped(step.workload)
        tensors = [torch.from_numpy(feeds[n.split("@")[0]]) for n in layer.inputs]
        built = next(iter(work.built.values()))
        calls["Specialized"] = lambda w=work, t=tensors: w(*t)
        calls["signature build"] = lambda b=built, t=tensors: b(*t)
        inner = next(n for n in networks if n.network.graph is built.graph)
        compiled = [(s, lay) for s, lay in zip(inner.steps, inner.layers)]
        if len(compiled) == 1 and list(inner.layers[0].inputs) == list(built.graph.inputs):
            calls["partition"] = lambda s=compiled[0][0], t=tensors: s.workload(*t)
        for step_in, lay in compiled:
            base = _unwrapped(step_in.workload)
            routes.append(f"  {lay.name}: {getattr(base, 'route', '-')}: {getattr(base, 'why', '')}")
    return calls, routes


def _unwrapped(workload: Any) -> Any:
    while hasattr(workload, "work"):
        workload = workload.work
    return workload


def ort_call(path: Path, feeds: dict[str, np.ndarray], threads: int) -> Callable[[], Any]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)


def one_model(model: str, threads: int, rounds: int, per_block: int) -> None:
    import torch

    from backplane import InferenceSession, SessionOptions

    path = CORPUS / f"{model}.onnx"
    feeds = dict(np.load(CORPUS / f"{model}.s0.npz"))
    session = InferenceSession(str(path), SessionOptions(intra_op_num_threads=threads),
                               providers=[("CpuAcc", {"background": False}), "CpuRef"])
    session.run(None, feeds)
    module = torch_module(model)
    inputs = [torch.from_numpy(feeds[i.name]) for i in session.get_inputs()]

    def eager() -> Any:
        with torch.inference_mode():
            return module(*inputs)

    calls = {"torch eager": eager, "session.run": lambda: session.run(None, feeds)}
    inner, routes = levels(session, feeds)
    calls.update(inner)
    times = alternate(calls, rounds, per_block)
    times["ORT"] = alternate({"ORT": ort_call(path, feeds, threads)}, rounds, per_block)["ORT"]
    line = "  ".join(f"{name} {value:.1f}" for name, value in times.items())
    print(f"{model}: {line} us (load average {os.getloadavg()[0]:.1f})")
    for route in routes:
        print(route)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400, help="calls per timed block")
    parser.add_argument("--all", action="store_true", help="every model of tests/data/corpus")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the calling thread's CPU time (time.thread_time)")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.all:
        args.models = ",".join(sorted(p.stem for p in CORPUS.glob("*.onnx")
                                      if (CORPUS / f"{p.stem}.s0.npz").exists()))
    os.environ.setdefault("BACKPLANE_CACHE_DIR", tempfile.mkdtemp(prefix="small_floor_"))
    from backplane.backends.torch import threads

    threads.CROWDED_CHECK = False  # measure routes at load whatever the neighbours do
    print(f"threads {args.threads}, {args.rounds} rounds of {args.calls} calls, best block median"
          f" ({args.clock} clock)")
    for model in args.models.split(","):
        try:
            one_model(model, args.threads, args.rounds, args.calls)
        except Exception as exc:  # noqa: BLE001  # one model's failure is a line, not the end
            print(f"{model}: failed: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
