"""The ``backplane`` command: run, inspect, compile, backends, bench (Arm NN's ExecuteNetwork, in spirit).

``--json`` prints one JSON document on stdout and nothing else (messages, warnings and progress go to
stderr). Tables never fold a path or a layer name; when stdout is not a terminal they are as wide as
their widest cells. Progress bars (``backplane.progress``) show on stderr where it is a terminal,
never with ``--quiet``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.logging import RichHandler
from rich.text import Text

from backplane import progress
from backplane.artifact import ArtifactError, SigningKey, is_artifact
from backplane.artifact import compile as compile_artifact
from backplane.backends.torch import background
from backplane.backends.registry.dynamic import PATHS_VARIABLE
from backplane.frontends.onnx import ModelError
from backplane.ir.graph import TensorInfo
from backplane.optimizer.measured import PLACEMENTS
from backplane.optimizer.optimize import OptimizationError
from backplane.optimizer.report import print_table
from backplane.runtime.loaded_network import ExecutionError
from backplane.runtime.runtime import InvalidInputError
from backplane import run_inputs
from backplane.bench_worker import option_value
from backplane.run_inputs import key_value as _key_value
from backplane.run_inputs import random_input  # noqa: F401  # backplane.cli.random_input, as before
from backplane.session import InferenceSession, SessionOptions, default_backends
from backplane import cli_tables
from backplane.cli_documents import (_backend_table, _keep_faster, _layer_table, _run_document,
                                      _summary, compiled_routes)

console = Console()
err_console = Console(stderr=True)
USER_ERRORS = (ModelError, OptimizationError, InvalidInputError, ExecutionError, ValueError, KeyError,
               ArtifactError)
WIDE = 10_000
"""The console's width when stdout is not a terminal: tables as wide as their cells, never folded."""


