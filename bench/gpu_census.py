"""GpuAcc's steps for a corpus model, counted without a GPU (issue 28): what a captured graph of
the model would replay, one step a call, read on any machine.

Usage:
    python bench/gpu_census.py --models audio_conv1d_dyn19,detect_nms_dyn21 [--tier small] [-v]

Why: a GpuAcc whole run costs about 12.2 us plus 1.1 us a kernel on the H200 machine
(bench/gpu_floor.py), so a small model's time is its kernel count, and the device is lent for
minutes a session. Here the model, at its ``.s0.npz`` sizes, goes through what GpuAcc's build does
to a Specialized layer (``specialize.built_graph``: folding, ``GpuAcc.optimize_subgraph``, then
``gpu_fusion.inner_steps`` for each CudaGraph layer) with a GpuAcc whose CUDA check is skipped:
no tensor is made, nothing runs. Per model: the layers after folding, the CudaGraph layers and
their steps, the layers left outside them; with ``-v`` each step (the layer whose output it makes,
and the CUDA function of a fused chain). A step launches one kernel or more on the GPU (a Conv's
cuDNN call and its bias, TopK's sort) and views launch none (Reshape, Unsqueeze, Slice), so
``bench/gpu_profile.py`` on the device stays the measure; this is the count to bring down between
device runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
VIEWS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Slice", "Flatten", "Identity"})
"""Steps that make a view on the GPU (no kernel) where their input is dense."""


def gpu_backend() -> Any:
    """A GpuAcc whose CUDA check is skipped: its graph passes and fusions run, no device is used."""
    from backplane.backends.torch.backend import GpuAcc

    class Unchecked(GpuAcc):
        def _missing(self) -> str | None:
            return None

    return Unchecked()


def census(model: Path, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """The model's GpuAcc build at the feeds' sizes: its CudaGraph layers' steps and the rest."""
    from backplane.backends.torch import specialize
    from backplane.backends.torch.gpu_fusion import inner_steps
    from backplane.frontends.onnx import import_onnx
    from backplane.frontends.onnx_file import read_model
    from backplane.ir.graph import Layer

    graph = import_onnx(read_model(str(model)))
    whole = Layer("Specialized", "whole", list(graph.inputs), list(graph.outputs), {
        "layers": list(graph.layers), "inputs": list(graph.inputs),
        "outputs": list(graph.outputs), "constants": dict(graph.constants),
        "tensors": dict(graph.tensors), "opsets": dict(graph.opsets)})
    backend = gpu_backend()
    built = specialize.built_graph(whole, backend, [feeds[name] for name in graph.inputs])
    if built is None:
        return {"error": "GpuAcc gave a part back (the model would not be one GpuAcc build)"}
    steps, outside = [], []
    for layer in built.layers:
        if layer.op_type != "CudaGraph":
            outside.append(layer.op_type)
            continue
        made_by = {out: inner.op_type for inner in layer.attrs["layers"] for out in inner.outputs}
        for workload, _, outs in inner_steps(layer.attrs["layers"], backend,
                                             layer.attrs["outputs"], layer.attrs["constants"]):
            named = re.search(r"backplane_\w+", getattr(workload, "code", ""))
            steps.append((made_by.get(outs[0], "?") if outs else "?",
                          named.group(0) if named else ""))
    launching = [s for s in steps if s[0] not in VIEWS or s[1]]
    return {"layers": len(built.layers), "steps": len(steps), "launching": len(launching),
            "fused": sum(1 for s in steps if s[1]), "outside": outside,
            "by_op": dict(collections.Counter(op for op, code in launching if not code)),
            "each": [f"{op} {code}".rstrip() for op, code in steps]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", required=True, help="comma-separated corpus model names")
    ap.add_argument("--tier", choices=("small", "full"), default="small")
    ap.add_argument("--corpus", type=Path)
    ap.add_argument("-v", "--verbose", action="store_true", help="each step")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "bench"))
    import wild

    corpus = args.corpus or (wild.FULL_CORPUS if args.tier == "full" else wild.CORPUS)
    manifest = json.loads((corpus / "manifest.json").read_text())
    for name in args.models.split(","):
        entry = manifest[name]
        feeds = dict(np.load(corpus / entry["inputs_files"][0]))
        try:
            found = census(corpus / entry["file"], feeds)
        except Exception as exc:  # noqa: BLE001 - an If's or Loop's body is a network of its own
            found = {"error": f"not counted ({type(exc).__name__}: {exc})"[:200]}
        if "error" in found:
            print(f"{name}: {found['error']}")
            continue
        print(f"{name}: {found['steps']} steps in CudaGraph layers, {found['launching']} launching "
              f"(not views), {found['fused']} of them fused chains; outside: "
              f"{', '.join(found['outside']) or 'nothing'}; unfused launching steps by op: "
              f"{found['by_op']}")
        if args.verbose:
            print("\n".join(f"    {line}" for line in found["each"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
