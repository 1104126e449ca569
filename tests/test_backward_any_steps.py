"""A backward compiled with ``steps=None`` serves every sequence length: one build (its three functions
over all T*B rows take T as their first argument, its reversed loop is compiled for any T and called
for T + 1 steps), T read off each call's x, gradients against float64 at several T; bad T refused
before anything runs."""

import functools

import numpy as np
import pytest
from conftest import TF32_TOLERANCE, TOLERANCE, gpu_available, random_inputs, rel_err, representative

import halstm
from halstm.backward import lower_backward
from halstm.cells import BUILTIN
from halstm.gradients import compile_backward, lower_backward_for, reference_backward
from halstm.targets import CudaTarget

STEPS = (1, 2, 7, 30)
B, I, H = 3, 12, 20


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    monkeypatch.setenv("HALSTM_CACHE", "0")


@functools.cache
def forward(cell_type, input_size, hidden_size, batch):
    """The forward for any T, compiled once a process for a cell type and size: every T's
    problem reads its state sequences from it."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HALSTM_CACHE", "0")  # a test that turns the disk cache on stores no forward of this
        return halstm.compile(cell_type(input_size, hidden_size), None, batch, database=False)


@functools.cache
def backward_for_any_length(cell_type, batch=B):
    """``compile_backward(cell_type(I, H), None, batch)``, once a process: tests that only call it share it."""
    return compile_backward(cell_type(I, H), None, batch, database=False)


def problem(cell, T, rng, batch=B):
    """Inputs, the forward's state sequences (compiled for any T) and random gradients at every step."""
    x, params, states = random_inputs(cell, T, batch, rng)
    seqs = forward(type(cell), cell.input_size, cell.hidden_size, batch).sequences(x, params, states)
    grads = {s: rng.standard_normal((T + 1, batch, cell.hidden_size)).astype(np.float32) for s in cell.states}
    return x, params, states, seqs, grads


def check(got, want, what):
    (dx, dparams, dstates), (wx, wparams, wstates) = got, want
    assert dx.shape == wx.shape and dx.dtype == np.float32, what
    assert rel_err(dx, wx) < TOLERANCE["float32"], (what, "x")
    for name, value in wparams.items():
        assert rel_err(dparams[name], value) < TOLERANCE["float32"], (what, name)
    for s, value in wstates.items():
        assert rel_err(dstates[s], value) < TOLERANCE["float32"], (what, s)


# CI: LSTM (two states), GRU, LayerNormGRU (sums over the hidden units), SRU and MinGRU (diagonal cells);
# the other cells repeat the any-length path with their own math (slow), which each cell's backward
# at a fixed T checks in CI (test_backward.py, test_scan_cells.py), ResetBeforeGRU's at any T below
CPU_BACKWARD_IN_CI = ["LSTM", "GRU", "LayerNormGRU", "SRU", "MinGRU"]


@pytest.mark.parametrize("cell_type", representative([(c,) for c in BUILTIN.values()], BUILTIN, CPU_BACKWARD_IN_CI))
def test_one_cpu_backward_serves_every_length(cell_type, rng):
    cell = cell_type(I, H)
    backward = backward_for_any_length(cell_type)
    assert backward.program.steps is None and backward.adjoint.signature.steps is None
    for T in STEPS:
        x, params, states, seqs, grads = problem(cell, T, rng)
        want = reference_backward(cell, x, params, states, grads)
        check(backward(x, params, seqs, grads), want, T)


@pytest.mark.parametrize("batch", [1, 16], ids=lambda b: f"B{b}")
def test_row_tiles_whatever_the_batch(batch, rng):
    """The GEMMs over n_steps * B rows take the largest register tile dividing them for every T (one
    row at B=1, eight at B=16), the hoisted GEMMs' rows padded as the forward's: right at both."""
    cell = halstm.ResetBeforeGRU(I, H)  # a GEMM of the rows function besides those of prepare and weights
    backward = compile_backward(cell, None, batch, database=False)
    for T in (3, 11):
        x, params, states, seqs, grads = problem(cell, T, rng, batch)
        check(backward(x, params, seqs, grads), reference_backward(cell, x, params, states, grads), (batch, T))


