"""Schedule recipes: how a lowered program runs on a target.

A recipe is a small class in the style of TVM's dlight rules: ``is_applicable(program, target)`` and
``apply(program, target, **knobs)``, which returns an ``s_tir.Schedule`` (its ``trace`` prints every
rewrite made) or None. ``knobs`` names each tunable and its candidate values; the first is the default.
``runs(program, target, knobs)`` says whether a setting can run at all (``halstm.compile`` refuses the
others), ``valid`` whether the tuner should measure it. Users write their own by subclassing ``Recipe``;
``recipes_for`` lists the built-in ones.
"""

from __future__ import annotations

from .recipe import Recipe
from .cpu import CpuStepLoop
from .cuda import CudaStepLoop
from .cuda_persistent import CudaPersistent

BUILTIN = (CpuStepLoop(), CudaPersistent(), CudaStepLoop())


def recipes_for(program, target) -> list[Recipe]:
    """The built-in recipes that apply to ``program`` on ``target``, preferred first: the persistent
    kernel goes last where ``CudaPersistent.preferred`` says so (it still applies; the tuner and the
    benchmark measure it)."""
    found = [r for r in BUILTIN if r.is_applicable(program, target)]
    found.sort(key=lambda r: isinstance(r, CudaPersistent) and not r.preferred(program, target))
    return found


__all__ = ["Recipe", "CpuStepLoop", "CudaStepLoop", "CudaPersistent", "recipes_for", "BUILTIN"]
