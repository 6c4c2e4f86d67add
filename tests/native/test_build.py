"""The native build: the package's C compiled once per machine into a cached library, loaded with
ctypes; without a compiler, a clear NativeUnavailable and nothing else."""

import ctypes
import os

import numpy as np
import pytest

from backplane.native import build

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache and no library loaded yet in this process."""
    monkeypatch.setenv("BACKPLANE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_loaded", {})
    return tmp_path


@needs_compiler
def test_a_library_is_built_once_and_called(fresh):
    lib = build.library("probe")
    assert lib.backplane_native_version() == 1
    built = list((fresh / "native").glob("probe-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    x = np.array([-1.0, 0.5, np.nan, -np.inf, 3.0], dtype=np.float32)
    out = np.empty_like(x)
    lib.backplane_relu(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                       ctypes.c_ssize_t(x.size))
    np.testing.assert_array_equal(out, [0.0, 0.5, np.nan, 0.0, 3.0])  # NaN in, NaN out
    build._loaded.clear()  # a new process: the cached library is loaded, not built again
    assert build.library("probe").backplane_native_version() == 1
    assert [path.stat().st_mtime_ns for path in (fresh / "native").glob("probe-*.so")] == [stamp]
    assert not list((fresh / "native").glob(".probe-*"))  # no scratch file left


@needs_compiler
def test_a_changed_source_builds_another_library(fresh, tmp_path_factory, monkeypatch):
    sources = tmp_path_factory.mktemp("sources")
    text = (build.SOURCES / "probe.c").read_text()
    (sources / "probe.c").write_text(text)
    monkeypatch.setattr(build, "SOURCES", sources)
    build.library("probe")
    build._loaded.clear()
    (sources / "probe.c").write_text(text.replace("return 1;", "return 2;"))
    assert build.library("probe").backplane_native_version() == 2
    assert len(list((fresh / "native").glob("probe-*.so"))) == 2


@needs_compiler
def test_a_changed_header_builds_another_library(fresh, tmp_path_factory, monkeypatch):
    """A source split into headers (cnn.c includes its own) is keyed by them too: a stale library
    built from an old header is never loaded."""
    sources = tmp_path_factory.mktemp("sources")
    text = (build.SOURCES / "probe.c").read_text()
    (sources / "probe.c").write_text(text.replace("return 1;", "return PROBE_VERSION;")
                                     .replace("#include", '#include "probe_version.h"\n#include', 1))
    (sources / "probe_version.h").write_text("#define PROBE_VERSION 3\n")
    monkeypatch.setattr(build, "SOURCES", sources)
    assert build.library("probe").backplane_native_version() == 3
    build._loaded.clear()
    (sources / "probe_version.h").write_text("#define PROBE_VERSION 4\n")
    assert build.library("probe").backplane_native_version() == 4
    assert len(list((fresh / "native").glob("probe-*.so"))) == 2


def test_without_a_compiler_the_error_says_so(fresh, monkeypatch):
    monkeypatch.setattr(build, "compiler", lambda: None)
    with pytest.raises(build.NativeUnavailable, match="no C compiler"):
        build.library("probe")
    assert not build.available("probe")  # the same answer, kept for the process


def test_turned_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(build.SWITCH, "0")
    with pytest.raises(build.NativeUnavailable, match="BACKPLANE_NATIVE=0"):
        build.library("probe")


def test_an_unknown_library_names_the_ones_there_are(fresh):
    with pytest.raises(build.NativeUnavailable, match="no native source 'nope'.*probe"):
        build.library("nope")


@needs_compiler
def test_a_failing_build_says_why(fresh, tmp_path_factory, monkeypatch):
    sources = tmp_path_factory.mktemp("broken")
    (sources / "broken.c").write_text("int f(void) { return }\n")
    monkeypatch.setattr(build, "SOURCES", sources)
    with pytest.raises(build.NativeUnavailable, match="failed"):
        build.library("broken")
    assert not list((fresh / "native").glob("*"))  # nothing half-built kept


def test_the_package_ships_its_sources():
    assert (build.SOURCES / "probe.c").is_file()
    assert os.path.basename(build.SOURCES) == "native"


def test_the_option_takes_auto_or_off_and_names_them_otherwise():
    from backplane.backends.api.backend import OptionError

    assert build.mode({}) == "auto"
    assert build.mode({"CpuAcc.native": "OFF"}) == "off"
    with pytest.raises(OptionError, match="CpuAcc.native 'fast' is not one of auto, off"):
        build.mode({"CpuAcc.native": "fast"})


def test_the_libraries_folder_can_be_named_apart_from_the_route_cache(fresh, tmp_path_factory,
                                                                      monkeypatch):
    kept = tmp_path_factory.mktemp("kept")
    monkeypatch.setenv(build.CACHE_VARIABLE, str(kept))
    assert build.cache_folder() == kept
    monkeypatch.delenv(build.CACHE_VARIABLE)
    assert build.cache_folder() == fresh / "native"


@needs_compiler
def test_a_library_of_another_version_is_unavailable_naming_both() -> None:
    """``library(name, version)`` reads ``backplane_<name>_version()``: a source and a library of
    two trees give NativeUnavailable (the torch routes run), not a call of the wrong signature."""
    from backplane.native import nms

    assert build.library("nms", nms.VERSION).backplane_nms_version() == nms.VERSION
    with pytest.raises(build.NativeUnavailable, match=rf"nms library is version {nms.VERSION}, "
                                                      rf"not {nms.VERSION + 1}"):
        build.library("nms", nms.VERSION + 1)
