"""Dynamic backends: the file-name table and version matrix of Arm NN's dynamic backends
documentation, path handling, and every invalid backend skipped with a warning, never a crash (as
Arm NN's DynamicBackendTests)."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

from backplane import OptimizationError, Runtime, RuntimeOptions, import_onnx, optimize
from backplane.backends.registry import BackendRegistry, UnknownBackendError
from backplane.backends.registry.dynamic import (PATHS_VARIABLE, backend_files, backend_paths,
                                                 is_backend_file_name, is_compatible, valid_paths)
from tests.conftest import small_cnn_model

# Seed 000's table, in its Python spelling (".so" becomes ".py").
VALID_NAMES = [
    "Arm_GpuAcc_backend.py",  # basic backend name
    "Arm_GpuAcc_backend.py.1",  # single field version number
    "Arm_GpuAcc_backend.py.1.2",  # multiple field version number
    "Arm_GpuAcc_backend.py.1.2.3",  # multiple field version number
    "Arm_GpuAcc_backend.py.10.1.27",  # multiple digit version
    "Arm123_GpuAcc_backend.py",  # digits in vendor name are allowed
    "Arm_GpuAcc456_backend.py",  # digits in backend id are allowed
    "Arm_CpuAcc_backend.py",  # basic backend name
]
INVALID_NAMES = [
    "Arm_GpuAcc_backend.py.10.1.33.",  # dot not followed by version number
    "Arm_GpuAcc_backend.py.3.4..5",  # dot not followed by version number
    "Arm_GpuAcc_backend.py.1,1.1",  # comma instead of dot in the version
    "Arm%Co_GpuAcc_backend.py",  # invalid character in vendor name
    "Arm_Gpu.Acc_backend.py",  # invalid character in backend id
    "GpuAcc_backend.py",  # missing vendor name
    "_GpuAcc_backend.py",  # missing vendor name
    "Arm__backend.py",  # missing backend id
    "Arm_GpuAcc.py",  # missing "backend" at the end
    "__backend.py",  # missing vendor name and backend id
    "__.py",  # missing all fields
    "Arm_GpuAcc_backend",  # missing at least ".py" at the end
    "Arm_GpuAcc_backend_v1.2.py",  # extra version info at the end
]


def source(backend_id: str = "Dyn", version: str = "(1, 0)", factory: str = "Dyn()",
           extra: str = "") -> str:
    return textwrap.dedent(f"""\
        import numpy as np
        from backplane import Backend

        class Dyn(Backend):
            id = {backend_id!r}
            KERNELS = {{"Relu": {{6: lambda x: (np.maximum(x, 0),)}}}}

        def get_backend_id():
            return {backend_id!r}

        def get_version():
            return {version}

        def backend_factory():
            return {factory}
        """) + textwrap.dedent(extra)


def write(directory: Path, name: str, text: str | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(source() if text is None else text)
    return path


@pytest.mark.parametrize("name", VALID_NAMES)
def test_valid_file_names(name: str) -> None:
    assert is_backend_file_name(name)


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_invalid_file_names(name: str) -> None:
    assert not is_backend_file_name(name)


def test_only_valid_names_are_candidates(tmp_path: Path) -> None:
    for name in VALID_NAMES + INVALID_NAMES:
        write(tmp_path, name)
    names = [os.path.basename(p) for p in backend_files([str(tmp_path)], [])]
    assert names == sorted(VALID_NAMES)


def test_symlink_chains_resolve_and_load_once_and_dangling_links_are_skipped(tmp_path: Path) -> None:
    write(tmp_path, "Arm_CpuAcc_backend.py", source("ArmCpuAcc"))
    os.symlink(tmp_path / "Arm_CpuAcc_backend.py", tmp_path / "Arm_CpuAcc_backend.py.1")
    os.symlink(tmp_path / "Arm_CpuAcc_backend.py.1", tmp_path / "Arm_CpuAcc_backend.py.1.2")
    os.symlink(tmp_path / "Arm_CpuAcc_backend.py.1.2", tmp_path / "Arm_CpuAcc_backend.py.1.2.3")
    os.symlink(tmp_path / "nothing.py", tmp_path / "Arm_no_backend.py")
    skipped: list = []
    files = backend_files([str(tmp_path)], skipped)
    assert [os.path.basename(f) for f in files] == ["Arm_CpuAcc_backend.py"]
    assert [(os.path.basename(s.candidate), s.reason) for s in skipped] == [
        ("Arm_no_backend.py", "a symbolic link to a file that does not exist")]
    registry = BackendRegistry()
    assert registry.load_dynamic_backends([str(tmp_path)]) == ["ArmCpuAcc"]


def test_the_same_id_in_two_directories_first_found_wins(tmp_path: Path) -> None:
    first = write(tmp_path / "pathA", "Arm_GpuAcc_backend.py", source("ArmGpuAcc"))
    second = write(tmp_path / "pathB", "Arm_GpuAcc_backend.py", source("ArmGpuAcc"))
    registry = BackendRegistry()
    assert registry.load_dynamic_backends([str(first.parent), str(second.parent)]) == ["ArmGpuAcc"]
    assert registry.origin("ArmGpuAcc") == f"file {first}"
    (skip,) = registry.skipped
    assert skip.candidate == str(second) and "already registered from file" in skip.reason


def test_a_package_directory_is_a_dynamic_backend(tmp_path: Path) -> None:
    write(tmp_path / "Acme_Pkg_backend", "__init__.py", source("AcmePkg"))
    (tmp_path / "Acme_Nopkg_backend").mkdir()  # no __init__.py: not a candidate
    registry = BackendRegistry()
    assert registry.load_dynamic_backends([str(tmp_path)]) == ["AcmePkg"]


# Seed 000's version examples: (backend, API, compatible)
VERSION_MATRIX = [((2, 4), (2, 4), True), ((2, 1), (2, 4), True), ((2, 5), (2, 4), False),
                  ((2, 0), (1, 0), False), ((2, 0), (3, 0), False)]


@pytest.mark.parametrize("backend, api, ok", VERSION_MATRIX)
def test_version_matrix(tmp_path: Path, backend, api, ok: bool) -> None:
    assert is_compatible(backend, api) is ok
    write(tmp_path, "Arm_Ver_backend.py", source("ArmVer", version=repr(backend)))
    registry = BackendRegistry(api_version=api)
    assert registry.load_dynamic_backends([str(tmp_path)]) == (["ArmVer"] if ok else [])
    if not ok:
        (skip,) = registry.skipped
        assert skip.reason == (f"its backend API version {backend[0]}.{backend[1]} is not compatible "
                               f"with backplane's backend API version {api[0]}.{api[1]}")


INVALID_BACKENDS = {
    "syntax error": ("def broken(:\n", "it failed to import: SyntaxError"),
    "raises on import": ("raise RuntimeError('no driver')\n", "it failed to import: RuntimeError: no driver"),
    "exits on import": ("import sys\nsys.exit(3)\n", "it failed to import: SystemExit: 3"),
    "no get_backend_id": (source().replace("def get_backend_id", "def other"),
                          "it has no function get_backend_id()"),
    "no get_version": (source().replace("def get_version", "def other"),
                       "it has no function get_version()"),
    "no backend_factory": (source().replace("def backend_factory", "def other"),
                           "it has no function backend_factory()"),
    "entry not callable": (source() + "get_version = (1, 0)\n", "it has no function get_version()"),
    "get_backend_id raises": (source(extra="def get_backend_id():\n    raise ValueError('x')\n"),
                              "its entry function raised ValueError: x"),
    "empty id": (source(""), "its backend id '' is empty or not a string"),
    "id not a string": (source(extra="def get_backend_id():\n    return 7\n"),
                        "its backend id 7 is empty or not a string"),
    "reserved id": (source("builtin"), "its backend id 'builtin' is reserved"),
    "version not a pair": (source(version="'1.0'"), "get_version() returned '1.0', not (major, minor)"),
    "version too new": (source(version="(1, 9)"), "its backend API version 1.9 is not compatible"),
    "factory raises": (source(factory="1 / 0"), "backend_factory() raised ZeroDivisionError"),
    "factory returns nothing": (source(factory="None"), "backend_factory() returned None, not a Backend"),
    "factory returns a non-backend": (source(factory="object()"), "not a Backend"),
    "factory id differs": (source(extra="Dyn.id = 'Other'\n"),
                           "backend_factory() made a backend with id 'Other', not 'Dyn'"),
    "id already registered": (source("CpuRef").replace("class Dyn(Backend)", "class Dyn(Backend)"),
                              "backend id 'CpuRef' is already registered from built in"),
}


@pytest.mark.parametrize("case", INVALID_BACKENDS, ids=list(INVALID_BACKENDS))
def test_invalid_backends_are_skipped_with_a_reason(tmp_path: Path, case: str, caplog) -> None:
    text, reason = INVALID_BACKENDS[case]
    path = write(tmp_path, "Bad_Case_backend.py", text)
    from backplane.backends.registry import registry as default

    registry = BackendRegistry()
    if case == "id already registered":
        registry.register("CpuRef", default.create("CpuRef").__class__, origin="built in")
    assert registry.load_dynamic_backends([str(tmp_path)]) == []
    (skip,) = registry.skipped
    assert skip.candidate == str(path) and reason in skip.reason
    assert any(reason.split(":")[0] in message for message in caplog.messages)


def test_a_mixed_set_registers_the_valid_ones_only(tmp_path: Path) -> None:
    write(tmp_path, "Good_One_backend.py", source("GoodOne"))
    write(tmp_path, "Bad_Two_backend.py", source(version="(0, 1)"))
    write(tmp_path, "Good_Three_backend.py.2", source("GoodThree"))
    write(tmp_path, "Bad_Four_backend.py", "raise ImportError('missing dependency')\n")
    registry = BackendRegistry()
    assert registry.load_dynamic_backends([str(tmp_path)]) == ["GoodOne", "GoodThree"]
    assert sorted(os.path.basename(s.candidate) for s in registry.skipped) == [
        "Bad_Four_backend.py", "Bad_Two_backend.py"]


def test_paths_are_checked_and_bad_ones_skipped(tmp_path: Path) -> None:
    a_file = write(tmp_path, "plain.txt", "")
    skipped: list = []
    paths = ["", "relative/dir", str(tmp_path / "missing"), str(a_file), str(tmp_path)]
    assert valid_paths(paths, skipped) == [str(tmp_path)]
    assert [s.reason for s in skipped] == [
        "an empty path in the backend path list", "backend path 'relative/dir' is not absolute",
        f"backend path '{tmp_path / 'missing'}' does not exist",
        f"backend path '{a_file}' is not a directory"]


def test_the_environment_list_is_processed_in_order_and_an_override_replaces_it() -> None:
    environ = {PATHS_VARIABLE: os.pathsep.join(["/a", "/b", "/c"])}
    assert backend_paths(environ=environ) == ["/a", "/b", "/c"]
    assert backend_paths("/only", environ=environ) == ["/only"]
    assert backend_paths(environ={}) == []


def test_no_path_loads_nothing_not_even_from_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path, "Cwd_Trap_backend.py", source("CwdTrap"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(PATHS_VARIABLE, raising=False)
    registry = BackendRegistry()
    Runtime(registry=registry)
    with pytest.raises(UnknownBackendError, match="unknown backend 'CwdTrap'"):
        registry.create("CwdTrap")


def test_a_runtime_option_path_replaces_the_environment(tmp_path: Path, monkeypatch) -> None:
    write(tmp_path / "env", "Env_One_backend.py", source("EnvOne"))
    write(tmp_path / "opt", "Opt_Two_backend.py", source("OptTwo"))
    monkeypatch.setenv(PATHS_VARIABLE, str(tmp_path / "env"))
    registry = BackendRegistry()
    runtime = Runtime(RuntimeOptions(dynamic_backends_path=str(tmp_path / "opt")),
                      registry=registry)  # held while the runtime lives
    assert "OptTwo" in registry.ids() and "EnvOne" not in registry.ids()
    runtime.close()


def test_a_preference_for_an_unregistered_id_is_looked_up_on_the_paths(tmp_path: Path,
                                                                        monkeypatch) -> None:
    write(tmp_path, "Acme_Relu_backend.py", source("AcmeRelu"))
    monkeypatch.setenv(PATHS_VARIABLE, str(tmp_path))
    from backplane.backends.registry import registry as default

    registry = BackendRegistry()
    registry.register("CpuRef", default.create("CpuRef").__class__, origin="built in")
    net = optimize(import_onnx(small_cnn_model()), ["AcmeRelu", "CpuRef"], registry=registry)
    assert net.report.backend_of("relu1") == "AcmeRelu"
    assert registry.origin("AcmeRelu") == f"file {tmp_path / 'Acme_Relu_backend.py'}"
    with pytest.raises(OptimizationError, match="unknown backend 'Nope'. Known backends are: "
                                                "CpuRef, AcmeRelu"):  # builtin: never a choice
        optimize(import_onnx(small_cnn_model()), ["Nope"], registry=registry)


def test_strict_placement_refuses_any_fallback() -> None:
    from backplane import OptimizerOptions
    from backplane.backends.registry import registry as default
    from tests.conftest import PartialBackend

    with default.temporarily(PartialBackend.id, PartialBackend):
        with pytest.raises(OptimizationError, match=r"strict placement failed:\n  layer 'pool' "
                                                    r"\(GlobalAveragePool\) fell back to CpuRef"):
            optimize(import_onnx(small_cnn_model()), ["TestPartial", "CpuRef"],
                     options=OptimizerOptions(strict=True))
    net = optimize(import_onnx(small_cnn_model()), ["CpuRef"], options=OptimizerOptions(strict=True))
    assert np.all([p.backend == "CpuRef" for p in net.report.layers.values()])
