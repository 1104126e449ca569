"""Backward through time derived from each cell's expressions.

The derivation in float64 (``reference_backward``) against torch autograd on the same cell and
against central differences of the forward reference; the compiled backward against torch autograd
in float32 and against float64 in float16/bfloat16; CUDA code generation; unsupported math named.
The loss is L = <gy, y> + sum over states of <g_s, final s>, all of gy and g_s random.
"""

import functools
import shutil

import numpy as np
import pytest
import tvm
from conftest import (NUMPY_DTYPE, TF32_TOLERANCE, TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err,
                      representative, upcast)
from halstm.targets import CudaTarget
from tvm import te
from tvm.s_tir import Schedule

import halstm
from halstm import linear, sigmoid, split, tanh
from halstm.gradients import compile_backward, reference_backward
from halstm.ops import maximum, minimum

torch = pytest.importorskip("torch")


class GatedNormRNN(halstm.Cell):
    """A cell defined here for the derivation's other rules: sums over the hidden units (a layer
    norm), rsqrt, Div, Select and if_then_else, Min/Max, exp, log, sqrt, and a nonlinear input
    before its matmul (the backward goes through it to x)."""

    states = ("h", "c")

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"w_x": (2 * H, I), "w_h": (2 * H, H), "b": (2 * H,), "gain": (H,)}

    def step(self, p, x, h, c):
        a, z = split(linear(tanh(x), p.w_x, p.b) + linear(h, p.w_h), 2)
        B, H = (int(d) for d in a.shape)
        k = te.reduce_axis((0, H), name="k")
        total = te.compute((B,), lambda b: te.sum(a[b, k], axis=k), name="total")
        k2 = te.reduce_axis((0, H), name="k2")
        squares = te.compute((B,), lambda b: te.sum((a[b, k2] - total[b] / H) * (a[b, k2] - total[b] / H), axis=k2),
                             name="squares")
        normed = te.compute((B, H), lambda b, n: (a[b, n] - total[b] / H) * te.rsqrt(squares[b] / H + 1e-3) * p.gain[n],
                            name="normed")
        up, down = maximum(z, 0.0), minimum(z, 0.0)  # each branch evaluated on its own side only
        gate = te.compute((B, H), lambda b, n: tvm.tirx.Select(z[b, n] > 0, tvm.tirx.sqrt(1.0 + up[b, n]),
                                                               tvm.tirx.exp(down[b, n])), name="gate")
        c = minimum(maximum(c * sigmoid(z) + normed * gate, -3.0), 3.0)
        up, down = maximum(c, 0.0), minimum(c, 0.0)
        h = te.compute((B, H), lambda b, n: te.if_then_else(c[b, n] > 0, tvm.tirx.log(1.0 + up[b, n]),
                                                            down[b, n] / (1.0 - down[b, n])), name="h_next")
        return h, c


# The same cells written in torch, a step at a time (LSTM and GRU run as torch.nn.LSTM/GRU instead)
def _peephole(p, x, h, c):
    gi, gf, gg, go = (x @ p["weight_ih"].T + p["bias"] + h @ p["weight_hh"].T).chunk(4, -1)
    c = torch.sigmoid(gf + p["peep_f"] * c) * c + torch.sigmoid(gi + p["peep_i"] * c) * torch.tanh(gg)
    return torch.sigmoid(go + p["peep_o"] * c) * torch.tanh(c), c


def _reset_before_gru(p, x, h):
    xr, xz, xn = (x @ p["weight_ih"].T + p["bias"]).chunk(3, -1)
    r = torch.sigmoid(xr + h @ p["weight_hr"].T)
    z = torch.sigmoid(xz + h @ p["weight_hz"].T)
    n = torch.tanh(xn + (r * h) @ p["weight_hn"].T)
    return (1 - z) * n + z * h


def _gated_norm(p, x, h, c):
    a, z = (torch.tanh(x) @ p["w_x"].T + p["b"] + h @ p["w_h"].T).chunk(2, -1)
    centred = a - a.mean(-1, keepdim=True)
    normed = centred * torch.rsqrt((centred * centred).mean(-1, keepdim=True) + 1e-3) * p["gain"]
    gate = torch.where(z > 0, torch.sqrt(1 + z.clamp(min=0)), torch.exp(z.clamp(max=0)))
    c = (c * torch.sigmoid(z) + normed * gate).clamp(-3, 3)
    return torch.where(c > 0, torch.log(1 + c.clamp(min=0)), c.clamp(max=0) / (1 - c.clamp(max=0))), c


