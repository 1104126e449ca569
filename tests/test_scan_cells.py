"""The cells whose state update is linear and elementwise in the state (h' = a(x) h + b(x)): MinGRU,
MinLSTM, SRU and RGLRU.

The float64 reference against the equations written here in NumPy, the compiled cell (fp32) against
the reference, and the compiled backward (fp32) against torch autograd of the same equations in
float64. The loss of the backward is L = <gy, y> + sum over states of <g_s, final s>, all random.
"""

import functools
import types

import numpy as np
import pytest
from conftest import TOLERANCE, rel_err, representative, upcast
from test_backward import sequence_grads

import halstm
from halstm.gradients import compile_backward

torch = pytest.importorskip("torch")

T, B, H = 7, 3, 8
SIZES = [5, H]  # input_size: a projection of its own, and I = H (SRU's highway carries x itself)


def parts(a, n):
    """The last axis of a split into n equal chunks, for NumPy arrays and torch tensors alike."""
    w = a.shape[-1] // n
    return [a[..., k * w:(k + 1) * w] for k in range(n)]


def min_gru(F, p, x, h):
    z, h_tilde = parts(x @ p["weight_ih"].T + p["bias_ih"], 2)
    z = F.sigmoid(z)
    return ((1 - z) * h + z * h_tilde,)


def min_lstm(F, p, x, h):
    f, i, h_tilde = parts(x @ p["weight_ih"].T + p["bias_ih"], 3)
    f, i = F.sigmoid(f), F.sigmoid(i)
    return (f / (f + i) * h + i / (f + i) * h_tilde,)


def sru(F, p, x, h, c):
    xt, f, r = parts(x @ p["weight"].T, 3)
    f, r = F.sigmoid(f + p["bias_f"]), F.sigmoid(r + p["bias_r"])
    c = f * c + (1 - f) * xt
    skip = x @ p["weight_skip"].T if "weight_skip" in p else x
    return r * F.tanh(c) + (1 - r) * skip, c


def rglru(F, p, x, h):
    r, i, u = parts(x @ p["weight_ih"].T + p["bias_ih"], 3)
    r, i = F.sigmoid(r), F.sigmoid(i)
    log_a = -8 * r * F.log1p(F.exp(-p["log_a"]))
    return (F.exp(log_a) * h + F.sqrt(-F.expm1(2 * log_a)) * (i * u),)


STEPS = {halstm.MinGRU: min_gru, halstm.MinLSTM: min_lstm, halstm.SRU: sru, halstm.RGLRU: rglru}
CELLS = list(STEPS)
NUMPY = types.SimpleNamespace(sigmoid=lambda v: 1 / (1 + np.exp(-v)), tanh=np.tanh, exp=np.exp, sqrt=np.sqrt,
                              log1p=np.log1p, expm1=np.expm1)
TORCH = types.SimpleNamespace(sigmoid=torch.sigmoid, tanh=torch.tanh, exp=torch.exp, sqrt=torch.sqrt,
                              log1p=torch.log1p, expm1=torch.expm1)


def problem(cell_type, I, rng):
    """A cell with its own initial parameters, random x and random nonzero initial states (float32)."""
    cell = cell_type(I, H)
    params = cell.init_parameters(seed=int(rng.integers(2**31)))
    x = rng.standard_normal((T, B, I)).astype(np.float32)
    states = {s: (0.5 * rng.standard_normal((B, H))).astype(np.float32) for s in cell.states}
    return cell, x, params, states


@functools.cache
def forward(cell_type, I):
    """``cell_type(I, H)`` compiled for the CPU (fp32, T, B), once a process: the tests here share it."""
    return halstm.compile(cell_type(I, H), T, B, "float32", "cpu")


def unrolled(F, cell, x, params, states):
    """The step of STEPS over every t: the output sequence and the final states."""
    current, ys = [states[s] for s in cell.states], []
    for t in range(x.shape[0]):
        current = list(STEPS[type(cell)](F, params, x[t], *current))
        ys.append(current[cell.states.index(cell.output)])
    return ys, dict(zip(cell.states, current))


@pytest.mark.parametrize("I", SIZES, ids=lambda i: f"I{i}")
@pytest.mark.parametrize("cell_type", CELLS, ids=lambda c: c.__name__)
def test_reference_matches_the_equations_in_numpy(cell_type, I, rng):
    cell, x, params, states = problem(cell_type, I, rng)
    y_ref, final_ref = halstm.reference(cell, x, params, states)
    ys, final = unrolled(NUMPY, cell, x.astype(np.float64), upcast(params), upcast(states))
    assert rel_err(y_ref, np.stack(ys)) < 1e-12
    for s in cell.states:
        assert rel_err(final_ref[s], final[s]) < 1e-12


