"""The native CNN plan on more than one thread (``cnn_pool.h``): a split record's items (output
pixel chunks, depthwise rows) are shared by the caller and the pool's workers, each item written
by one thread with the one-thread run's arithmetic, so the outputs are the one-thread run's bit for
bit, in every build (this CPU's, AVX2's, plain x86-64's); a session of two threads takes a CNN
above the one-thread size rule natively and its runs use the pool; a one-thread session's runs
never do."""

from __future__ import annotations

import ctypes
import platform
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import native_cnn  # noqa: E402
from backplane.native import build, cnn  # noqa: E402
from tests.native import flavours  # noqa: E402

CORPUS = "tests/data/corpus"
SHARED = ("conv", "dwconv", "maxpool", "avgpool", "resize", "slice", "gather", "scatter", "arith",
          "act", "softmax")
"""The records the threads share (``cnn_split.h``; and the float32 edges)."""
FLAVOURS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"],
            "plain": ["-march=x86-64"]}
pytestmark = pytest.mark.skipif(build.compiler() is None or platform.machine() != "x86_64",
                                reason="needs a C compiler on x86-64")


@pytest.fixture(scope="module")
def libraries(tmp_path_factory) -> dict[str, ctypes.CDLL]:
    folder = tmp_path_factory.mktemp("cnn_threads")
    return {name: flavours.built("cnn", march, folder) for name, march in FLAVOURS.items()}


def _items(library: ctypes.CDLL) -> int:
    """The work items the library's pool workers have run in this process."""
    count = library.backplane_cnn_pool_items
    count.restype = ctypes.c_int64
    return int(count())


def _plan(monkeypatch, path: str, shapes: dict) -> tuple[cnn.Plan, list[str], list[str]]:
    """The route's largest plan of the model's partitions, caught as the session plans them:
    (the plan, its inputs' names, its outputs')."""
    caught = []
    real = cnn.plan

    def catch(*args):
        made = real(*args)
        caught.append((made, list(args[2]), list(args[4])))
        return made

    monkeypatch.setattr(cnn, "plan", catch)
    monkeypatch.setattr(native_cnn, "SMALL", 1 << 62)
    InferenceSession(path, backends=["CpuAcc", "CpuRef"], input_shapes=shapes,
                     provider_options=[{"CpuAcc.native": "auto", "CpuAcc.threads": 1}, {}])
    monkeypatch.setattr(cnn, "plan", real)
    assert caught, "the partition was not planned natively"
    return max(caught, key=lambda found: found[0].flops)


def _runs_split(executor: cnn.Executor, library: ctypes.CDLL, values: list[np.ndarray],
                threads: int) -> list[np.ndarray]:
    """The plan's outputs at ``threads`` threads, after runs enough for a worker to have taken
    part (for up to 20 s: on a busy machine a woken worker may wait for a CPU longer than a
    run takes, and the caller then runs every item)."""
    executor.threads = threads
    before, got = _items(library), executor.numpy(*values)
    until = time.monotonic() + 20
    while _items(library) == before and time.monotonic() < until:
        got = executor.numpy(*values)
    assert _items(library) > before, f"no worker ran any item at {threads} threads"
    return got


@pytest.mark.parametrize("name,side", [("resnet_basic_ts16", 64), ("mobilenet_dw_ts13", 64),
                                       ("unet_resize_ts13", 48), ("yolo_v8_ts17", 0),
                                       ("detect_nms_dyn21", 0)])
def test_split_runs_give_the_one_thread_outputs_bit_for_bit_in_every_build(
        libraries, monkeypatch, name, side):
    """Every record of a shared kind split (``cnn.split`` at 0 and 0), run at 1, 2 and 3 threads (3:
    more than this machine's CPUs) by each build: the same bits as its one-thread run, whose
    outputs that are the model's are ONNX Runtime's within the corpus tests' tolerance (the
    detector's plan feeds its NMS); the workers ran items at 2 and 3."""
    path = f"{CORPUS}/{name}.onnx"
    feeds = dict(np.load(f"{CORPUS}/{name}.s0.npz"))
    if side:
        rng = np.random.default_rng(1)
        feeds = {k: rng.standard_normal((*v.shape[:2], side, side)).astype(v.dtype)
                 for k, v in feeds.items()}
    made, names, outputs = _plan(monkeypatch, path, {k: list(v.shape) for k, v in feeds.items()})
    cnn.split(made.records, 0, 0)
    kinds = made.records[:, cnn.FIELDS.index("op")]
    edges = np.isin(kinds, [cnn.OPS["import"], cnn.OPS["export"]])
    shared = np.isin(kinds, [cnn.OPS[k] for k in SHARED]) | edges & (
        made.records[:, cnn.FIELDS.index("x1")] == 0)
    assert made.records[:, cnn.FIELDS.index("split")].sum() == shared.sum() > 0
    values = [feeds[n] for n in names]
    reference = ort.InferenceSession(path)
    want = dict(zip([o.name for o in reference.get_outputs()], reference.run(None, feeds)))
    assert set(outputs) & set(want) or name.startswith("detect")  # its plan feeds the NMS
    for flavour, library in libraries.items():
        executor = cnn.Executor(made, library)
        assert executor.splits
        one = executor.numpy(*values)
        for n, o in zip(outputs, one):
            if n in want and o.dtype == np.float32:
                w = want[n]
                scale = np.abs(w[np.isfinite(w)]).max(initial=1.0)
                np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-5 * scale, err_msg=flavour)
        for threads in (2, 3):
            got = _runs_split(executor, library, values, threads)
            for g, o in zip(got, one):
                np.testing.assert_array_equal(g, o, err_msg=f"{flavour}, {threads} threads")


