"""A backward that takes the forward's hoisted GEMM results (``compile_backward(..., given_hoisted=True)``,
``SequenceFunction.sequences_keeping``) instead of computing them again: the same gradients as the
float64 derivation, for fixed and any T, cells with a layer norm and with x read in the step; its
arguments checked; its CUDA code compiled by nvcc; on a GPU, against float64.
"""

import functools
import shutil

import numpy as np
import pytest
from conftest import (NUMPY_DTYPE, TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err,
                      representative, upcast)
from test_backward import sequence_grads
from test_backward_x import SharedInput

import halstm
from halstm.gradients import compile_backward, reference_backward
from halstm.lowering import kept_results
from halstm.targets import CudaTarget

CELLS = [halstm.LSTM, halstm.GRU, halstm.LayerNormLSTM, SharedInput]


def _kept(forward):
    return [g.name for g in forward.plan.hoisted]


def _problem(cell, T, B, rng, dtype="float32"):
    x, params, states = random_inputs(cell, T, B, rng, dtype)
    gy, finals = rng.standard_normal((T, B, cell.hidden_size)), {s: rng.standard_normal((B, cell.hidden_size))
                                                                 for s in cell.states}
    want = reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals))
    return x, params, states, sequence_grads(cell, gy, finals, NUMPY_DTYPE[dtype]), want


def _assert_close(got, want, tolerance):
    for part, expected in zip(got, want):
        if isinstance(expected, dict):
            for name, value in expected.items():
                assert rel_err(np.asarray(part[name], np.float64), value) < tolerance, name
        else:
            assert rel_err(np.asarray(part, np.float64), expected) < tolerance, "x"


def _cell(cell_type):
    return cell_type(6, 6) if cell_type is SharedInput else cell_type(5, 8)


@functools.cache
def _forward(cell_type, steps):
    """The plain CPU forward of ``_cell(cell_type)`` at B=3, once a process: tests that only call it share it."""
    return halstm.compile(_cell(cell_type), steps, 3, "float32")


@functools.cache
def _given_hoisted(cell_type, steps):
    """Its backward taking the forward's hoisted GEMM results, once a process."""
    return compile_backward(_cell(cell_type), steps, 3, "float32", given_hoisted=True)


def _cases(cells):
    return [(c, s) for c in cells for s in (5, None)], [f"{c.__name__}-{'T5' if s else 'any-T'}" for c in cells
                                                        for s in (5, None)]


# CI: LayerNormLSTM (sums over the hidden units) at T=5 and SharedInput (x read in its step) at any T;
# test_kept_step_results_match_float64 runs LSTM at any T and SharedInput at T=5 in CI. The other cases
# repeat those paths with other math (slow: a forward and a backward compiled a case)
MATCHES_IN_CI = ["LayerNormLSTM-T5", "SharedInput-any-T"]


@pytest.mark.parametrize("cell_type, steps", representative(*_cases(CELLS), MATCHES_IN_CI))
def test_given_hoisted_matches_float64(cell_type, steps, rng):
    cell = _cell(cell_type)
    forward, backward = _forward(cell_type, steps), _given_hoisted(cell_type, steps)
    assert "given (the forward's)" in str(backward.program.plan)
    for T in (5,) if steps else (5, 2):
        x, params, states, grads, want = _problem(cell, T, 3, rng)
        seqs, kept = forward.sequences_keeping(x, params, states, _kept(forward))
        _assert_close(backward(x, params, seqs, grads, hoisted=kept), want, TOLERANCE["float32"])


def test_given_hoisted_arguments_are_checked(rng):
    cell = halstm.LSTM(5, 8)
    forward, given = _forward(halstm.LSTM, None), _given_hoisted(halstm.LSTM, None)
    recomputing = compile_backward(cell, None, 3, "float32")
    x, params, states, grads, _ = _problem(cell, 4, 3, rng)
    seqs, kept = forward.sequences_keeping(x, params, states, ["x_proj0"])
    assert kept["x_proj0"].shape == (128, 32)  # T*B rows padded to 128, as the forward pads them
    with pytest.raises(KeyError, match=r"hoisted: missing \['x_proj0'\]"):
        given(x, params, seqs, grads)
    with pytest.raises(ValueError, match=r"hoisted\['x_proj0'\].*shape"):
        given(x, params, seqs, grads, hoisted={"x_proj0": kept["x_proj0"][:64]})
    with pytest.raises(ValueError, match="computes the hoisted GEMMs' results itself"):
        recomputing(x, params, seqs, grads, hoisted=kept)
    with pytest.raises(ValueError, match="no scratch buffer"):
        forward.sequences_keeping(x, params, states, ["gemm7"])


