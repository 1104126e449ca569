"""Every built-in cell, compiled for the CPU, against the float64 reference and against torch."""

import functools

import numpy as np
import pytest

import halstm
from conftest import TOLERANCE, random_inputs, rel_err, representative, upcast

CELLS = [halstm.LSTM, halstm.GRU, halstm.PeepholeLSTM, halstm.ResetBeforeGRU, halstm.LayerNormLSTM, halstm.LayerNormGRU]
# (T, B, I, H): single step, single row, sizes that are not multiples of the SIMD width or tiles
SHAPES = [(1, 1, 3, 5), (7, 1, 10, 13), (5, 3, 17, 24), (4, 6, 33, 40)]
shape_id = "T{}-B{}-I{}-H{}".format


@functools.cache
def compiled(cell_type, shape):
    """``cell_type`` compiled for the CPU at ``shape``, once a process: the tests here share LSTM's and GRU's."""
    T, B, I, H = shape
    return halstm.compile(cell_type(I, H), steps=T, batch=B)


# CI: LSTM and GRU at every shape (compiled once for this test and test_matches_torch_with_its_state_dict),
# each other cell at two shapes (one row and several), each shape twice among them; their other shapes
# repeat the remainders' paths with the same math (slow)
REFERENCE_IN_CI = [f"{c.__name__}-{shape_id(*s)}" for c in (halstm.LSTM, halstm.GRU) for s in SHAPES] + [
    f"{c.__name__}-{shape_id(*SHAPES[(k + i) % 4])}" for k, c in enumerate(CELLS[2:]) for i in (0, 2)]


@pytest.mark.parametrize("cell_type, shape", representative(
    [(c, s) for c in CELLS for s in SHAPES], [f"{c.__name__}-{shape_id(*s)}" for c in CELLS for s in SHAPES],
    REFERENCE_IN_CI))
def test_compiled_matches_reference(cell_type, shape, rng):
    T, B, I, H = shape
    cell = cell_type(I, H)
    x, params, states = random_inputs(cell, T, B, rng)
    y, final = compiled(cell_type, shape)(x, params, states)
    y_ref, final_ref = halstm.reference(cell, x, params, states)
    assert y.shape == (T, B, H)
    assert rel_err(y, y_ref) < TOLERANCE["float32"]
    for s in cell.states:
        assert rel_err(final[s], final_ref[s]) < TOLERANCE["float32"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cell_type", [halstm.LSTM, halstm.ResetBeforeGRU], ids=lambda c: c.__name__)
def test_low_precision_accumulates_in_float32(cell_type, dtype, rng):
    cell = cell_type(20, 24)
    x, params, states = random_inputs(cell, 6, 3, rng, dtype)
    y, _ = halstm.compile(cell, 6, 3, dtype=dtype)(x, params, states)
    y_ref, _ = halstm.reference(cell, upcast({"x": x})["x"], upcast(params), upcast(states))
    assert rel_err(y, y_ref) < TOLERANCE[dtype]


torch = pytest.importorskip("torch")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: shape_id(*s))
@pytest.mark.parametrize("cell_type, torch_type", [(halstm.LSTM, torch.nn.LSTM), (halstm.GRU, torch.nn.GRU)],
                         ids=["LSTM", "GRU"])
def test_matches_torch_with_its_state_dict(cell_type, torch_type, shape, rng):
    """The reference and the compiled cell agree with torch.nn.LSTM/GRU on torch's own weights."""
    T, B, I, H = shape
    module = torch_type(I, H).double()
    params = {k.removesuffix("_l0"): v.detach().numpy() for k, v in module.state_dict().items()}
    cell = cell_type(I, H)
    x, _, states = random_inputs(cell, T, B, rng)
    hx = tuple(torch.from_numpy(states[s].astype(np.float64))[None] for s in cell.states)
    y_torch, _ = module(torch.from_numpy(x.astype(np.float64)), hx if len(hx) > 1 else hx[0])
    y_torch = y_torch.detach().numpy()

    y_ref, _ = halstm.reference(cell, x, params, states)
    assert rel_err(y_ref, y_torch) < 1e-12
    f32 = {k: v.astype(np.float32) for k, v in params.items()}
    y, _ = compiled(cell_type, shape)(x, f32, states)
    assert rel_err(y, y_torch) < TOLERANCE["float32"]


def test_torch_tensors_pass_through_dlpack(rng):
    cell = halstm.GRU(12, 16)
    x, params, states = random_inputs(cell, 4, 2, rng)
    f = halstm.compile(cell, 4, 2)
    y, final = f(torch.from_numpy(x), {k: torch.from_numpy(v) for k, v in params.items()},
                 {"h": torch.from_numpy(states["h"])})
    assert isinstance(y, torch.Tensor) and isinstance(final["h"], torch.Tensor)
    y_ref, _ = halstm.reference(cell, x, params, states)
    assert rel_err(y.numpy(), y_ref) < TOLERANCE["float32"]


def test_torch_views_and_tensors_that_require_grad_are_shared_as_their_values(rng):
    """A non-contiguous weight (a transposed view) and tensors that require grad give the result of
    their contiguous, detached values, and the caller's tensors are left as they were."""
    cell = halstm.GRU(12, 16)
    x, params, states = random_inputs(cell, 4, 2, rng)
    f = halstm.compile(cell, 4, 2)
    plain = {k: torch.from_numpy(v) for k, v in params.items()}
    viewed = dict(plain, weight_hh=torch.from_numpy(params["weight_hh"].T.copy()).T)
    assert not viewed["weight_hh"].is_contiguous()
    x_grad = torch.from_numpy(x).requires_grad_()
    y_plain, _ = f(torch.from_numpy(x), plain, {"h": torch.from_numpy(states["h"])})
    y, _ = f(x_grad, viewed, {"h": torch.from_numpy(states["h"]).requires_grad_()})
    assert torch.equal(y, y_plain)
    assert x_grad.requires_grad and not viewed["weight_hh"].is_contiguous()
    y_ref, _ = halstm.reference(cell, x, params, states)
    assert rel_err(y.numpy(), y_ref) < TOLERANCE["float32"]