def _layer_norm_lstm(p, x, h, c):
    ln = torch.nn.functional.layer_norm
    width = p["bias"].shape
    gates = ln(x @ p["weight_ih"].T, width, p["gamma_ih"]) + ln(h @ p["weight_hh"].T, width, p["gamma_hh"]) + p["bias"]
    i, f, g, o = gates.chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(ln(c, c.shape[-1:], p["gamma_c"], p["beta_c"])), c


def _layer_norm_gru(p, x, h):
    ln = torch.nn.functional.layer_norm
    width = p["bias_ih"].shape
    xr, xz, xn = (ln(x @ p["weight_ih"].T, width, p["gamma_ih"]) + p["bias_ih"]).chunk(3, -1)
    hr, hz, hn = (ln(h @ p["weight_hh"].T, width, p["gamma_hh"]) + p["bias_hh"]).chunk(3, -1)
    r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
    return (1 - z) * torch.tanh(xn + r * hn) + z * h


STEPS = {halstm.PeepholeLSTM: _peephole, halstm.ResetBeforeGRU: _reset_before_gru, GatedNormRNN: _gated_norm,
         halstm.LayerNormLSTM: _layer_norm_lstm, halstm.LayerNormGRU: _layer_norm_gru}
MODULES = {halstm.LSTM: torch.nn.LSTM, halstm.GRU: torch.nn.GRU}
CELLS = [halstm.LSTM, halstm.GRU, halstm.PeepholeLSTM, halstm.ResetBeforeGRU, GatedNormRNN, halstm.LayerNormLSTM,
         halstm.LayerNormGRU]
T_, B_, I_, H_ = 5, 3, 6, 16


@functools.cache
def compiled(cell_type, dtype="float32"):
    """The forward and the backward for the test shape, compiled once per cell type and dtype."""
    cell = cell_type(I_, H_)
    return halstm.compile(cell, T_, B_, dtype), compile_backward(cell, T_, B_, dtype)


def problem(cell_type, rng, dtype="float32", inputs=I_):
    """A cell, its inputs, and the loss's gradients with respect to y and the final states."""
    cell = cell_type(inputs, H_)
    x, params, states = random_inputs(cell, T_, B_, rng, dtype)
    gy = rng.standard_normal((T_, B_, H_))
    finals = {s: rng.standard_normal((B_, H_)) for s in cell.states}
    return cell, x, params, states, gy, finals


def sequence_grads(cell, gy, finals, dtype=np.float64):
    """The loss's gradients with respect to every state at every step (halstm's interface)."""
    T, B, H = gy.shape
    grads = {s: np.zeros((T + 1, B, H)) for s in cell.states}
    grads[cell.output][1:] += gy
    for s, g in finals.items():
        grads[s][T] += g
    return {s: g.astype(dtype) for s, g in grads.items()}


def torch_gradients(cell, x, params, states, gy, finals, dtype):
    """Gradients of the loss by torch autograd, in ``dtype``: {"x": dx, parameter: ..., state: ...}."""
    leaves = {k: torch.tensor(np.asarray(v, np.float64), dtype=dtype, requires_grad=True)
              for k, v in {"x": x, **params, **states}.items()}
    if type(cell) in MODULES:
        module = MODULES[type(cell)](cell.input_size, cell.hidden_size).to(dtype)
        hx = tuple(leaves[s][None] for s in cell.states)
        weights = {f"{n}_l0": leaves[n] for n in params}
        y, final = torch.func.functional_call(module, weights, (leaves["x"], hx if len(hx) > 1 else hx[0]))
        final = dict(zip(cell.states, (f[0] for f in (final if isinstance(final, tuple) else (final,)))))
    else:
        current, ys = [leaves[s] for s in cell.states], []
        for t in range(x.shape[0]):
            out = STEPS[type(cell)](leaves, leaves["x"][t], *current)
            current = list(out) if isinstance(out, tuple) else [out]
            ys.append(current[cell.states.index(cell.output)])
        y, final = torch.stack(ys), dict(zip(cell.states, current))
    loss = (y * torch.tensor(gy, dtype=dtype)).sum()
    loss = loss + sum((final[s] * torch.tensor(g, dtype=dtype)).sum() for s, g in finals.items())
    loss.backward()
    return {k: v.grad.numpy() for k, v in leaves.items()}


