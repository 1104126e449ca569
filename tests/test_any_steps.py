"""A function compiled with ``steps=None`` serves every sequence length: one build, T read off each
call's x, results against float64 at several T; bad T refused before anything runs."""

import numpy as np
import pytest

import halstm
from conftest import TOLERANCE, gpu_available, outputs_on_gpu, random_inputs, rel_err, representative
from halstm import schedules
from halstm.cells import BUILTIN
from halstm.lowering import NOMINAL_STEPS, lower, max_steps
from halstm.targets import CudaTarget

STEPS = (1, 2, 7, 40)
H100 = CudaTarget("sm_90", sms=132)
CUDA_RECIPES = [r for r in schedules.BUILTIN if r.name.startswith("cuda")]


@pytest.mark.parametrize("cell_type", BUILTIN.values(), ids=lambda c: c.__name__)
def test_one_cpu_function_serves_every_length(cell_type, rng):
    cell = cell_type(12, 20)
    f = halstm.compile(cell, None, 3, database=False)
    assert f.signature.steps is None and f.signature.longest == max_steps(f.plan, 3, f.program.layout)
    for T in STEPS:
        x, params, states = random_inputs(cell, T, 3, rng)
        y, finals = f(x, params, states)
        want_y, want_finals = halstm.reference(cell, x, params, states)
        assert y.shape == (T, 3, 20)
        assert rel_err(y, want_y) < TOLERANCE["float32"], T
        for s in cell.states:
            assert rel_err(finals[s], want_finals[s]) < TOLERANCE["float32"], (T, s)


def test_any_length_source_names_its_steps_and_fixed_sources_do_not():
    cell = halstm.LSTM(8, 8)
    any_t = lower(cell, None, 2)
    assert [a.name for a in any_t.args][0] == "n_steps" and "n_steps" in any_t.source
    assert "n_steps" not in lower(cell, 5, 2).source
    assert any_t.nominal_steps == NOMINAL_STEPS and lower(cell, 5, 2).nominal_steps == 5


def test_exported_any_length_function_loads_and_runs(tmp_path, rng):
    cell = halstm.GRU(8, 16)
    f = halstm.compile(cell, None, 2, database=False)
    halstm.export(f, tmp_path / "gru.so")
    loaded = halstm.load(tmp_path / "gru.so")
    assert loaded.signature.steps is None and "T=any" in repr(loaded)
    for T in (1, 9):
        x, params, states = random_inputs(cell, T, 2, rng)
        assert np.array_equal(loaded(x, params, states)[0], f(x, params, states)[0])


@pytest.mark.parametrize("steps, error", [(0, "0 steps"), (None, "past")], ids=["empty", "too long"])
def test_lengths_out_of_range_are_refused(steps, error, monkeypatch):
    cell = halstm.LSTM(4, 4)
    f = halstm.compile(cell, None, 1, database=False)
    if steps is None:  # a T past the function's longest, without allocating it: a smaller bound
        monkeypatch.setattr(f, "signature", f.signature.__class__(**{**vars(f.signature), "longest": 3}))
        steps, error = 4, "takes 1 to 3"
    with pytest.raises(ValueError, match=error):
        f(np.ones((steps, 1, 4), np.float32), cell.init_parameters(seed=0))


def test_batch_and_width_still_checked():
    cell = halstm.LSTM(4, 4)
    f = halstm.compile(cell, None, 2, database=False)
    with pytest.raises(ValueError, match=r"expected shape \(3, 2, 4\)"):
        f(np.ones((3, 1, 4), np.float32), cell.init_parameters(seed=0))
    with pytest.raises(ValueError, match="rank 3"):
        f(np.ones((3, 4), np.float32), cell.init_parameters(seed=0))


def test_steps_must_be_a_positive_integer_or_none():
    with pytest.raises(ValueError, match="or None"):
        halstm.compile(halstm.LSTM(4, 4), 0, 1)
    with pytest.raises(ValueError, match="or None"):
        halstm.compile(halstm.LSTM(4, 4), True, 1)


SCHEDULE_CASES = [(c, r, d, i, b) for c in BUILTIN.values() for r in CUDA_RECIPES
                  for d, i in (("float16", 64), ("float16", 48), ("float32", 64)) for b in (1, 16, 64)]
SCHEDULE_IDS = [f"{c.__name__}-{r.name}-{d}-{i}-{b}" for c, r, d, i, b in SCHEDULE_CASES]
# CI: the four settings of distinct GEMM paths on an H100 (fp16 B=1: an FFMA step beside a wgmma hoisted
# GEMM; K=48 B=16: WMMA; B=64: wgmma, the persistent kernel's row blocks; fp32 B=16: exact fp32 as three
# TF32 wgmma products) for LSTM and SRU (one cell of each recipe); each other cell x recipe at two of
# them, the pairs alternating along the cells and the recipes so that each recipe meets each setting
# with half the cells; the other cases repeat those paths with another cell or batch (slow: LSTM's and
# SRU's other five settings took 34 s of a 2-core machine's test time).
SCHEDULE_SETTINGS_IN_CI = (("float16-64-1", "float16-64-64"), ("float16-48-16", "float32-64-16"))
SCHEDULE_IN_CI = [f"{c.__name__}-{r.name}-{s}" for i, c in enumerate(BUILTIN.values()) for j, r in enumerate(CUDA_RECIPES)
                  for s in SCHEDULE_SETTINGS_IN_CI[(i + j) % 2]]
SCHEDULE_IN_CI += [f"{c}-{r.name}-{s}" for c in ("LSTM", "SRU") for r in CUDA_RECIPES for pair in SCHEDULE_SETTINGS_IN_CI
                   for s in pair if f"{c}-{r.name}-{s}" not in SCHEDULE_IN_CI]


@pytest.mark.parametrize("cell_type, recipe, dtype, input_size, batch",
                         representative(SCHEDULE_CASES, SCHEDULE_IDS, SCHEDULE_IN_CI))
def test_cuda_recipes_schedule_any_length(cell_type, recipe, dtype, input_size, batch):
    """Scheduling (building is the GPU test's): the hoisted GEMMs' rows and the time loop symbolic,
    on tensor cores (wgmma: a kernel a row tile, the tiles along the grid; WMMA where K = 48 is no
    whole wgmma tile) and FFMA."""
    cell = cell_type(input_size, 64)
    program = lower(cell, None, batch, dtype)
    if not recipe.is_applicable(program, H100):
        assert recipe.name != "cuda-step-loop", f"the step loop serves every cell ({cell!r}, {dtype})"
        pytest.skip(f"{recipe.name} does not apply")
    knobs = recipe.resolve(program, H100, None)
    layout = recipe.layout(program, H100, knobs)
    if layout != program.layout:
        program = lower(cell, None, batch, dtype, layout=layout)
    assert recipe.apply(program, H100, **knobs) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("recipe", CUDA_RECIPES, ids=lambda r: r.name)
@pytest.mark.parametrize("cell_type", BUILTIN.values(), ids=lambda c: c.__name__)
def test_one_cuda_function_serves_every_length(cell_type, recipe, dtype, rng):
    cell = cell_type(48, 64)
    program = lower(cell, None, 16, dtype)
    if not recipe.is_applicable(program, halstm.targets.resolve("cuda")):
        pytest.skip(f"{recipe.name} does not apply")
    f = halstm.compile(cell, None, 16, dtype, target="cuda", recipe=recipe)
    for T in STEPS:
        for name, got, want in outputs_on_gpu(f, cell, T, 16, rng, dtype):
            assert rel_err(got, want) < TOLERANCE[dtype], (T, name)
