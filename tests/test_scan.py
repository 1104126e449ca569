"""Diagonal recurrences as scans: which cells the planner scans and why not the others
(``halstm.diagonal``), the scan's function (``halstm.scan``) under its recipes against float64 —
serial and chunked, any T, long sequences — and the backward, whose reversed loop scans too."""

import shutil

import numpy as np
import pytest
from conftest import TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err, representative, upcast
from tvm import te

import halstm
import halstm.nn
from halstm import linear, sigmoid, split, tanh
from halstm.targets import CudaTarget

H100 = CudaTarget("sm_90", sms=132)
ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA device")])
SCANNED = [halstm.MinGRU, halstm.MinLSTM, halstm.SRU, halstm.RGLRU]


class Squared(halstm.Cell):
    def parameters(self):
        return {"w": (self.hidden_size, self.input_size)}

    def step(self, p, x, h):
        return linear(x, p.w) + h * h


class Flipped(halstm.Cell):
    def parameters(self):
        return {"w": (self.hidden_size, self.input_size)}

    def step(self, p, x, h):
        H = self.hidden_size
        return linear(x, p.w) + te.compute(h.shape, lambda b, n: h[b, H - 1 - n], name="flipped")


class Squashed(halstm.Cell):
    def parameters(self):
        return {"w": (self.hidden_size, self.input_size)}

    def step(self, p, x, h):
        return tanh(linear(x, p.w) + h)


class Coupled(halstm.Cell):
    """h' = f h + c: h's b reads c, itself scanned (a triangular system, not scanned)."""

    states = ("h", "c")

    def parameters(self):
        return {"w": (2 * self.hidden_size, self.input_size)}

    def step(self, p, x, h, c):
        f, g = split(linear(x, p.w), 2)
        return sigmoid(f) * h + c, sigmoid(g) * c


class Gated(halstm.Cell):
    """h's coefficient reads g, a state computed from x alone: a state first, then the scan."""

    states = ("h", "g")

    def parameters(self):
        return {"w": (2 * self.hidden_size, self.input_size)}

    def step(self, p, x, h, g):
        f, u = split(linear(x, p.w), 2)
        return sigmoid(g) * h + u, f


@pytest.mark.parametrize("cell_type", SCANNED + [Gated], ids=lambda c: c.__name__)
def test_diagonal_cells_scan(cell_type):
    plan = halstm.make_plan(cell_type(6, 8))
    assert plan.diagonal.scans, plan.diagonal.reason
    assert "a parallel scan over T" in str(plan)
    program = halstm.lower(cell_type(6, 8), 5, 2)
    assert [r.name for r in halstm.schedules.recipes_for(program, halstm.targets.resolve("cpu"))][0] == "cpu-scan"
    assert halstm.schedules.recipes_for(program, H100)[0].name == "cuda-scan"


def test_what_each_state_is():
    assert (halstm.make_plan(halstm.SRU(8, 8)).diagonal.scanned, halstm.make_plan(halstm.SRU(8, 8)).diagonal.derived) \
        == (("c",), ("h",))
    gated = halstm.make_plan(Gated(6, 8)).diagonal
    assert (gated.first, gated.scanned, gated.derived) == (("g",), ("h",), ())


@pytest.mark.parametrize("cell_type, words", [
    (halstm.LSTM, "a state feeds a matmul"),
    (Squared, "multiplies two values that depend on h"),
    (Flipped, "reads h at other than its own element"),
    (Squashed, "applies tirx.tanh to a value that depends on h"),
    (Coupled, "reading state(s) c"),
], ids=lambda v: v if isinstance(v, str) else v.__name__)
def test_a_cell_that_is_not_diagonal_is_never_scanned(cell_type, words):
    cell = cell_type(6, 8)
    plan = halstm.make_plan(cell)
    assert not plan.diagonal.scans and words in plan.diagonal.reason
    assert f"no parallel scan over T: {plan.diagonal.reason}" in str(plan)
    program = halstm.lower(cell, 5, 2)
    for target in (halstm.targets.resolve("cpu"), H100):
        assert not any(r.name.endswith("-scan") for r in halstm.schedules.recipes_for(program, target))
    with pytest.raises(ValueError, match="does not apply"):
        halstm.compile(cell, 5, 2, recipe="cpu-scan")