def test_kept_results_are_the_calls_own(rng):
    """Two forward calls keep two buffers: the first call's results survive the second."""
    cell = halstm.GRU(5, 8)
    forward = halstm.compile(cell, None, 3, "float32")
    x1, params, states, _, _ = _problem(cell, 4, 3, rng)
    _, first = forward.sequences_keeping(x1, params, states, ["x_proj0"])
    before = np.array(first["x_proj0"][:12])
    forward.sequences_keeping(x1[::-1].copy(), params, states, ["x_proj0"])
    np.testing.assert_array_equal(first["x_proj0"][:12], before)
    np.testing.assert_allclose(before, x1.reshape(12, 5) @ params["weight_ih"].T, rtol=1e-5, atol=1e-6)


# CI: LSTM at any T and SharedInput (x read in its step) at T=5; the other cases repeat the kept results'
# path with other math, LayerNormLSTM's in CI in test_given_hoisted_matches_float64 (slow: two forwards
# and a backward a case)
KEPT_IN_CI = ["LSTM-any-T", "SharedInput-T5"]


@pytest.mark.parametrize("cell_type, steps", representative(
    *_cases([halstm.LSTM, halstm.ResetBeforeGRU, halstm.LayerNormLSTM, SharedInput]), KEPT_IN_CI))
def test_kept_step_results_match_float64(cell_type, steps, rng):
    """A CPU forward that keeps its first stage's GEMM results (``keep_results``): the same sequences,
    each step's rows the GEMM of the state before it, and a backward reading them
    (``given_results``) against float64; with those rows changed, its gradients change."""
    cell = _cell(cell_type)
    plain = _forward(cell_type, steps)
    forward = halstm.compile(cell, steps, 3, "float32", keep_results=True)
    backward = compile_backward(cell, steps, 3, "float32", given_hoisted=True, given_results=True)
    names = _kept(forward) + kept_results(forward.plan)
    assert "gemm0 given (the forward's)" in str(backward.program.plan).replace("x_proj0, ", "")
    for T in (5,) if steps else (5, 2):
        x, params, states, grads, want = _problem(cell, T, 3, rng)
        seqs, kept = forward.sequences_keeping(x, params, states, names)
        for s, seq in plain.sequences(x, params, states).items():
            np.testing.assert_allclose(seqs[s], seq, rtol=1e-6, atol=1e-6)
        if cell_type is halstm.LSTM:  # gemm0 = h_t @ weight_hh^T, step by step
            h = np.asarray(seqs["h"][:T]).reshape(T * 3, 8)
            np.testing.assert_allclose(kept["gemm0_steps"][:T * 3], h @ params["weight_hh"].T, rtol=1e-5, atol=1e-6)
        got = backward(x, params, seqs, grads, hoisted=kept)
        _assert_close(got, want, TOLERANCE["float32"])
        noise = rng.standard_normal(kept["gemm0_steps"].shape).astype(np.float32)  # not a shift: LN ignores those
        changed = {**kept, "gemm0_steps": np.asarray(kept["gemm0_steps"]) + noise}
        assert rel_err(np.asarray(backward(x, params, seqs, grads, hoisted=changed)[0], np.float64), want[0]) > 1e-3


