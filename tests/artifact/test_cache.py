"""The compile cache: compiled once, reused after; any change of its key compiles again; writes are
atomic; a damaged entry is compiled again, never loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import backplane
from backplane import InferenceSession, OptimizerOptions
from backplane.artifact import cache, container
from backplane.backends.registry import registry
from backplane.backends.reference.backend import CpuRef
from tests.artifact.conftest import model_and_feeds

MODEL, FEEDS = model_and_feeds("tiny_bert")


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.bpl"))


def test_compiles_once_then_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "cache"
    first = InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    (entry,) = entries(folder)
    stamp = entry.stat().st_mtime_ns

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again on a cache hit")

    monkeypatch.setattr(backplane.artifact, "build", no_compile)
    second = InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    assert entry.stat().st_mtime_ns == stamp and entries(folder) == [entry]
    expected = InferenceSession(MODEL, ["CpuRef"]).run(None, FEEDS)
    for session in (first, second):
        for a, b in zip(session.run(None, FEEDS), expected):
            assert a.tobytes() == b.tobytes()


def test_the_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cache.CACHE_VARIABLE, str(tmp_path / "env"))
    InferenceSession(MODEL, ["CpuRef"])
    assert len(entries(tmp_path / "env")) == 1


def key(**changes: object) -> str:
    parts = {"model": MODEL, "ids": ["CpuRef"], "options": {}, "registry": registry, "pins": {},
             "optimizer": {}, "input_shapes": None, **changes}
    return cache.key(parts.pop("model"), parts.pop("ids"), parts.pop("options"),
                     parts.pop("registry"), **parts)  # type: ignore[arg-type]


def test_every_part_of_the_key_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = key()
    assert key() == base  # stable
    other = tmp_path / "other.onnx"
    other.write_bytes(MODEL.read_bytes() + b" ")  # one byte more
    changed = {
        "model": key(model=other),
        "backends": key(ids=["CpuAcc", "CpuRef"]),
        "options": key(options={"CpuAcc.compile": "layers"}),
        "pins": key(pins={"MatMul": "CpuRef"}),
        "optimizer": key(optimizer={"fold_constants": False}),
        "input_shapes": key(input_shapes={"x": [1, 2]}),
    }
    monkeypatch.setattr(CpuRef, "version", "9.9.9")
    changed["backend version"] = key()
    monkeypatch.undo()
    monkeypatch.setattr(CpuRef, "machine_facts", lambda self: {"isa": "something else"})
    changed["machine facts"] = key()
    monkeypatch.undo()
    monkeypatch.setattr(backplane, "__version__", "99.0")
    changed["backplane version"] = key()
    monkeypatch.undo()
    assert key() == base
    same = [part for part, value in changed.items() if value == base]
    assert not same, f"the key ignores: {same}"


def test_a_changed_option_compiles_a_second_entry(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder,
                     optimizer_options=OptimizerOptions(fold_constants=False))
    assert len(entries(folder)) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_entry_is_compiled_again(tmp_path: Path, damage: str) -> None:
    folder = tmp_path / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    (entry,) = entries(folder)
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    entry.write_bytes(bytes(data))
    with pytest.raises(container.ArtifactError):
        container.read(entry)
    session = InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    container.read(entry)  # whole again
    for a, b in zip(session.run(None, FEEDS), InferenceSession(MODEL, ["CpuRef"]).run(None, FEEDS)):
        assert a.tobytes() == b.tobytes()


def test_two_processes_fill_one_entry_at_once(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    script = ("import sys, numpy as np; from backplane import InferenceSession; "
              "s = InferenceSession(sys.argv[1], ['CpuRef'], cache_dir=sys.argv[2]); "
              "feeds = dict(np.load(sys.argv[3])); "
              "np.save(sys.argv[4], s.run(None, feeds)[0])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    npz = MODEL.with_suffix(".npz")
    children = [subprocess.Popen([sys.executable, "-c", script, str(MODEL), str(folder), str(npz),
                                  str(tmp_path / f"out{i}.npy")], env=env,
                                 stderr=subprocess.PIPE) for i in range(2)]
    for child in children:
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err.decode()[-2000:]
    (entry,) = entries(folder)
    container.read(entry)
    assert not list(folder.glob("*.tmp"))
    expected = InferenceSession(MODEL, ["CpuRef"]).run(None, FEEDS)[0]
    for i in range(2):
        assert np.load(tmp_path / f"out{i}.npy").tobytes() == expected.tobytes()


def test_a_hit_does_not_read_the_model_again(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The model file's digest is remembered under its identity (inode, size, times); a file
    written to since is hashed again, and its key changes with its bytes."""
    model = tmp_path / "model.onnx"
    model.write_bytes(Path(MODEL).read_bytes())
    folder = str(tmp_path / "cache")
    monkeypatch.setattr(cache, "SETTLED_NS", -1)  # the file is new: remember it all the same
    first = cache.key(model, ["CpuRef"], {}, registry, directory=folder)

    def unread(model: object) -> str:
        raise AssertionError("the model was hashed again")

    with monkeypatch.context() as patch:
        patch.setattr(cache, "model_hash", unread)
        assert cache.key(model, ["CpuRef"], {}, registry, directory=folder) == first
    model.write_bytes(model.read_bytes() + b"\0")  # other bytes (the key never parses them)
    assert cache.key(model, ["CpuRef"], {}, registry, directory=folder) != first
    assert cache.key(model, ["CpuRef"], {}, registry) == \
        cache.key(model, ["CpuRef"], {}, registry, directory=folder)


def test_a_freshly_written_model_is_not_remembered(tmp_path: Path) -> None:
    """Written within SETTLED_NS before it was hashed: hashed again at every key."""
    model = tmp_path / "model.onnx"
    model.write_bytes(Path(MODEL).read_bytes())
    cache.key(model, ["CpuRef"], {}, registry, directory=str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / cache.DIGESTS).exists()
