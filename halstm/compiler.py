"""``halstm.compile``: plan, lower, schedule and build a cell for one shape, dtype and target."""

from __future__ import annotations

import warnings

import numpy as np

from halstm import schedules, targets

from .cell import Cell, check_cell
from .database import Database, Record, tuning_key
from .lowering import Program, lower
from .plan import make_plan
from .runtime import SequenceFunction, Signature

DTYPES = ("float32", "float16", "bfloat16")


def compile(  # noqa: A001 (the package's verb, as tvm.compile)
    cell: Cell,
    steps: int,
    batch: int,
    dtype: str = "float32",
    target="cpu",
    recipe=None,
    knobs: dict | None = None,
    database=None,
    allow_tf32: bool = False,
) -> CompiledCell:
    """Compile ``cell`` for sequences of ``steps`` steps and ``batch`` rows.

    ``target`` is "cpu", "cuda" or a ``halstm.targets`` object; ``recipe`` a recipe (or its name)
    from ``halstm.schedules``, ``knobs`` overrides its defaults. Given neither, the best record of
    the tuning database (``database``: a path or ``halstm.database.Database``; False to skip it)
    decides, for this problem or else for the same cell, batch, dtype and target at the nearest
    sequence length; without one, the first recipe that applies with its default knobs.
    ``allow_tf32`` lets float32 GEMMs run on tensor cores as TF32 (operands rounded to 10 mantissa
    bits, as cuDNN and cuBLAS do by default; relative error ~1e-3 instead of ~1e-6) where the GPU
    has them (sm_80+). Without it, float32 stays float32-accurate: on Hopper the step loop may run
    its GEMMs as three TF32 products each (``schedules.cuda.split_tf32``, within float32's
    tolerance; ``knobs={"tensor_cores": False}`` keeps them on FFMA cores).
    """
    check_problem(cell, steps, batch, dtype)
    target = targets.resolve(target)
    plan = make_plan(cell)
    program = lower(cell, int(steps), int(batch), dtype, plan, allow_tf32=allow_tf32)
    record = None
    if recipe is None and knobs is None and database is not False:
        record = _tuned(program, target, database)
        if record is not None:
            recipe, knobs = record.recipe, record.knobs
    if recipe is None:
        candidates = schedules.recipes_for(program, target)
        if not candidates:
            raise ValueError(f"no built-in recipe applies to {cell!r} on {target}")
        recipe = candidates[0]
    elif isinstance(recipe, str):
        by_name = {r.name: r for r in schedules.BUILTIN}
        if recipe not in by_name:
            raise ValueError(f"unknown recipe {recipe!r}; built-in: {sorted(by_name)}")
        recipe = by_name[recipe]
    given, knobs = knobs, recipe.resolve(program, target, knobs)
    if not recipe.runs(program, target, knobs):
        raise ValueError(f"recipe '{recipe.name}' cannot run knobs {given} for {cell!r} on {target.key}: a tile or grid "
                         f"past the target's limits (threads, registers, shared memory, co-residency)")
    layout = recipe.layout(program, target, knobs)
    if layout != program.layout:
        program = lower(cell, int(steps), int(batch), dtype, plan, layout, allow_tf32)
    schedule = recipe.apply(program, target, **knobs)
    if schedule is None:
        raise ValueError(f"recipe '{recipe.name}' does not apply to {cell!r} on {target}")
    module = target.build(schedule.mod, **getattr(recipe, "build_options", {}))
    return CompiledCell(program, target, recipe, knobs, schedule, module, record)


def check_problem(cell: Cell, steps, batch, dtype) -> None:
    """Reject a cell, shape or dtype that cannot be compiled, naming what is wrong."""
    check_cell(cell)
    for name, value in (("steps", steps), ("batch", batch)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _tuned(program: Program, target, database) -> Record | None:
    """The best record for this problem among the built-in recipes (those compile can name); where
    none is for this sequence length, the best at the nearest one (``Database.nearest_steps``) if
    its knobs run here. A record for this very problem whose knobs do not (written by another
    version of halstm) is passed over with a warning."""
    db = database if isinstance(database, Database) else Database(database)
    if not db.path.exists():
        return None
    key = tuning_key(program.cell, program.steps, program.batch, program.dtype, target, program.allow_tf32)
    recipes = {r.name: r for r in schedules.BUILTIN}
    exact = db.best(key, set(recipes))
    if exact is not None:
        if _runs(recipes[exact.recipe], program, target, exact.knobs):
            return exact
        warnings.warn(f"{db.path}: the tuned {exact.candidate} does not run here; using the defaults", stacklevel=3)
        return None
    near = db.nearest_steps(key, set(recipes))
    return near if near is not None and _runs(recipes[near.recipe], program, target, near.knobs) else None


def _runs(recipe, program: Program, target, knobs: dict) -> bool:
    if not recipe.is_applicable(program, target) or not set(knobs) <= set(recipe.knobs):
        return False
    return recipe.runs(program, target, recipe.resolve(program, target, knobs))


class CompiledCell(SequenceFunction):
    """``halstm.compile``'s result: the sequence function with how it was made (``program``,
    ``recipe``, ``knobs``, ``schedule``: ``print(f.schedule.trace)`` lists every rewrite; ``record``:
    the tuning record the recipe and knobs came from, None where they did not)."""

    def __init__(self, program: Program, target, recipe, knobs, schedule, module, record: Record | None = None):
        super().__init__(module["main"], signature(program), target.device())
        self.program, self.target, self.recipe, self.knobs = program, target, recipe, knobs
        self.schedule, self.module, self.record = schedule, module, record

    cell = property(lambda self: self.program.cell)
    plan = property(lambda self: self.program.plan)

    def __repr__(self):
        p = self.program
        return (f"<compiled {p.cell!r} T={p.steps} B={p.batch} {p.dtype}{' (TF32)' * p.allow_tf32} on {self.target.key} "
                f"with {self.recipe.name} {self.knobs}>")


def signature(program: Program) -> Signature:
    cell = program.cell
    return Signature(cell.name, tuple(cell.states), cell.output, cell.input_size, cell.hidden_size,
                     program.steps, program.batch, program.dtype, tuple(program.args))
