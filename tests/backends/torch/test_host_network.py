"""A CpuAcc network whose steps all run on NumPy arrays (a detector's native plan, then its
HostChain) runs as one straight function of those runs (``fusion/host_network.py``): the corpus's
detectors take it, their selections CpuRef's and ONNX Runtime's, their outputs the caller's; a
HostChain's NumPy run copies an output that is a view or given twice; a network that is not
straight, or a run that raises, goes back to the steps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch.fusion import host_chain, host_network  # noqa: E402
from backplane.ir.graph import Layer  # noqa: E402
from backplane.runtime import host_route  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402

CORPUS = Path(__file__).parents[2] / "data" / "corpus"


def _static(name: str, tmp_path: Path) -> str:
    """The corpus detector with its input's free dimensions fixed to its sample's: no
    Specialized layer, the session's own network the native plan and the HostChain between
    MemImports."""
    import onnx

    model = onnx.load(str(CORPUS / f"{name}.onnx"))
    for dim, size in zip(model.graph.input[0].type.tensor_type.shape.dim, (1, 3, 32, 32)):
        dim.ClearField("dim_param")
        dim.dim_value = size
    path = tmp_path / f"{name}_static.onnx"
    onnx.save(model, str(path))
    return str(path)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("name", ["detect_nms_dyn21", "detect_nms_ts14"])
def test_detectors_run_as_one_host_network(name, static, monkeypatch, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    calls: list[bool] = []
    code = host_network._code

    def counting(*args):  # the network's NumPy run, counted: from the steps' run or a direct one
        host = code(*args)

        def counted(*arrays):
            made = host(*arrays)
            calls.append(made is not None)
            return made

        return counted

    monkeypatch.setattr(host_network, "_code", counting)
    path = _static(name, tmp_path) if static else str(CORPUS / f"{name}.onnx")
    session = InferenceSession(path, backends=["CpuAcc", "CpuRef"], runtime=Runtime(
        RuntimeOptions(backend_options={"CpuAcc.threads": 1})))
    ref = InferenceSession(path, providers=["CpuRef"])
    peer = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for sample in ("s0",) if static else ("s0", "s1"):
        feeds = dict(np.load(CORPUS / f"{name}.{sample}.npz"))
        first = session.run(None, feeds)
        calls.clear()
        got = session.run(None, feeds)
        assert calls == [True]  # the network's one NumPy run, taken
        for a in got:
            assert not any(np.shares_memory(a, b) for b in (*first, *feeds.values()))
        for want in (ref.run(None, feeds), peer.run(None, feeds)):
            for a, b in zip(got, want):
                assert a.shape == b.shape and a.dtype == b.dtype
                if a.dtype == np.int64:
                    np.testing.assert_array_equal(a, b)
                else:
                    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _chain_layer() -> Layer:
    """A HostChain of: a Gather of one column of the selections (a view inside), an Add (fresh),
    a Reshape of the chain's input (a view of the caller's array), an Identity of the Add (the
    same array again): outputs [shifted, flat, same, selected]."""
    layers = [
        Layer("col", "Gather", ["selected", "zero"], ["column"], {"axis": 1}, "", 13),
        Layer("add", "Add", ["column", "one"], ["shifted"], {}, "", 14),
        Layer("flat", "Reshape", ["selected", "shape"], ["flat"], {}, "", 14),
        Layer("same", "Identity", ["shifted"], ["same"], {}, "", 14),
    ]
    constants = {"zero": np.int64(0), "one": np.int64(1), "shape": np.int64([-1])}
    return Layer("HostChain[col..same](4 layers)", "HostChain", ["selected"],
                 ["shifted", "flat", "same", "selected"],
                 {"layers": layers, "constants": constants, "inputs": ["selected"],
                  "outputs": ["shifted", "flat", "same", "selected"], "ranks": {"selected": 2}},
                 "backplane.fused", 1)


def test_chain_host_run_copies_views_and_repeats():
    run = host_chain.host_chain_workload(_chain_layer(), None)
    host = host_route.of(run)
    assert host is not None and run.plans_network is host_network.planner
    selected = np.arange(12, dtype=np.int64).reshape(4, 3)
    shifted, flat, same, again = host(selected)
    np.testing.assert_array_equal(shifted, selected[:, 0] + 1)
    np.testing.assert_array_equal(flat, selected.reshape(-1))
    np.testing.assert_array_equal(same, shifted)
    np.testing.assert_array_equal(again, selected)
    outputs = (shifted, flat, same, again)
    for k, a in enumerate(outputs):
        assert type(a) is np.ndarray and a.flags.c_contiguous and a.flags.writeable
        assert not np.shares_memory(a, selected)
        assert not any(np.shares_memory(a, b) for b in outputs[k + 1:])
    torch_run = run(torch.from_numpy(selected))  # the torch run: the same values
    for a, b in zip(torch_run, outputs):
        np.testing.assert_array_equal(a.numpy(), b)


def _offering(host):
    def workload(*values):  # the steps' run (never called by the host network)
        raise AssertionError

    host_route.offer(workload, host)
    return workload


def _step(workload, inputs, outputs, convert=None):
    return SimpleNamespace(workload=workload, inputs=tuple(inputs), outputs=tuple(outputs),
                           convert=convert)


def test_planner_takes_straight_networks_only():
    double = _offering(lambda a: [a * 2, a + 1])
    add = _offering(lambda a, b, c: [a + b + c])
    template = [None, None, None, None, torch.tensor([10.0]), None]
    steps = [_step(double, [1], [2, 3]), _step(add, [2, 3, 4], [5])]
    network = host_network.planner(steps, [], template, [1], [5])
    assert network is not None and host_route.of(network) is network.host  # lent to a build
    (out,) = network([torch.tensor([1.0, 2.0])])
    assert isinstance(out, torch.Tensor)
    np.testing.assert_array_equal(out.numpy(), [14.0, 17.0])  # 2a + (a + 1) + 10
    assert network([np.float32([1.0])]) is None  # not the backend's tensors: the steps run
    assert network.make((), ())(np.float32([1.0]))[0].tolist() == [14.0]
    plain = lambda *values: values  # noqa: E731  # a workload without a NumPy run
    assert host_network.planner([_step(double, [1], [2, 3]), _step(plain, [2], [5])], [],
                                template, [1], [5]) is None
    assert host_network.planner(steps, [], template, [1], [1]) is None  # an input given back
    assert host_network.planner(steps, [], template, [1], [5, 5]) is None  # an output twice
    unknown = [_step(double, [1], [2, 3]), _step(add, [2, 3, 6], [5])]  # slot 6: no value
    assert host_network.planner(unknown, [], [*template, None], [1], [5]) is None
    handover = [_step(double, [1], [2, 3], convert=lambda v: v), _step(add, [2, 3, 4], [5])]
    assert host_network.planner(handover, [], template, [1], [5]) is None


def test_handovers_make_a_network_on_the_callers_arrays():
    """MemImports (the caller's arrays handed to CpuAcc and back) are the same arrays: such a
    network takes NumPy arrays and gives its outputs as they are; one handed back in part, or
    a step reading the caller's array itself, is not taken."""
    double = _offering(lambda a: [a * 2, a + 1])
    add = _offering(lambda a, b: [a + b])
    copy = SimpleNamespace(op_type="MemImport")
    same = lambda v: v  # noqa: E731
    steps = [_step(None, [1], [2], same), _step(double, [2], [3, 4]), _step(add, [3, 4], [5]),
             _step(None, [5], [6], same)]
    layers = [copy, None, None, copy]
    network = host_network.planner(steps, layers, [None] * 7, [1], [6])
    assert network is not None and network.on_host
    (out,) = network([np.float32([1.0, 2.0])])
    assert type(out) is np.ndarray
    np.testing.assert_array_equal(out, [4.0, 7.0])
    assert network([torch.tensor([1.0])]) is None
    assert host_network.planner(steps, layers, [None] * 7, [1], [6, 5]) is None  # in part
    direct = [steps[0], _step(double, [1], [3, 4]), *steps[2:]]
    assert host_network.planner(direct, layers, [None] * 7, [1], [6]) is None
    other = [SimpleNamespace(op_type="Relu"), None, None, copy]
    assert host_network.planner(steps, other, [None] * 7, [1], [6]) is None


def test_a_run_that_raises_goes_back_to_the_steps():
    def failing(a):
        raise IndexError("index 9 is out of bounds")

    steps = [_step(_offering(lambda a: [a + 1]), [1], [2]), _step(_offering(failing), [2], [3])]
    network = host_network.planner(steps, [], [None] * 4, [1], [3])
    assert network is not None
    assert network([torch.tensor([1.0])]) is None
    assert network.make((), ())(np.float32([1.0])) is None
