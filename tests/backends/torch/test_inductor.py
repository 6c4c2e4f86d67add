"""``CpuAcc.compile`` "inductor" (backends/torch/inductor.py): a partition compiled by
TorchInductor's C++ backend gives CpuRef's values, NaN where CpuRef has it (inductor's fused ReLU
and max pool drop it: the route's own input check hands such a run to CpuAcc's own route), and a
machine without a C++ compiler gets an error that says so at load."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backplane import InferenceSession  # noqa: E402
from backplane.backends.torch import inductor  # noqa: E402
from backplane.runtime.runtime import Runtime, RuntimeOptions  # noqa: E402
from tests.backends.torch.test_graph_rule import _inner_layers  # noqa: E402


def _compiler() -> bool:
    try:
        inductor.compiler()
    except inductor.CompilerMissing:
        return False
    return True


needs_compiler = pytest.mark.skipif(not _compiler(), reason="no C++ compiler for TorchInductor")


class SmallCnn(torch.nn.Module):
    """Conv -> ReLU -> MaxPool -> Conv -> ReLU -> Flatten -> Linear: one OneDnnGraph partition."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
            torch.nn.Linear(8 * 4 * 4, 5))

    def forward(self, x):
        return self.body(x)


def _exported() -> bytes:
    buffer = io.BytesIO()
    torch.onnx.export(SmallCnn().eval(), (torch.zeros(1, 3, 8, 8),), buffer, opset_version=17,
                      input_names=["x"], output_names=["y"], dynamo=False)
    return buffer.getvalue()


def _session(model: bytes, tmp_path) -> InferenceSession:
    """An "inductor" session whose route cache and inductor's cache are ``tmp_path``'s."""
    options = {"CpuAcc.route_cache": False, "CpuAcc.compile": "inductor"}
    return InferenceSession(model, backends=["CpuAcc", "CpuRef"],
                            runtime=Runtime(RuntimeOptions(backend_options=options)))


def _partition_work(session: InferenceSession) -> object:
    (work,) = [w for layer, w in _inner_layers(session) if layer.op_type in inductor.PARTITIONS]
    while hasattr(work, "work"):
        work = work.work
    return work


@pytest.mark.slow  # a minute of g++ on a busy 2-core machine
@needs_compiler
def test_a_partition_compiled_by_inductor_gives_cpurefs_values_and_keeps_nan(tmp_path) -> None:
    model = _exported()
    session = _session(model, tmp_path)
    assert _partition_work(session).route == "inductor"
    reference = InferenceSession(model, backends=["CpuRef"])
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (got,), (want,) = session.run(None, {"x": x}), reference.run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    x[0, 1, 2, 3] = np.nan
    (got,), (want,) = session.run(None, {"x": x}), reference.run(None, {"x": x})
    assert np.isnan(want).all() and np.isnan(got).all()  # through the Linear: every output


def test_no_cpp_compiler_is_an_error_that_says_so(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path) -> None:
    from torch._inductor import config

    inductor.compiler.cache_clear()
    monkeypatch.setattr(config.cpp, "cxx", ("no-such-c++-compiler",))
    try:
        with pytest.raises(inductor.CompilerMissing, match="needs a C.. compiler") as raised:
            _session(_exported(), tmp_path)
        assert "no-such-c++-compiler" in str(raised.value)
    finally:
        inductor.compiler.cache_clear()