@pytest.mark.parametrize("I", SIZES, ids=lambda i: f"I{i}")
@pytest.mark.parametrize("cell_type", CELLS, ids=lambda c: c.__name__)
def test_compiled_matches_reference(cell_type, I, rng):
    cell, x, params, states = problem(cell_type, I, rng)
    y, final = forward(cell_type, I)(x, params, states)
    y_ref, final_ref = halstm.reference(cell, x, params, states)
    assert y.shape == (T, B, H)
    assert rel_err(y, y_ref) < TOLERANCE["float32"]
    for s in cell.states:
        assert rel_err(final[s], final_ref[s]) < TOLERANCE["float32"]


# CI: SRU at both input sizes (its highway projected, and x itself), each other cell at one (slow: the other
# size, which changes only the hoisted GEMM's K)
BACKWARD_IN_CI = ["SRU-I5", "SRU-I8", "MinGRU-I5", "MinLSTM-I8", "RGLRU-I5"]


@pytest.mark.parametrize("cell_type, I", representative(
    [(c, i) for c in CELLS for i in SIZES], [f"{c.__name__}-I{i}" for c in CELLS for i in SIZES], BACKWARD_IN_CI))
def test_compiled_backward_matches_torch_autograd(cell_type, I, rng):
    """x, every parameter and every initial state within fp32's tolerance of torch in float64."""
    cell, x, params, states = problem(cell_type, I, rng)
    gy = rng.standard_normal((T, B, H))
    finals = {s: rng.standard_normal((B, H)) for s in cell.states}

    leaves = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True)
              for k, v in {"x": x, **params, **states}.items()}
    ys, final = unrolled(TORCH, cell, leaves["x"], leaves, {s: leaves[s] for s in cell.states})
    loss = (torch.stack(ys) * torch.from_numpy(gy)).sum() + sum((final[s] * torch.from_numpy(g)).sum()
                                                                for s, g in finals.items())
    loss.backward()
    want = {k: np.zeros(v.shape) if v.grad is None else v.grad.numpy() for k, v in leaves.items()}

    seqs = forward(cell_type, I).sequences(x, params, states)
    dx, dparams, dstates = compile_backward(cell, T, B)(x, params, seqs, sequence_grads(cell, gy, finals, np.float32))
    got = {"x": dx, **dparams, **dstates}
    assert set(got) == set(want)
    for name, value in want.items():
        error = np.linalg.norm(np.asarray(got[name], np.float64) - value)  # exactly 0 where want is (SRU's h)
        assert error <= TOLERANCE["float32"] * np.linalg.norm(value), f"{name}: {rel_err(got[name], value):.3g}"


def test_sru_projects_the_highway_only_where_the_sizes_differ():
    assert halstm.SRU(5, H).parameters()["weight_skip"] == (H, 5)
    assert "weight_skip" not in halstm.SRU(H, H).parameters()
    assert halstm.SRU(H, H).bias_parameters() == ("bias_f", "bias_r")


def test_rglru_initialises_the_decay_as_griffin():
    """a = sigmoid(log_a) with a^8 in [0.9, 0.999]; the other parameters as the base class draws them."""
    cell = halstm.RGLRU(5, 64)
    params = cell.init_parameters(seed=3)
    a = 1 / (1 + np.exp(-params["log_a"].astype(np.float64)))
    assert params["log_a"].dtype == np.float32 and np.all((a**8 > 0.9 - 1e-6) & (a**8 < 0.999 + 1e-6))
    assert np.ptp(a**8) > 0.08
    assert np.array_equal(params["weight_ih"], halstm.Cell.init_parameters(cell, 3)["weight_ih"])
    assert cell.bias_parameters() == ("bias_ih",)
    assert cell.init_parameters(seed=0, dtype="float16")["log_a"].dtype == np.float16


def test_log1p_and_expm1_are_exact_near_zero():
    """float32 within its rounding of float64 on both sides of the series' threshold, where
    log(1 + t) and exp(t) - 1 would cancel (t = 3e-5: log(1 + t) in float32 is 1e-3 off)."""
    import tvm
    from tvm import te

    from halstm.ops import expm1, log1p

    t = np.array([-0.6, -0.25, -0.2, -1e-6, 3e-5, 0.2, 0.25, 5.0], np.float32)
    x = te.placeholder(t.shape, "float32", name="x")
    for op, want in ((log1p, np.log1p), (expm1, np.expm1)):
        f = tvm.compile(te.create_prim_func([x, op(x)]), "llvm")
        out = tvm.runtime.tensor(np.zeros_like(t))
        f(tvm.runtime.tensor(t), out)
        exact = want(t.astype(np.float64))
        assert np.all(np.abs(out.numpy() - exact) <= 2e-7 * np.abs(exact)), op.__name__
