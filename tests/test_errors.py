"""Bad input is rejected before anything runs, with the argument named; NaN propagates as documented."""

import numpy as np
import pytest

import halstm
from conftest import random_inputs


@pytest.fixture(scope="module")
def lstm():
    cell = halstm.LSTM(6, 8)
    return cell, halstm.compile(cell, steps=4, batch=3)


def call_with(lstm, rng, **change):
    cell, f = lstm
    x, params, states = random_inputs(cell, 4, 3, rng)
    args = {"x": x, "params": params, "states": states}
    args.update(change)
    return f(args["x"], args["params"], args["states"])


@pytest.mark.parametrize("x, error, words", [
    (np.zeros((4, 3), np.float32) + 1, ValueError, "x: expected rank 3"),
    (np.ones((5, 3, 6), np.float32), ValueError, "x: expected shape (4, 3, 6)"),
    (np.ones((4, 3, 7), np.float32), ValueError, "got (4, 3, 7)"),
    (np.ones((4, 3, 6), np.float64), TypeError, "x: expected dtype float32, got float64"),
    ([[[1.0]]], TypeError, "NumPy array or a torch tensor"),
])
def test_bad_x(lstm, rng, x, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call_with(lstm, rng, x=x)


def test_missing_and_extra_parameters(lstm, rng):
    cell, _ = lstm
    _, params, _ = random_inputs(cell, 4, 3, rng)
    missing = {k: v for k, v in params.items() if k != "bias_hh"}
    with pytest.raises(KeyError, match=r"params: missing \['bias_hh'\]"):
        call_with(lstm, rng, params=missing)
    with pytest.raises(KeyError, match=r"unexpected \['peephole'\]"):
        call_with(lstm, rng, params={**params, "peephole": params["bias_hh"]})


def test_parameter_shape_and_state_errors(lstm, rng):
    cell, _ = lstm
    _, params, _ = random_inputs(cell, 4, 3, rng)
    with pytest.raises(ValueError, match=r"params\['weight_hh'\]: expected shape \(32, 8\)"):
        call_with(lstm, rng, params={**params, "weight_hh": params["weight_hh"].T.copy()})
    with pytest.raises(KeyError, match=r"states: unexpected \['z'\]"):
        call_with(lstm, rng, states={"z": np.ones((3, 8), np.float32)})
    with pytest.raises(ValueError, match=r"states\['c'\]: expected shape \(3, 8\)"):
        call_with(lstm, rng, states={"c": np.ones((2, 8), np.float32)})


@pytest.mark.parametrize("steps, batch, words", [(0, 2, "steps must be a positive"), (3, 0, "batch must be")])
def test_empty_sequences_are_rejected_at_compile(steps, batch, words):
    with pytest.raises(ValueError, match=words):
        halstm.compile(halstm.GRU(4, 4), steps=steps, batch=batch)


def test_bad_compile_options():
    with pytest.raises(ValueError, match="dtype must be one of"):
        halstm.compile(halstm.GRU(4, 4), 2, 2, dtype="int8")
    with pytest.raises(ValueError, match="unknown target"):
        halstm.compile(halstm.GRU(4, 4), 2, 2, target="tpu")
    with pytest.raises(ValueError, match="has no knob"):
        halstm.compile(halstm.GRU(4, 4), 2, 2, knobs={"tiles": 3})


def test_bad_cells_are_named():
    class Wrong(halstm.GRU):
        def step(self, p, x, h):
            return h, h

    with pytest.raises(ValueError, match="Wrong.step returned 2 tensors"):
        halstm.compile(Wrong(4, 4), 2, 2)

    class ComputedWeight(halstm.GRU):
        def step(self, p, x, h):
            return halstm.matmul(h, p.weight_hh * 2.0)

    with pytest.raises(TypeError, match="weight must be a cell parameter"):
        halstm.compile(ComputedWeight(4, 4), 2, 2)


def test_nan_propagates_along_its_batch_row_only(lstm, rng):
    """Documented: NaN is not checked; it flows through the math like in PyTorch."""
    cell, f = lstm
    x, params, states = random_inputs(cell, 4, 3, rng)
    x[1, 2, 0] = np.nan
    y, _ = f(x, params, states)
    assert np.isnan(y[1:, 2]).all()
    assert np.isfinite(y[:1]).all() and np.isfinite(y[:, :2]).all()


def test_compile_refuses_knobs_that_cannot_run():
    """A knob setting past the target's limits is refused before anything is built, naming it (a
    tensor-core tile past the block's shared memory: four stages of 128 x 128 need 74 KiB, a GPU with
    64 KiB a block cannot launch it; a persistent grid of more blocks than SMs cannot be
    co-resident); on a CPU every setting runs, the slow ones included."""
    from halstm.schedules.cuda_tensorcore import tensorize_works
    from halstm.targets import CudaTarget

    h100 = CudaTarget("sm_90", sms=132)
    with pytest.raises(ValueError, match=r"cannot run knobs \{'units': 1\}"):
        halstm.compile(halstm.LSTM(256, 256), 2, 1, target=h100, recipe="cuda-persistent", knobs={"units": 1})
    if tensorize_works():
        small = CudaTarget("sm_90", sms=132, shared_memory=64 * 1024)
        with pytest.raises(ValueError, match="cannot run knobs"):
            halstm.compile(halstm.LSTM(1024, 1024), 2, 256, "float16", target=small, recipe="cuda-step-loop",
                           knobs={"tc_stages": 4, "tc_hoisted_frags": 4})
    f = halstm.compile(halstm.LSTM(8, 8), 2, 3, recipe="cpu-step-loop", knobs={"rows": 2})  # 2 does not divide 3
    assert f.knobs["rows"] == 2
