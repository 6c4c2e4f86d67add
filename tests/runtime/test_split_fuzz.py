"""Split fuzzing against CpuRef (issue 18, item 2): random splits of the small models between CpuAcc
(or GpuAcc) and CpuRef, with ``CpuAcc.compile`` at each of its values, each within 1e-4 of CpuRef
alone. This is the CI slice, a few splits of the cheap models; bench/split_fuzz.py is the long run
(more splits, every light model, other backends), with the same generator (tests/runtime/split_fuzz.py).

A split pins layers of the imported graph (by name) or op types to CpuRef, which cuts CpuAcc's part
of the model into partitions: each partition is fused and compiled (or not) on its own, and handed
tensors in the layout the one before left them in (010ad4f: a compiled partition traced on contiguous
samples was 0.081 off, on a scale of 0.26, when handed channels-last ones).
"""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.models.test_models import LIGHT_DIR  # noqa: E402
from tests.runtime import split_fuzz as fuzz  # noqa: E402

pytestmark = pytest.mark.slow  # random splits of whole models: `python -m pytest -m slow`
SEED = 0

CI_SLICE = {path.stem: path for path in fuzz.SMALL} | {
    name: LIGHT_DIR / f"{name}.onnx" for name in ("light_squeezenet", "light_bvlc_alexnet")}
"""The models of the CI slice. The other light models are the long run's (bench/split_fuzz.py):
a split of light_vgg19 takes 2 to 18 s to load here (three modes, 2 cores), light_densenet121,
light_inception_v2, light_resnet50 and light_shufflenet 1 to 10 s, light_inception_v1 and
light_zfnet512 about 1 s; a split of these takes 0.03 to 0.4 s."""

RANDOM_SPLITS = {"tiny_mobilenet_v3": 5, "tiny_bert": 5, "tiny_gpt2": 5, "mobilenet_v2_w020_c10": 3,
                 "light_squeezenet": 2, "light_bvlc_alexnet": 2}
"""Random splits per model, after the one per op type inside a fused group (``group_splits``)."""


@functools.lru_cache(maxsize=None)
def subject(name: str) -> fuzz.Subject:
    return fuzz.load_subject(CI_SLICE[name])


def ci_splits(name: str) -> list[fuzz.Split]:
    sub = subject(name)
    return fuzz.splits(sub.layers, fuzz.model_rng(SEED, sub), RANDOM_SPLITS[name])


def check(name: str, backends: list[str], mode: str | None, extra: dict | None = None,
          to: str = fuzz.REFERENCE) -> None:
    """Every split of ``name``'s CI slice: its pinned layers on CpuRef, the rest on the first
    backend, its outputs (two runs) within TOLERANCE of CpuRef alone. All splits run; the message
    names each that is off, with the command that repeats it."""
    if not CI_SLICE[name].is_file():
        pytest.skip("the installed onnx ships no light models")  # as tests/models/test_models.py
    sub = subject(name)
    options = fuzz.options_for(mode, extra)
    failures = []
    for split in ci_splits(name):
        diff, session = fuzz.run_split(sub, backends, split.pins, options)
        report = session.report
        pinned = {p.name for p in report.layers.values()
                  if p.name in split.pins or p.op_type in split.pins}
        assert pinned and all(report.layers[n].backend == to for n in pinned), \
            (name, str(split), {n: report.layers[n].backend for n in pinned})
        assert backends[0] in report.counts(), (name, str(split), report.counts())
        if not diff <= fuzz.TOLERANCE:
            failures.append(f"{name}, mode {mode}, {split}: {diff:.3g} off CpuRef (relative to its "
                            f"largest magnitude)\n  repro: "
                            f"{fuzz.repro(_shown(CI_SLICE[name]), backends, split.pins, mode, extra)}")
    assert not failures, f"{len(failures)} split(s) off by more than {fuzz.TOLERANCE}:\n" + \
        "\n".join(failures)


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(fuzz.ROOT))
    except ValueError:
        return str(path)