def test_a_nan_stays_where_one_thread_puts_it(libraries, monkeypatch):
    """A NaN in the image: the split run's NaNs are the one-thread run's, element for element."""
    path = f"{CORPUS}/resnet_basic_ts16.onnx"
    x = np.random.default_rng(2).standard_normal((1, 3, 48, 48)).astype(np.float32)
    x[0, 1, 20, 30] = np.nan
    name = ort.InferenceSession(path).get_inputs()[0].name
    made, names, _ = _plan(monkeypatch, path, {name: [1, 3, 48, 48]})
    cnn.split(made.records, 0, 0)
    library = libraries["native"]
    executor = cnn.Executor(made, library)
    one = executor.numpy(x)
    assert np.isnan(one[0]).any()
    got = _runs_split(executor, library, [x], 2)
    np.testing.assert_array_equal(got[0], one[0])


def _resnet_at(side: int) -> tuple[str, dict[str, np.ndarray]]:
    path = f"{CORPUS}/resnet_basic_dyn21.onnx"
    name = ort.InferenceSession(path).get_inputs()[0].name
    x = np.random.default_rng(3).standard_normal((1, 3, side, side)).astype(np.float32)
    return path, {name: x}


def test_a_session_of_two_threads_runs_its_plan_on_the_pool(monkeypatch):
    """unet_resize at 192x192 (the rule lifted: above ``SMALL``): native at two threads, its runs
    sharing the split records with the pool (the workload asks torch's count), ONNX Runtime's
    outputs."""
    monkeypatch.setattr(native_cnn, "SMALL", 1 << 62)
    path = f"{CORPUS}/unet_resize_dyn20.onnx"
    name = ort.InferenceSession(path).get_inputs()[0].name
    x = np.random.default_rng(4).standard_normal((1, 3, 192, 192)).astype(np.float32)
    feeds = {name: x}
    want = ort.InferenceSession(path).run(None, feeds)
    library = build.library("cnn")
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                               input_shapes={k: list(v.shape) for k, v in feeds.items()},
                               provider_options=[{"CpuAcc.threads": 2}, {}])
    loaded = session.runtime.network(session.network_id)
    assert [getattr(s.workload, "route", "?") for s, lay in zip(loaded.steps, loaded.layers)
            if lay.op_type == "OneDnnGraph"] == ["native"]
    until = time.monotonic() + 20
    before, got = _items(library), session.run(None, feeds)
    while _items(library) == before and time.monotonic() < until:
        got = session.run(None, feeds)
    assert _items(library) > before
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4 * np.abs(w).max())


def test_the_size_rule_holds_at_two_threads():
    """resnet_basic at 224x224 (~4.7e8 multiply-adds, above ``SMALL``): oneDNN Graph's route at
    two threads as at one (its two threads ran the full tier's CNNs as fast or faster)."""
    path, feeds = _resnet_at(224)
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                               input_shapes={k: list(v.shape) for k, v in feeds.items()},
                               provider_options=[{"CpuAcc.threads": 2}, {}])
    loaded = session.runtime.network(session.network_id)
    assert [getattr(s.workload, "route", "?") for s, lay in zip(loaded.steps, loaded.layers)
            if lay.op_type == "OneDnnGraph"] == ["onednn_graph"]


def test_a_one_thread_run_of_a_split_plan_never_wakes_the_pool(monkeypatch):
    """The rule lifted, a one-thread session plans resnet_basic at 224x224 natively, its large
    convolutions split; its runs (torch's count 1) leave every item to the caller."""
    monkeypatch.setattr(native_cnn, "SMALL", 1 << 62)
    path, feeds = _resnet_at(224)
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"],
                               input_shapes={k: list(v.shape) for k, v in feeds.items()},
                               provider_options=[{"CpuAcc.threads": 1}, {}])
    loaded = session.runtime.network(session.network_id)
    executors = [s.workload.executor for s, lay in zip(loaded.steps, loaded.layers)
                 if lay.op_type == "OneDnnGraph"]
    assert executors and executors[0].splits
    library = build.library("cnn")
    before = _items(library)
    for _ in range(5):
        session.run(None, feeds)
    assert _items(library) == before


def test_two_callers_at_once_get_the_one_thread_outputs(libraries, monkeypatch):
    """Two Python threads running one split plan at once, each asking two threads: one run holds
    the pool, the other runs alone (``team.owner`` tried, never waited for), its arena its own;
    every output is the one-thread run's, bit for bit."""
    import threading

    path = f"{CORPUS}/unet_resize_ts13.onnx"
    name = ort.InferenceSession(path).get_inputs()[0].name
    made, names, _ = _plan(monkeypatch, path, {name: [1, 3, 64, 64]})
    cnn.split(made.records, 0, 0)
    executor = cnn.Executor(made, libraries["native"], threads=2)
    rng = np.random.default_rng(5)
    images = [rng.standard_normal((1, 3, 64, 64)).astype(np.float32) for _ in range(2)]
    executor.threads = 1
    wanted = [executor.numpy(x)[0] for x in images]
    executor.threads = 2
    found: list[list[np.ndarray]] = [[], []]

    def calls(index: int) -> None:
        for _ in range(40):
            found[index].append(executor.numpy(images[index])[0])

    workers = [threading.Thread(target=calls, args=(i,)) for i in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for index in range(2):
        assert len(found[index]) == 40
        for got in found[index]:
            np.testing.assert_array_equal(got, wanted[index])
