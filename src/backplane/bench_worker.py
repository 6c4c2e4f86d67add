"""One process of ``backplane bench``: load a model on one runtime (backplane, ONNX Runtime, eager
PyTorch, a CUDA graph of it), warm it up, time its calls, report one JSON line on stdout
(``backplane.bench_engine`` starts these processes: ``python -m backplane.bench_engine --worker``).

``torch-eager`` is the PyTorch module the model was exported from, rebuilt by
``scripts/export_models.py``'s builders with the same seed (so the same weights): it needs that
script and what the model's builder imports (torchvision for the CNNs, transformers for BERT and
GPT-2); without them the column is skipped with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from backplane.backends.torch import background

ROOT = Path(__file__).resolve().parents[2]  # the checkout, for scripts/export_models.py
ORT = "onnxruntime"
EAGER = "torch-eager"
CUDA_GRAPH = "torch-cudagraph"
NO_MODULE = "no torch module"
"""How a torch column's error begins where the model's module cannot be rebuilt (a skip)."""
Run = Callable[[], list[np.ndarray]]


def load_backplane(model: str, feeds: dict[str, np.ndarray], args: argparse.Namespace,
                   column: str) -> tuple[Run, dict[str, Any]]:
    """``column`` is a backend list with backend options after it, each after an ``@``:
    "GpuAcc,CpuAcc,CpuRef@GpuAcc.precision=fp16" (so that two settings are columns of one run).
    With the call, the plan: its partitions and the tensors a run hands between backends."""
    from backplane.runtime.runtime import Runtime, RuntimeOptions
    from backplane.session import InferenceSession

    backends, *settings = column.split("@")
    chosen = {"CpuAcc.threads": args.threads, "GpuAcc.device": _cuda(args)}
    for setting in settings:
        key, _, value = setting.partition("=")
        chosen[key] = option_value(value)
    session = InferenceSession(model, backends=backends.split(","),
                               runtime=Runtime(RuntimeOptions(backend_options=chosen)))
    report = session.report
    plan = {"partitions": len(report.partitions), "crossings": sum(report.crossings().values())}
    return (lambda: session.run(None, feeds)), plan


def option_value(text: str) -> Any:
    """An option's value as written: true / false, a number, or the text itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return json.loads(text) if text[:1].isdigit() or text[:1] == "-" else text
    except ValueError:
        return text


def load_onnxruntime(model: str, feeds: dict[str, np.ndarray], args: argparse.Namespace) -> Run:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)


def load_torch(model: str, feeds: dict[str, np.ndarray], args: argparse.Namespace,
               graph: bool) -> Run:
    import torch

    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32, as GpuAcc by default
    torch.backends.cudnn.allow_tf32 = False
    module = _torch_module(Path(model).stem)
    device = torch.device(_cuda(args) if args.device == "cuda" else "cpu")
    module = module.to(device)
    host = [torch.from_numpy(v) for v in feeds.values()]
    if not graph:
        def eager() -> list[np.ndarray]:
            with torch.inference_mode():
                outputs = module(*[x.to(device) for x in host])
            return [o.cpu().numpy() for o in _flat(outputs)]
        return eager
    static = [x.to(device) for x in host]
    with torch.inference_mode():
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                module(*static)
        torch.cuda.current_stream(device).wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph), _pinned_tensor_constants() as constants:
            outputs = _flat(module(*static))

    def replay(pinned: list[Any] = constants) -> list[np.ndarray]:  # keeps what the graph reads
        for s, x in zip(static, host):
            s.copy_(x, non_blocking=True)
        cuda_graph.replay()
        return [o.cpu().numpy() for o in outputs]
    return replay


@contextlib.contextmanager
def _pinned_tensor_constants() -> Iterator[list[Any]]:
    """While a module is captured: ``torch.tensor(data, device=<cuda>)`` made from pinned memory.

    Some modules make small constants on the GPU in ``forward`` (transformers' eager attention mask:
    ``torch.tensor(0.0, device=mask.device)`` in ``masking_utils.eager_mask``); from pageable memory
    that copy is refused inside a capture ("Cannot copy between CPU and CUDA tensors during CUDA
    graph capture unless the CPU tensor is pinned"). From a pinned buffer it is captured as a copy
    node that each replay repeats: the buffers are yielded, for the caller to keep while the graph
    lives. The module's kernels are unchanged.
    """
    import torch

    original = torch.tensor
    kept: list[Any] = []

    def tensor(data: Any, *, device: Any = None, **kwargs: Any) -> Any:
        if device is None or torch.device(device).type != "cuda":
            return original(data, device=device, **kwargs)
        kwargs.pop("pin_memory", None)
        host = original(data, **kwargs).pin_memory()
        kept.append(host)
        return host.to(device, non_blocking=True)

    torch.tensor = tensor  # type: ignore[assignment]
    try:
        yield kept
    finally:
        torch.tensor = original  # type: ignore[assignment]


