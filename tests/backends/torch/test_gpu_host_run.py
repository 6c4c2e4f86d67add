"""GpuAcc's whole runs from host memory (torch/cuda_host.py): a network of one GpuAcc partition
between the user's NumPy inputs and outputs runs as one CUDA graph with its copies in and out, per
input signature. Which networks take it (``io_map``) is checked on IR graphs on any machine; the
runs (the corpus VAD's decided versions against CpuRef, both rates, new batch sizes, NaN, owned
outputs, device inputs through the network) need CUDA and skip without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backplane.backends.torch.cuda_host import io_map
from backplane.ir.graph import Graph, Layer, TensorInfo

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus"
FUSED = "backplane.torch"


def _layer(name: str, op: str, inputs: list[str], outputs: list[str], backend: str,
           domain: str = "") -> Layer:
    layer = Layer(name, op, inputs, outputs, {}, domain, 1)
    layer.backend = backend
    return layer


def _version(partition_op: str = "Specialized", extra: list[Layer] | None = None,
             outputs: tuple[str, ...] = ("prob@user", "state_out@user")) -> Graph:
    """The decided VAD version's form: x and state handed to GpuAcc, one GpuAcc partition, each
    output waited for and handed to the user (the partition reads state before x)."""
    layers = [_layer("in_x", "MemImport", ["x"], ["x@G"], "builtin"),
              _layer("in_s", "MemImport", ["state"], ["state@G"], "builtin"),
              _layer("part", partition_op, ["state@G", "x@G"], ["state_out", "prob"], "GpuAcc",
                     FUSED),
              *(extra or []),
              _layer("sync_p", "Sync", ["prob"], ["prob@synced"], "builtin"),
              _layer("out_p", "MemImport", ["prob@synced"], ["prob@user"], "builtin"),
              _layer("sync_s", "Sync", ["state_out"], ["state_out@synced"], "builtin"),
              _layer("out_s", "MemImport", ["state_out@synced"], ["state_out@user"], "builtin")]
    names = {n for lay in layers for n in (*lay.inputs, *lay.outputs)}
    return Graph("v", layers, ["x", "state", "sr"], list(outputs),
                 {n: TensorInfo((1,), np.dtype(np.float32)) for n in names})


def test_io_map_follows_the_handovers_to_the_inputs_and_outputs() -> None:
    found = io_map(_version(), ["x", "state", "sr"])
    assert found is not None
    partition, positions, outputs = found
    assert partition.name == "part"
    assert positions == [1, 0]  # state@G from input 1, x@G from input 0; sr unread
    assert outputs == [1, 0]  # prob is the partition's output 1, state_out its 0


def test_io_map_takes_a_static_captured_partition() -> None:
    found = io_map(_version("CudaGraph"), ["x", "state", "sr"])
    assert found is not None and found[0].op_type == "CudaGraph"


@pytest.mark.parametrize("case", ["two partitions", "a CPU layer", "output given back",
                                  "another kind of layer"])
def test_io_map_refuses_other_networks(case: str) -> None:
    if case == "two partitions":
        graph = _version(extra=[_layer("part2", "CudaGraph", ["prob"], ["p2"], "GpuAcc", FUSED)])
    elif case == "a CPU layer":
        graph = _version(extra=[_layer("relu", "Relu", ["x"], ["r"], "CpuAcc")])
    elif case == "output given back":  # the user's x is also an output: not the partition's
        graph = _version(outputs=("prob@user", "x"))
    else:
        graph = _version("Conv")
    assert io_map(graph, ["x", "state", "sr"]) is None


def _gathers() -> tuple[list[Layer], dict[str, np.ndarray]]:
    """Two Gathers of a constant index (the VAD's state[0], state[1]), one index also added."""
    layers = [Layer("g0", "Gather", ["state", "zero"], ["h"], {"axis": 0}, "", 13),
              Layer("g1", "Gather", ["state", "one"], ["c"], {"axis": 0}, "", 13),
              Layer("g2", "Gather", ["x", "rows"], ["xr"], {"axis": 0}, "", 13),
              Layer("add", "Add", ["h", "one_f"], ["y"], {}, "", 13),
              Layer("g3", "Gather", ["x", "two"], ["x2"], {"axis": 1}, "", 13),
              Layer("mul", "Mul", ["x2", "two"], ["z"], {}, "", 13)]
    constants = {"zero": np.array(0, np.int64), "one": np.array(-1, np.int64),
                 "rows": np.array([0, 1], np.int64), "one_f": np.array(1.0, np.float32),
                 "two": np.array(2, np.int64)}
    return layers, constants


def test_constant_gather_indices_stay_on_the_host() -> None:
    from backplane.backends.torch.cuda import _select_indices

    layers, constants = _gathers()
    # "rows" is 1-D (index_select on the device); "two" is also read by a Mul (on the device)
    assert _select_indices(layers, constants) == {"zero", "one"}


torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _runs(session):  # noqa: ANN001, ANN202
    loaded = session.runtime.network(session.network_id)
    (step,) = [s for s, lay in zip(loaded.steps, loaded.layers) if lay.op_type == "DecidedIf"]
    return step.workload.runs


@cuda
def test_corpus_vad_runs_as_one_graph_per_version_and_matches_cpuref() -> None:
    from backplane import InferenceSession
    from backplane.backends.torch.cuda_host import HostGraph, HostRuns

    path = CORPUS / "vad_lstm_if_ts16.onnx"
    session = InferenceSession(path, providers=[("GpuAcc", {"against_cpu": "off"}), "CpuAcc",
                                                "CpuRef"])
    reference = InferenceSession(path, providers=["CpuRef"])
    runs = _runs(session)
    assert all(isinstance(run, HostRuns) for run in runs.values())
    feeds = dict(np.load(CORPUS / "vad_lstm_if_ts16.s0.npz"))
    rng = np.random.default_rng(0)
    seen = []
    for batch, sr in ((1, 16000), (1, 8000), (3, 16000), (1, 16000), (3, 8000)):
        x = rng.standard_normal((batch, feeds["x"].shape[1])).astype(np.float32)
        state = rng.standard_normal((2, batch, feeds["state"].shape[2])).astype(np.float32)
        run = {"x": x, "state": state, "sr": np.array([sr], np.int64)}
        got = session.run(None, run)
        for g, r in zip(got, reference.run(None, run)):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)
        seen.append((run, [g.copy() for g in got], got))
    for run, copies, got in seen:  # each run's outputs its own: no later run changed them
        for c, g in zip(copies, got):
            np.testing.assert_array_equal(c, g)
    built = runs["then_branch"].built
    assert sum(isinstance(g, HostGraph) for g in built.values()) == 2  # batch 1 and 3


