"""The backward of cells whose step reads x itself (``Plan.x_in_step``), not only through a hoisted
matmul: a residual ``+ x``, an SRU-style highway, a gate of x. The gradient of x is then the hoisted
GEMMs' part plus, each step, the adjoint of the step's own read of its rows of x.

The derivation in float64 (``reference_backward``) against torch autograd on the same math; the
compiled backward (fp32, and fp16 for one cell) against float64; ``halstm.nn.RNN`` training through
it; and the CUDA step-loop recipe scheduling both backward functions down to their kernels' TIR.
The loss is L = <gy, y> + sum over states of <g_s, final s>, all of gy and g_s random.
"""

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err, representative, upcast
from test_backward import B_, H_, T_, sequence_grads
from test_backward import problem as backward_problem

import halstm
import halstm.nn
from halstm import linear, matmul, sigmoid, split, tanh
from halstm.gradients import compile_backward, lower_backward_for, reference_backward
from halstm.targets import CudaTarget

torch = pytest.importorskip("torch")


class Residual(halstm.Cell):
    """h' = tanh(W x + b + U h) + x (I = H): x through a hoisted matmul and added as it is."""

    biases = ("b",)

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"w_x": (H, I), "w_h": (H, H), "b": (H,)}

    def step(self, p, x, h):
        return tanh(linear(x, p.w_x, p.b) + linear(h, p.w_h)) + x


class SRU(halstm.Cell):
    """Lei et al.'s simple recurrent unit (I = H): every matmul of x hoisted, none of a state; the
    highway h' = r tanh(c') + (1 - r) x reads x itself. h is only an output: the step never reads it."""

    states = ("h", "c")
    biases = ("b_f", "b_r")

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"w": (3 * H, I), "v_f": (H,), "v_r": (H,), "b_f": (H,), "b_r": (H,)}

    def step(self, p, x, h, c):
        xt, f, r = split(matmul(x, p.w), 3)
        f = sigmoid(f + p.v_f * c + p.b_f)
        r = sigmoid(r + p.v_r * c + p.b_r)
        c = f * c + (1.0 - f) * xt
        return r * tanh(c) + (1.0 - r) * x, c


class GatedInput(halstm.Cell):
    """x enters the step's math alone, through a gate and a tanh (I = H): nothing is hoisted."""

    biases = ("b",)

    def parameters(self):
        H = self.hidden_size
        return {"w_h": (2 * H, H), "b": (2 * H,)}

    def step(self, p, x, h):
        a, z = split(linear(h, p.w_h, p.b), 2)
        z = sigmoid(z + x)
        return z * tanh(a) + (1.0 - z) * tanh(x)


class SharedInput(halstm.Cell):
    """tanh(x) is a hoisted matmul's operand and read by the step too (I = H), with a state c."""

    states = ("h", "c")
    biases = ()

    def parameters(self):
        I, H = self.input_size, self.hidden_size
        return {"w_x": (2 * H, I), "w_h": (2 * H, H), "gain": (H,)}

    def step(self, p, x, h, c):
        xt = tanh(x)
        a, z = split(matmul(xt, p.w_x) + matmul(h, p.w_h), 2)
        c = sigmoid(z) * c + p.gain * xt * tanh(a)
        return tanh(c) + 0.5 * xt, c


# The same cells in torch, one step
def _residual(p, x, h):
    return torch.tanh(x @ p["w_x"].T + p["b"] + h @ p["w_h"].T) + x


def _sru(p, x, h, c):
    xt, f, r = (x @ p["w"].T).chunk(3, -1)
    f = torch.sigmoid(f + p["v_f"] * c + p["b_f"])
    r = torch.sigmoid(r + p["v_r"] * c + p["b_r"])
    c = f * c + (1 - f) * xt
    return r * torch.tanh(c) + (1 - r) * x, c