INSTALL = {"torchvision": "pip install torchvision --index-url https://download.pytorch.org/whl/cpu",
           "transformers": "pip install transformers"}
"""What a builder of scripts/export_models.py may need, and how to install it (torchvision from
PyTorch's CPU index, as torch: see ``backplane.install_hints``)."""


def _torch_module(name: str) -> Any:
    """The module ``scripts/export_models.py`` exports as ``name`` (an anchor or a committed model:
    ``anchors()``, ``small()``), built with the same seed; where it cannot be, a RuntimeError that
    begins with ``NO_MODULE`` and says why in one line."""
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import export_models
    except ImportError as exc:
        raise RuntimeError(f"{NO_MODULE}: scripts/export_models.py is not importable "
                           f"({exc})") from exc
    builders = {**export_models.anchors(),
                **{known: build for known, (_, build) in export_models.small().items()}}
    if name not in builders:
        raise RuntimeError(f"{NO_MODULE}: {name} is not a model scripts/export_models.py builds "
                           f"({', '.join(builders)})")
    torch.manual_seed(0)
    try:
        return builders[name]()[0].eval()
    except ImportError as exc:  # the builder's library (torchvision, transformers)
        missing = (exc.name or str(exc)).split(".")[0]
        how = f": {INSTALL[missing]}" if missing in INSTALL else ""
        raise RuntimeError(f"{NO_MODULE}: rebuilding {name} in PyTorch needs {missing}, which is "
                           f"not installed{how}") from exc


def _flat(outputs: Any) -> list[Any]:
    if isinstance(outputs, (tuple, list)):
        return [o for item in outputs for o in _flat(item)]
    if isinstance(outputs, dict):
        return [o for item in outputs.values() for o in _flat(item)]
    return [outputs]


def _cuda(args: argparse.Namespace) -> str:
    return "cuda:0"  # one GPU: the device machines have one per process


def _loader(runtime: str, model: str, feeds: dict[str, np.ndarray],
            args: argparse.Namespace) -> tuple[Run, dict[str, Any]]:
    """The runtime's call, and its plan where it is backplane's (else {})."""
    if runtime == ORT:
        return load_onnxruntime(model, feeds, args), {}
    if runtime in (EAGER, CUDA_GRAPH):
        return load_torch(model, feeds, args, graph=runtime == CUDA_GRAPH), {}
    return load_backplane(model, feeds, args, runtime)


def worker(args: argparse.Namespace) -> None:
    """One process of one runtime: load, warm up, time, report one JSON line on stdout."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the runtime prints goes to stderr
    feeds = dict(np.load(args.feeds))
    try:
        start = time.perf_counter()
        run, plan = _loader(args.worker, args.model, feeds, args)
        load_s = time.perf_counter() - start
        run()
        background.settle(run)  # CpuAcc's routes built in the background, chosen by runs: then timed
        outputs, times = timed_runs(run, args.warmup, args.runs)
        if args.save:
            np.savez(args.save, *[np.asarray(o) for o in outputs])
        replies.write(json.dumps({"load_s": load_s, "times": times, "plan": plan}) + "\n")
    except Exception as exc:  # noqa: BLE001 - a runtime that cannot run a model is a result
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:500]}) + "\n")


def timed_runs(run: Callable[[], Any], warmup: int, runs: int) -> tuple[Any, list[float]]:
    """``warmup`` untimed calls of ``run``, then ``runs`` timed ones: the last outputs and the
    seconds of each timed call (a bench worker's loop, shared by the bench scripts)."""
    outputs = None
    for _ in range(warmup):
        outputs = run()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        outputs = run()
        times.append(time.perf_counter() - start)
    return outputs, times


def peak_worker(args: argparse.Namespace) -> None:
    """The fp32 matmul peak of the device at --threads, in GFLOP/s: the best of a few 2048^3
    products through NumPy and torch (MKL, and oneDNN on the CPU)."""
    n = 2048
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    calls: list[Callable[[], Any]] = [] if args.device == "cuda" else [lambda: a @ a]
    sync: Callable[[], Any] = lambda: None  # noqa: E731
    try:
        import torch

        torch.set_num_threads(args.threads)
        torch.backends.cuda.matmul.allow_tf32 = False
        t = torch.from_numpy(a).to(_cuda(args) if args.device == "cuda" else "cpu")
        calls.append(lambda: t @ t)
        if args.device == "cuda":
            sync = torch.cuda.synchronize
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(t, n)
            calls.append(lambda: torch.ops.mkldnn._linear_pointwise(t, packed, None, "none", [], None))
    except ImportError:
        pass
    best = math.inf
    for call in calls:
        call()
        for _ in range(5):
            sync()
            best = min(best, _timed(lambda: (call(), sync())))
    print(json.dumps({"gflops": 2 * n ** 3 / best / 1e9}))


def _timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start
