"""Adapters for the ONNX node-suite runner (shared/tools/onnx_node_suite.py --adapter MODULE:CALLABLE).

``cpuref`` runs a case on CpuRef alone. A layer CpuRef does not claim ends the case with
OptimizationError ("not supported"), never with a wrong answer. ``cpuacc`` runs it on CpuAcc with
CpuRef taking what CpuAcc refuses (the multi-backend flow the torch backends are used in); ``gpuacc``
on GpuAcc, CpuRef taking the rest (needs a CUDA device).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backplane.session import InferenceSession


def cpuref(model_path: str, inputs: Mapping[str, Any]) -> list[Any]:
    session = InferenceSession(model_path, backends=["CpuRef"])
    return session.run(None, dict(inputs))


def cpuacc(model_path: str, inputs: Mapping[str, Any]) -> list[Any]:
    session = InferenceSession(model_path, backends=["CpuAcc", "CpuRef"])
    return session.run(None, dict(inputs))


def gpuacc(model_path: str, inputs: Mapping[str, Any]) -> list[Any]:
    session = InferenceSession(model_path, backends=["GpuAcc", "CpuRef"])
    return session.run(None, dict(inputs))