def _gated_input(p, x, h):
    a, z = (h @ p["w_h"].T + p["b"]).chunk(2, -1)
    z = torch.sigmoid(z + x)
    return z * torch.tanh(a) + (1 - z) * torch.tanh(x)


def _shared_input(p, x, h, c):
    xt = torch.tanh(x)
    a, z = (xt @ p["w_x"].T + h @ p["w_h"].T).chunk(2, -1)
    c = torch.sigmoid(z) * c + p["gain"] * xt * torch.tanh(a)
    return torch.tanh(c) + 0.5 * xt, c


STEPS = {Residual: _residual, SRU: _sru, GatedInput: _gated_input, SharedInput: _shared_input}
CELLS = list(STEPS)


def problem(cell_type, rng, dtype="float32"):
    """A cell (I = H), its inputs, and the loss's gradients with respect to y and the final states."""
    return backward_problem(cell_type, rng, dtype, inputs=H_)


def torch_gradients(cell, x, params, states, gy, finals):
    """Gradients of the loss by torch autograd in float64: {"x": dx, parameter: ..., state: ...}."""
    leaves = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True)
              for k, v in {"x": x, **params, **states}.items()}
    current, ys = [leaves[s] for s in cell.states], []
    for t in range(x.shape[0]):
        out = STEPS[type(cell)](leaves, leaves["x"][t], *current)
        current = list(out) if isinstance(out, tuple) else [out]
        ys.append(current[cell.states.index(cell.output)])
    final = dict(zip(cell.states, current))
    loss = (torch.stack(ys) * torch.from_numpy(gy)).sum()
    loss = loss + sum((final[s] * torch.from_numpy(g)).sum() for s, g in finals.items())
    loss.backward()
    return {k: np.zeros(v.shape) if v.grad is None else v.grad.numpy() for k, v in leaves.items()}


def as_dict(dx, dparams, dstates):
    return {"x": dx, **dparams, **dstates}


def assert_close(got, want, tolerance: float, name: str):
    """Within ``tolerance`` relative norm error; exactly zero where ``want`` is (SRU's initial h)."""
    error = np.linalg.norm(np.asarray(got, np.float64) - want)
    assert error <= tolerance * np.linalg.norm(want), f"{name}: relative error {rel_err(got, want):.3g}"


def test_the_cells_read_x_in_their_step():
    plans = {c: halstm.make_plan(c(H_, H_)) for c in CELLS}
    assert all(p.x_in_step for p in plans.values())
    assert [len(p.hoisted) for p in plans.values()] == [1, 1, 0, 1]
    assert "the step's own read of x" in str(halstm.lower_backward(SRU(H_, H_), T_, B_).plan)


@pytest.mark.parametrize("cell_type", CELLS, ids=lambda c: c.__name__)
def test_derivation_matches_torch_autograd_in_float64(cell_type, rng):
    cell, x, params, states, gy, finals = problem(cell_type, rng)
    ours = as_dict(*reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals)))
    for name, want in torch_gradients(cell, x, params, states, gy, finals).items():
        assert_close(ours[name], want, 1e-12, name)


@pytest.mark.parametrize("cell_type", CELLS, ids=lambda c: c.__name__)
def test_compiled_matches_float64(cell_type, rng):
    """x, every parameter and every initial state within fp32's tolerance of torch autograd in float64."""
    cell, x, params, states, gy, finals = problem(cell_type, rng)
    seqs = halstm.compile(cell, T_, B_).sequences(x, params, states)
    ours = as_dict(*compile_backward(cell, T_, B_)(x, params, seqs, sequence_grads(cell, gy, finals, np.float32)))
    want = torch_gradients(cell, x, params, states, gy, finals)
    assert set(ours) == set(want)
    for name, value in want.items():
        assert ours[name].dtype == np.float32 and ours[name].shape == value.shape, name
        assert_close(ours[name], value, TOLERANCE["float32"], name)


