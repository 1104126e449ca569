"""A function compiled with ``steps=None`` serves every sequence length: one build, T read off each
call's x, results against float64 at several T; bad T refused before anything runs."""

import numpy as np
import pytest

import halstm
from conftest import TOLERANCE, random_inputs, rel_err
from halstm.cells import BUILTIN
from halstm.lowering import NOMINAL_STEPS, lower, max_steps

STEPS = (1, 2, 7, 40)


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    monkeypatch.setenv("HALSTM_CACHE", "0")


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
