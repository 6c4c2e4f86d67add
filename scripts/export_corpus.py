"""Export the corpus of real-world exports: small torch.nn architectures through torch's own exporters.

Usage (with the project's venv: torch, onnx, onnxruntime, onnxscript for the dynamo exporter):
    python scripts/export_corpus.py                  # every model -> tests/data/corpus/, manifest.json
    python scripts/export_corpus.py --only gpt_causal_ts15 lstm_bi2_ts14
    python scripts/export_corpus.py --list           # names, exporters, opsets, free axes
    python scripts/export_corpus.py --tier full      # the full tier -> ~/.cache/backplane/corpus-full
    python scripts/export_corpus.py --tier full --out DIR --only yolo_v8_ts17

Users bring ONNX files that other exporters wrote; this corpus is what torch writes for the
architectures they bring, small: random weights from fixed seeds (nothing is downloaded), each file
well under 1 MB. The models are written here as torch.nn modules (no torchvision, no transformers)
and exported with the TorchScript exporter (`torch.onnx.export(..., dynamo=False)`, `ts` in the
names) or the dynamo exporter (`dynamo=True`, `dyn`), at opsets from 11 to 21, with free axes
(batch, sequence, height, width, time). A few are quantized after export by ONNX Runtime's own
quantizer (`onnxruntime.quantization`: QDQ, QOperator and dynamic formats), which is how int8 ONNX
files are usually made; their ops are all of the standard domain.

Every model gets, in tests/data/corpus/:
    <name>.onnx          the export
    <name>.s0.npz        inputs at the first size of every free axis (`dict(np.load(p))` is a feed)
    <name>.s1.npz        inputs at the second size of every free axis
and an entry in manifest.json: file, exporter, opset, inputs with their symbolic shapes, the free
axes and their two sizes, what the model exercises, its op types and size. After writing each model
the script checks it (onnx.checker), runs it in ONNX Runtime at both sizes and compares that with
eager torch on the same inputs, so that a model whose export baked in a size, or computes something
else than the module, never enters the corpus.

The full tier (`--tier full`, `full_specs`) is twelve of these models at the sizes users run them
(YOLOv8n's widths at 320x320, the layout detector at 800x608, a CRNN at 32x320 over 6625 classes,
...): the same modules with size parameters, the same exporters and opsets, the same layout and
checks, written outside the repository (up to 15 MB a file; about two minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus_specs import Feeds, Spec, full_specs, make_feeds, specs  # noqa: E402,F401 - beside this script

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "corpus"
FULL_OUT = Path.home() / ".cache" / "backplane" / "corpus-full"  # the full tier: not in the repository
MAX_FILE_BYTES = 1_000_000
MAX_CORPUS_BYTES = 8_000_000
FULL_MAX_FILE_BYTES = 200_000_000




# ---------------------------------------------------------------- export

def export_torch(spec: Spec, module: nn.Module, path: Path) -> None:
    feeds = make_feeds(spec, spec.export_size)
    args = tuple(torch.from_numpy(feeds[n]) for n in spec.inputs)
    in_names = list(spec.inputs)
    if spec.exporter.startswith("torchscript"):
        axes = {n: {i: d for i, d in enumerate(shape) if isinstance(d, str)}
                for n, (_, shape, _) in spec.inputs.items()}
        with torch.set_grad_enabled(spec.grad_for_export):
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=spec.opset,
                              input_names=in_names, output_names=spec.outputs, dynamic_axes=axes,
                              do_constant_folding=True, **spec.export_options)
    else:
        dims: dict[str, torch.export.Dim] = {}
        for which in (0, 1):
            for axis, size in spec.sizes[which].items():
                # 4096 for every small model; the full tier's byte classifier reads 16 KB
                top = max(4096, 2 * max(sizes[axis] for sizes in spec.sizes))
                dims.setdefault(axis, torch.export.Dim(axis, min=1, max=top))
        shapes = tuple({i: dims[d] for i, d in enumerate(shape) if isinstance(d, str)} or None
                       for _, shape, _ in spec.inputs.values())
        with torch.no_grad():
            program = torch.onnx.export(module, args, dynamo=True, opset_version=spec.opset,
                                        input_names=in_names, output_names=spec.outputs,
                                        dynamic_shapes=shapes, external_data=False, verbose=False,
                                        custom_translation_table=spec.custom_translation or None,
                                        **spec.export_options)
        program.save(str(path), external_data=False)


def quantize(spec: Spec, float_path: Path, path: Path) -> None:
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType, quantize_dynamic,
                                          quantize_static)
    # reduce_range: 7-bit weights, as ONNX Runtime's documentation asks for x86 machines without
    # VNNI. Its uint8 x int8 kernels there (VPMADDUBSW) add pairs of products in int16 and saturate;
    # with 8-bit weights its QLinearConv was 14 quanta off the exact integer result at 369 of the
    # stem's 4096 outputs on this project's machine, and onnxruntime would be a wrong reference.
    if spec.quantize == "dynamic":
        quantize_dynamic(str(float_path), str(path), op_types_to_quantize=["MatMul"],
                         weight_type=QuantType.QInt8, per_channel=False, reduce_range=True)
        return

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.batches = [make_feeds(spec, w) for w in (0, 1)]

        def get_next(self):
            return self.batches.pop() if self.batches else None

    fmt = QuantFormat.QDQ if spec.quantize == "qdq" else QuantFormat.QOperator
    # Conv and MatMul only for QOperator: the others (QGemm, QLinearAdd, QLinearGlobalAveragePool)
    # are com.microsoft contrib ops, not ONNX.
    ops = None if fmt == QuantFormat.QDQ else ["Conv", "MatMul"]
    quantize_static(str(float_path), str(path), Reader(), quant_format=fmt, op_types_to_quantize=ops,
                    per_channel=True, reduce_range=True, activation_type=QuantType.QUInt8,
                    weight_type=QuantType.QInt8)


def torch_outputs(module: nn.Module, spec: Spec, feeds: Feeds) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*(torch.from_numpy(feeds[n]) for n in spec.inputs))
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o.numpy() for o in out]


def ort_run(path: Path, feeds: Feeds) -> list[np.ndarray]:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, feeds)


def describe(path: Path) -> dict[str, Any]:
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    ops: set[str] = set()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            ops.add(node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}")
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
    walk(model.graph)
    for function in model.functions:
        walk(onnx.helper.make_graph(function.node, function.name, [], []))
    inits = {i.name for i in model.graph.initializer}

    def shape(vi: onnx.ValueInfoProto) -> list[int | str]:
        return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]

    def dtype(vi: onnx.ValueInfoProto) -> str:
        return onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).name

    return {
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "inputs": [{"name": vi.name, "dtype": dtype(vi), "shape": shape(vi)}
                   for vi in model.graph.input if vi.name not in inits],
        "outputs": [{"name": vi.name, "dtype": dtype(vi), "shape": shape(vi)} for vi in model.graph.output],
        "ops": sorted(ops),
        "nodes": len(model.graph.node),
        "functions": [f"{f.domain}.{f.name}" for f in model.functions],
        "bytes": os.path.getsize(path),
    }


def max_rel(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    if got.dtype.kind in "iub":
        return float(np.max(np.abs(got.astype(np.int64) - want.astype(np.int64)), initial=0))
    scale = max(float(np.max(np.abs(want.astype(np.float64)), initial=0)), 1e-3)
    return float(np.max(np.abs(got.astype(np.float64) - want), initial=0)) / scale


def export(spec: Spec, out: Path = OUT, max_bytes: int = MAX_FILE_BYTES, tier: str = "small") -> dict[str, Any]:
    """Export one model into `out` with its two inputs files, check it, and return its manifest entry."""
    torch.manual_seed(0)
    module = spec.build()
    path = out / f"{spec.name}.onnx"
    t0 = time.perf_counter()
    if spec.quantize:
        with tempfile.TemporaryDirectory() as tmp:
            float_path = Path(tmp) / "float.onnx"
            export_torch(spec, module, float_path)
            quantize(spec, float_path, path)
    else:
        export_torch(spec, module, path)
    info = describe(path)
    if info["opset"] != spec.opset:
        raise RuntimeError(f"asked for opset {spec.opset}, the file has {info['opset']}")
    if info["bytes"] > max_bytes:
        raise RuntimeError(f"{info['bytes']} bytes: over {max_bytes}")
    free = sorted({d for vi in info["inputs"] for d in vi["shape"] if isinstance(d, str)})
    if free != sorted(spec.free_axes):
        raise RuntimeError(f"free axes in the file {free}, meant {sorted(spec.free_axes)}")
    checks, notes = [], []
    for which in (0, 1):
        feeds = make_feeds(spec, which)
        np.savez(out / f"{spec.name}.s{which}.npz", **feeds)
        got = ort_run(path, feeds)
        names = [o["name"] for o in info["outputs"]]
        if names != spec.outputs:
            raise RuntimeError(f"outputs {names}, meant {spec.outputs}")
        if not all(np.isfinite(o).all() for o in got if o.dtype.kind == "f"):
            raise RuntimeError(f"size {which}: onnxruntime's outputs are not finite")
        if not spec.quantize:  # the export computes what the module does (a quantized one does not)
            want = torch_outputs(module, spec, feeds)
            diffs = [max_rel(g, w) for g, w in zip(got, want)]
            if max(diffs) > spec.torch_tolerance:
                raise RuntimeError(f"size {which}: onnxruntime vs torch differ by {diffs}")
            checks.append(f"s{which} ort~torch {max(diffs):.1e}")
        for o, value in zip(info["outputs"], got):
            declared = o["shape"]
            if len(declared) != value.ndim or any(isinstance(d, int) and d and d != n
                                                  for d, n in zip(declared, value.shape)):
                note = f"output {o['name']} is declared {declared} but is {list(value.shape)} at size {which}"
                notes.append(note)
        shapes = " ".join("x".join(map(str, o.shape)) for o in got)
        checks.append(f"s{which} out {shapes}")
    entry = {
        "file": path.name,
        **({"tier": tier} if tier != "small" else {}),
        "exporter": spec.exporter,
        **({"quantized_with": f"onnxruntime.quantization {spec.quantize}"} if spec.quantize else {}),
        "free_axes": spec.free_axes,
        "sizes": list(spec.sizes),
        "inputs_files": [f"{spec.name}.s0.npz", f"{spec.name}.s1.npz"],
        "exercises": spec.exercises,
        "torch": torch.__version__,
        **info,
        "notes": notes,
    }
    print(f"OK   {spec.name}: {spec.exporter} opset {info['opset']}, {info['nodes']} nodes, "
          f"{info['bytes'] / 1e3:.0f} KB, {'; '.join(checks)} ({time.perf_counter() - t0:.1f}s)")
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="export only these models")
    ap.add_argument("--list", action="store_true", help="list the models and exit")
    ap.add_argument("--tier", choices=("small", "full"), default="small",
                    help="small: tests/data/corpus (default); full: the wild sizes, to --out")
    ap.add_argument("--out", type=Path, help=f"the full tier's folder (default {FULL_OUT})")
    a = ap.parse_args()
    if a.out and a.tier == "small":
        sys.exit("--out is for --tier full: the small tier is tests/data/corpus")
    all_specs = specs() if a.tier == "small" else full_specs()
    out = OUT if a.tier == "small" else (a.out or FULL_OUT).expanduser()
    max_bytes = MAX_FILE_BYTES if a.tier == "small" else FULL_MAX_FILE_BYTES
    if a.list:
        for spec in all_specs.values():
            print(f"{spec.name:24s} {spec.exporter:22s} opset {spec.opset:2d}  free {','.join(spec.free_axes)}")
        return
    unknown = sorted(set(a.only or ()) - set(all_specs))
    if unknown:
        sys.exit(f"Unknown model(s) {unknown}. Known: {', '.join(all_specs)}")
    warnings.filterwarnings("ignore")
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    start = time.perf_counter()
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    failed = []
    for spec in all_specs.values():
        if a.only and spec.name not in a.only:
            continue
        try:
            manifest[spec.name] = export(spec, out, max_bytes, a.tier)
        except Exception as e:  # noqa: BLE001 - report and go on with the others
            traceback.print_exc(limit=4)
            print(f"FAIL {spec.name}: {type(e).__name__}: {str(e)[:1500]}")
            failed.append(spec.name)
    manifest = {name: manifest[name] for name in all_specs if name in manifest}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(e["bytes"] for e in manifest.values())
    print(f"{len(manifest)} models in {out}, {total / 1e6:.2f} MB of .onnx, "
          f"{time.perf_counter() - start:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    too_big = a.tier == "small" and total > MAX_CORPUS_BYTES
    if too_big:
        print(f"the corpus is over {MAX_CORPUS_BYTES} bytes")
    sys.exit(1 if failed or too_big else 0)


if __name__ == "__main__":
    main()
