"""The ``backplane`` command: run, inspect, backends (Arm NN's ExecuteNetwork, in spirit)."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import Progress
from rich.table import Table
from rich.text import Text

from backplane.backends.registry import registry
from backplane.backends.registry.dynamic import PATHS_VARIABLE, backend_paths
from backplane.frontends.onnx import ModelError
from backplane.ir.graph import TensorInfo
from backplane.optimizer.optimize import OptimizationError
from backplane.runtime.loaded_network import ExecutionError, LayerTiming
from backplane.runtime.runtime import InvalidInputError
from backplane.session import InferenceSession

console = Console()
USER_ERRORS = (ModelError, OptimizationError, InvalidInputError, ExecutionError, ValueError, KeyError)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        handlers=[RichHandler(console=Console(stderr=True), show_time=False,
                                              show_path=False)])
    try:
        return int(args.command(args) or 0)
    except USER_ERRORS as exc:
        console.print(Text("error: ", style="bold red") + Text(str(exc)), highlight=False)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="backplane", description=__doc__)
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a model, showing where each layer ran and how long it took")
    _model_arguments(run)
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                     help="an input from a .npy file (random data for inputs not given)")
    run.add_argument("--repeat", type=int, default=10, help="timed runs after one warm-up run")
    run.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    run.set_defaults(command=cmd_run)
    inspect = sub.add_parser("inspect", help="print the placement report: where each layer goes, why")
    _model_arguments(inspect)
    inspect.add_argument("--graph", action="store_true", help="also print the optimized graph")
    inspect.set_defaults(command=cmd_inspect)
    backends = sub.add_parser("backends", help="list the backends: built in, entry points, files, "
                                               "and the candidates skipped with their reasons")
    backends.add_argument("--dynamic-backends-path", metavar="DIR",
                          help=f"one directory of dynamic backends, instead of ${PATHS_VARIABLE}")
    backends.set_defaults(command=cmd_backends)
    bench = sub.add_parser("bench", help="time a model on backplane, ONNX Runtime and eager PyTorch, "
                                         "each in processes of its own (bench/bench_torch.py)")
    bench.add_argument("model", help="an ONNX model file")
    bench.add_argument("--backends", action="append", default=[],
                       help="a backend list, most preferred first, options after @ "
                            "(CpuAcc,CpuRef@CpuAcc.threads=1); repeat for more columns")
    for option, default in (("--device", "cpu"), ("--threads", None), ("--rounds", 5), ("--runs", 20)):
        bench.add_argument(option, default=default, help=f"as bench_torch's {option}")
    bench.set_defaults(command=cmd_bench)
    return parser


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an ONNX model file")
    parser.add_argument("--backends", default="CpuRef",
                        help="comma-separated backend ids, most preferred first (default: CpuRef)")
    parser.add_argument("--pin", action="append", default=[], metavar="LAYER_OR_OP=BACKEND",
                        help="run a layer (by name) or every layer of an op type on a backend first")


def _session(args: argparse.Namespace) -> InferenceSession:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    pins = dict(_key_value(p, "--pin") for p in args.pin)
    return InferenceSession(args.model, backends=backends, pins=pins)


def _key_value(text: str, option: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise ValueError(f"{option} expects NAME=VALUE, got '{text}'")
    return key, value


def cmd_inspect(args: argparse.Namespace) -> int:
    session = _session(args)
    session.report.render(console)
    if args.graph:
        console.print(Text(repr(session.optimized.graph)), highlight=False)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    session = _session(args)
    feeds = _feeds(session, dict(_key_value(i, "--input") for i in args.input), args.seed)
    outputs, timings = session.run_profiled(None, feeds)  # warm-up, and the per-layer profile
    totals: list[float] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("timed runs", total=args.repeat)
        for _ in range(args.repeat):
            _, run_timings = session.run_profiled(None, feeds)
            totals.append(sum(t.seconds for t in run_timings))
            timings = _keep_faster(timings, run_timings)
            progress.advance(task)
    console.print(_layer_table(timings))
    console.print(_backend_table(timings))
    if totals:
        console.print(f"median of {len(totals)} runs: {statistics.median(totals) * 1e3:.2f} ms "
                      f"(min {min(totals) * 1e3:.2f}, max {max(totals) * 1e3:.2f})")
    for arg, value in zip(session.get_outputs(), outputs):
        console.print(Text(f"output {arg.name}: {_summary(value)}"), highlight=False)
    return 0


def _keep_faster(best: list[LayerTiming], new: list[LayerTiming]) -> list[LayerTiming]:
    """Per layer, the faster of two runs (the steadiest view of where time goes)."""
    return [a if a.seconds <= b.seconds else b for a, b in zip(best, new)]


def _layer_table(timings: list[LayerTiming]) -> Table:
    table = Table(title="Where each layer ran (fastest of the runs)")
    for column in ("#", "layer", "op", "backend", "ms"):
        table.add_column(column, justify="right" if column in ("#", "ms") else "left")
    for index, t in enumerate(timings):
        cells = (str(index), t.layer, t.op_type, t.backend, f"{t.seconds * 1e3:.3f}")
        table.add_row(*map(Text, cells))
    return table


def _backend_table(timings: list[LayerTiming]) -> Table:
    table = Table(title="Per backend")
    for column in ("backend", "layers", "ms", "share"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    total = sum(t.seconds for t in timings) or 1.0
    for backend in dict.fromkeys(t.backend for t in timings):
        mine = [t.seconds for t in timings if t.backend == backend]
        table.add_row(backend, str(len(mine)), f"{sum(mine) * 1e3:.2f}", f"{sum(mine) / total:.0%}")
    return table


def _summary(value: Any) -> str:
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.size:
        flat = value.reshape(-1)
        top = int(np.argmax(flat)) if value.ndim <= 2 else None
        head = np.array2string(flat[:5], precision=4, separator=", ")
        extra = f", argmax {top}" if top is not None else ""
        return f"{value.dtype}{list(value.shape)} first {head}{extra}"
    return repr(value)


def _feeds(session: InferenceSession, files: dict[str, str], seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, Any] = {}
    known = [arg.name for arg in session.get_inputs()]
    for name in files:
        if name not in known:
            raise InvalidInputError(f"--input {name}: not an input of the model; its inputs are: "
                                    f"{', '.join(known)}")
    for name in known:
        info = session.graph.info(name)
        feeds[name] = np.load(files[name]) if name in files else random_input(info, rng)
    return feeds


def random_input(info: TensorInfo, rng: np.random.Generator) -> np.ndarray:
    """Data for an input: normal floats, zeros for integers (valid ids and masks alike), False."""
    shape = tuple(d if isinstance(d, int) else 1 for d in (info.shape or ()))
    dtype = info.dtype if info.dtype is not None else np.dtype(np.float32)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def cmd_bench(args: argparse.Namespace) -> int:
    from backplane.backends.torch.bench import main as bench_main

    argv = [args.model, "--device", args.device, "--rounds", str(args.rounds), "--runs", str(args.runs)]
    argv += [a for b in args.backends for a in ("--backends", b)]
    return bench_main(argv + (["--threads", str(args.threads)] if args.threads else []))


def cmd_backends(args: argparse.Namespace) -> int:
    registry.load_entry_points()
    registry.load_dynamic_backends(backend_paths(args.dynamic_backends_path))
    table = Table(title="Registered backends")
    for column in ("id", "version", "from", "available", "capabilities", "ops"):
        table.add_column(column, overflow="fold")
    for backend_id in registry.ids():
        try:
            backend = registry.create(backend_id)
        except Exception as exc:  # a broken factory is shown, not fatal
            table.add_row(*map(Text, (backend_id, "?", registry.origin(backend_id), f"no: {exc}",
                                      "", "")))
            continue
        status = backend.availability()
        caps = ", ".join(f"{k}={v}" for k, v in backend.capabilities().items())
        cells = (backend_id, backend.version, registry.origin(backend_id),  # as text: no markup
                 "yes" if status.ok else f"no: {status.reason}", caps, str(len(backend.KERNELS)))
        table.add_row(*map(Text, cells))
    console.print(table)
    if registry.skipped:
        skipped = Table(title="Skipped candidates")
        skipped.add_column("candidate", overflow="fold")
        skipped.add_column("reason", overflow="fold")
        for entry in registry.skipped:
            skipped.add_row(Text(entry.candidate), Text(entry.reason))
        console.print(skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