def as_dict(dx, dparams, dstates):
    return {"x": dx, **dparams, **dstates}


@pytest.mark.parametrize("cell_type", CELLS, ids=lambda c: c.__name__)
def test_derivation_matches_torch_autograd_in_float64(cell_type, rng):
    cell, x, params, states, gy, finals = problem(cell_type, rng)
    ours = as_dict(*reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals)))
    theirs = torch_gradients(cell, x, params, states, gy, finals, torch.float64)
    for name, want in theirs.items():
        assert rel_err(ours[name], want) < 1e-12, name


@pytest.mark.parametrize("cell_type", CELLS, ids=lambda c: c.__name__)
def test_derivation_matches_central_differences(cell_type, rng):
    """<dL/da, v> against (L(a + eps v) - L(a - eps v)) / 2 eps, a random direction v for each
    argument a (x, every parameter, every initial state) in turn."""
    cell, x, params, states, gy, finals = problem(cell_type, rng)
    args = {"x": x.astype(np.float64), **upcast(params), **upcast(states)}
    grads = as_dict(*reference_backward(cell, args["x"], upcast(params), upcast(states), sequence_grads(cell, gy, finals)))

    def loss(a):
        y, final = halstm.reference(cell, a["x"], {n: a[n] for n in params}, {s: a[s] for s in states})
        return np.sum(y * gy) + sum(np.sum(final[s] * g) for s, g in finals.items())

    eps = 1e-6
    for name, value in args.items():
        v = rng.standard_normal(value.shape)
        central = (loss({**args, name: value + eps * v}) - loss({**args, name: value - eps * v})) / (2 * eps)
        assert abs(np.sum(grads[name] * v) - central) < 1e-6 * max(1.0, abs(central)), name


# GatedNormRNN's forward takes about 73 s to compile for the CPU on a 2-core machine (its backward 3-5 s,
# the large values its derivatives read stored: autodiff._Bounded): slow where the CPU forward compiles.
# The GPU machine runs the slow tests; CI compiles GatedNormRNN's backward for CUDA
# (test_backward_generates_cuda). CI: LSTM (two states), PeepholeLSTM, ResetBeforeGRU and LayerNormLSTM
# (sums over the hidden units), each cell family at a fixed T; GRU and LayerNormGRU repeat those paths
# (slow), their backward against float64 in CI at any T (test_backward_any_steps.py).
FLOAT32_IN_CI = ["LSTM", "PeepholeLSTM", "ResetBeforeGRU", "LayerNormLSTM"]


@pytest.mark.parametrize("cell_type", representative([(c,) for c in CELLS], [c.__name__ for c in CELLS],
                                                     FLOAT32_IN_CI))
def test_compiled_matches_torch_autograd_in_float32(cell_type, rng):
    cell, x, params, states, gy, finals = problem(cell_type, rng)
    forward, backward = compiled(cell_type)
    seqs = forward.sequences(x, params, states)
    ours = as_dict(*backward(x, params, seqs, sequence_grads(cell, gy, finals, np.float32)))
    theirs = torch_gradients(cell, x, params, states, gy, finals, torch.float32)
    for name, want in theirs.items():
        assert ours[name].dtype == np.float32 and ours[name].shape == want.shape, name
        assert rel_err(ours[name], want) < TOLERANCE["float32"], name


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_compiled_low_precision_against_float64(dtype, rng):
    """Stored in float16/bfloat16, computed in float32 (the adjoint sequences included)."""
    cell, x, params, states, gy, finals = problem(halstm.LSTM, rng, dtype)
    forward, backward = compiled(halstm.LSTM, dtype)
    seqs = forward.sequences(x, params, states)
    got = as_dict(*backward(x, params, seqs, sequence_grads(cell, gy, finals, seqs["h"].dtype)))
    want = as_dict(*reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals)))
    for name, value in want.items():
        assert rel_err(got[name], value) < TOLERANCE[dtype], name


