"""InferenceSession as ONNX Runtime users hold it: backends / providers with options, SessionOptions,
RunOptions, get_modelmeta; the older spelling (runtime=Runtime(RuntimeOptions(...)), pins=) still works."""

from __future__ import annotations

import logging
import os

import numpy as np
import onnx
import pytest

import backplane
from backplane import InferenceSession, Runtime, RuntimeOptions, RunOptions, SessionOptions
from backplane.backends.api.backend import Backend, OptionError
from backplane.backends.registry import registry
from backplane.optimizer.optimize import OptimizationError
from tests.conftest import small_cnn_model

X = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
MODEL = small_cnn_model().SerializeToString()
LOUD = logging.getLogger("backplane.tests.loud")


def loud_relu(x):
    LOUD.warning("relu ran on %s", list(x.shape))
    return (np.maximum(x, 0),)


class Loud(Backend):
    """Relu only, logging a warning at every call; takes two options."""

    id = "TestLoud"
    version = "0.1.0"
    KERNELS = {"Relu": {6: loud_relu}}
    OPTIONS = {"TestLoud.level": "a number", "TestLoud.name": "a name"}


@pytest.fixture
def loud():
    with registry.temporarily(Loud.id, Loud):
        yield


def options_of(session: InferenceSession, backend: str) -> dict:
    return dict(session.optimized.backends[backend].options.values)


def test_backends_take_options_as_pairs_and_they_reach_the_sessions_backends(loud) -> None:
    session = InferenceSession(MODEL, backends=[("TestLoud", {"level": 3, "TestLoud.name": "a"}),
                                                "CpuRef"])
    assert options_of(session, "TestLoud") == {"TestLoud.level": 3, "TestLoud.name": "a"}
    assert session.runtime.options.backend_options == {"TestLoud.level": 3, "TestLoud.name": "a"}
    assert session.get_provider_options() == {"TestLoud": {"level": 3, "name": "a"}}
    assert session.get_providers() == ["TestLoud", "CpuRef"]
    assert session.report.backend_of("relu1") == "TestLoud"


def test_providers_is_an_alias_and_provider_options_run_parallel(loud) -> None:
    session = InferenceSession(MODEL, providers=["TestLoud", "CpuRef"],
                               provider_options=[{"level": 1}, {}])
    assert options_of(session, "TestLoud") == {"TestLoud.level": 1}
    (probs,) = session.run(None, {"x": X})
    (reference,) = InferenceSession(MODEL, ["CpuRef"]).run(None, {"x": X})
    np.testing.assert_allclose(probs, reference, rtol=1e-6)
    with pytest.raises(ValueError, match="give backends= or providers="):
        InferenceSession(MODEL, backends=["CpuRef"], providers=["CpuRef"])
    with pytest.raises(ValueError, match="provider_options has 1 entries for 2 backends"):
        InferenceSession(MODEL, providers=["TestLoud", "CpuRef"], provider_options=[{}])


def test_an_unknown_backend_option_is_an_error_listing_the_backends_options(loud) -> None:
    with pytest.raises(OptionError, match=r"'TestLoud.levle': not an option of TestLoud; its "
                                          r"options are: TestLoud.level, TestLoud.name"):
        InferenceSession(MODEL, backends=[("TestLoud", {"levle": 1}), "CpuRef"])
    with pytest.raises(OptionError, match="'CpuRef.threads' given for TestLoud"):
        InferenceSession(MODEL, backends=[("TestLoud", {"CpuRef.threads": 1}), "CpuRef"])
    with pytest.raises(TypeError, match=r"backends\[0\] must be a backend id or an \(id, "):
        InferenceSession(MODEL, backends=[("TestLoud", 1), "CpuRef"])
    with pytest.raises(TypeError, match="must be a list of backend ids"):
        InferenceSession(MODEL, backends="CpuRef")