@cuda
def test_nan_in_nan_out_and_device_inputs_through_the_network() -> None:
    from backplane import InferenceSession

    path = CORPUS / "vad_lstm_if_ts16.onnx"
    session = InferenceSession(path, providers=[("GpuAcc", {"against_cpu": "off"}), "CpuRef"])
    reference = InferenceSession(path, providers=["CpuRef"])
    feeds = {**dict(np.load(CORPUS / "vad_lstm_if_ts16.s0.npz")), "sr": np.array([16000])}
    feeds["state"] = feeds["state"].copy()
    feeds["state"][0, 0, 3] = np.nan
    got, want = session.run(None, feeds), reference.run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        assert np.isnan(g).any()
    on_gpu = {k: torch.from_numpy(v).cuda() for k, v in feeds.items() if k != "sr"}
    got = session.run(None, {**on_gpu, "sr": feeds["sr"]})
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g.cpu() if hasattr(g, "cpu") else g), w,
                                   rtol=1e-4, atol=1e-5, equal_nan=True)


@cuda
def test_static_versions_capture_their_partition_again_with_copies() -> None:
    """A model of static shapes: each version's partition is captured at load (a CudaGraph
    layer); its whole run captures those layers again with the copies, from the workload (the
    network's graph holds released weights)."""
    from backplane import InferenceSession
    from backplane.backends.torch.cuda_host import HostGraph, HostRuns

    from .test_gpu_control_flow import if_model

    model = if_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2  # x: (2, 16)
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_value = 2
    session = InferenceSession(model, providers=[("GpuAcc", {"against_cpu": "off"}), "CpuRef"])
    reference = InferenceSession(model, providers=["CpuRef"])
    runs = _runs(session)
    assert all(isinstance(run, HostRuns) for run in runs.values())
    rng = np.random.default_rng(3)
    for sr in (16000, 8000, 16000):
        feeds = {"x": rng.standard_normal((2, 16)).astype(np.float32), "sr": np.array([sr])}
        np.testing.assert_allclose(session.run(None, feeds)[0], reference.run(None, feeds)[0],
                                   rtol=1e-4, atol=1e-5)
    assert all(isinstance(g, HostGraph) for run in runs.values() for g in run.built.values())


@cuda
def test_captured_gather_of_a_constant_index_is_a_view() -> None:
    """Inside a CudaGraph layer, state[0] and state[-1] are views of the state (no kernel), the
    values CpuRef's."""
    from backplane.backends.registry import registry
    from backplane.backends.torch import cuda as gpu

    layers, constants = _gathers()
    layer = Layer("cg", "CudaGraph", ["state", "x"], ["h", "c", "xr", "y", "z"],
                  {"layers": layers, "constants": constants, "inputs": ["state", "x"],
                   "outputs": ["h", "c", "xr", "y", "z"]}, FUSED, 1)
    infos = [TensorInfo((2, 3, 4), np.dtype(np.float32)), TensorInfo((3, 4), np.dtype(np.float32))]
    run_layers, static = gpu.graph_parts(layer, registry.create("GpuAcc"), infos)
    state = torch.arange(24, dtype=torch.float32, device="cuda").reshape(2, 3, 4)
    x = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    h, c, xr, y, z = run_layers(state, x)
    assert h.untyped_storage().data_ptr() == state.untyped_storage().data_ptr()
    assert c.untyped_storage().data_ptr() == state.untyped_storage().data_ptr()
    np.testing.assert_array_equal(h.cpu().numpy(), state[0].cpu().numpy())
    np.testing.assert_array_equal(c.cpu().numpy(), state[1].cpu().numpy())
    np.testing.assert_array_equal(xr.cpu().numpy(), x[[0, 1]].cpu().numpy())
    np.testing.assert_array_equal(y.cpu().numpy(), state[0].cpu().numpy() + 1)
    np.testing.assert_array_equal(z.cpu().numpy(), x[:, 2].cpu().numpy() * 2)