@pytest.mark.parametrize("cell_type", [halstm.LSTM, halstm.ResetBeforeGRU], ids=lambda c: c.__name__)
def test_backward_in_the_k_major_layout_matches_float64(cell_type, rng, monkeypatch):
    """The backward's operands packed (N, K), as allow_tf32 keeps them for TF32 wgmma (which reads
    no other layout), run on the CPU: its packings in that layout, and the weight gradients' operands
    rounded to TF32, against float64 (transposed packings were off by 1.4 in dx)."""
    from halstm.layout import PackedLayout
    from halstm.schedules import CpuStepLoop

    cell, x, params, states, gy, finals = problem(cell_type, rng)
    seqs = compiled(cell_type)[0].sequences(x, params, states)
    monkeypatch.setattr(CpuStepLoop, "layout", lambda self, program, target, knobs: PackedLayout(k_major=True))
    backward = compile_backward(cell, T_, B_, "float32", allow_tf32=True)
    assert backward.program.prepare.layout.k_major and backward.program.plan.tf32
    got = as_dict(*backward(x, params, seqs, sequence_grads(cell, gy, finals, np.float32)))
    want = as_dict(*reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals)))
    for name, value in want.items():
        assert rel_err(got[name], value) < TF32_TOLERANCE, name


def test_torch_tensors_in_torch_tensors_out(rng):
    cell, x, params, states, gy, finals = problem(halstm.GRU, rng)
    to_torch = lambda d: {k: torch.from_numpy(v) for k, v in d.items()}
    forward, backward = compiled(halstm.GRU)
    seqs = forward.sequences(torch.from_numpy(x), to_torch(params), to_torch(states))
    dx, _, _ = backward(torch.from_numpy(x), to_torch(params), seqs, to_torch(sequence_grads(cell, gy, finals, np.float32)))
    assert isinstance(dx, torch.Tensor) and dx.shape == (T_, B_, I_)
    want = reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals))
    assert rel_err(dx.numpy(), want[0]) < TOLERANCE["float32"]


def test_a_state_left_out_of_grads_has_zero_gradient(rng):
    """Leaving a state out of ``grads`` is passing zeros for it; torch results are allocated each on
    its own (autograd may keep a parameter's gradient: it holds none of the call's other buffers);
    ``prepare`` binds the same call."""
    cell, x, params, states, gy, finals = problem(halstm.LSTM, rng)
    forward, backward = compiled(halstm.LSTM)
    to_torch = lambda d: {k: torch.from_numpy(v) for k, v in d.items()}
    x, params = torch.from_numpy(x), to_torch(params)
    seqs = forward.sequences(x, params, to_torch(states))
    grads = to_torch(sequence_grads(cell, gy, {"h": finals["h"]}, np.float32))  # c's: zeros
    want = as_dict(*backward(x, params, seqs, grads))
    got = as_dict(*backward(x, params, seqs, {"h": grads["h"]}))
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    for name in ["x", *cell.parameters()]:
        assert got[name].untyped_storage().nbytes() == got[name].numel() * got[name].element_size(), name
    backward.prepare(x, params, seqs, grads)()


def test_bad_arguments_are_named(rng):
    _, x, params, states, _, _ = problem(halstm.GRU, rng)
    forward, backward = compiled(halstm.GRU)
    seqs = forward.sequences(x, params, states)
    with pytest.raises(ValueError, match=r"seqs\['h'\]: expected shape \(6, 3, 16\)"):
        backward(x, params, {"h": seqs["h"][1:]})
    with pytest.raises(KeyError, match=r"grads: unexpected \['c'\]"):
        backward(x, params, seqs, {"c": seqs["h"]})


def test_the_step_adjoint_gemm_is_scheduled_as_a_gemm():
    """dh = dG W runs each step of the reversed loop (the adjoint cell's step GEMM) in the recipe's
    GEMM micro-kernel (its register tile), and the weight gradients after the loop too."""
    _, backward = compiled(halstm.LSTM)
    assert "gemm0 = concat @ [gemm0_t]^T" in str(backward.adjoint.plan)
    reversed_loop = backward.adjoint.schedule.mod.script()
    assert 'T.sblock("gemm0_local")' in reversed_loop[reversed_loop.index('T.sblock("step")'):]
    assert 'T.sblock("grad_w_gemm0_local")' in backward.schedules["weights"].mod.script()