def test_session_options_unknown_names_are_errors_listing_the_valid_ones() -> None:
    options = SessionOptions()
    with pytest.raises(AttributeError, match=r"SessionOptions has no option 'intra_op_threads' "
                                             r"\(did you mean 'intra_op_num_threads'\?\); its "
                                             r"options are: intra_op_num_threads, strict, pins"):
        options.intra_op_threads = 2
    with pytest.raises(AttributeError, match="has no option 'graph_optimization_level'"):
        SessionOptions(graph_optimization_level=99)
    with pytest.raises(AttributeError, match="RunOptions has no option 'tag'"):
        RunOptions().tag  # noqa: B018 - reading is checked too
    with pytest.raises(ValueError, match="intra_op_num_threads must be an int >= 0"):
        options.intra_op_num_threads = -1
    with pytest.raises(ValueError, match=r"log_severity_level must be 0 \(verbose\)"):
        options.log_severity_level = 7
    with pytest.raises(ValueError, match="enable_profiling must be True or False"):
        options.enable_profiling = "yes"
    options.intra_op_num_threads = 2
    assert options.intra_op_num_threads == 2 and options.strict is False
    assert "intra_op_num_threads=2" in repr(options)


def test_session_options_come_second_as_in_onnx_runtime(loud) -> None:
    options = SessionOptions(pins={"Relu": "TestLoud"})
    session = InferenceSession(MODEL, options, providers=["CpuRef", "TestLoud"])
    assert session.get_session_options() is options
    assert session.report.backend_of("relu1") == "TestLoud"  # pinned, though CpuRef comes first
    with pytest.raises(TypeError, match="is sess_options, and sess_options= is given too"):
        InferenceSession(MODEL, options, sess_options=options)
    with pytest.raises(TypeError, match="sess_options must be a backplane.SessionOptions"):
        InferenceSession(MODEL, ["CpuRef"], sess_options={"strict": True})


def test_pins_from_session_options_and_pins_keyword_both_apply_and_must_agree(loud) -> None:
    session = InferenceSession(MODEL, backends=["CpuRef", "TestLoud"],
                               sess_options=SessionOptions(pins={"relu1": "TestLoud"}),
                               pins={"relu2": "TestLoud"})
    assert session.report.backend_of("relu1") == "TestLoud"
    assert session.report.backend_of("relu2") == "TestLoud"
    with pytest.raises(OptionError, match="relu1 is 'TestLoud' in SessionOptions.pins but "
                                          "'CpuRef' in pins="):
        InferenceSession(MODEL, ["CpuRef"], sess_options=SessionOptions(pins={"relu1": "TestLoud"}),
                         pins={"relu1": "CpuRef"})


def test_strict_is_the_optimizers_strict(loud) -> None:
    lenient = InferenceSession(MODEL, backends=["TestLoud", "CpuRef"])
    assert lenient.report.backend_of("conv1") == "CpuRef"  # refused by TestLoud, fell back
    assert lenient.optimized.options.strict is False
    with pytest.raises(OptimizationError, match="conv1"):
        InferenceSession(MODEL, backends=["TestLoud", "CpuRef"],
                         sess_options=SessionOptions(strict=True))


def test_placement_measured_is_the_optimizers_placement(loud) -> None:
    session = InferenceSession(MODEL, backends=["CpuRef"],
                               sess_options=SessionOptions(placement="measured"))
    assert session.optimized.options.placement == "measured"
    assert {m.backend for m in session.report.measurements} == {"CpuRef"}
    assert InferenceSession(MODEL, ["CpuRef"]).report.measurements == []
    with pytest.raises(ValueError, match="placement must be one of the choices "
                                         r"\(preference: .*measured: .*\), got 'fastest'"):
        SessionOptions(placement="fastest")


def test_intra_op_threads_is_cpuaccs_threads_and_belongs_to_the_runtime() -> None:
    session = InferenceSession(MODEL, ["CpuRef"], sess_options=SessionOptions(intra_op_num_threads=1))
    assert session.backend_options == {"CpuAcc.threads": 1}
    assert session.runtime.options.backend_options == {"CpuAcc.threads": 1}
    with pytest.raises(OptionError, match="CpuAcc.threads is 1 in SessionOptions but 2 in the "
                                          "backends' options"):
        InferenceSession(MODEL, backends=[("CpuAcc", {"threads": 2}), "CpuRef"],
                         sess_options=SessionOptions(intra_op_num_threads=1))
    with pytest.raises(OptionError, match="CpuAcc.threads is the runtime's"):
        InferenceSession(MODEL, ["CpuRef"], sess_options=SessionOptions(intra_op_num_threads=1),
                         runtime=Runtime(RuntimeOptions()))


