"""Every built-in cell at any shape on CUDA: T=B=I=H=1 and odd sizes, in each dtype, with whichever
recipe applies. A recipe that cannot serve a shape says so through ``is_applicable``, never by a
TVM error; the GPU test runs what applies against float64."""

import numpy as np
import pytest

import halstm
from conftest import TOLERANCE, gpu_available, outputs_on_gpu, rel_err, representative
from halstm import schedules
from halstm.cells import BUILTIN
from halstm.targets import CudaTarget

H100 = CudaTarget("sm_90", sms=132)
SHAPES = [(1, 1, 1, 1), (37, 3, 19, 333)]  # T, B, I, H
DTYPES = ["float32", "float16", "bfloat16"]
CUDA_RECIPES = [r for r in schedules.BUILTIN if r.name.startswith("cuda")]
shape_id = "T{}-B{}-I{}-H{}".format


SCHEDULE_CASES = [(c, r, s) for c in BUILTIN.values() for r in CUDA_RECIPES for s in SHAPES]
SCHEDULE_IDS = [f"{c.__name__}-{r.name}-{shape_id(*s)}" for c, r, s in SCHEDULE_CASES]
# CI: each cell x recipe at one of the two shapes, the shapes alternating along the cells and along the
# recipes (each recipe at each shape for half the cells); the other shape repeats the recipe's path with
# the same cell (slow)
SCHEDULE_IN_CI = [f"{c.__name__}-{r.name}-{shape_id(*SHAPES[(i + j) % 2])}"
                  for i, c in enumerate(BUILTIN.values()) for j, r in enumerate(CUDA_RECIPES)]


@pytest.mark.parametrize("cell_type, recipe, shape", representative(SCHEDULE_CASES, SCHEDULE_IDS, SCHEDULE_IN_CI))
def test_each_recipe_schedules_or_declines(cell_type, recipe, shape):
    """Scheduling (not building: that is the GPU test's) at the degenerate and the odd shape, fp32
    and fp16 (the tensor-core paths): the CUDA recipes failed in ``fuse`` at T=B=I=H=1."""
    T, B, I, H = shape
    cell = cell_type(I, H)
    for dtype in ("float32", "float16"):
        program = halstm.lower(cell, T, B, dtype)
        if not recipe.is_applicable(program, H100):
            assert recipe.name != "cuda-step-loop", f"the step loop serves every cell ({cell!r}, {dtype})"
            continue
        knobs = recipe.resolve(program, H100, None)
        layout = recipe.layout(program, H100, knobs)
        if layout != program.layout:
            program = halstm.lower(cell, T, B, dtype, layout=layout)
        assert recipe.apply(program, H100, **knobs) is not None, (cell, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: shape_id(*s))
@pytest.mark.parametrize("cell_type", BUILTIN.values(), ids=lambda c: c.__name__)
def test_any_shape_matches_reference_on_gpu(cell_type, shape, dtype, rng):
    pytest.importorskip("torch")
    T, B, I, H = shape
    cell = cell_type(I, H)
    f = halstm.compile(cell, T, B, dtype, target=CudaTarget.detect(), database=False)
    for name, got, want in outputs_on_gpu(f, cell, T, B, rng, dtype):
        assert error(got, want) < TOLERANCE[dtype], (name, f.recipe.name)


def error(got, want) -> float:
    """The relative norm error; of one value (B = H = 1), its error against the scale of the cells'
    values (1: gates and states are bounded by about 1): one value's relative error is
    ill-conditioned where gate terms cancel, and fp32's own rounding then passes 1e-5."""
    if want.size > 1:
        return rel_err(got, want)
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))