class MaxPooled(halstm.Cell):
    def parameters(self):
        return {"w_x": (self.hidden_size, self.input_size)}

    def step(self, p, x, h):
        k = te.reduce_axis((0, self.hidden_size), name="k")
        peak = te.compute((x.shape[0],), lambda b: te.max(h[b, k], axis=k), name="peak")
        return tanh(linear(x, p.w_x) + te.compute(h.shape, lambda b, n: peak[b], name="spread"))


class Reversed(halstm.Cell):
    def parameters(self):
        return {"w_x": (self.hidden_size, self.input_size)}

    def step(self, p, x, h):
        H = self.hidden_size
        return tanh(linear(x, p.w_x) + te.compute(h.shape, lambda b, n: h[b, H - 1 - n], name="flipped"))


class Diagonal(halstm.Cell):
    def parameters(self):
        return {"w_x": (self.hidden_size, self.input_size), "w_h": (self.hidden_size, self.hidden_size)}

    def step(self, p, x, h):
        return tanh(linear(x, p.w_x) + te.compute(h.shape, lambda b, n: h[b, n] * p.w_h[n, n], name="scaled"))


@pytest.mark.parametrize("cell_type, words", [
    (MaxPooled, "reduction 'peak' is not a sum"),
    (Reversed, "compute 'flipped' reads h at index"),
    (Diagonal, "compute 'scaled' reads w_h with one axis in two dimensions"),
], ids=["max-reduction", "reversed-index", "diagonal"])
def test_what_cannot_be_differentiated_is_named(cell_type, words, rng):
    cell = cell_type(4, 4)
    x, params, states = random_inputs(cell, 2, 1, rng)
    with pytest.raises(NotImplementedError, match=words):
        reference_backward(cell, x, params, states, {"h": np.ones((3, 1, 4))})


