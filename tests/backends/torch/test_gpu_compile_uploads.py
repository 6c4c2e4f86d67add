"""GpuAcc.compile's trace with its uploads folded (``gpu_compile.uploads_folded``): a host constant a
kernel copies to the device at its first run (``torch.from_numpy(b).to(device)``, then kept) is
traced as that constant and its copy, which the compiled function made at every call from pageable
memory, and a CUDA graph cannot capture. Checked on any machine with the meta device standing for
the GPU; on CUDA, the compiled function captured and its replays' values."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
WEIGHT = np.arange(12, dtype=np.float32).reshape(4, 3)


def _layers() -> object:
    """A product by a NumPy weight uploaded at the first call and kept, then an in-place add
    (mutable: kept by the rewrite) and a host-side float64 copy of a constant (not an upload)."""
    kept: dict = {}

    def run(x: object) -> list:
        if kept.get("device") != x.device:  # type: ignore[attr-defined]
            kept.update(device=x.device, w=torch.from_numpy(WEIGHT).to(x.device))  # type: ignore[attr-defined]
        y = torch.matmul(x, kept["w"])
        y.add_(torch.from_numpy(WEIGHT[0]).double().float().to(x.device))  # type: ignore[attr-defined]
        return [y]

    return run


def _uploads(traced: object) -> list:
    """The graph's copies to a device of a host constant."""
    aten = torch.ops.aten
    found = []
    for node in traced.graph.nodes:  # type: ignore[attr-defined]
        if node.target is aten._to_copy.default and node.kwargs.get("device") is not None \
                and torch.device(node.kwargs["device"]).type != "cpu":
            source = node.args[0]
            while source.op == "call_function" and source.target in (
                    aten.lift_fresh_copy.default, aten._to_copy.default):
                source = source.args[0]
            if source.op == "get_attr":
                found.append(node)
    return found


def test_a_traced_upload_becomes_a_device_constant() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from backplane.backends.torch.gpu_compile import uploads_folded

    x = torch.empty(2, 4, device="meta")
    traced = make_fx(_layers(), tracing_mode="real")(x)
    assert len(_uploads(traced)) == 2
    folded = uploads_folded(traced)
    assert _uploads(folded) == []
    targets = [n.target for n in folded.graph.nodes]
    assert torch.ops.aten.add_.Tensor in targets  # the in-place add stays
    constants = {n.target: getattr(folded, n.target) for n in folded.graph.nodes
                 if n.op == "get_attr"}
    assert all(t.device.type == "meta" for t in constants.values()), constants
    assert {tuple(t.shape) for t in constants.values()} == {(4, 3), (3,)}
    (y,) = folded(x)
    assert y.shape == (2, 3) and y.device.type == "meta"


def test_an_upload_written_into_stays_a_copy_at_each_call() -> None:
    """Made once, a tensor written in place would carry one call's writes into the next."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from backplane.backends.torch.gpu_compile import uploads_folded

    def run(x: object) -> list:
        b = torch.from_numpy(WEIGHT[0]).to(x.device)  # type: ignore[attr-defined]
        b.add_(x[0, :3])  # type: ignore[index]
        c = torch.from_numpy(WEIGHT[1]).to(x.device)  # type: ignore[attr-defined]
        c.view(1, 3).mul_(2)
        return [b + c]

    folded = uploads_folded(make_fx(run, tracing_mode="real")(torch.empty(2, 4, device="meta")))
    assert len(_uploads(folded)) == 2


def test_a_host_graph_is_left_as_it_is() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx

    from backplane.backends.torch.gpu_compile import uploads_folded

    x = torch.ones(2, 4)
    traced = make_fx(_layers(), tracing_mode="real")(x)
    before = traced.code
    assert uploads_folded(traced).code == before
    np.testing.assert_array_equal(traced(x)[0].numpy(), np.ones((2, 4)) @ WEIGHT + WEIGHT[0])


@cuda
def test_a_compiled_upload_is_captured_and_replays_new_inputs() -> None:
    from backplane.backends.torch.cuda import CapturedGraph, compiled

    device = torch.device("cuda")
    static = [torch.zeros(2, 4, device=device)]
    function = compiled(_layers(), static, "inductor", "uploads")
    graph = CapturedGraph(function, static, device)  # a copy from pageable memory: CaptureError
    for scale in (1.0, -2.5):
        x = np.full((2, 4), scale, np.float32)
        (y,) = graph(torch.from_numpy(x).to(device))
        np.testing.assert_allclose(y.cpu().numpy(), x @ WEIGHT + WEIGHT[0], rtol=1e-6)