def _check(cell, steps, batch, dtype, target, rng, knobs=None, calls=(None,)):
    f = halstm.compile(cell, steps, batch, dtype, target, recipe=f"{target}-scan", knobs=knobs)
    for T in calls:
        x, params, states = random_inputs(cell, T or steps, batch, rng, dtype)
        y, finals = f(x, params, states)
        want_y, want = halstm.reference(cell, np.float64(x), upcast(params), upcast(states))
        assert rel_err(y, want_y) < TOLERANCE[dtype]
        for s in cell.states:
            assert rel_err(finals[s], want[s]) < TOLERANCE[dtype], s


CHUNKS = {"serial": 0, "chunks": 4, "ragged-chunks": 5}
# CI: each cell in one of the three forms in turn, Gated (its coefficients read its first state) in two;
# the other forms repeat the scan's path with the cell's coefficients (slow)
CPU_SCAN_IN_CI = ["MinGRU-serial", "MinLSTM-chunks", "SRU-ragged-chunks", "RGLRU-serial", "Gated-chunks",
                  "Gated-ragged-chunks"]


@pytest.mark.parametrize("cell_type, chunk", representative(
    [(c, n) for c in SCANNED + [Gated] for n in CHUNKS.values()],
    [f"{c.__name__}-{name}" for c in SCANNED + [Gated] for name in CHUNKS], CPU_SCAN_IN_CI))
def test_cpu_scan_matches_float64(cell_type, chunk, rng):
    _check(cell_type(6, 16), 13, 3, "float32", "cpu", rng, {"chunk": chunk})


@pytest.mark.parametrize("chunk", [0, 4])
@pytest.mark.parametrize("cell_type", [halstm.SRU, Gated], ids=lambda c: c.__name__)
def test_cpu_scan_for_any_length(cell_type, chunk, rng):
    """Chunked for any T, the coefficients are stored apart (``halstm.scan.fuses``): Gated's read
    its first state g, from its initial value on."""
    _check(cell_type(6, 16), None, 3, "float32", "cpu", rng, {"chunk": chunk}, calls=(1, 4, 11))


@pytest.mark.parametrize("hidden, units", [(7, 256), (64, 32), (96, 64)], ids=["ragged", "two-vectors", "of-96"])
def test_units_a_task(hidden, units, rng):
    """A task over one unit (H not whole vectors), or over several vectors of units."""
    for chunk in (0, 5):
        _check(halstm.SRU(5, hidden), 9, 2, "float32", "cpu", rng, {"chunk": chunk, "units": units})


@pytest.mark.parametrize("device, chunk", [("cpu", 0), ("cpu", 64), *(pytest.param("cuda", c, marks=ON_GPU.marks)
                                                                      for c in (0, 64))])