GENERATES = [(c, *d) for c in CELLS[:6] for d in (("float32", 2, 24), ("float16", 16, 32))]
GENERATES_IDS = [f"{c.__name__}-{'fp32' if d == 'float32' else 'fp16-B16'}" for c, d, _, _ in GENERATES]
# CI: in fp16 at B=16 (tensor cores beside FFMA) LSTM (its forward's units layout), LayerNormLSTM (sums
# over the hidden units) and GatedNormRNN (the WMMA fallback below); in fp32 (FFMA alone, H=24) LSTM.
# The other cases repeat those paths with other math (slow); the CUDA backward of GRU, PeepholeLSTM and
# ResetBeforeGRU nvcc compiles in CI at any T (test_backward_any_steps.py).
GENERATES_IN_CI = ["LSTM-fp16-B16", "LayerNormLSTM-fp16-B16", "GatedNormRNN-fp16-B16", "LSTM-fp32"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
# GatedNormRNN: its reversed loop's fp16 GEMM, on WMMA, left the scope no stage pipeline (ScheduleError;
# gemm_rules.WmmaGemm tries WMMA on a copy first, and FfmaGemm takes the GEMM)
@pytest.mark.parametrize("cell_type, dtype, batch, hidden", representative(GENERATES, GENERATES_IDS, GENERATES_IN_CI))
def test_backward_generates_cuda(cell_type, dtype, batch, hidden, tmp_path):
    """The CUDA step-loop recipe schedules the backward's functions; nvcc compiles them. In fp16 at
    B=16 the GEMMs of fp16 operands run on tensor cores, those of the fp32 adjoints on FFMA (the
    tensor-core schedule failed there on an adjoint that other blocks read too, and on the weight
    gradients' fp32 operands). At H=32 the forward's layout groups LSTM's gate columns by units (a
    fused step epilogue): the backward keeps them in order (lower_backward), which autodiff needs."""
    h100 = CudaTarget("sm_90", sms=132)
    cell = cell_type(20, hidden)
    backward = compile_backward(cell, 3, batch, dtype, target=h100)
    source = backward.module.mod.imports[0].inspect_source()
    assert ("wmma::mma_sync" in source) == (dtype == "float16")
    assert_nvcc_compiles(source, tmp_path)
    if cell_type in (halstm.LSTM, halstm.PeepholeLSTM) and dtype == "float16":
        assert halstm.compile(cell, 3, batch, dtype, target=h100, recipe="cuda-step-loop").program.layout.units
        assert backward.program.rows.layout.units is None


GPU_BACKWARD = [(c, dtype, (5, 16, 32)) for c in (halstm.LSTM, halstm.ResetBeforeGRU, halstm.LayerNormLSTM, GatedNormRNN)
                for dtype in ("float32", "float16")]
# the reversed loop in the persistent kernel (its defaults at these shapes), on tensor cores in fp16
# and in float32 with allow_tf32 ("tf32")
GPU_BACKWARD += [(c, dtype, (20, 16, 256)) for c in (halstm.LSTM, halstm.GRU) for dtype in ("float32", "float16", "tf32")]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("cell_type, dtype, shape", GPU_BACKWARD,
                         ids=["{}-{}-T{}-B{}-H{}".format(c.__name__, d, *s) for c, d, s in GPU_BACKWARD])
def test_backward_on_gpu_against_float64(cell_type, dtype, shape, rng):
    """Forward and backward on the GPU (B=16: fp16 GEMMs on tensor cores) against the float64 derivation."""
    T, B, H = shape
    cell = cell_type(H, H)
    target = CudaTarget.detect()
    tf32, tolerance = dtype == "tf32", TF32_TOLERANCE if dtype == "tf32" else TOLERANCE[dtype]
    dtype = "float32" if tf32 else dtype
    forward = halstm.compile(cell, T, B, dtype, target=target, allow_tf32=tf32)
    backward = compile_backward(cell, T, B, dtype, target=target, allow_tf32=tf32)
    if H == 256 and (dtype == "float16" or tf32):
        assert backward.adjoint.recipe.name == "cuda-persistent"
    x, params, states = random_inputs(cell, T, B, rng, dtype)
    gy, finals = rng.standard_normal((T, B, H)), {s: rng.standard_normal((B, H)) for s in cell.states}
    to_gpu = lambda d: {k: torch.from_numpy(np.asarray(v)).cuda() for k, v in d.items()}
    x_gpu = torch.from_numpy(x).cuda()
    seqs = forward.sequences(x_gpu, to_gpu(params), to_gpu(states))
    grads = to_gpu(sequence_grads(cell, gy, finals, NUMPY_DTYPE[dtype]))
    got = as_dict(*backward(x_gpu, to_gpu(params), seqs, grads))
    want = as_dict(*reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals)))
    for name, value in want.items():
        assert rel_err(got[name].float().cpu().numpy(), value) < tolerance, name


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_tf32_backward_runs_its_float32_gemms_on_tensor_cores(tmp_path):
    """With allow_tf32 the reversed loop and the functions around it run their float32 GEMMs as TF32
    (the loop in the persistent kernel at this shape), the functions' all on wgmma (their operands
    packed (N, K), the one layout TF32 wgmma reads); without it they stay exact, off tensor cores."""
    h100, cell = CudaTarget("sm_90", sms=132), halstm.LSTM(256, 256)
    tf32 = compile_backward(cell, 20, 16, "float32", target=h100, allow_tf32=True)
    source = tf32.module.mod.imports[0].inspect_source()
    assert tf32.program.allow_tf32 and "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32" in source
    assert "wmma::" not in source
    assert tf32.adjoint.program.allow_tf32 and tf32.adjoint.recipe.name == "cuda-persistent"
    assert_nvcc_compiles(source, tmp_path)
    exact = compile_backward(cell, 20, 16, "float32", target=h100)
    assert not exact.adjoint.program.allow_tf32 and ".tf32" not in exact.module.mod.imports[0].inspect_source()


def _adjoint_input(adjoint, x, params, seqs, grads):
    """The reversed loop's input (``AdjointCell.columns``) in float64, as the prepare function writes
    it, for cells whose hoisted GEMMs read x and first-stage GEMMs read h (LSTM's two summed in one
    block of columns, ``AdjointCell.summed``)."""
    T, B, _ = x.shape
    gemms = {g.name: g for g in adjoint.forward.gemms}
    rows = []
    for t in [*reversed(range(T)), None]:  # the steps reversed, then the extra step
        columns = []
        for name, width in adjoint.columns:
            if t is None:
                value = seqs[name[:-5]][0] if name.endswith("_next") else np.zeros((B, width))
            elif name in gemms:  # the GEMM's result, plus those summed into its columns
                value = 0
                for g in (gemms[n] for n in adjoint.summed_into(name)):
                    operand = x[t] if g.stage == 0 else seqs["h"][t]
                    value = value + operand @ np.concatenate([params[m.weight] for m in g.members]).T
            elif name.endswith("_next"):
                value = seqs[name[:-5]][t + 1]
            else:
                value = x[t] if name == "x" else seqs[name][t] if name in seqs else grads[name[1:]][t]
            columns.append(value)
        rows.append(np.concatenate(columns, 1))
    return np.stack(rows)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("cell_type, sums", [(halstm.LSTM, 1), (halstm.GRU, 2)], ids=["LSTM", "GRU"])