def test_the_older_spelling_still_works(loud) -> None:
    runtime = Runtime(RuntimeOptions(backend_options={"TestLoud.level": 5}))
    session = InferenceSession(MODEL, ["TestLoud", "CpuRef"], runtime=runtime, pins={"conv1": "CpuRef"})
    assert session.runtime is runtime
    assert options_of(session, "TestLoud") == {"TestLoud.level": 5}
    both = InferenceSession(MODEL, [("TestLoud", {"name": "n"}), "CpuRef"], runtime=runtime)
    assert options_of(both, "TestLoud") == {"TestLoud.level": 5, "TestLoud.name": "n"}


def test_cache_dir_is_where_cpuaccs_routes_are_kept(tmp_path) -> None:
    pytest.importorskip("torch")
    from backplane.backends.torch.route_cache import CACHE_VARIABLE, FILE_NAME

    before = os.environ.get(CACHE_VARIABLE)
    session = InferenceSession(MODEL, backends=[("CpuAcc", {"compile": "layers"}), "CpuRef"],
                               sess_options=SessionOptions(cache_dir=tmp_path / "routes"))
    assert (tmp_path / "routes" / FILE_NAME).is_file()  # the conv's measured route
    assert os.environ.get(CACHE_VARIABLE) == before  # put back after the load
    session.run(None, {"x": X})


def test_modelmeta_is_onnx_runtimes() -> None:
    ort = pytest.importorskip("onnxruntime")
    model = small_cnn_model()
    model.producer_name, model.producer_version, model.domain = "tests", "1.2", "org.example"
    model.model_version, model.doc_string, model.graph.doc_string = 7, "a model", "its graph"
    onnx.helper.set_model_props(model, {"author": "backplane", "licence": "MIT"})
    for source in (model.SerializeToString(), "tests/data/tiny_mobilenet_v3.onnx"):
        mine = InferenceSession(source, ["CpuRef"]).get_modelmeta()
        theirs = ort.InferenceSession(source, providers=["CPUExecutionProvider"]).get_modelmeta()
        for name in ("producer_name", "graph_name", "domain", "description", "graph_description",
                     "version", "custom_metadata_map"):
            assert getattr(mine, name) == getattr(theirs, name), name
    meta = InferenceSession(model.SerializeToString(), ["CpuRef"]).get_modelmeta()
    assert meta.custom_metadata_map == {"author": "backplane", "licence": "MIT"}
    assert (meta.version, meta.producer_version, meta.graph_name) == (7, "1.2", "test")


def test_run_options_tag_the_runs_messages_and_set_their_severity(loud, caplog) -> None:
    session = InferenceSession(MODEL, backends=["TestLoud", "CpuRef"])
    with caplog.at_level(logging.WARNING, logger="backplane"):
        plain = session.run(["probs"], {"x": X})
        tagged = session.run(["probs"], {"x": X}, RunOptions(logid="batch-7"))
        session.run(None, {"x": X}, RunOptions(log_severity_level=3))
    messages = [r.getMessage() for r in caplog.records if r.name == LOUD.name]
    assert messages == ["relu ran on [1, 4, 8, 8]"] * 2 + ["[batch-7] relu ran on [1, 4, 8, 8]"] * 2
    np.testing.assert_array_equal(plain[0], tagged[0])
    with pytest.raises(TypeError, match="run_options must be a backplane.RunOptions"):
        session.run(None, {"x": X}, {"logid": "x"})