def test_long_sequence_against_float64(device, chunk, rng):
    """T = 65536: the scan in float32 against the recurrence in float64, from a state kept ~1e5 steps
    to one that decays at once (products of a underflow within a chunk): within float32's tolerance,
    or where the recurrence itself evaluated in float32, step by step, strays further, within twice
    that (over 20 draws the serial scan's error was that one's within 1.03x, 2.3e-6 in the median;
    a draw where it reached 1.1e-5 failed the tolerance alone)."""
    T, B, H = 65536, 1, 16
    cell = halstm.MinGRU(4, H)
    f = halstm.compile(cell, T, B, "float32", device, recipe=f"{device}-scan", knobs={"chunk": chunk})
    x, params, states = random_inputs(cell, T, B, rng)
    params["bias_ih"][:H] = np.linspace(-12, 4, H)  # z from ~1e-5 (a ~ 1: long memory) to ~1 (a ~ 0)
    y, _ = f(x, params, states)
    p = upcast(params)
    gates = np.float64(x).reshape(T * B, -1) @ p["weight_ih"].T + p["bias_ih"]
    z, u = 1 / (1 + np.exp(-gates[:, :H])), gates[:, H:]
    h, want = upcast(states)["h"][0], np.empty((T, H))
    h32, serial32 = states["h"][0], np.empty((T, H), np.float32)
    z32, u32 = z.astype(np.float32), u.astype(np.float32)
    for t in range(T):
        h = (1 - z[t]) * h + z[t] * u[t]
        want[t] = h
        h32 = (1 - z32[t]) * h32 + z32[t] * u32[t]
        serial32[t] = h32
    assert rel_err(y[:, 0], want) < max(TOLERANCE["float32"], 2 * rel_err(serial32, want))


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
def test_backward_scans_its_reversed_loop(device, rng, monkeypatch):
    """halstm.nn.RNN of SRU cells trains: the reversed loop (the adjoint cell: dh first, dc scanned,
    the total adjoints after) of the backward it compiles runs as a scan, the gradients as torch
    autograd's in float64."""
    torch = pytest.importorskip("torch")

    monkeypatch.setattr(halstm.nn, "_COMPILED", {})  # the functions this model compiles, and no others
    cell = halstm.SRU(8, 8)
    model = halstm.nn.RNN(halstm.SRU, 8, 8, device=device)
    x = torch.from_numpy(rng.standard_normal((9, 2, 8)).astype(np.float32)).to(device).requires_grad_()
    hx = tuple(torch.from_numpy(0.5 * rng.standard_normal((1, 2, 8)).astype(np.float32)).to(device).requires_grad_()
               for _ in cell.states)
    dy = torch.from_numpy(rng.standard_normal((9, 2, 8)).astype(np.float32)).to(device)
    y, _ = model(x, hx)
    y.backward(dy)
    [backward] = [f for key, f in halstm.nn._COMPILED.items() if "backward" in key[0]]
    assert backward.adjoint.recipe.name == f"{device}-scan"
    got = {"x": x.grad, "h0": hx[0].grad[0], "c0": hx[1].grad[0], **{n: p.grad for n, p in model.named_parameters()}}
    leaves = {n: p.detach().cpu().double().requires_grad_() for n, p in model.named_parameters()}
    x64 = x.detach().cpu().double().requires_grad_()
    h, c = (s.detach().cpu().double()[0].requires_grad_() for s in hx)
    start, ys = (h, c), []
    for t in range(9):
        xt, f, r = (x64[t] @ leaves["weight_l0"].T).chunk(3, 1)
        f, r = torch.sigmoid(f + leaves["bias_f_l0"]), torch.sigmoid(r + leaves["bias_r_l0"])
        c = f * c + (1 - f) * xt
        h = r * torch.tanh(c) + (1 - r) * x64[t]
        ys.append(h)
    (torch.stack(ys) * dy.cpu().double()).sum().backward()
    assert start[0].grad is None and not got["h0"].any()  # the step never reads h
    pairs = [(got["x"], x64.grad), (got["c0"], start[1].grad), *((got[n], leaves[n].grad) for n in leaves)]
    for mine, want in pairs:
        assert rel_err(mine.cpu().numpy(), want.numpy()) < TOLERANCE["float32"]


SCAN_BUILDS = [(c, *setting) for c in (halstm.MinGRU, halstm.SRU)
               for setting in ((64, "float32", 16), (64, "bfloat16", 0), (None, "float16", 16))]
SCAN_BUILD_IDS = [f"{c.__name__}-T{steps or 'any'}-{dtype}-{f'chunk{chunk}' if chunk else 'serial'}"
                  for c, steps, dtype, chunk in SCAN_BUILDS]
# CI: each setting once, each cell in it: SRU (a state derived from the scanned one) chunked at T=64 and
# any T, MinGRU serial; a setting's other cell repeats its path with other math (slow)
SCAN_BUILDS_IN_CI = ["SRU-T64-float32-chunk16", "MinGRU-T64-bfloat16-serial", "SRU-Tany-float16-chunk16"]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("cell_type, steps, dtype, chunk", representative(SCAN_BUILDS, SCAN_BUILD_IDS, SCAN_BUILDS_IN_CI))
def test_cuda_scan_compiles_for_h100(cell_type, steps, dtype, chunk, tmp_path):
    """Serial, chunked and for any T: TVM lowers each and nvcc compiles its CUDA source for an H100
    (run on a GPU below)."""
    f = halstm.compile(cell_type(32, 32), steps, 4, dtype, H100, recipe="cuda-scan", knobs={"chunk": chunk})
    assert f.recipe.name == "cuda-scan"
    assert_nvcc_compiles(f.module.mod.imports[0].inspect_source(), tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [0, 16, 64])
@pytest.mark.parametrize("cell_type", SCANNED, ids=lambda c: c.__name__)
def test_cuda_scan_matches_float64(cell_type, chunk, dtype, rng):
    _check(cell_type(64, 64), 200, 4, dtype, "cuda", rng, {"chunk": chunk})
    _check(cell_type(64, 64), None, 4, dtype, "cuda", rng, {"chunk": chunk}, calls=(3, 150))
