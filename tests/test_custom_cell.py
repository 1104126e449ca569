"""The cell language is open: a cell defined here, with raw te.compute reductions, compiles."""

import shutil

import numpy as np
import pytest
from tvm import te

import halstm
from halstm import linear, sigmoid, split, tanh
from halstm.targets import CudaTarget
from conftest import TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err, representative, upcast


class CoupledLayerNormLSTM(halstm.Cell):
    """Coupled input/forget gate (i = 1 - f), layer norm on c before the output tanh."""

    states = ("h", "c")

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"w_x": (3 * H, I), "w_h": (3 * H, H), "b": (3 * H,), "gamma": (H,), "beta": (H,)}

    def step(self, p, x, h, c):
        f, g, o = split(linear(x, p.w_x, p.b) + linear(h, p.w_h), 3)
        f = sigmoid(f)
        c = f * c + (1.0 - f) * tanh(g)
        B, H = (int(d) for d in c.shape)
        k = te.reduce_axis((0, H), name="k")
        total = te.compute((B,), lambda b: te.sum(c[b, k], axis=k), name="total")
        k2 = te.reduce_axis((0, H), name="k2")
        squares = te.compute((B,), lambda b: te.sum(c[b, k2] * c[b, k2], axis=k2), name="squares")

        def norm(b, n):
            mean = total[b] / H
            return (c[b, n] - mean) * te.rsqrt(squares[b] / H - mean * mean + 1e-5) * p.gamma[n] + p.beta[n]

        normed = te.compute((B, H), norm, name="normed")
        return sigmoid(o) * tanh(normed), c


class ProjectedInputRNN(halstm.Cell):
    """An Elman RNN whose input passes a nonlinearity before its matmul: still hoisted."""

    def parameters(self):
        return {"w_x": (self.hidden_size, self.input_size), "w_h": (self.hidden_size, self.hidden_size)}

    def step(self, p, x, h):
        return tanh(linear(tanh(x), p.w_x) + linear(h, p.w_h))


class HighwayRNN(halstm.Cell):
    """x through a matmul and added as it is (I = H): the step reads x itself too (Plan.x_in_step)."""

    def parameters(self):
        return {"w_x": (self.hidden_size, self.input_size), "w_h": (self.hidden_size, self.hidden_size)}

    def step(self, p, x, h):
        return tanh(linear(x, p.w_x) + linear(h, p.w_h)) + 0.5 * x


class ResidualRNN(halstm.Cell):
    """x added without any matmul of it (I = H): nothing to hoist."""

    def parameters(self):
        return {"w_h": (self.hidden_size, self.hidden_size), "b": (self.hidden_size,)}

    def step(self, p, x, h):
        return tanh(linear(h, p.w_h, p.b) + x)


X_IN_STEP = [HighwayRNN, ResidualRNN]


@pytest.mark.parametrize("cell_type", [CoupledLayerNormLSTM, ProjectedInputRNN], ids=lambda c: c.__name__)
@pytest.mark.parametrize("shape", [(1, 1, 5, 7), (6, 4, 19, 30)], ids=lambda s: "T{}-B{}-I{}-H{}".format(*s))
def test_custom_cell_matches_reference(cell_type, shape, rng):
    T, B, I, H = shape
    cell = cell_type(I, H)
    x, params, states = random_inputs(cell, T, B, rng)
    y, final = halstm.compile(cell, T, B)(x, params, states)
    y_ref, final_ref = halstm.reference(cell, x, params, states)
    assert rel_err(y, y_ref) < TOLERANCE["float32"]
    assert all(rel_err(final[s], final_ref[s]) < TOLERANCE["float32"] for s in cell.states)


def test_planner_hoists_a_transformed_input():
    plan = halstm.make_plan(ProjectedInputRNN(5, 7))
    assert [g.name for g in plan.hoisted] == ["x_proj0"]
    assert [m.weight for m in plan.hoisted[0].members] == ["w_x"]
    assert [[m.weight for g in stage for m in g.members] for stage in plan.stages] == [["w_h"]]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("cell_type", [CoupledLayerNormLSTM, ProjectedInputRNN], ids=lambda c: c.__name__)