def test_rows_sums_each_distinct_parameter_adjoint_once(cell_type, sums, dtype):
    """LSTM's two biases have one adjoint, the gates' summed down the rows: rows sums it once and
    writes it to both (in float16 each sum then scaled by its bias cast's 1). The GRU's recurrent n
    bias is reset-gated, its sum its own."""
    sch = Schedule(halstm.lower_backward(cell_type(5, 8), 3, 2, dtype).functions["rows"].mod)
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("step"))]
    reductions = [b.name_hint for b in blocks if b.name_hint.startswith("d_bias") and b.init is not None]
    assert len(reductions) == sums, reductions


@pytest.mark.parametrize("cell_type, summed, width", [
    (halstm.LSTM, {"x_proj0": "gemm0"}, 8 * 8), (halstm.PeepholeLSTM, {"x_proj0": "gemm0"}, 8 * 8),
    (halstm.GRU, {}, 8 * 8), (halstm.LayerNormLSTM, {}, 12 * 8)], ids=lambda v: getattr(v, "__name__", ""))
def test_the_reversed_loop_reads_gates_added_together_as_one_sum(cell_type, summed, width):
    """LSTM's input and recurrent gates enter its step only as their sum: the reversed loop's input
    holds that sum once (8 columns of H a row, not 12). The GRU's reset gate scales its recurrent
    n block alone, and the layer-norm LSTM normalises each matmul's gates apart: both kept."""
    adjoint = halstm.AdjointCell(halstm.make_plan(cell_type(5, 8)))
    assert adjoint.summed == summed
    assert adjoint.input_size == width


@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "a-gemm-a-gate"])
@pytest.mark.parametrize("cell_type", [halstm.LSTM, halstm.GRU, halstm.PeepholeLSTM, halstm.ResetBeforeGRU,
                                       halstm.LayerNormLSTM], ids=lambda c: c.__name__)
def test_reversed_loop_cell_gives_the_initial_states_gradients(cell_type, gathered, rng):
    """The adjoint cell (the backward's reversed loop as a cell), run by the float64 reference for
    T + 1 steps from the final states' gradients: its last d<s> are the initial states' gradients."""
    T, B, I, H = 4, 3, 5, 8
    cell = cell_type(I, H)
    x, params, states = (upcast(v) if isinstance(v, dict) else np.float64(v) for v in random_inputs(cell, T, B, rng))
    steps = [states]
    for t in range(T):
        steps.append(halstm.reference(cell, x[t:t + 1], params, steps[-1])[1])
    seqs = {s: np.stack([step[s] for step in steps]) for s in cell.states}
    grads = {s: rng.standard_normal((T + 1, B, H)) for s in cell.states}
    adjoint = halstm.AdjointCell(halstm.make_plan(cell), gathered)
    weights = {}
    for name, (g, start, width) in adjoint.transposed().items():
        weights[name] = np.concatenate([params[m.weight] for m in g.members])[start:start + width].T
    weights |= {f"{m.weight}_t": params[m.weight].T for g in adjoint.later for m in g.members}
    adjoint_params = {n: params[n] if n in params else weights[n] for n in adjoint.parameters()}
    initial = {q: np.zeros((B, H)) for q in adjoint.states} | {f"d{s}_local": grads[s][T] for s in cell.states}
    _, final = halstm.reference(adjoint, _adjoint_input(adjoint, x, params, seqs, grads), adjoint_params, initial)
    _, _, want = reference_backward(cell, x, params, states, grads)
    for s in cell.states:
        assert rel_err(final[f"d{s}"], want[s]) < 1e-12, s