@pytest.mark.parametrize("mode", fuzz.MODES)
@pytest.mark.parametrize("name", list(CI_SLICE))
def test_random_splits_match_cpuref(name: str, mode: str) -> None:
    check(name, ["CpuAcc", "CpuRef"], mode)


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graph", "eager"])
@pytest.mark.parametrize("name", list(CI_SLICE))
def test_random_splits_on_the_gpu_match_cpuref(name: str, graphs: bool) -> None:
    """GpuAcc first, CpuAcc for what it refuses, the pinned layers on CpuRef: every partition of
    GpuAcc's is a captured CUDA graph (or its layers one by one, eager), its inputs uploaded and its
    outputs downloaded at each crossing. fp32 (``GpuAcc.tf32`` off by default), so held to 1e-4 as
    well."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    check(name, ["GpuAcc", "CpuAcc", "CpuRef"], "auto", {"GpuAcc.cuda_graphs": graphs})


# -- the generator ----------------------------------------------------------------------------------

def test_the_splits_are_the_same_for_a_seed_and_differ_between_seeds() -> None:
    sub = subject("tiny_mobilenet_v3")
    first = fuzz.splits(sub.layers, fuzz.model_rng(SEED, sub), 10)
    again = fuzz.splits(sub.layers, fuzz.model_rng(SEED, sub), 10)
    other = fuzz.splits(sub.layers, fuzz.model_rng(SEED + 1, sub), 10)
    assert first == again
    assert first != other
    keys = [tuple(sorted(s.pins)) for s in first]
    assert len(set(keys)) == len(keys)  # distinct
    assert {s.strategy for s in first} >= set(fuzz.STRATEGIES)  # each strategy, within ten
    names = {layer.name for layer in sub.layers}
    types = {layer.op_type for layer in sub.layers}
    for split in first:
        assert split.pins and set(split.pins.values()) == {"CpuRef"}
        assert all(pin in names for pin in split.pins) or all(pin in types for pin in split.pins)
        assert set(split.pins) != names and set(split.pins) != types  # never everything


def test_the_fused_groups_hold_the_layers_after_a_conv_and_the_squeeze_excite_scale() -> None:
    """The layers a single pin is put in the middle of: the HardSigmoid and Mul of every
    squeeze-and-excitation block, the activation after a Conv, not the Convs themselves."""
    sub = subject("tiny_mobilenet_v3")
    inside = fuzz.group_members(sub.layers)
    types = {layer.op_type for layer in inside}
    assert {"HardSigmoid", "Mul", "Relu", "HardSwish", "Add"} <= types
    assert not types & fuzz.ANCHORS
    hard_sigmoids = [layer for layer in sub.layers if layer.op_type == "HardSigmoid"]
    assert all(layer in inside for layer in hard_sigmoids)
    pinned = fuzz.group_splits(sub.layers)
    assert [s.strategy for s in pinned if len(s.pins) == 1] == [s.strategy for s in pinned]
    assert {"in_group[HardSigmoid]", "in_group[Mul]"} <= {s.strategy for s in pinned}


def test_a_split_that_is_off_is_reported() -> None:
    """The comparison catches what it is for: an output changed by 1e-3 of its largest magnitude,
    a NaN, another shape."""
    sub = subject("tiny_mobilenet_v3")
    (want,) = sub.expected
    assert fuzz.relative_difference([want.copy()], sub.expected) == 0.0
    shifted = want.copy()
    shifted.flat[random.Random(SEED).randrange(want.size)] += 1e-3 * float(abs(want).max())
    assert fuzz.relative_difference([shifted], sub.expected) == pytest.approx(1e-3, rel=1e-3)
    broken = want.copy()
    broken.flat[0] = float("nan")
    assert fuzz.relative_difference([broken], sub.expected) == float("inf")
    assert fuzz.relative_difference([want[:, :1]], sub.expected) == float("inf")
    assert fuzz.relative_difference([], sub.expected) == float("inf")
