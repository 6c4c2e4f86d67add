"""The compile cache: compiled once, reused after; any change of its key compiles again; writes are
atomic; a damaged entry is compiled again, never loaded."""

from __future__ import annotations

import json
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


# -- who may write the folder chooses what is loaded: it must be the user's alone ---------------------
def test_the_folder_is_made_private(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    assert folder.stat().st_mode & 0o777 == 0o700 and len(entries(folder)) == 1


def refused(folder: Path, caplog: pytest.LogCaptureFixture, why: str) -> None:
    """The session compiles in memory: right outputs, nothing written to or read from ``folder``,
    a warning naming the folder and why."""
    before = sorted(folder.iterdir())
    with caplog.at_level("WARNING", logger="backplane.artifact"):
        session = InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    assert sorted(folder.iterdir()) == before
    assert f"the compile cache {folder} is not used: {why}" in caplog.text
    expected = InferenceSession(MODEL, ["CpuRef"]).run(None, FEEDS)
    for a, b in zip(session.run(None, FEEDS), expected):
        assert a.tobytes() == b.tobytes()


def test_a_folder_writable_by_others_is_not_used(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    (entry,) = entries(folder)
    data = bytearray(entry.read_bytes())  # whoever can write there could put anything
    folder.chmod(0o777)
    refused(folder, caplog, "the folder is writable by its group or by others (mode 777)")
    folder.chmod(0o770)
    refused(folder, caplog, "the folder is writable by its group or by others (mode 770)")
    assert entry.read_bytes() == data


def test_a_folder_of_another_user_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """The owner must be this process's user (root owns everything here: the user seen is
    another)."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    owner = folder.stat().st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1000)
    refused(folder, caplog, f"the folder belongs to user {owner}, not to this process's user "
                            f"{owner + 1000}")


def test_an_entry_writable_by_others_is_compiled_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    (entry,) = entries(folder)
    entry.chmod(0o666)
    builds = []
    real = backplane.artifact.build
    monkeypatch.setattr(backplane.artifact, "build",
                        lambda *args, **kwargs: builds.append(1) or real(*args, **kwargs))
    with caplog.at_level("WARNING", logger="backplane.artifact"):
        InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    assert builds == [1] and "the entry is writable by its group or by others (mode 666)" in \
        caplog.text
    assert entry.stat().st_mode & 0o022 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_an_entry_of_another_user_is_compiled_again(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    (entry,) = entries(folder)
    os.chown(entry, 4321, 4321)
    with caplog.at_level("WARNING", logger="backplane.artifact"):
        InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    assert "the entry belongs to user 4321, not to this process's user 0" in caplog.text
    assert entry.stat().st_uid == 0


def test_another_models_artifact_under_this_key_is_not_served(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An entry holding another model's artifact (whole, its checksums right) under this model's
    key: its manifest's model sha256 is not this model's, so it is compiled again and replaced."""
    folder = tmp_path / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    (entry,) = entries(folder)
    other, other_feeds = model_and_feeds("tiny_mobilenet_v3")
    backplane.compile(other, ["CpuRef"], entry)
    theirs = container.read(entry).header["manifest"]["model"]["sha256"]
    with caplog.at_level("WARNING", logger="backplane.artifact"):
        session = InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    assert f"it holds another artifact than this key's: its model sha256 {theirs}" in caplog.text
    expected = InferenceSession(MODEL, ["CpuRef"]).run(None, FEEDS)
    for a, b in zip(session.run(None, FEEDS), expected):
        assert a.tobytes() == b.tobytes()
    manifest = container.read(entry).header["manifest"]
    assert manifest["model"]["sha256"] == cache.model_hash(MODEL)


def test_an_entry_of_other_options_under_this_key_is_not_served(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "cache"
    InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    (entry,) = entries(folder)
    backplane.compile(MODEL, ["CpuRef"], entry, pins={"MatMul": "CpuRef"})
    with caplog.at_level("WARNING", logger="backplane.artifact"):
        InferenceSession(MODEL, ["CpuRef"], cache_dir=folder)
    assert "its pins {'MatMul': 'CpuRef'}, this key's {}" in caplog.text
    assert container.read(entry).header["manifest"]["pins"] == {}


MALFORMED = {
    "a digest that is not hex": lambda identity: {"MODEL": [*identity, "not hex"]},
    "a digest that is a number": lambda identity: {"MODEL": [*identity, 12345]},
    "a digest that is a list": lambda identity: {"MODEL": [*identity, ["ab" * 32]]},
    "a digest too short": lambda identity: {"MODEL": [*identity, "ab"]},
}


@pytest.mark.parametrize("malformed", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_digests_file_is_not_believed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  malformed) -> None:  # type: ignore[no-untyped-def]
    """model-digests.json is input from the folder: an entry whose digest is not a sha256 (hex,
    64 digits) is dropped and the model hashed (it was taken as the digest, whatever it was)."""
    model = tmp_path / "model.onnx"
    model.write_bytes(MODEL.read_bytes())
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    monkeypatch.setattr(cache, "SETTLED_NS", -1)
    truth = cache.model_digest(model, str(folder))
    path = str(model.resolve())
    identity = json.loads((folder / cache.DIGESTS).read_text())[path][:5]
    text = json.dumps(malformed(identity)).replace('"MODEL"', json.dumps(path))
    (folder / cache.DIGESTS).write_text(text)
    assert cache.model_digest(model, str(folder)) == truth