def main(argv: Sequence[str] | None = None) -> int:
    """The command; the process's logging and debug knob are put back as they were after it (a
    program or a test that calls main keeps its own)."""
    args = _parser().parse_args(argv)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    debug_before = os.environ.get("BACKPLANE_DEBUG")
    if getattr(args, "verbose", 0) >= 2 and not debug_before:
        os.environ["BACKPLANE_DEBUG"] = "2"  # the debug knob: the plan, then each layer as it runs
    try:
        return _main(args)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        if debug_before is None:
            os.environ.pop("BACKPLANE_DEBUG", None)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes each message to whatever ``sys.stderr`` is when it is written."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _main(args: argparse.Namespace) -> int:
    messages = Console(stderr=True)
    if messages.is_terminal:
        handler: logging.Handler = RichHandler(console=messages, show_time=False, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:  # a file or a pipe: one plain line per message, as long as the message (rich pads
        handler = _Stderr()  # every line to the console's width)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=log_level(args), force=True, handlers=[handler])
    if not console.is_terminal:
        console.width = WIDE
    as_json = getattr(args, "json", False)
    try:
        if as_json:
            with _stdout_to_stderr():  # whatever a library prints keeps off the document
                code, document = args.command(args)
            _emit(document)
            return code
        return int(args.command(args) or 0)
    except USER_ERRORS as exc:
        if as_json:
            _emit({"error": str(exc), "type": type(exc).__name__})
        else:
            console.print(Text("error: ", style="bold red") + Text(str(exc)), highlight=False)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="backplane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=version_line())
    sub = parser.add_subparsers(required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run a model, showing where each layer ran and how long it took")
    _model_arguments(run)
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                     help="an input from a .npy file (random data for inputs not given)")
    run.add_argument("--shape", action="append", default=[], metavar="NAME=D0,D1,...",
                     help="the shape of a made-up input (its free dimensions included)")
    run.add_argument("--dim", action="append", default=[], metavar="SYMBOL=SIZE",
                     help="the size of a free dimension, by its name in the model, in every "
                          "made-up input (default 1)")
    run.add_argument("--repeat", type=at_least(0), default=10, help="timed runs after one warm-up run")
    run.add_argument("--seed", type=at_least(0), default=0, help="seed of the random inputs")
    run.add_argument("--trace", metavar="FILE.json",
                     help="write a Chrome trace of the runs (chrome://tracing, ui.perfetto.dev)")
    run.set_defaults(command=cmd_run)
    compile_ = sub.add_parser("compile", help="compile a model ahead of time into one artifact, "
                                              "loaded after without the model (docs/artifact.md)")
    _model_arguments(compile_)
    compile_.add_argument("-o", "--output", metavar="FILE.bpl",
                          help="the artifact (default: the model's path with .bpl)")
    compile_.add_argument("--sign", metavar="KEYFILE",
                          help="sign the artifact with the key in this file (its bytes, at least "
                               "16: head -c 32 /dev/urandom > KEYFILE); a session with "
                               "SessionOptions.artifact_key loads only artifacts signed with it")
    compile_.set_defaults(command=cmd_compile)
    inspect = sub.add_parser("inspect", help="print the placement report: where each layer goes, why")
    _model_arguments(inspect)
    inspect.add_argument("--graph", action="store_true", help="also print the optimized graph")
    inspect.add_argument("--html", metavar="FILE.html",
                         help="write a picture of the placement (drawn with Graphviz's dot where "
                              "installed): layers coloured by backend, partitions outlined, copies "
                              "and imports with their bytes, refusals with their reasons")
    inspect.add_argument("--dot", metavar="FILE.dot", help="write the picture as Graphviz DOT text")
    inspect.set_defaults(command=cmd_inspect)
    backends = sub.add_parser("backends", help="list the backends: built in, entry points, files, "
                                               "and the candidates skipped with their reasons")
    backends.add_argument("--dynamic-backends-path", metavar="DIR",
                          help=f"one directory of dynamic backends, instead of ${PATHS_VARIABLE}")
    _output_arguments(backends)
    backends.set_defaults(command=cmd_backends)
    bench = sub.add_parser("bench", help="time a model on backplane, ONNX Runtime and eager PyTorch, "
                                         "each in processes of its own (backplane.bench_engine)")
    bench.add_argument("model", help="an ONNX model file")
    bench.add_argument("--backends", action="append", default=[],
                       help="a backend list, most preferred first, options after @ "
                            "(CpuAcc,CpuRef@CpuAcc.threads=1); repeat for more columns")
    for option, default in (("--device", "cpu"), ("--threads", None), ("--rounds", 5), ("--runs", 20),
                            ("--warmup", 3)):
        bench.add_argument(option, default=default, help=f"as bench_torch's {option}")
    bench.add_argument("--no-ort", action="store_true", help="leave ONNX Runtime out")
    bench.add_argument("--no-torch", action="store_true", help="leave the PyTorch columns out")
    bench.add_argument("--no-peak", action="store_true",
                       help="with --json: do not measure the device's matmul peak")
    _output_arguments(bench)
    bench.set_defaults(command=cmd_bench)
    return parser


def _output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document on stdout and nothing else")
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument("-q", "--quiet", action="store_true",
                          help="log errors only (no warnings: the report keeps them)")
    loudness.add_argument("-v", "--verbose", action="count", default=0,
                          help="log more: -v info (each load's steps and times), -vv debug (each "
                               "layer's fallback and the placement plan)")


def severity(args: argparse.Namespace) -> int:
    """The sessions' log_severity_level for the flags (it drops backplane's messages below it)."""
    return {logging.DEBUG: 0, logging.INFO: 1}.get(log_level(args), 2)


def log_level(args: argparse.Namespace) -> int:
    """The logging level: WARNING, ERROR with --quiet, INFO with -v, DEBUG with -vv."""
    if getattr(args, "quiet", False):
        return logging.ERROR
    return {0: logging.WARNING, 1: logging.INFO}.get(getattr(args, "verbose", 0), logging.DEBUG)


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an ONNX model file, or an artifact (backplane compile)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated backend ids, most preferred first, backend options "
                             "after @ (CpuAcc,CpuRef@CpuAcc.compile=layers; default: the fastest "
                             "available, GpuAcc,CpuAcc,CpuRef where torch and CUDA are there, or "
                             "an artifact's own)")
    parser.add_argument("--pin", action="append", default=[], metavar="LAYER_OR_OP=BACKEND",
                        help="run a layer (by name) or every layer of an op type on a backend first")
    parser.add_argument("--threads", type=at_least(0), default=0,
                        help="intra-op threads (SessionOptions.intra_op_num_threads)")
    parser.add_argument("--strict", action="store_true",
                        help="fail instead of falling back (SessionOptions.strict)")
    parser.add_argument("--placement", choices=tuple(PLACEMENTS), default="preference",
                        help="preference: each layer on the first backend that supports it; "
                             "measured: each partition on the backend timed fastest at load, "
                             "copies included (SessionOptions.placement)")
    _output_arguments(parser)


