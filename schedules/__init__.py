"""Schedule recipes: how a lowered program runs on a target.

A recipe is a small class in the style of TVM's dlight rules: ``is_applicable(program, target)`` and
``apply(program, target, **knobs)``, which returns an ``s_tir.Schedule`` (its ``trace`` prints every
rewrite made) or None. ``knobs`` names each tunable and its candidate values; the first is the default.
Users write their own by subclassing ``Recipe``; ``recipes_for`` lists the built-in ones.
"""

from __future__ import annotations

from .recipe import Recipe
from .cpu import CpuStepLoop
from .cuda import CudaStepLoop, step_gemm_on_tensor_cores
from .cuda_persistent import PREFERRED_MAX_BATCH, CudaPersistent

TENSOR_CORE_MIN_STEP = 64 * 1024

BUILTIN = (CpuStepLoop(), CudaPersistent(), CudaStepLoop())


def recipes_for(program, target) -> list[Recipe]:
    """The built-in recipes that apply to ``program`` on ``target``, preferred first: the persistent
    kernel goes last above ``PREFERRED_MAX_BATCH`` rows, and from ``TENSOR_CORE_MIN_STEP`` B x H
    when the step loop's step GEMM runs on tensor cores (it still applies there; the tuner and the
    benchmark measure it).

    H100, 2026-11-22 (docs/gpu-results.md, fifth run), fp16, step loop on tensor cores against the
    persistent kernel: B=64, H=1024 2.7-2.8 ms against 3.7-4.5 (LSTM, GRU, PeepholeLSTM; not
    ResetBeforeGRU, 7.0 against 5.2, its second GEMM waits for the reset gate); B=64, H=512
    (T=512) 7.8-8.1 ms against 5.7-7.2 and B=16, H=512 1.2-1.4 against 0.55-0.71."""
    found = [r for r in BUILTIN if r.is_applicable(program, target)]
    wide = program.batch * program.cell.hidden_size >= TENSOR_CORE_MIN_STEP
    if program.batch > PREFERRED_MAX_BATCH or (wide and step_gemm_on_tensor_cores(program, target)):
        found.sort(key=lambda r: isinstance(r, CudaPersistent))
    return found


__all__ = ["Recipe", "CpuStepLoop", "CudaStepLoop", "CudaPersistent", "recipes_for", "BUILTIN"]
