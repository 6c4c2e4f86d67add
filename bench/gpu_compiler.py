"""GpuAcc against TorchInductor on the GPU: latency at batch 1, throughput over batch, per precision.

Usage (on the GPU machine):
    python bench/gpu_compiler.py                              # the five anchors, batch 1, tf32 and fp16
    python bench/gpu_compiler.py --models resnet50 bert_base_s128 --batches 1 8 32 64
    python bench/gpu_compiler.py --runtimes gpuacc inductor --precisions fp16 --models resnet50

Runtimes, each in a process of its own per model, batch and precision (one after the other, never two
on the GPU at once):
- ``gpuacc``: ``GpuAcc,CpuRef`` as it loads by default (CUDA graphs over torch's kernels);
- ``gpuacc-inductor``: the same with ``GpuAcc.compile=inductor`` (each captured subgraph compiled by
  TorchInductor first);
- ``inductor``: ``torch.compile(module, mode="reduce-overhead")`` of the very module the ONNX file was
  exported from (``scripts/export_models.py``'s builders, seed 0: the same weights).
Precisions: ``tf32`` (float32 with TF32 matrix products and convolutions) and ``fp16`` (GpuAcc's
``GpuAcc.precision=fp16``; the module in half precision). Every call takes NumPy inputs and returns
NumPy outputs: the uploads and downloads are timed on every runtime (``--io device``: inputs uploaded
once and outputs left on the GPU, GpuAcc through its ``io_binding``, both runtimes synchronized at
the end of each call).

Printed per model and batch: the median ms of a call, samples per second, the load time (GpuAcc: the
session's construction and first run, captures and compiles included; inductor: compile and the
three calls its CUDA-graph trees need), the plan's partitions and crossings (GpuAcc), and each
output's max |diff| against a reference relative to the reference's max |value|: CpuRef's outputs at
batch 1 (``--reference cpuref``, the default), else GpuAcc's strict float32 (itself held to CpuRef by
the GPU tests). The GPU, the CPU and the library versions are printed first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("resnet50", "mobilenet_v3_large", "efficientnet_b0", "bert_base_s128", "gpt2_6l_512_s128")
RUNTIMES = ("gpuacc", "gpuacc-inductor", "inductor")
PRECISIONS = ("tf32", "fp16")
GPU_OPTIONS = {"tf32": {"GpuAcc.tf32": True},
               "fp16": {"GpuAcc.tf32": True, "GpuAcc.precision": "fp16"},
               "fp32": {}}


# -- the worker side ------------------------------------------------------------------------------
def _builder(name: str, batch: int) -> Any:
    sys.path.insert(0, str(ROOT / "scripts"))
    import export_models

    return export_models.anchors(batch)[name]


def load_gpuacc(args: argparse.Namespace, feeds: dict[str, np.ndarray], compile_: bool) -> Any:
    from backplane.runtime.runtime import Runtime, RuntimeOptions
    from backplane.session import InferenceSession

    options: dict[str, Any] = dict(GPU_OPTIONS[args.precision])
    options.update(json.loads(args.options))
    if compile_:
        options["GpuAcc.compile"] = "inductor"
    backends = ["CpuRef"] if args.worker == "cpuref" else ["GpuAcc", "CpuRef"]
    session = InferenceSession(args.model, backends=backends,
                               runtime=Runtime(RuntimeOptions(backend_options=options)))
    report = session.report
    plan = {"partitions": len(report.partitions), "crossings": sum(report.crossings().values()),
            "on": sorted(set(report.partitions))}
    if args.io == "host" or args.worker == "cpuref":
        return (lambda: session.run(None, feeds)), plan
    import torch

    binding = session.io_binding()  # inputs uploaded once, outputs left on the GPU
    for name, value in feeds.items():
        binding.bind_input(name, torch.from_numpy(value).cuda())
    for output in session.get_outputs():
        binding.bind_output(output.name, "cuda")

    def run() -> list[Any]:
        session.run_with_iobinding(binding)  # the outputs are written when it returns
        return binding.get_outputs()

    return run, plan


def load_inductor(args: argparse.Namespace, feeds: dict[str, np.ndarray]) -> Any:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    module, _, in_names, _ = _builder(args.name, args.batch)()
    half = args.precision == "fp16"
    module = module.cuda().eval()
    if half:
        module = module.half()
    compiled = torch.compile(module, mode="reduce-overhead", dynamic=False)

    uploaded = [torch.from_numpy(feeds[name]).cuda() for name in in_names]

    def run() -> list[Any]:
        with torch.no_grad():
            values = []
            for name, ready in zip(in_names, uploaded):
                value = torch.from_numpy(feeds[name]).cuda(non_blocking=True) \
                    if args.io == "host" else ready
                values.append(value.half() if half and value.is_floating_point() else value)
            outputs = compiled(*values)
            flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
            if args.io == "device":
                torch.cuda.current_stream().synchronize()  # as GpuAcc's run: done when it returns
                return flat
            return [o.float().cpu().numpy() if o.is_floating_point() else o.cpu().numpy()
                    for o in flat]

    return run, {}


def on_host(value: Any) -> np.ndarray:
    """An output as a NumPy array (a device tensor copied, fp16 widened to float32)."""
    if hasattr(value, "cpu"):
        value = value.detach().cpu()
        return (value.float() if value.is_floating_point() else value).numpy()
    return np.asarray(value)


def worker(args: argparse.Namespace) -> None:
    """One process: load, warm up, time, save the outputs, report one JSON line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    feeds = dict(np.load(args.feeds))
    try:
        start = time.perf_counter()
        if args.worker == "inductor":
            run, plan = load_inductor(args, feeds)
            for _ in range(3):  # compile, then the CUDA-graph trees' warm-up and recording
                outputs = run()
        else:
            run, plan = load_gpuacc(args, feeds, args.worker == "gpuacc-inductor")
            outputs = run()
        load_s = time.perf_counter() - start
        runs = 1 if args.worker == "cpuref" else args.runs
        for _ in range(0 if args.worker == "cpuref" else args.warmup):
            run()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            outputs = run()
            times.append(time.perf_counter() - start)
        np.savez(args.save, *[on_host(o) for o in outputs])
        replies.write(json.dumps({"load_s": load_s, "times": times, **plan}) + "\n")
    except Exception as exc:  # noqa: BLE001 - a runtime that cannot run a model is a result
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:600]}) + "\n")