def test_custom_cell_compiles_for_cuda(cell_type):
    """The CUDA step loop takes a cell's own reductions too (serial within a thread); the
    persistent kernel declines them."""
    target = CudaTarget("sm_90", sms=132)
    f = halstm.compile(cell_type(20, 24), 3, 2, target=target, recipe="cuda-step-loop", database=False)
    assert "__global__" in f.module.mod.imports[0].inspect_source()


@pytest.mark.parametrize("cell_type", X_IN_STEP, ids=lambda c: c.__name__)
@pytest.mark.parametrize("shape", [(1, 1, 7), (6, 4, 30)], ids=lambda s: "T{}-B{}-H{}".format(*s))
def test_a_step_that_reads_x_itself_matches_reference(cell_type, shape, rng):
    """x's rows of the step are a view of x the step's math reads (beside any hoisted GEMM of x)."""
    T, B, H = shape
    cell = cell_type(H, H)
    plan = halstm.make_plan(cell)
    assert plan.x_in_step and len(plan.hoisted) == (cell_type is HighwayRNN)
    x, params, states = random_inputs(cell, T, B, rng)
    y, final = halstm.compile(cell, T, B)(x, params, states)
    y_ref, final_ref = halstm.reference(cell, x, params, states)
    assert rel_err(y, y_ref) < TOLERANCE["float32"] and rel_err(final["h"], final_ref["h"]) < TOLERANCE["float32"]


X_IN_STEP_CUDA = [(c, d, r) for c in X_IN_STEP for d in ("float32", "float16") for r in ("cuda-step-loop", "cuda-persistent")]
# CI: each cell with each recipe, each cell and each recipe in both dtypes (4 of 8: HighwayRNN's hoisted
# GEMM, ResidualRNN hoisting nothing); the other dtype repeats a cell's recipe path (slow)
X_IN_STEP_CUDA_IN_CI = ["HighwayRNN-float32-cuda-step-loop", "HighwayRNN-float16-cuda-persistent",
                        "ResidualRNN-float16-cuda-step-loop", "ResidualRNN-float32-cuda-persistent"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("cell_type, dtype, recipe", representative(
    X_IN_STEP_CUDA, [f"{c.__name__}-{d}-{r}" for c, d, r in X_IN_STEP_CUDA], X_IN_STEP_CUDA_IN_CI))
def test_a_step_that_reads_x_itself_compiles_for_cuda(cell_type, dtype, recipe, tmp_path):
    """Both CUDA recipes read the step's rows of x (the persistent kernel from global memory, with a
    prologue that may then hoist nothing); nvcc compiles what they generate."""
    f = halstm.compile(cell_type(24, 24), 3, 16, dtype, target=CudaTarget("sm_90", sms=132), recipe=recipe,
                       database=False)
    assert f.recipe.name == recipe
    assert_nvcc_compiles(f.module.mod.imports[0].inspect_source(), tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("recipe", ["cuda-step-loop", "cuda-persistent"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("cell_type", X_IN_STEP, ids=lambda c: c.__name__)
def test_a_step_that_reads_x_itself_matches_reference_on_gpu(cell_type, dtype, recipe, rng):
    torch = pytest.importorskip("torch")
    T, B, H = 20, 16, 64
    cell = cell_type(H, H)
    f = halstm.compile(cell, T, B, dtype, target=CudaTarget.detect(), recipe=recipe, database=False)
    x, params, states = random_inputs(cell, T, B, rng, dtype)
    to_gpu = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(getattr(torch, dtype)).cuda()  # noqa: E731
    y, final = f(to_gpu(x), {k: to_gpu(v) for k, v in params.items()}, {k: to_gpu(v) for k, v in states.items()})
    want_y, want = halstm.reference(cell, np.asarray(x, np.float64), upcast(params), upcast(states))
    assert rel_err(y.float().cpu().numpy(), want_y) < TOLERANCE[dtype]
    assert rel_err(final["h"].float().cpu().numpy(), want["h"]) < TOLERANCE[dtype]

