"""``halstm.compile``: plan, lower, schedule and build a cell for one shape, dtype and target."""

from __future__ import annotations

import numpy as np

from halstm import schedules, targets

from .cell import Cell, check_cell
from .database import Database, tuning_key
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
    decides, else the first recipe that applies with its default knobs. ``allow_tf32`` lets float32
    GEMMs run on tensor cores as TF32 (operands rounded to 10 mantissa bits, as cuDNN and cuBLAS do
    by default; relative error ~1e-3 instead of ~1e-6) where the GPU has them (sm_80+). Without it,
    float32 stays float32-accurate: on Hopper the step loop may run its GEMMs as three TF32 products
    each (``schedules.cuda.split_tf32``, within float32's tolerance; ``knobs={"tensor_cores": False}``
    keeps them on FFMA cores).
    """
    check_problem(cell, steps, batch, dtype)
    target = targets.resolve(target)
    plan = make_plan(cell)
    program = lower(cell, int(steps), int(batch), dtype, plan, allow_tf32=allow_tf32)
    if recipe is None and knobs is None and database is not False:
        best = _tuned(cell, int(steps), int(batch), dtype, target, database, allow_tf32)
        if best is not None:
            recipe, knobs = best.recipe, best.knobs
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
    return CompiledCell(program, target, recipe, knobs, schedule, module)


def check_problem(cell: Cell, steps, batch, dtype) -> None:
    """Reject a cell, shape or dtype that cannot be compiled, naming what is wrong."""
    check_cell(cell)
    for name, value in (("steps", steps), ("batch", batch)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _tuned(cell, steps, batch, dtype, target, database, allow_tf32):
    """The best record for this problem among the built-in recipes (those compile can name)."""
    db = database if isinstance(database, Database) else Database(database)
    if not db.path.exists():
        return None
    key = tuning_key(cell, steps, batch, dtype, target, allow_tf32)
    return db.best(key, {r.name for r in schedules.BUILTIN})


class CompiledCell(SequenceFunction):
    """``halstm.compile``'s result: the sequence function with how it was made (``program``,
    ``recipe``, ``knobs``, ``schedule``: ``print(f.schedule.trace)`` lists every rewrite)."""

    def __init__(self, program: Program, target, recipe, knobs, schedule, module):
        super().__init__(module["main"], signature(program), target.device())
        self.program, self.target, self.recipe, self.knobs = program, target, recipe, knobs
        self.schedule, self.module = schedule, module

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