def test_float16_against_float64(rng):
    """Stored in float16, computed in float32, the buffers between the functions in float16 too."""
    cell = halstm.LSTM(I, H)
    backward = compile_backward(cell, None, B, "float16", database=False)
    forward = halstm.compile(cell, None, B, "float16", database=False)
    for T in (3, 9):
        x, params, states = random_inputs(cell, T, B, rng, "float16")
        seqs = forward.sequences(x, params, states)
        grads = {s: rng.standard_normal((T + 1, B, H)).astype(np.float16) for s in cell.states}
        (dx, dparams, dstates) = backward(x, params, seqs, grads)
        wx, wparams, wstates = reference_backward(cell, x, params, states, grads)
        assert rel_err(dx, wx) < TOLERANCE["float16"], T
        for name, value in {**wparams, **wstates}.items():
            assert rel_err({**dparams, **dstates}[name], value) < TOLERANCE["float16"], (T, name)


def test_a_state_left_out_of_grads_has_zero_gradient(rng):
    cell = halstm.LSTM(I, H)
    backward = backward_for_any_length(halstm.LSTM)
    for T in (2, 5):
        x, params, states, seqs, grads = problem(cell, T, rng)
        grads = {"h": grads["h"]}
        want = reference_backward(cell, x, params, states, {**grads, "c": np.zeros((T + 1, B, H))})
        check(backward(x, params, seqs, grads), want, T)


def test_any_length_sources_name_their_steps_and_fixed_sources_do_not():
    cell = halstm.GRU(8, 8)
    any_t, fixed = lower_backward(cell, None, 2), lower_backward(cell, 5, 2)
    for name, function in any_t.functions.items():
        assert function.args[0].name == "n_steps" and "n_steps" in function.source, name
        assert "n_steps" not in fixed.functions[name].source, name
    assert any_t.steps is None and fixed.longest == 5 and any_t.longest > 10**6


def test_a_cached_any_length_backward_loads_and_runs(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("HALSTM_CACHE", "1")
    monkeypatch.setenv("HALSTM_CACHE_DIR", str(tmp_path))
    cell = halstm.GRU(I, H)
    built = compile_backward(cell, None, B, database=False)
    loaded = compile_backward(cell, None, B, database=False)
    assert built.cached is None and loaded.cached is not None and "T=any" in repr(loaded)
    for T in (1, 6):
        x, params, states, seqs, grads = problem(cell, T, rng)
        check(loaded(x, params, seqs, grads), reference_backward(cell, x, params, states, grads), T)


def test_a_cached_cuda_backward_is_loaded_without_scheduling_its_functions(monkeypatch):
    """On tensor cores the backward's functions are scheduled only to build them: where the cache
    has the entry, nothing schedules them (before, they were scheduled first to find out whether TVM
    could)."""
    from halstm import cache
    from halstm.schedules import BUILTIN

    target, looked_up, scheduled = CudaTarget("sm_90", sms=132), [], []
    step_loop = next(r for r in BUILTIN if r.name == "cuda-step-loop")
    apply = type(step_loop).apply
    monkeypatch.setattr(type(step_loop), "apply", lambda self, p, *a, **k: (scheduled.append(p), apply(self, p, *a, **k))[1])
    monkeypatch.setattr(cache, "backward", lambda program, *args: looked_up.append(program) or "loaded")
    assert compile_backward(halstm.LSTM(16, 32), 5, 16, "float16", target, database=False) == "loaded"
    assert not set(map(id, looked_up[0].functions.values())) & set(map(id, scheduled))


def test_lengths_out_of_range_and_mismatched_sequences_are_refused(monkeypatch, rng):
    cell = halstm.LSTM(I, H)
    backward = backward_for_any_length(halstm.LSTM)  # shared: its longest is patched for this test alone
    params = cell.init_parameters(seed=0)
    seqs = {s: np.ones((4, B, H), np.float32) for s in cell.states}
    with pytest.raises(ValueError, match="0 steps"):
        backward(np.ones((0, B, I), np.float32), params, seqs)
    with pytest.raises(ValueError, match=rf"seqs\['h'\].*\(3, {B}, {H}\)"):  # x of 2 steps, sequences of 3
        backward(np.ones((2, B, I), np.float32), params, seqs)
    with pytest.raises(ValueError, match="rank 3"):
        backward(np.ones((3, I), np.float32), params, seqs)
    monkeypatch.setattr(backward, "longest", 3)  # without allocating that much
    with pytest.raises(ValueError, match="takes 1 to 3"):
        backward(np.ones((4, B, I), np.float32), params, {s: np.ones((5, B, H), np.float32) for s in cell.states})
    x, _, _, seqs, grads = problem(cell, 3, rng)
    assert backward(x, params, seqs, grads)[0].shape == (3, B, I)


DTYPES = {"float16": ("float16", False), "float32": ("float32", False), "tf32": ("float32", True)}
SIZES = [(1, 64), (16, 64), (64, 64), (4, 32)]  # (B, H); (4, 32): the training benchmark's gradient check
BUILD_CASES = [(c, *DTYPES[d], b, h) for c in BUILTIN.values() for d in DTYPES for b, h in SIZES]
BUILD_IDS = [f"{c.__name__}-{d}-B{b}-H{h}" for c in BUILTIN.values() for d in DTYPES for b, h in SIZES]
# CI: LSTM in each dtype (fp16 B=16, TF32 B=64, fp32 B=1), ResetBeforeGRU fp16 B=1, PeepholeLSTM fp32 B=16
# and GRU fp16 B=4 H=32 (FFMA over a symbolic K); the other cases repeat those GEMM paths with other
# math (slow), LayerNormLSTM's CUDA backward nvcc compiles in CI at a fixed T (test_backward.py)
BUILD_IN_CI = ["LSTM-float16-B16-H64", "LSTM-tf32-B64-H64", "LSTM-float32-B1-H64", "ResetBeforeGRU-float16-B1-H64",
               "PeepholeLSTM-float32-B16-H64", "GRU-float16-B4-H32"]


@pytest.mark.parametrize("cell_type, dtype, allow_tf32, batch, width",
                         representative(BUILD_CASES, BUILD_IDS, BUILD_IN_CI))
def test_cuda_schedules_of_the_any_length_functions_build(cell_type, dtype, allow_tf32, batch, width):
    """The step-loop recipe schedules prepare, rows and weights over n_steps * B rows and nvcc compiles
    them for an H100 (sm_90: wgmma where it applies): the GEMMs' rows and the weight gradients' K
    padded to whole tiles, the column sums over symbolic rows, tensor-core schedules where their
    tiles divide symbolic rows, FFMA where TVM cannot tensorize a GEMM over a symbolic K (GRU fp16,
    B=4, H=32); running them is the GPU's test."""
    target = CudaTarget("sm_90", sms=132)
    recipe, knobs, program, scheduled = lower_backward_for(cell_type(width, width), None, batch, dtype, target,
                                                           allow_tf32=allow_tf32)
    assert program.steps is None
    for name, function in program.functions.items():
        target.build((scheduled.get(name) or recipe.apply(function, target, **knobs)).mod)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [*DTYPES, "bfloat16"])