def test_compiled_float16_against_float64(rng):
    """Stored in float16, computed in float32: the step's rows of x are read in float16 too."""
    cell, x, params, states, gy, finals = problem(SRU, rng, "float16")
    seqs = halstm.compile(cell, T_, B_, "float16").sequences(x, params, states)
    grads = sequence_grads(cell, gy, finals, np.float16)
    got = as_dict(*compile_backward(cell, T_, B_, "float16")(x, params, seqs, grads))
    want = as_dict(*reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals)))
    for name, value in want.items():
        assert_close(got[name], value, TOLERANCE["float16"], name)


def test_nn_rnn_trains_through_the_compiled_backward(rng):
    """``y, _ = model(x); y.backward(dy)`` on a halstm.nn.RNN of SRU cells: the gradients of x, the
    initial states and every parameter as torch autograd's in float64 on the same math."""
    model = halstm.nn.RNN(SRU, H_, H_)
    x = torch.from_numpy(rng.standard_normal((T_, B_, H_)).astype(np.float32)).requires_grad_()
    hx = [torch.from_numpy(0.5 * rng.standard_normal((1, B_, H_)).astype(np.float32)).requires_grad_()
          for _ in SRU.states]
    dy = torch.from_numpy(rng.standard_normal((T_, B_, H_)).astype(np.float32))
    y, _ = model(x, tuple(hx))
    y.backward(dy)
    cell = SRU(H_, H_)
    params = {n: model.get_parameter(f"{n}_l0").detach().numpy() for n in cell.parameters()}
    states = {s: h[0].detach().numpy() for s, h in zip(cell.states, hx)}
    want = torch_gradients(cell, x.detach().numpy(), params, states, dy.numpy().astype(np.float64), {})
    got = {"x": x.grad, **{n: model.get_parameter(f"{n}_l0").grad for n in params},
           **{s: h.grad[0] for s, h in zip(cell.states, hx)}}
    for name, value in want.items():
        assert_close(got[name].numpy(), value, TOLERANCE["float32"], name)


SCHEDULES_CASES = [(c, d, b) for c in CELLS for d, b in (("float32", 2), ("float16", 16))]
SCHEDULES_IDS = [f"{c.__name__}-{'fp32' if d == 'float32' else 'fp16-B16'}" for c, d, _ in SCHEDULES_CASES]
# CI: each cell once, each dtype for two of them; a cell's other dtype repeats that dtype's GEMM path
# with the same step (slow)
SCHEDULES_IN_CI = ["Residual-fp32", "SRU-fp16-B16", "GatedInput-fp16-B16", "SharedInput-fp32"]


@pytest.mark.parametrize("cell_type, dtype, batch", representative(SCHEDULES_CASES, SCHEDULES_IDS, SCHEDULES_IN_CI))
def test_cuda_step_loop_schedules_the_backward(cell_type, dtype, batch):
    """The CUDA step-loop recipe schedules the backward's functions, and the first recipe that applies
    its reversed loop (the adjoint cell), as compile_backward does for a GPU; TVM lowers them to host
    and kernel TIR;
    CUDA code generation and nvcc are left out (tests/test_backward.py compiles the other cells'
    backward with nvcc)."""
    target = CudaTarget("sm_90", sms=132)
    cell = cell_type(24, 24)
    recipe, knobs, program, scheduled = lower_backward_for(cell, 3, batch, dtype, target)
    reversed_loop = halstm.lower(program.adjoint, 4, batch, dtype)
    schedules = [scheduled.get(name) or recipe.apply(f, target, **knobs) for name, f in program.functions.items()]
    chosen = halstm.schedules.recipes_for(reversed_loop, target)[0]  # as halstm.compile chooses
    schedules.append(chosen.apply(reversed_loop, target, **chosen.resolve(reversed_loop, target, None)))
    for schedule in schedules:
        _, kernels = target.split(schedule.mod)
        assert sum(len(m.functions) for m in kernels.values()) > 0
    assert any(a.name == "dx_seq" for a in program.rows.args)