def test_the_persistent_kernel_stores_kept_step_results():
    """The persistent kernel of a forward lowered with ``keep_results``: the copy of the step GEMM's
    results over (B, 4H) read as one elementwise block a gate, each storing its gate's columns
    into a step's view of the kept buffer (``<gemm>_steps``) from the results it holds on chip."""
    import tvm_ffi
    from tvm import tirx

    from halstm.schedules import CudaPersistent
    from halstm.schedules.persistent_kernel import PersistentKernel
    from halstm.schedules.step_program import Elementwise, step_blocks

    h100 = CudaTarget("sm_90", sms=132)
    program = halstm.lower(halstm.LSTM(32, 32), None, 16, "float16", keep_results=True)
    kept = [b for b in step_blocks(program) if isinstance(b, Elementwise) and b.buffer == "gemm0_kept"]
    assert [b.column for b in kept] == [0, 32, 64, 96]
    kernel = PersistentKernel.plan(program, h100, CudaPersistent().defaults(program, h100))
    stores = []
    tvm_ffi.structural_walk(kernel.func().body, (tirx.BufferStore, stores.append))
    assert len([n for n in stores if n.buffer.name == "gemm0_kept"]) == 4  # a step's view of gemm0_steps
    plain = halstm.lower(halstm.LSTM(32, 32), None, 16, "float16")
    assert not any(isinstance(b, Elementwise) and b.buffer.endswith("_kept") for b in step_blocks(plain))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_a_gpu_forward_keeps_step_results_where_its_recipe_does():
    """``keep_results`` on a GPU: the persistent kernel keeps them; the step loop, asked for, does
    not (its function keeps the hoisted results alone, as without the flag)."""
    h100 = CudaTarget("sm_90", sms=132)
    cell = halstm.LSTM(64, 64)
    persistent = halstm.compile(cell, None, 16, "float16", target=h100, keep_results=True)
    assert persistent.recipe.name == "cuda-persistent" and persistent.program.keeps_results
    assert persistent.program.kept == ["x_proj0", "gemm0_steps"]
    step_loop = halstm.compile(cell, None, 16, "float16", target=h100, recipe="cuda-step-loop", keep_results=True)
    assert not step_loop.program.keeps_results and step_loop.program.kept == ["x_proj0"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype, batch", [("float16", 64), ("float32", 16)])
def test_given_hoisted_generates_cuda(dtype, batch, tmp_path):
    """The hoisted results as prepare's arguments, its hoisted GEMM gone; nvcc compiles the rest."""
    h100 = CudaTarget("sm_90", sms=132)
    cell = halstm.LSTM(64, 64)
    given = compile_backward(cell, None, batch, dtype, target=h100, given_hoisted=True)
    recomputing = compile_backward(cell, None, batch, dtype, target=h100)
    assert [a.name for a in given.program.prepare.args if a.role == "hoisted"] == ["x_proj0"]
    assert not any(a.role == "hoisted" for a in recomputing.program.prepare.args)
    forward = halstm.compile(cell, None, batch, dtype, target=h100)
    kept = next(a for a in forward.scratch if a.name == "x_proj0")
    taken = next(a for a in given.program.prepare.args if a.name == "x_proj0")
    assert (kept.shape, kept.dtype) == (taken.shape, taken.dtype)
    assert_nvcc_compiles(given.module.mod.imports[0].inspect_source(), tmp_path)


GPU = [(halstm.LSTM, "float16", (20, 16, 256)), (halstm.GRU, "float32", (20, 16, 256)),
       (halstm.LSTM, "float16", (7, 64, 128)), (halstm.LayerNormLSTM, "float16", (5, 16, 32))]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("cell_type, dtype, shape", GPU, ids=["{}-{}-T{}-B{}-H{}".format(c.__name__, d, *s)
                                                              for c, d, s in GPU])
@pytest.mark.parametrize("keep", [False, True], ids=["hoisted", "kept-results"])
def test_given_hoisted_on_gpu_against_float64(cell_type, dtype, shape, keep, rng):
    """With ``keep``, a forward that keeps its step GEMMs' results where its recipe does (the
    persistent kernel at these shapes: LSTM's rows each h_t @ weight_hh^T) and a backward taking them."""
    import torch

    T, B, H = shape
    cell, target = cell_type(H, H), CudaTarget.detect()
    forward = halstm.compile(cell, None, B, dtype, target=target, keep_results=keep)
    keeps = forward.program.keeps_results
    assert keeps == (keep and forward.recipe.name == "cuda-persistent")
    backward = compile_backward(cell, None, B, dtype, target=target, given_hoisted=True, given_results=keeps)
    x, params, states, grads, want = _problem(cell, T, B, rng, dtype)
    gpu = lambda d: {k: torch.from_numpy(np.asarray(v)).cuda() for k, v in d.items()}
    x_gpu, params_gpu = torch.from_numpy(x).cuda(), gpu(params)
    seqs, kept = forward.sequences_keeping(x_gpu, params_gpu, gpu(states), forward.program.kept)
    if keeps and cell_type is halstm.LSTM:
        h = seqs["h"][:T].double().reshape(T * B, H)
        gemm = (h @ params_gpu["weight_hh"].double().T).cpu().numpy()
        assert rel_err(kept["gemm0_steps"][:T * B].double().cpu().numpy(), gemm) < TOLERANCE[dtype]
    got = backward(x_gpu, params_gpu, seqs, gpu(grads), hoisted=kept)
    host = (got[0].float().cpu().numpy(), *({k: v.float().cpu().numpy() for k, v in part.items()} for part in got[1:]))
    _assert_close(host, want, TOLERANCE[dtype])
