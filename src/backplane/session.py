"""InferenceSession: the ONNX Runtime-style facade over import, optimize, load and run.

As in ONNX Runtime: ``InferenceSession(model, sess_options, providers=[...])`` or, in backplane's
words, ``InferenceSession(model, backends=[...], sess_options=...)``; what a session is given
(``SessionOptions``, ``RunOptions``, the backend list) is in ``backplane.session_options``.
``get_modelmeta()`` gives the model's metadata and ``end_profiling()`` writes a Chrome trace of the
runs (``backplane.profiling``). Once loaded, a model read from its file leaves each weight to the
workloads that read it (``backplane.optimizer.release``; ``SessionOptions.keep_initializers``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import onnx

from backplane import against_cpu, artifact, deferred_load  # artifact's: at first use (its __init__)
from backplane.backends.api.backend import OptionError
from backplane.frontends.onnx import import_onnx
from backplane.frontends.onnx_file import WeightFile, read_model
from backplane.io_binding import IOBinding
from backplane.ir.graph import Graph
from backplane.optimizer.optimize import OptimizedNetwork, OptimizerOptions, optimize
from backplane.optimizer.release import FileWeights, released_graph
from backplane.optimizer.report import PlacementReport
from backplane.overriding import Overrides, overridable
from backplane.profiling import Trace, profile_file
from backplane.runtime.loaded_network import LayerTiming
from backplane.runtime.runtime import InvalidInputError, Runtime, RuntimeOptions, within
from backplane.session_info import (NO_VERSION, ModelMetadata, NodeArg,  # noqa: F401  # its names
                                    _node_arg, metadata_of)
from backplane.session_checks import (artifact_backends, by_kind, check_artifact_choices,
                                      check_pins, stored_artifact)
from backplane.session_options import (BackendSpec, RunOptions, SessionOptions, backend_list,
                                       cache_scope, default_backends, log_scope, merge,
                                       optimizer_options_for, qualified, stop_scope)

_log = logging.getLogger(__name__)


# -- the session -------------------------------------------------------------------------------------------
class InferenceSession:
    """Load an ONNX model onto a list of backends, in order of preference, and run it.

    The signature is ONNX Runtime's: ``InferenceSession(model, sess_options, providers,
    provider_options)``, so code written for it runs unchanged (its provider names included).

    Args:
        model: a path, the serialized bytes, or an onnx.ModelProto.
        sess_options: a ``SessionOptions``. A backend list in its place is taken as ``backends``
            (``InferenceSession(path, ["CpuAcc", "CpuRef"])``).
        providers: backend ids, most preferred first; each layer runs on the first that supports
            it. An entry may be ``(id, {option: value})``: options for that backend, named without
            its id (``("CpuAcc", {"threads": 2})`` is ``CpuAcc.threads``). ONNX Runtime's provider
            names run on backplane's backends (``session_options.ORT_PROVIDERS``):
            CPUExecutionProvider on CpuAcc (where torch is installed) and CpuRef,
            CUDAExecutionProvider and TensorrtExecutionProvider on GpuAcc, OpenVINOExecutionProvider
            on OpenVINO; their ONNX Runtime options are dropped with a warning. Default:
            ``default_backends()``, the fastest this machine has (GpuAcc, CpuAcc where torch can
            run them, then CpuRef); ``get_providers()`` says which.
        provider_options: ONNX Runtime's options per provider: one mapping per entry of
            ``providers`` (or ``backends``).
        backends: backplane's name for ``providers`` (the same entries); give one or the other.
        pins: layer name or op type -> backend id, tried before the preferences (with
            ``SessionOptions.pins``: both apply).
        optimizer_options: turn generic passes off (``SessionOptions.strict`` sets its ``strict``).
        runtime: a Runtime to load into (one per session by default); its
            ``RuntimeOptions.backend_options`` apply to this session too.
        input_shapes: sizes for the model's free input dimensions.
        cache_dir: the compile cache's folder (``$BACKPLANE_COMPILE_CACHE`` where not given): the
            model is compiled into an artifact there on its first load and loaded from it after
            (``backplane.artifact.cache``); also the folder of CpuAcc's measured routes where
            ``SessionOptions.cache_dir`` is not set.
        repreprocess: for an artifact whose blobs were made for other machine facts, preprocess
            those partitions again from their stored subgraphs instead of refusing it.

    ``model`` may also be an artifact made by ``backplane.compile`` (a path): it loads without the
    ONNX file, on the backends and with the options it was compiled for (``backends`` and their
    options, where given, must be those).
    """

    def __init__(self, model: str | os.PathLike | bytes | onnx.ModelProto, *positional: Any,
                 sess_options: SessionOptions | None = None,
                 providers: Sequence[BackendSpec] | None = None,
                 provider_options: Sequence[Mapping[str, Any]] | None = None,
                 backends: Sequence[BackendSpec] | None = None,
                 pins: Mapping[str, str] | None = None,
                 optimizer_options: OptimizerOptions | None = None, runtime: Runtime | None = None,
                 input_shapes: Mapping[str, Sequence[int]] | None = None,
                 cache_dir: str | os.PathLike | None = None, repreprocess: bool = False) -> None:
        start = time.perf_counter()
        self._overrides: Overrides | None = None  # a network per set of defaults fed (overriding)
        self._later: Any = None  # the default backends' load: deferred_load.Later, TorchFree
        given = by_kind(positional, sess_options=sess_options, providers=providers,
                         provider_options=provider_options, backends=backends)
        sess_options, providers = given["sess_options"], given["providers"]
        provider_options, backends = given["provider_options"], given["backends"]
        if backends is not None and providers is not None:
            raise ValueError("give backends= or providers= (the same list: providers is ONNX "
                             "Runtime's name for it), not both")
        if sess_options is not None and not isinstance(sess_options, SessionOptions):
            raise TypeError(f"sess_options must be a backplane.SessionOptions, got "
                            f"{type(sess_options).__name__}")
        self.sess_options = sess_options if sess_options is not None else SessionOptions()
        listed = backends if backends is not None else providers
        stored = stored_artifact(model, self.sess_options.artifact_key)
        if stored is not None and listed is None and provider_options is None:
            listed = artifact_backends(stored[1])
        later = None
        if listed is None:  # torch's backends built in the background where they may (deferred_load)
            later = deferred_load.deferrable(model, {"provider_options": provider_options,
                                                     "runtime": runtime, "cache_dir": cache_dir,
                                                     "pins": pins or self.sess_options.pins or None},
                                             self.sess_options.enable_profiling)
            asked = optimizer_options  # as given: the background's session derives its own
            listed = default_backends() if later is None else \
                [b for b in later if b not in deferred_load.TORCH_BACKENDS]
            _log.info("no backends given: %s, the fastest available here", ", ".join(later or listed))
        ids, per_backend = backend_list(listed, provider_options)
        self._provider_options = per_backend
        options = self.sess_options
        from backplane.backends.torch.threads import AtMost  # no torch import

        session_wide = {"CpuAcc.threads": AtMost(options.intra_op_num_threads)} \
            if options.intra_op_num_threads else {}  # a ceiling: fewer while others hold the CPUs
        chosen = merge(("SessionOptions", session_wide), ("the backends' options",
                                                           qualified(per_backend)))
        if runtime is not None:
            mine = runtime.options.backend_options
            if "CpuAcc.threads" in chosen and mine.get("CpuAcc.threads") != chosen["CpuAcc.threads"]:
                raise OptionError("CpuAcc.threads is the runtime's (its backend context sets torch's "
                                  "threads): give it in the RuntimeOptions of the runtime passed, or "
                                  "pass no runtime")
            chosen = merge(("the runtime's RuntimeOptions", mine), ("this session", chosen))
        self._own_runtime = runtime is None  # made here: closed with the session
        self.runtime = runtime or Runtime(RuntimeOptions(backend_options=dict(chosen),
                                                         backends=list(ids)))  # contexts now
        self.backend_options: dict[str, Any] = chosen
        """The backend options this session's backends were given ("CpuAcc.threads": 2, ...)."""
        all_pins = merge(("SessionOptions.pins", options.pins), ("pins=", pins or {}))
        optimizer_options = optimizer_options_for(options, optimizer_options)
        self._severity = options.log_severity_level
        compiled = _compile_cache(cache_dir) if stored is None else None
        self._cache_dir = options.cache_dir if options.cache_dir or not compiled else compiled
        with log_scope(self._severity), cache_scope(self._cache_dir):
            timing, remade = None, None
            if stored is not None or compiled is not None:
                found = self._load_artifact(model, stored, compiled, ids, chosen, all_pins,
                                            optimizer_options, input_shapes, repreprocess)
                self._meta = ModelMetadata(**found.manifest["model"]["metadata"])
                self.graph = found.network.graph
                self._optimized: OptimizedNetwork = found.network
                _ceiling_here(found.network, chosen.get("CpuAcc.threads"))
                optimized = time.perf_counter()
                if compiled is not None and not against_cpu.at_load(self.graph):
                    timing = against_cpu.applies(ids, self._optimized, chosen, all_pins)
                    remade = lambda: import_onnx(read_model(model), input_shapes)  # noqa: E731
            else:
                read = read_model(model)
                self._meta = metadata_of(read.proto)
                defaults = overridable(read.proto)  # inputs with an initializer: fed or not
                self.graph = import_onnx(read, input_shapes)
                check_pins(self.graph, all_pins)
                optimized = time.perf_counter()
                self._optimized = optimize(
                    self.graph, ids, pins=all_pins, options=optimizer_options,
                    registry=self.runtime.registry, backend_options=chosen)
                timing = against_cpu.applies(ids, self._optimized, chosen, all_pins)
                if read.weights is not None and not options.keep_initializers \
                        and timing is None:
                    registry = self.runtime.registry
                    self._give_up_weights(read.weights, lambda graph, exclude: optimize(
                        graph, ids, pins=all_pins, options=optimizer_options, registry=registry,
                        backend_options=chosen, exclude=exclude), input_shapes)
                del read  # the proto: the graph holds the weights
                if defaults:
                    self._overrides = Overrides(defaults, self.graph, lambda graph: optimize(
                        graph, ids, pins=all_pins, options=optimizer_options,
                        registry=self.runtime.registry, backend_options=chosen))
            loading = time.perf_counter()
            self.network_id = self.runtime.load(self._optimized)
            self._against_cpu: Callable[..., tuple[OptimizedNetwork, int]] | None = None
            if timing is not None:  # timed against other placements: see backplane.against_cpu
                graph_of = remade or (lambda: self.graph)  # an artifact's: the model placed again

                def place(backends: Sequence[str]) -> OptimizedNetwork:
                    return optimize(graph_of(), backends, pins=all_pins, options=optimizer_options,
                                    registry=self.runtime.registry, backend_options=chosen)

                self._against_cpu = lambda feeds=None: against_cpu.settle(  # the network then
                    self.runtime, ids, self._optimized, self.network_id, chosen, all_pins, place,
                    feeds)
                if against_cpu.at_load(self.graph):
                    self._optimized, self.network_id = self._against_cpu()
                    self._against_cpu = None
            loaded = time.perf_counter()
        self._optimized = self.runtime.network(self.network_id).network  # as loaded: see Runtime.load
        self._outputs = list(self._optimized.output_names)
        self._builds_at_run = any(layer.op_type == "Specialized" for net in within(self._optimized)
                                  for layer in net.graph.layers)
        self._trace: Trace | None = None
        self._closed = False
        self._choosing = threading.Lock()  # the first run's choice against the CPU, made once
        _log.info("imported in %.3f s, placed in %.3f s (%s), loaded in %.3f s",
                  optimized - start, loading - optimized,
                  ", ".join(f"{b}: {n} layers" for b, n in self._optimized.report.counts().items()),
                  loaded - loading)
        if options.enable_profiling:
            name = (os.path.basename(os.fspath(model)) if isinstance(model, (str, os.PathLike))
                    else self._meta.graph_name or "model")
            self._trace = Trace(name, ids, origin=start)
            self._trace.span("import", start, optimized)
            self._trace.span("optimize", optimized, loading, backends=ids)
            self._trace.span("load", loading, loaded)
        if later is not None:  # the first run waits for it and takes it over (or runs natively)
            self._later = deferred_load.later(self, lambda: InferenceSession(
                model, self.sess_options, providers=list(later), optimizer_options=asked,
                input_shapes=input_shapes,
                repreprocess=repreprocess), model)
        self._update_fast_path()

    def _give_up_weights(self, weights: WeightFile,
                         optimize_: Callable[[Graph, dict[str, dict[str, str]] | None],
                                             OptimizedNetwork],
                         input_shapes: Mapping[str, Sequence[int]] | None) -> None:
        """Leave each weight of the model file to the workloads that will read it: the graphs
        hold it weakly from now (``backplane.optimizer.release``), the load lets go of each
        layer's once its workload is made, and the network is made again from the file where it
        is loaded again (``optimize_``: this session's optimize, with exclusions)."""
        shelf = FileWeights(weights, self.graph.constants)
        self.graph = released_graph(self.graph, shelf)

        def remake(exclude: dict[str, dict[str, str]] | None) -> OptimizedNetwork:
            weights.check("the network cannot be made again from it")
            read = read_model(weights.path)
            graph = import_onnx(read, input_shapes)
            network = optimize_(graph, exclude)
            assert read.weights is not None
            network.weights, network.remake = FileWeights(read.weights, graph.constants), remake
            return network

        self._optimized.weights, self._optimized.remake = shelf, remake

    def _load_artifact(self, model: Any, stored: tuple[Any, dict[str, Any]] | None,
                       compiled: str | None, ids: list[str], chosen: dict[str, Any],
                       pins: dict[str, str], optimizer_options: OptimizerOptions | None,
                       input_shapes: Mapping[str, Sequence[int]] | None,
                       repreprocess: bool) -> artifact.Artifact:
        """The network from an artifact: ``model`` itself (``stored``: its contents, manifest), or
        the compile cache's entry for it in the folder ``compiled``, compiled there if missing."""
        registry, key = self.runtime.registry, self.sess_options.artifact_key
        if stored is not None:
            contents, manifest = stored
            check_artifact_choices(manifest, ids, chosen, input_shapes)
            return artifact.load(contents, registry=registry, repreprocess=repreprocess, key=key)
        assert compiled is not None
        optimizer = dataclasses.asdict(optimizer_options or OptimizerOptions())
        parts = artifact.cache.key_parts(model, ids, chosen, registry, pins=pins,
                                         optimizer=optimizer, input_shapes=input_shapes,
                                         directory=compiled, sign_key=key)

        def compile_into(path: str) -> None:
            artifact.build(model, path, ids, chosen, pins=pins, optimizer_options=optimizer_options,
                           input_shapes=input_shapes, runtime=self.runtime, sign_key=key,
                           durable=False)

        return artifact.cache.fetch(compiled, parts, compile_into, registry, key)

    # -- what the model is ---------------------------------------------------------------------------
    @property
    def optimized(self) -> OptimizedNetwork:
        """The network as placed and loaded. A default session's, while its backends still load in
        the background (deferred_load), is the one its runs will use: reading it waits for them."""
        if self._later is not None:
            self._later.adopt(self)
        return self._optimized

    @property
    def report(self) -> PlacementReport:
        if self._later is not None:  # the placement is the background's (deferred_load): wait
            self._later.adopt(self)
        return self._optimized.report

    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(n, self.graph.info(n)) for n in self._optimized.input_names]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(n, self.graph.info(n)) for n in self._outputs]

    def get_modelmeta(self) -> ModelMetadata:
        return self._meta

    def get_providers(self) -> list[str]:
        said = self._later.providers() if hasattr(self._later, "providers") else ()  # torch_free's
        return list(said or self.report.preferences)  # said: the list, without waiting for torch

    def get_provider_options(self) -> dict[str, dict[str, Any]]:
        """Each backend's options as given to this session, named without its id."""
        return {b: dict(o) for b, o in self._provider_options.items()}

    def get_session_options(self) -> SessionOptions:
        return self.sess_options

    # -- runs ------------------------------------------------------------------------------------------
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
            run_options: RunOptions | None = None) -> list[Any]:
        """Outputs named in ``output_names`` (all when None), in that order."""
        direct = self._direct  # the network's prepared run where _fast holds: no frame between
        if direct is not None and run_options is None:
            results = direct(input_feed)  # None: not its feed (a wrong one, an input's default)
            if results is not None:
                return results if output_names is None else self._select(output_names, results)
        if self._later is not None:  # outputs where its runs need no torch (torch_free)
            results = self._later.adopt(self, input_feed if run_options is None else None)
            if results is not None:
                return results if output_names is None else self._select(output_names, results)
        if self._overrides is not None and not self._overrides.names.isdisjoint(input_feed):
            self._check_open()  # an input's default given: the network that reads it as an input
            with stop_scope(run_options):
                network_id = self._overrides.network_for(input_feed, self.runtime)
                return self._select(output_names, self.runtime.run(network_id, input_feed))
        if self._fast and run_options is None:
            results = self.runtime.run(self.network_id, input_feed)
            return results if output_names is None else self._select(output_names, results)
        self._check_open()
        if self._against_cpu is not None:
            self._time_against_cpu(input_feed)
        return self._run(output_names, input_feed, run_options)[0]

    def _time_against_cpu(self, input_feed: Mapping[str, Any]) -> None:
        """At the first run of a model free in more than its batch, its placement timed against
        the one without GpuAcc (or CpuAcc) on these inputs, the faster kept
        (``backplane.against_cpu``)."""
        with self._choosing:
            pending, self._against_cpu = self._against_cpu, None
            if pending is not None:
                with log_scope(self._severity):
                    _, self.network_id = pending(dict(input_feed))
                self._optimized = self.runtime.network(self.network_id).network  # as loaded
                self._outputs = list(self._optimized.output_names)
                self._builds_at_run = any(layer.op_type == "Specialized"
                                          for net in within(self._optimized)
                                          for layer in net.graph.layers)
                deferred_load.remember(self)  # a default session's placement, settled now
                self._update_fast_path()

    def run_profiled(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
                     run_options: RunOptions | None = None,
                     ) -> tuple[list[Any], list[LayerTiming]]:
        """``run``, with the time each layer took (in the profile too when profiling is on)."""
        self._check_open()
        results, timings = self._run(output_names, input_feed, run_options, timed=True)
        assert timings is not None
        return results, timings

    def end_profiling(self) -> str:
        """Write the profile (a Chrome trace: ``backplane.profiling``) and stop profiling; returns
        the file's path, or "" where profiling was not on (as ONNX Runtime does)."""
        trace, self._trace = self._trace, None
        self._update_fast_path()
        if trace is None:
            return ""
        return trace.write(profile_file(self.sess_options.profile_file_prefix))

    def _run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any],
             run_options: RunOptions | None, timed: bool = False,
             outputs_on: Sequence[str | None] | None = None,
             into: Sequence[Any] | None = None) -> tuple[list[Any], list[LayerTiming] | None]:
        """One run under its log scope (the severity and logid of its RunOptions), its stop and
        the cache folder; profiled where ``timed`` or where the session profiles (then in the
        trace). ``run`` (but its fast path), ``run_profiled`` and ``run_with_iobinding`` come
        here; ``outputs_on`` and ``into`` are ``Runtime.run``'s."""
        if run_options is not None and not isinstance(run_options, RunOptions):
            raise TypeError(f"run_options must be a backplane.RunOptions or None, got "
                            f"{type(run_options).__name__}")
        if self._later is not None:
            self._later.adopt(self)
        severity, tag = self._severity, ""
        if run_options is not None:
            tag = run_options.logid
            if run_options.log_severity_level is not None:
                severity = run_options.log_severity_level
        trace = self._trace
        timings: list[LayerTiming] | None = None
        with log_scope(severity, tag), stop_scope(run_options), \
                cache_scope(self._cache_dir if self._builds_at_run else None):
            start = time.perf_counter()
            if trace is None and not timed:
                results = self.runtime.run(self.network_id, input_feed, outputs_on, into)
            else:
                results, timings = self.runtime.run_profiled(self.network_id, input_feed,
                                                             outputs_on, into)
            if trace is not None:
                trace.add_run(timings or [], start, time.perf_counter(), tag)
        return self._select(output_names, results), timings

    def _update_fast_path(self) -> None:
        self._fast = (self._trace is None and self._severity == 2 and not self._closed
                      and not (self._cache_dir and self._builds_at_run)
                      and self._against_cpu is None and self._later is None)
        self._direct = self.runtime.host_run(self.network_id) if self._fast else None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this InferenceSession is closed (close() unloaded its network): "
                               "create a new session to run the model again")

    def _select(self, output_names: Sequence[str] | None, results: list[Any]) -> list[Any]:
        if output_names is None:
            return results
        index = {name: i for i, name in enumerate(self._outputs)}
        unknown = [name for name in output_names if name not in index]
        if unknown:
            raise InvalidInputError(f"{unknown}: not output(s) of the model; its outputs are: "
                                    f"{', '.join(self._outputs)}")
        return [results[index[name]] for name in output_names]

    # -- inputs and outputs bound to memory (ONNX Runtime's IOBinding) ------------------------------
    def io_binding(self) -> IOBinding:
        """A binding of this session's inputs and outputs to memory: ``backplane.io_binding``."""
        return IOBinding(self)

    def run_with_iobinding(self, binding: IOBinding, run_options: RunOptions | None = None) -> None:
        """Run on the bound inputs; the bound outputs are then ``binding.get_outputs()``, written
        when this returns."""
        if not isinstance(binding, IOBinding) or binding._session is not self:
            raise TypeError("run_with_iobinding takes a binding made by this session's io_binding()")
        binding._run(run_options)

    def _run_on(self, input_feed: Mapping[str, Any], outputs_on: Sequence[str | None],
                run_options: RunOptions | None, into: Sequence[Any] | None = None) -> list[Any]:
        """All outputs, each in the memory ``outputs_on`` names (None: the host), or written into
        the host array ``into`` gives for it (``Runtime.run``)."""
        self._check_open()
        return self._run(None, input_feed, run_options, outputs_on=outputs_on, into=into)[0]

    def close(self) -> None:
        """Unload the network and release what its backends hold, and close the session's
        Runtime where the session made it (one given to it stays open); running after is an
        error, and closing again does nothing."""
        if self._closed:
            return
        if self._later is not None:
            self._later.cancel()
            self._later = None
        self.runtime.unload(self.network_id)
        if self._overrides is not None:
            self._overrides.unload(self.runtime)
        if self._own_runtime:
            self.runtime.close()  # its contexts, and the backends it holds (destroy hooks)
        self._closed = True
        self._update_fast_path()


def _ceiling_here(network: OptimizedNetwork, threads: Any) -> None:
    """An artifact's network given this session's ``intra_op_num_threads`` (an ``AtMost``: a
    ceiling its CpuAcc workloads' governor lowers on a busy machine): the count its manifest stored
    reads back as a plain int, a fixed count (bench/wild.py's sessions load through the compile
    cache). The runtime gives the network's options to its backends (``Runtime._configure``)."""
    from backplane.backends.torch.threads import AtMost

    if not isinstance(threads, AtMost):
        return
    for net in within(network):
        if "CpuAcc.threads" in net.backend_options:
            net.backend_options["CpuAcc.threads"] = threads


def _compile_cache(cache_dir: str | os.PathLike | None) -> str | None:
    """``artifact.cache.folder``, whose modules (the artifact's writer and reader) are imported
    only where a compile cache is asked for: a plain session's load does without them."""
    if cache_dir is None and not os.environ.get("BACKPLANE_COMPILE_CACHE"):
        return None
    return artifact.cache.folder(cache_dir)
