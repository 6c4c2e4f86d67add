"""Random splits of a model between an accelerated backend and CpuRef, each held to CpuRef alone.

The generator and the comparison shared by the CI slice (tests/runtime/test_split_fuzz.py) and the
long run (bench/split_fuzz.py). A split is a ``pins`` mapping (layer names or op types -> "CpuRef")
drawn by one of ``STRATEGIES`` from the layers of the imported graph that CpuRef's passes leave (a
pin on a folded layer splits nothing); the same seed gives the same splits, on any machine.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import backplane
from backplane import InferenceSession
from backplane.ir.graph import Layer
from backplane.runtime.runtime import Runtime, RuntimeOptions
from tests.models.test_models import DATA, LIGHT, LIGHT_DIR, TINY, TOLERANCE, light_inputs

ROOT = Path(__file__).resolve().parents[2]
SMALL = [DATA / f"{name}.onnx" for name in TINY] + [ROOT / "models" / "mobilenet_v2_w020_c10.onnx"]
LIGHT_MODELS = [LIGHT_DIR / f"{name}.onnx" for name in LIGHT]
MODES = ("auto", "onednn_graph", "layers")  # CpuAcc.compile
REFERENCE = "CpuRef"

ANCHORS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
"""What CpuAcc fuses the layers after into (batch norm, bias, residual Add, activation, GELU, a
squeeze-and-excitation scale), and GpuAcc its Conv [-> Add] -> Relu chains."""
GROUP_DEPTH = 3  # a layer up to this many layers after an anchor counts as inside its fused group


@dataclass
class Subject:
    """A model as the fuzzer runs it: what is compared, its feeds, CpuRef's outputs, its layers."""

    name: str
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    expected: list[np.ndarray]
    layers: list[Layer]  # those of the imported graph that CpuRef's network still runs, in order


@dataclass(frozen=True)
class Split:
    strategy: str
    pins: dict[str, str]

    def __str__(self) -> str:
        return f"{self.strategy}: pins={self.pins!r}"


def load_subject(path: str | Path) -> Subject:
    """The model, its feeds and CpuRef's outputs.

    The light models' constant weights make their logits 1000 equal values (3.6e12 for alexnet,
    9.5e9 for squeezenet), whose softmax is 0.001 everywhere when they are equal to the bit and
    anything else when one ulp apart (light_squeezenet: 1.0 off with ``CpuAcc.compile`` "layers",
    unsplit): their logits are compared instead, as tests/models/test_models.py does for
    light_squeezenet (COMPARE_INSTEAD)."""
    path = Path(path)
    model = onnx.load(str(path))
    if _is_light(path):
        _compare_logits(model)
    feeds = model_feeds(path, model)
    reference = InferenceSession(model, backends=[REFERENCE])
    expected = reference.run(None, feeds)
    kept = {layer.name for layer in reference.optimized.graph.layers}
    layers = [layer for layer in backplane.import_onnx(model).layers if layer.name in kept]
    return Subject(path.stem, model, feeds, expected, layers)


def _is_light(path: Path) -> bool:
    """One of onnx's light models (those of another onnx install too)."""
    return path.parent == LIGHT_DIR or path.name.startswith("light_")


def _compare_logits(model: onnx.ModelProto) -> None:
    """Each output a Softmax makes replaced by that Softmax's input."""
    producer = {out: node for node in model.graph.node for out in node.output}
    outputs = []
    for output in model.graph.output:
        node = producer.get(output.name)
        if node is not None and node.op_type == "Softmax":
            output = onnx.helper.make_empty_tensor_value_info(node.input[0])
        outputs.append(output)
    del model.graph.output[:]
    model.graph.output.extend(outputs)