def test_session_severity_silences_its_messages_and_only_its_own(loud, caplog) -> None:
    quiet = InferenceSession(MODEL, backends=["TestLoud", "CpuRef"],
                             sess_options=SessionOptions(log_severity_level=3))
    chatty = InferenceSession(MODEL, backends=["TestLoud", "CpuRef"])
    with caplog.at_level(logging.WARNING, logger="backplane"):
        quiet.run(None, {"x": X})
        assert not [r for r in caplog.records if r.name == LOUD.name]
        chatty.run(None, {"x": X})
        assert len([r for r in caplog.records if r.name == LOUD.name]) == 2
        quiet.run(None, {"x": X}, RunOptions(log_severity_level=2))  # a run may ask for more
        assert len([r for r in caplog.records if r.name == LOUD.name]) == 4


def test_the_new_names_are_exported() -> None:
    for name in ("SessionOptions", "RunOptions", "ModelMetadata"):
        assert name in backplane.__all__ and hasattr(backplane, name)


def test_keep_initializers_is_a_flag_and_keeps_the_graphs_weights(tmp_path) -> None:
    """Off by default: a model read from its file leaves its weights to the loaded network
    (tests/runtime/test_released_weights.py); on, the graphs keep them as imported."""
    with pytest.raises(ValueError, match="keep_initializers must be True or False"):
        SessionOptions(keep_initializers=1)
    path = tmp_path / "cnn.onnx"
    onnx.save(small_cnn_model(), str(path))
    released = InferenceSession(path, ["CpuRef"])
    kept = InferenceSession(path, ["CpuRef"], SessionOptions(keep_initializers=True))
    assert released.optimized.released and not kept.optimized.released
    assert type(kept.graph.constants) is dict and type(kept.optimized.graph.constants) is dict
    assert sorted(released.graph.constants) == sorted(kept.graph.constants)
    assert released.run(None, {"x": X})[0].tobytes() == kept.run(None, {"x": X})[0].tobytes()


# -- ONNX Runtime's spellings (issue 31, item 4) ------------------------------------------------------
def test_onnx_runtimes_argument_order_runs_unchanged() -> None:
    options = SessionOptions(intra_op_num_threads=1)
    feed = {"x": np.ones((1, 3, 8, 8), np.float32)}
    expected = InferenceSession(MODEL, backends=["CpuRef"]).run(None, feed)
    for session in (InferenceSession(MODEL, options, ["CpuRef"]),            # ORT's positions
                    InferenceSession(MODEL, options, backends=["CpuRef"]),   # was a TypeError
                    InferenceSession(MODEL, options, providers=["CpuRef"]),
                    InferenceSession(MODEL, ["CpuRef"], options),            # backplane's before
                    InferenceSession(MODEL, ["CpuRef"], sess_options=options),
                    InferenceSession(MODEL, sess_options=options, providers=["CpuRef"],
                                     provider_options=[{}]),
                    InferenceSession(MODEL, options, ["CpuRef"], [{}])):
        assert session.get_providers() == ["CpuRef"]
        assert session.get_session_options() is options
        np.testing.assert_array_equal(session.run(None, feed)[0], expected[0])


def test_the_same_argument_twice_is_named() -> None:
    options = SessionOptions()
    with pytest.raises(TypeError, match="sess_options"):
        InferenceSession(MODEL, options, sess_options=options)
    with pytest.raises(TypeError, match="backends"):
        InferenceSession(MODEL, ["CpuRef"], backends=["CpuRef"])
    with pytest.raises(TypeError, match="argument 2 of InferenceSession is a int"):
        InferenceSession(MODEL, 3)


def test_onnx_runtimes_provider_names_run_on_backplanes_backends(caplog) -> None:
    caplog.set_level(logging.INFO, logger="backplane")
    session = InferenceSession(MODEL, providers=["CPUExecutionProvider"])
    torch_here = registry.create("CpuAcc").availability().ok
    assert session.get_providers() == (["CpuAcc", "CpuRef"] if torch_here else ["CpuRef"])
    session = InferenceSession(MODEL, providers=[("OpenVINOExecutionProvider", {"device_type": "CPU"}),
                                                 "CPUExecutionProvider"])
    assert session.get_providers()[-1] == "CpuRef"
    assert "device_type" in caplog.text and "ignored" in caplog.text
    assert "ONNX Runtime's name" in caplog.text
