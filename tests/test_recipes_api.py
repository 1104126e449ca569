"""Recipes of one's own in ``halstm.compile``: registered ones by name and through their tuning
records, names no two recipe classes share, ``is_applicable`` checked; the backward's plan printed."""

import re

import pytest

import halstm
from halstm import schedules, targets
from halstm.database import Database, Record, tuning_key
from halstm.schedules import CpuStepLoop
from conftest import TOLERANCE, random_inputs, rel_err

CELL = halstm.LSTM(8, 16)
T, B = 3, 2


class WideRows(CpuStepLoop):
    """A recipe of one's own: the CPU step loop under a name of its own."""

    name = "wide-rows"


class Nowhere(CpuStepLoop):
    """A recipe that applies to nothing."""

    name = "nowhere"

    def is_applicable(self, program, target):
        return False


class Impostor(CpuStepLoop):
    """A recipe of one's own that kept the built-in's name."""


@pytest.fixture(autouse=True)
def no_registered_recipes(monkeypatch):
    """Each test registers its own recipes, none left for the next."""
    monkeypatch.setattr(schedules, "_REGISTERED", {})


def test_a_registered_recipe_compiles_by_name(rng):
    mine = schedules.register(WideRows())
    f = halstm.compile(CELL, T, B, recipe="wide-rows", knobs={"rows": 2})
    assert f.recipe is mine and f.knobs["rows"] == 2
    x, params, states = random_inputs(CELL, T, B, rng)
    assert rel_err(f(x, params, states)[0], halstm.reference(CELL, x, params, states)[0]) < TOLERANCE["float32"]


def test_an_unknown_name_lists_the_built_in_and_registered_recipes():
    schedules.register(WideRows())
    with pytest.raises(ValueError, match=r"unknown recipe 'wide-row'.*'cpu-step-loop'.*\['wide-rows'\]"):
        halstm.compile(CELL, T, B, recipe="wide-row")


def test_register_refuses_a_name_another_class_has():
    with pytest.raises(ValueError, match=r"'cpu-step-loop' of test_recipes_api\.Impostor is taken by "
                                         r"halstm\.schedules\.cpu\.CpuStepLoop"):
        schedules.register(Impostor())
    schedules.register(WideRows())
    other = type("WideRows", (CpuStepLoop,), {"name": "wide-rows", "__qualname__": "Other"})
    with pytest.raises(ValueError, match=r"taken by test_recipes_api\.WideRows"):
        schedules.register(other())
    again = schedules.register(WideRows())  # the same class, defined again or not: the later one counts
    assert schedules.named("wide-rows") is again
    with pytest.raises(ValueError, match="the base class's name 'recipe'"):
        schedules.register(type("Nameless", (CpuStepLoop,), {"name": "recipe"})())
    with pytest.raises(TypeError, match=r"an instance: MyRecipe\(\)"):
        schedules.register(WideRows)


def test_compile_refuses_a_recipe_named_like_another_class():
    """Its records and sidecars would name the built-in one, whose knobs they are not."""
    with pytest.raises(ValueError, match="'cpu-step-loop' of test_recipes_api.Impostor is taken"):
        halstm.compile(CELL, T, B, recipe=Impostor())


def test_compile_refuses_a_recipe_that_does_not_apply():
    where = f"recipe 'nowhere' does not apply to {CELL!r} on {targets.resolve('cpu').key}"
    with pytest.raises(ValueError, match=re.escape(where)):
        halstm.compile(CELL, T, B, recipe=Nowhere())


def test_compile_reads_the_tuned_records_of_registered_recipes(tmp_path):
    """A record of a registered recipe is used where it is the fastest; an unregistered recipe's is
    passed over."""
    db = Database(tmp_path / "tuning.jsonl")
    key = tuning_key(CELL, T, B, "float32", targets.resolve("cpu"))
    db.append(Record(key, "cpu-step-loop", {}, ms=2.0))
    db.append(Record(key, "wide-rows", {"rows": 2, "vectors": 1}, ms=1.0))
    assert halstm.compile(CELL, T, B, database=db).recipe.name == "cpu-step-loop"
    mine = schedules.register(WideRows())
    f = halstm.compile(CELL, T, B, database=db)
    assert f.recipe is mine and (f.knobs["rows"], f.knobs["vectors"]) == (2, 1)
    assert f.record.recipe == "wide-rows"


def test_the_backward_programs_plans_print():
    backward = halstm.lower_backward(halstm.ResetBeforeGRU(4, 8), 3, 2)
    reversed_loop = str(halstm.plan.make_plan(backward.adjoint))
    assert "x_proj0 = T_multiply @ [weight_hn]^T  (N=8, K=8)" in reversed_loop  # the forward's, recomputed
    assert "stage 1: gemm0 = concat @ [gemm0_t]^T  (N=8, K=16)" in reversed_loop
    assert "stage 2: gemm1 = d_T_add @ [weight_hn_t]^T  (N=8, K=8)" in reversed_loop
    rows = str(backward.rows.plan)
    # the forward's later stage recomputed, its first stage and hoisted GEMMs read from prepare's output
    assert "stage 1: gemm1 = T_multiply @ [weight_hn]^T" in rows and "gemm0 =" not in rows and "x_proj0 =" not in rows
    assert "stage 2: grad_a_gemm1 = dgemm1 @ [weight_hn] -> d T_multiply" in rows
    assert "grad_a_gemm0" not in rows  # h's share is the reversed loop's
    assert "stage 1: grad_w_gemm1 = dgemm1^T @ T_multiply -> d [weight_hn]" in str(backward.weights.plan)
    assert reversed_loop.replace("\n", "\n  ") in str(backward.plan)