# -- shared pieces ------------------------------------------------------------------------------------------
def version_line() -> str:
    """``backplane 0.1.0 (Python 3.11.9, numpy 2.1.0, onnx 1.17.0, torch 2.13.0+cpu)``: what a bug
    report needs; torch only where installed (it is not imported to find its version)."""
    import platform
    from importlib import metadata

    from backplane import __version__

    parts = [f"Python {platform.python_version()}"]
    for name in ("numpy", "onnx", "torch", "onnxruntime", "openvino"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            parts.append(f"{name} {metadata.version(name)}")
    return f"backplane {__version__} ({', '.join(parts)})"


def at_least(low: int) -> Any:
    """An argparse type: an int not below ``low`` (``--repeat -1`` is an error, not zero runs)."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got '{text}'") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {value}")
        return value
    return check


def backend_specs(text: str) -> list[str | tuple[str, dict[str, Any]]]:
    """``A,B@A.option=value@...`` as InferenceSession's backends: ids, and (id, options) pairs."""
    ids_text, *settings = text.split("@")
    ids = [b.strip() for b in ids_text.split(",") if b.strip()]
    options: dict[str, dict[str, Any]] = {}
    for setting in settings:
        key, value = _key_value(setting, "a backend option after @")
        backend, dot, name = key.partition(".")
        if not dot or backend not in ids:
            raise ValueError(f"backend option '{key}': name it <backend>.<option> with a backend of "
                             f"the list ({', '.join(ids)})")
        options.setdefault(backend, {})[name] = option_value(value)
    return [(b, options[b]) if b in options else b for b in ids]


def chosen_backends(args: argparse.Namespace) -> list[str | tuple[str, dict[str, Any]]]:
    """``--backends`` as InferenceSession takes them, or the default: the fastest available
    (``session.default_backends``), named in the output as the default."""
    if args.backends is not None:
        return backend_specs(args.backends)
    args.default_backends = True
    return list(default_backends())


def _backends_line(args: argparse.Namespace, session: InferenceSession) -> Text:
    """"backends: CpuAcc, CpuRef (the fastest available: --backends to choose)", or as given."""
    how = " (the fastest available: --backends to choose)" \
        if getattr(args, "default_backends", False) else ""
    return Text(f"backends: {', '.join(session.get_providers())}{how}")


def _session(args: argparse.Namespace, profiling: bool = False) -> InferenceSession:
    options = SessionOptions(intra_op_num_threads=args.threads, strict=args.strict,
                             placement=args.placement, enable_profiling=profiling,
                             log_severity_level=severity(args))
    pins = dict(_key_value(p, "--pin") for p in args.pin)
    if args.backends is None and is_artifact(args.model):
        with _working(args, f"loading the artifact {Path(args.model).name}"):
            return InferenceSession(args.model, sess_options=options, pins=pins or None)
    backends = chosen_backends(args)
    with _working(args, f"loading {Path(args.model).name} on {', '.join(_ids(backends))}"):
        return InferenceSession(args.model, backends=backends, sess_options=options, pins=pins)


def cmd_compile(args: argparse.Namespace) -> Any:
    """Compile the model into one artifact; print where it went and its size."""
    options = SessionOptions(intra_op_num_threads=args.threads, strict=args.strict,
                             placement=args.placement, log_severity_level=severity(args))
    pins = dict(_key_value(p, "--pin") for p in args.pin)
    backends = chosen_backends(args)
    output = args.output or str(Path(args.model).with_suffix(".bpl"))
    key = SigningKey.from_file(args.sign) if args.sign else None
    with _working(args, f"compiling {Path(args.model).name} for {', '.join(_ids(backends))}"):
        size = compile_artifact(args.model, backends, output, sess_options=options, pins=pins,
                                sign_key=key)
    model_size = Path(args.model).stat().st_size
    document = {"artifact": output, "bytes": size, "model": args.model, "model_bytes": model_size,
                "backends": _ids(backends), "signed_with": key.id if key else None}
    if args.json:
        return 0, document
    signed = f", signed with key {key.id}" if key else ""
    console.print(Text(f"{output}: {size:,} bytes (the model: {model_size:,} bytes), for "
                       f"{', '.join(_ids(backends))}{signed}"))
    return 0


def _ids(backends: Sequence[str | tuple[str, Any]]) -> list[str]:
    return [b if isinstance(b, str) else b[0] for b in backends]


@contextlib.contextmanager
def _working(args: argparse.Namespace, what: str,
             total: int | None = None) -> Iterator[progress.Step]:
    """A bar on stderr while ``what`` goes on (``total`` steps; None: a spinner), and under it the
    bars of the work inside (measured placement, CpuAcc's routes, compiled partitions): on a
    terminal only, never with --quiet; gone when done."""
    with progress.shown(err_console, quiet=getattr(args, "quiet", False)), \
            progress.task(what, total) as step:
        yield step


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """stdout, Python's and file descriptor 1 (a library's C code printing), sent to stderr."""
    sys.stdout.flush()
    try:
        saved: int | None = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 to move
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _emit(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


# -- inspect ------------------------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> Any:
    from backplane import placement_picture

    session = _session(args)
    document: dict[str, Any] = {"model": args.model, "backends": session.get_providers(),
                                "default_backends": getattr(args, "default_backends", False),
                                "placement": session.report.to_dict()}
    if args.graph:
        document["graph"] = [{"name": layer.name, "op_type": layer.op_type, "domain": layer.domain,
                              "backend": layer.backend, "inputs": layer.inputs,
                              "outputs": layer.outputs}
                             for layer in session.optimized.graph.layers]
    title = Path(args.model).stem
    if args.dot:
        Path(args.dot).write_text(placement_picture.dot_source(session.optimized, session.graph,
                                                                title))
        document["dot"] = {"path": args.dot, "bytes": os.path.getsize(args.dot)}
    if args.html:
        with _working(args, "drawing the placement with Graphviz"):
            drawn = placement_picture.write_html(args.html, session.optimized, session.graph, title)
        document["html"] = {"path": args.html, "bytes": os.path.getsize(args.html), "drawn": drawn}
        if not drawn:
            logging.getLogger("backplane.cli").warning(
                "Graphviz's dot was not found: %s holds the tables and the DOT text but no drawing "
                "(install Graphviz, e.g. apt-get install graphviz, to draw it)", args.html)
    if args.json:
        return 0, document
    console.print(_backends_line(args, session), highlight=False)
    session.report.render(console)
    if args.graph:
        console.print(Text(repr(session.optimized.graph)), highlight=False)
    for kind in ("dot", "html"):
        if kind in document:
            written = document[kind]
            how = "" if kind == "dot" else (", drawn with Graphviz" if written["drawn"]
                                            else ", not drawn: Graphviz's dot was not found")
            console.print(Text(f"wrote {written['path']} ({written['bytes']:,} bytes{how})"),
                          highlight=False)
    return 0


# -- run ------------------------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> Any:
    session = _session(args, profiling=bool(args.trace))
    feeds, made = run_inputs.feeds(session, dict(_key_value(i, "--input") for i in args.input),
                                   args.seed, run_inputs.shapes(args.shape),
                                   run_inputs.dims(args.dim))
    if not args.json:  # before the run: what it runs on, also when the run fails on it
        for line in made:
            console.print(Text(line), highlight=False, soft_wrap=True)
    outputs, timings = session.run_profiled(None, feeds)  # warm-up, and the per-layer profile
    if "CpuAcc" in session.get_providers():  # its routes chosen (another session's Trials in
        background.settle(lambda: session.run(None, feeds))  # this process are not its own)
    totals: list[float] = []
    with _working(args, "timed runs", total=args.repeat) as step:
        for _ in range(args.repeat):
            _, run_timings = session.run_profiled(None, feeds)
            totals.append(sum(t.seconds for t in run_timings))
            timings = _keep_faster(timings, run_timings)
            step()
    trace = None
    if args.trace:
        written = session.end_profiling()
        os.replace(written, args.trace)
        trace = args.trace
    if args.json:
        return 0, _run_document(args, session, timings, totals, outputs, trace) | {"inputs": made}
    console.print(_backends_line(args, session), highlight=False)
    print_table(console, _layer_table(timings))
    print_table(console, _backend_table(timings))
    if totals:
        fastest = sum(t.seconds for t in timings) * 1e3
        console.print(f"median of {len(totals)} runs: {statistics.median(totals) * 1e3:.2f} ms "
                      f"(min {min(totals) * 1e3:.2f}, max {max(totals) * 1e3:.2f}); the tables "
                      f"give each layer's fastest run, {fastest:.2f} ms together")
    for line in compiled_routes(session):
        console.print(Text(line), highlight=False, soft_wrap=True)
    for arg, value in zip(session.get_outputs(), outputs):
        console.print(Text(f"output {arg.name}: {_summary(value)}"), highlight=False)
    if trace:
        console.print(Text(f"wrote {trace} (a Chrome trace: chrome://tracing, ui.perfetto.dev)"),
                      highlight=False)
    return 0


# -- bench ----------------------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> Any:
    from backplane.bench_engine import main as bench_main

    argv = [args.model, "--device", args.device, "--rounds", str(args.rounds), "--runs", str(args.runs),
            "--warmup", str(args.warmup)]
    argv += [a for b in args.backends for a in ("--backends", b)]
    argv += ["--threads", str(args.threads)] if args.threads else []
    argv += (["--no-ort"] if args.no_ort else []) + (["--no-torch"] if args.no_torch else [])
    if args.json:
        return cli_tables.bench_document(args, argv, not args.no_peak, _working)
    with progress.shown(err_console, quiet=args.quiet):  # bench's own bar shows on it, or not
        return bench_main(argv)


# -- backends -------------------------------------------------------------------------------------------------
def cmd_backends(args: argparse.Namespace) -> Any:
    return cli_tables.backends(args, console)


if __name__ == "__main__":
    sys.exit(main())
