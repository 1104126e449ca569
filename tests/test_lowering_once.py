"""``halstm.compile`` chooses the recipe, its knobs and the weight layout from the problem (the plan,
the sizes and the step as IR), then lowers the program once, with the layout chosen."""

import numpy as np
import pytest
from conftest import random_inputs, rel_err

import halstm
from halstm import compiler, lowering
from halstm.layout import PackedLayout
from halstm.plan import make_plan
from halstm.targets import CudaTarget

H100 = CudaTarget("sm_90", sms=132)


def _counting(monkeypatch):
    """The calls of ``lower`` (by (steps, batch)), ``step_function`` and ``parsed`` from now on."""
    calls = {"lower": [], "step": 0, "parsed": 0}
    lower, step, parsed = lowering.lower, lowering.step_function, lowering.parsed

    def counted_lower(cell, steps, batch, *args, **kwargs):
        calls["lower"].append((steps, batch))
        return lower(cell, steps, batch, *args, **kwargs)

    def counted(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(lowering, "lower", counted_lower)
    monkeypatch.setattr(lowering, "step_function", counted("step", step))
    monkeypatch.setattr(lowering, "parsed", counted("parsed", parsed))
    return calls


def test_a_layout_other_than_the_default_is_lowered_once(monkeypatch):
    """The CPU's step loop stores the weights in strips (a layout of its own): the program is lowered
    once, in that layout, and the function matches float64."""
    cell = halstm.LSTM(8, 16)
    calls = _counting(monkeypatch)
    f = halstm.compile(cell, 3, 2, "float32", "cpu", database=False)
    assert f.program.layout.tile is not None
    assert calls["lower"].count((3, 2)) == 1 and calls["step"] == 1
    x, params, states = random_inputs(cell, 3, 2, np.random.default_rng(7))
    y, _ = f(x, params, states)
    assert rel_err(y, halstm.reference(cell, x, params, states)[0]) < 1e-5


@pytest.mark.parametrize("cell, dtype", [(halstm.LSTM, "float16"), (halstm.LayerNormLSTM, "float16"),
                                         (halstm.GRU, "float32")], ids=lambda v: getattr(v, "__name__", v))
def test_the_persistent_kernels_choice_parses_no_program(monkeypatch, cell, dtype):
    """The persistent kernel's recipe chooses from the step's IR (``Problem.step``, built once),
    lowering and parsing no program; exact float32 GRU's layout (its hoisted GEMMs as three TF32
    products) leaves the step as it was, so the program lowered for it reuses that step."""
    cell = cell(64, 64)
    problem = lowering.Problem(cell, make_plan(cell), 3, 16 if dtype == "float16" else 3, dtype)
    calls = _counting(monkeypatch)
    choice = compiler._choose(problem, H100, None, None, None)
    assert choice["recipe"] == "cuda-persistent"
    assert calls == {"lower": [], "step": 1, "parsed": 0}
    program = problem.lowered(PackedLayout(**choice["layout"]))
    assert program.layout.tf32x3 == (dtype == "float32") and program.step is problem.step
    assert calls["step"] == 1


def test_a_recipe_that_reads_the_lowered_program_while_choosing_is_told_so():
    """A recipe whose ``layout`` reads ``program.mod`` (the lowered program, which ``apply`` gets) is
    told that it was given the problem, before lowering."""
    from halstm.schedules import CpuStepLoop

    class ReadsTheProgram(CpuStepLoop):
        name = "reads-the-program"

        def layout(self, program, target, knobs):
            program.mod
            return super().layout(program, target, knobs)

    with pytest.raises(AttributeError, match="before it is lowered"):
        halstm.compile(halstm.LSTM(8, 16), 3, 2, "float32", "cpu", recipe=ReadsTheProgram())
