"""Targets: where a program runs, what the hardware offers, and how a scheduled module is built.

``resolve("cpu")`` gives the host CPU (LLVM, all cores, its SIMD width); ``resolve("cuda")`` a CUDA
GPU whose properties are read from the device (or given, to cross-compile on a machine without one).
"""

from __future__ import annotations

from .cpu import CpuTarget
from .cuda import CudaTarget
from . import cpu_math  # noqa: F401  (registers the vectorisable exp for LLVM)


def resolve(target) -> CpuTarget | CudaTarget:
    """A target object from "cpu"/"llvm", "cuda", or a target object itself."""
    if isinstance(target, (CpuTarget, CudaTarget)):
        return target
    if target in ("cpu", "llvm"):
        return CpuTarget.host()
    if target in ("cuda", "gpu"):
        return CudaTarget.detect()
    raise ValueError(f"unknown target {target!r}: use 'cpu', 'cuda', or a halstm.targets object")


__all__ = ["CpuTarget", "CudaTarget", "resolve"]