# -- the parent side ------------------------------------------------------------------------------
def export(name: str, batch: int, out: Path) -> Path:
    """The anchor ``name`` at ``batch`` as ONNX (opset 17, TorchScript exporter, seed 0)."""
    import torch

    path = out / f"{name}_b{batch}.onnx"
    if path.exists():
        return path
    torch.manual_seed(0)
    module, inputs, in_names, out_names = _builder(name, batch)()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer warnings
        torch.onnx.export(module, inputs, str(path), opset_version=17, dynamo=False,
                          input_names=in_names, output_names=out_names, do_constant_folding=True)
    return path


def spawn(args: argparse.Namespace, runtime: str, precision: str, model: Path, name: str,
          batch: int, feeds: Path, save: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker", runtime, "--model", str(model),
               "--name", name, "--batch", str(batch), "--feeds", str(feeds), "--save", str(save),
               "--precision", precision, "--runs", str(args.runs), "--warmup", str(args.warmup),
               "--options", json.dumps(options_of(args.option)), "--io", args.io]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no report within {args.timeout} s"}
    lines = done.stdout.strip().splitlines()
    if not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return {"error": f"worker exited {done.returncode} without a report: {tail}"[:600]}
    return json.loads(lines[-1])


def options_of(pairs: list[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs as backend options: each value JSON where it parses, else text."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.startswith("GpuAcc."):
            raise SystemExit(f"--option {pair!r}: expected GpuAcc.NAME=VALUE")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def diff(outputs: list[np.ndarray], reference: list[np.ndarray] | None, precision: str) -> str:
    """The worst output's max |diff| relative to the reference's max |value|; "underflow" where
    that max is below the precision's smallest number (torchvision's mobilenet_v3_large and
    efficientnet_b0 with random weights give logits of about 1e-9 and 1e-14: zero in fp16, in any
    runtime), since the figure would then say nothing about the runtime."""
    if reference is None:
        return "-"
    worst = 0.0
    for got, want in zip(outputs, reference):
        if np.issubdtype(want.dtype, np.floating):
            scale = float(np.abs(want).max()) or 1.0
            if precision == "fp16" and scale < np.finfo(np.float16).smallest_subnormal:
                return "underflow"
            worst = max(worst, float(np.abs(got.astype(np.float64) - want).max()) / scale)
        elif not np.array_equal(got, want):
            return "differs"
    return f"{worst:.1e}"


def machine() -> str:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    import onnx
    import triton  # noqa: F401 - inductor's kernels

    return (f"GPU: {gpu}; CPU: {cpu}; Python {platform.python_version()}, torch {torch.__version__} "
            f"(CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
            f"triton {sys.modules['triton'].__version__}, onnx {onnx.__version__}, numpy {np.__version__}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--runtimes", nargs="+", default=list(RUNTIMES), choices=RUNTIMES)
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS)
    ap.add_argument("--configs", nargs="+", metavar="RUNTIME:PRECISION",
                    help="instead of every runtime in every precision, these pairs, e.g. gpuacc:fp16")
    ap.add_argument("--reference", choices=("cpuref", "gpuacc-fp32"), default="cpuref",
                    help="what outputs are held to at batch 1 (larger batches: gpuacc-fp32)")
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--dir", type=Path, help="where the exported models go (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON lines here")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a GpuAcc option for the gpuacc runtimes, e.g. GpuAcc.channels_last=true "
                         "(the value read as JSON where it is JSON, else as a string)")
    ap.add_argument("--io", choices=("host", "device"), default="host",
                    help="host: NumPy in and out, uploads and downloads timed (the default); "
                         "device: inputs already on the GPU and outputs left there (GpuAcc through "
                         "io_binding, inductor on CUDA tensors), the GPU's own time")
    ap.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    # the worker's own arguments
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--feeds", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="tf32", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    if args.worker:
        worker(args)
        return 0
    from backplane.backends.torch.bench import make_feeds

    print(machine(), flush=True)
    if args.option:
        print(f"GpuAcc options for the gpuacc runtimes: {options_of(args.option)}", flush=True)
    print("inputs and outputs: " + ("NumPy, uploads and downloads timed" if args.io == "host" else
                                    "on the GPU (inputs uploaded once, outputs left there)"),
          flush=True)
    out = args.dir or Path(tempfile.mkdtemp(prefix="gpu_compiler_"))
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    header = (f"{'model':20} {'batch':>5} {'runtime':16} {'prec':5} {'median ms':>10} {'samples/s':>10} "
              f"{'load s':>7} {'parts':>5} {'cross':>5} {'diff':>9}")
    print(header, flush=True)
    for name in args.models:
        for batch in args.batches:
            start = time.perf_counter()
            try:
                model = export(name, batch, out)
            except Exception as exc:  # noqa: BLE001
                print(f"{name:20} {batch:5} export failed: {type(exc).__name__}: {exc}"[:300])
                continue
            export_s = time.perf_counter() - start
            feeds = out / f"{model.stem}.feeds.npz"
            np.savez(feeds, **make_feeds(model))  # type: ignore[arg-type]
            kind = "cpuref" if batch == 1 and args.reference == "cpuref" else "gpuacc"
            ref_save = out / f"{model.stem}.ref.npz"
            reply = spawn(args, kind, "fp32", model, name, batch, feeds, ref_save)
            reference = None
            if "error" in reply:
                print(f"{name:20} {batch:5} reference ({kind}) failed: {reply['error']}")
            else:
                with np.load(ref_save) as saved:
                    reference = [saved[k] for k in saved.files]
            print(f"{name:20} {batch:5} exported in {export_s:.1f} s; reference: "
                  f"{'CpuRef' if kind == 'cpuref' else 'GpuAcc fp32'}", flush=True)
            configs = [tuple(c.split(":")) for c in args.configs] if args.configs else \
                [(runtime, precision) for precision in args.precisions for runtime in args.runtimes]
            for runtime, precision in configs:
                save = out / f"{model.stem}.{runtime}.{precision}.npz"
                reply = spawn(args, runtime, precision, model, name, batch, feeds, save)
                if "error" in reply:
                    print(f"{name:20} {batch:5} {runtime:16} {precision:5} error: {reply['error']}",
                          flush=True)
                    continue
                median = statistics.median(reply["times"])
                with np.load(save) as saved:
                    outputs = [saved[k] for k in saved.files]
                row = {"model": name, "batch": batch, "runtime": runtime, "precision": precision,
                       "median_ms": median * 1e3, "samples_per_s": batch / median,
                       "load_s": reply["load_s"], "partitions": reply.get("partitions"),
                       "crossings": reply.get("crossings"), "diff": diff(outputs, reference, precision)}
                rows.append(row)
                if args.json:  # row by row: a run cut short keeps what it measured
                    with args.json.open("a") as sink:
                        sink.write(json.dumps(row) + "\n")
                parts = "-" if row["partitions"] is None else str(row["partitions"])
                cross = "-" if row["crossings"] is None else str(row["crossings"])
                print(f"{name:20} {batch:5} {runtime:16} {precision:5} {row['median_ms']:10.3f} "
                      f"{row['samples_per_s']:10.1f} {row['load_s']:7.1f} {parts:>5} {cross:>5} "
                      f"{row['diff']:>9}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