@pytest.mark.parametrize("cell_type", [halstm.LSTM, halstm.GRU, halstm.ResetBeforeGRU, halstm.LayerNormLSTM],
                         ids=lambda c: c.__name__)
def test_one_cuda_backward_serves_every_length(cell_type, dtype, rng):
    """On the GPU, torch tensors: one backward for any T against float64 at T = 1, 7, 30."""
    import torch

    storage, allow_tf32 = DTYPES.get(dtype, (dtype, False))
    tolerance = TF32_TOLERANCE if allow_tf32 else TOLERANCE[storage]
    cell, batch = cell_type(48, 64), 16
    options = dict(target="cuda", allow_tf32=allow_tf32, database=False)
    forward = halstm.compile(cell, None, batch, storage, **options)
    backward = compile_backward(cell, None, batch, storage, **options)
    cuda = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(getattr(torch, storage)).cuda()  # noqa: E731
    for T in (1, 7, 30):
        x, params, states = random_inputs(cell, T, batch, rng, storage)
        grads = {s: rng.standard_normal((T + 1, batch, cell.hidden_size)).astype(np.float32) for s in cell.states}
        on_gpu = [{k: cuda(v) for k, v in d.items()} for d in (params, states, grads)]
        seqs = forward.sequences(cuda(x), on_gpu[0], on_gpu[1])
        dx, dparams, dstates = backward(cuda(x), on_gpu[0], seqs, on_gpu[2])
        wx, wparams, wstates = reference_backward(cell, np.asarray(x, np.float64), params, states, grads)
        assert rel_err(dx.float().cpu().numpy(), wx) < tolerance, (T, "x")
        for name, value in {**wparams, **wstates}.items():
            got = {**dparams, **dstates}[name].float().cpu().numpy()
            assert rel_err(got, value) < tolerance, (T, name)