def model_feeds(path: Path, model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The .npz beside the model (the tiny test models), onnx's inputs for the light models, else
    seeded random data as the anchor models get (``backplane.cli.random_input``)."""
    if path.with_suffix(".npz").is_file():
        return dict(np.load(path.with_suffix(".npz")))
    if _is_light(path):
        return light_inputs(path)
    from backplane.cli import random_input

    graph = backplane.import_onnx(model)
    rng = np.random.default_rng(0)
    return {name: random_input(graph.info(name), rng) for name in graph.inputs}


# -- the generator ----------------------------------------------------------------------------------

def _names(layers: Sequence[Layer], to: str) -> dict[str, str]:
    return {layer.name: to for layer in layers}


def pin_op_types(layers: Sequence[Layer], rng: random.Random, to: str) -> dict[str, str] | None:
    """Every layer of one or two op types (never all of the model's types)."""
    types = sorted({layer.op_type for layer in layers})
    count = min(rng.choice([1, 1, 2]), len(types) - 1)
    return {op: to for op in rng.sample(types, count)} if count > 0 else None


def pin_names(layers: Sequence[Layer], rng: random.Random, to: str) -> dict[str, str] | None:
    """One to three layers anywhere."""
    return _names(rng.sample(list(layers), min(rng.randint(1, 3), len(layers) - 1)), to) or None


def pin_every_kth(layers: Sequence[Layer], rng: random.Random, to: str) -> dict[str, str] | None:
    """Every k-th layer from a random offset: many partitions."""
    if len(layers) < 4:
        return None
    k = rng.randint(2, max(2, min(12, len(layers) // 3)))
    return _names(layers[rng.randrange(k)::k], to)


def pin_in_group(layers: Sequence[Layer], rng: random.Random, to: str) -> dict[str, str] | None:
    """One layer (now and then two) inside a fused group: the batch norm, Relu, Add, Clip after a
    Conv; the HardSigmoid or Mul of a squeeze-and-excitation block; a bias Add or GELU after a
    MatMul."""
    inside = group_members(layers)
    if not inside:
        return None
    return _names(rng.sample(inside, min(rng.choice([1, 1, 1, 2]), len(inside))), to)


def pin_range(layers: Sequence[Layer], rng: random.Random, to: str) -> dict[str, str] | None:
    """A run of consecutive layers: the accelerated part cut in two around it."""
    if len(layers) < 4:
        return None
    length = rng.randint(2, max(2, len(layers) // 5))
    start = rng.randrange(len(layers) - length + 1)
    return _names(layers[start:start + length], to)


STRATEGIES: dict[str, Callable[[Sequence[Layer], random.Random, str], dict[str, str] | None]] = {
    "op_types": pin_op_types, "names": pin_names, "every_kth": pin_every_kth,
    "in_group": pin_in_group, "range": pin_range}


def group_members(layers: Sequence[Layer]) -> list[Layer]:
    """The layers (not anchors themselves) up to GROUP_DEPTH layers after an anchor."""
    producer = {out: layer for layer in layers for out in layer.outputs if out}
    depth: dict[str, int] = {}  # layer name -> layers since the nearest anchor
    for layer in layers:  # topological order
        if layer.op_type in ANCHORS:
            depth[layer.name] = 0
            continue
        before = [depth.get(producer[n].name) for n in layer.inputs if n in producer]
        nearest = min((d for d in before if d is not None), default=None)
        if nearest is not None and nearest < GROUP_DEPTH:
            depth[layer.name] = nearest + 1
    return [layer for layer in layers if depth.get(layer.name, 0) > 0]


def group_splits(layers: Sequence[Layer], to: str = REFERENCE) -> list[Split]:
    """One split per op type found inside fused groups: the middle one of that type, alone."""
    members: dict[str, list[Layer]] = {}
    for layer in group_members(layers):
        members.setdefault(layer.op_type, []).append(layer)
    return [Split(f"in_group[{op}]", {found[len(found) // 2].name: to})
            for op, found in sorted(members.items())]


def splits(layers: Sequence[Layer], rng: random.Random, count: int, to: str = REFERENCE) -> list[Split]:
    """``group_splits``, then ``count`` random splits unlike them and each other (fewer where the
    model has fewer), the strategies in turn."""
    found = group_splits(layers, to)
    seen = {tuple(sorted(split.pins)) for split in found}
    fixed = len(found)
    order = list(STRATEGIES)
    for attempt in range(count * 20):
        if len(found) - fixed == count:
            break
        strategy = order[attempt % len(order)]
        pins = STRATEGIES[strategy](layers, rng, to)
        if not pins or tuple(sorted(pins)) in seen:
            continue
        seen.add(tuple(sorted(pins)))
        found.append(Split(strategy, pins))
    return found


def model_rng(seed: int, subject: Subject) -> random.Random:
    """One generator per model and seed (a str seed hashes the same in every process)."""
    return random.Random(f"{seed}:{subject.name}")


# -- running and comparing --------------------------------------------------------------------------

def relative_difference(actual: Sequence[Any], expected: Sequence[np.ndarray]) -> float:
    """The worst over outputs of max |actual - expected| / max |expected| (as the repository's model
    tests measure); inf for a missing output, another shape or type, NaN or inf where CpuRef has a
    finite value, or integers that differ."""
    if len(actual) != len(expected):
        return math.inf
    worst = 0.0
    for got, want in zip(actual, expected):
        got = np.asarray(got)
        if got.shape != want.shape or got.dtype != want.dtype:
            return math.inf
        if want.dtype.kind != "f":
            if not np.array_equal(got, want):
                return math.inf
            continue
        if got.size == 0:
            continue
        same_nonfinite = ~np.isfinite(want) & ((got == want) | (np.isnan(got) & np.isnan(want)))
        diff = np.where(same_nonfinite, 0.0, np.abs(got.astype(np.float64) - want))
        if np.isnan(diff).any():
            return math.inf
        finite = np.abs(want[np.isfinite(want)])
        scale = max(float(finite.max()) if finite.size else 0.0, 1e-12)
        worst = max(worst, float(diff.max()) / scale)
    return worst


def options_for(mode: str | None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The backend options of a split's session: ``CpuAcc.compile`` = ``mode`` (None: the default),
    then ``extra`` (``GpuAcc.cuda_graphs``, ...)."""
    return {**({} if mode is None else {"CpuAcc.compile": mode}), **dict(extra or {})}


def run_split(subject: Subject, backends: Sequence[str], pins: Mapping[str, str],
              options: Mapping[str, Any], runs: int = 2) -> tuple[float, InferenceSession]:
    """The worst relative difference to CpuRef over ``runs`` runs of one session (the second one
    replays what the first built: a captured CUDA graph, a compiled partition)."""
    session = InferenceSession(subject.model, backends=list(backends), pins=dict(pins),
                               runtime=Runtime(RuntimeOptions(backend_options=dict(options))))
    worst = 0.0
    for _ in range(runs):
        worst = max(worst, relative_difference(session.run(None, subject.feeds), subject.expected))
    return worst, session


def repro(path: str | Path, backends: Sequence[str], pins: Mapping[str, str], mode: str | None,
          extra: Mapping[str, Any] | None = None) -> str:
    """The command that runs this one split against CpuRef and prints its difference."""
    import json
    import shlex

    words = ["python", "bench/split_fuzz.py", "--models", str(path), "--backends", ",".join(backends),
             "--pins", json.dumps(dict(pins))]
    words += ["--modes", mode] if mode is not None else []
    for key, value in (extra or {}).items():
        words += ["--option", f"{key}={value}"]
    return " ".join(map(shlex.quote, words))


__all__ = ["LIGHT_MODELS", "MODES", "SMALL", "STRATEGIES", "Split", "Subject", "TOLERANCE",
           "group_members", "group_splits", "load_subject", "model_rng", "options_for",
           "relative_difference", "repro", "run_split", "splits"]
