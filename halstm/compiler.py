"""``halstm.compile``: plan, lower, schedule and build a cell for one shape, dtype and target."""

from __future__ import annotations

import functools
import warnings

import numpy as np

from halstm import schedules, targets

from .cell import BUILD_LOCK, Cell, check_cell
from .database import Database, Record, best, nearest_steps, tuning_key
from .lowering import Program, lower
from .plan import make_plan
from .runtime import SequenceFunction, Signature
from .scratch import lift_module

DTYPES = ("float32", "float16", "bfloat16")


def serialised(function):
    """``function``, run holding ``BUILD_LOCK``."""

    @functools.wraps(function)
    def locked(*args, **kwargs):
        with BUILD_LOCK:
            return function(*args, **kwargs)

    return locked


@serialised
def compile(  # noqa: A001 (the package's verb, as tvm.compile)
    cell: Cell,
    steps: int | None,
    batch: int,
    dtype: str = "float32",
    target="cpu",
    recipe=None,
    knobs: dict | None = None,
    database=None,
    allow_tf32: bool = False,
) -> CompiledCell:
    """Compile ``cell`` for sequences of ``steps`` steps and ``batch`` rows; ``steps=None``: for
    sequences of any length, T read off each call's x (choices made for ``lowering.NOMINAL_STEPS``).

    ``target`` is "cpu", "cuda" or a ``halstm.targets`` object; ``recipe`` a ``halstm.schedules.Recipe``
    or the name of a built-in or registered one (``halstm.schedules.register``), refused where it
    does not apply; ``knobs`` overrides its defaults. Given neither, the best record of the tuning
    database (``database``: a path or ``halstm.database.Database``; False to skip it) among the
    built-in and registered recipes decides, for this problem or else for the same cell, batch, dtype
    and target at the nearest sequence length; without one, the first built-in recipe that applies
    with its default knobs.
    ``allow_tf32`` lets float32 GEMMs run on tensor cores as TF32 (operands rounded to 10 mantissa
    bits, as cuDNN and cuBLAS do by default; relative error ~1e-3 instead of ~1e-6) where the GPU
    has them (sm_80+). Without it, float32 stays float32-accurate: on Hopper the step loop may run
    its GEMMs as three TF32 products each (``schedules.cuda_gemm.split_tf32``, within float32's
    tolerance; ``knobs={"tensor_cores": False}`` keeps them on FFMA cores).
    A malformed or stale record, or a database that cannot be read, is passed over with a warning
    (``_tuned``). Threads may call it at once: they compile one at a time (``BUILD_LOCK``).
    """
    check_problem(cell, steps, batch, dtype)
    target = targets.resolve(target)
    plan = make_plan(cell)
    steps = None if steps is None else int(steps)
    program = lower(cell, steps, int(batch), dtype, plan, allow_tf32=allow_tf32)
    record = None
    if recipe is not None:
        recipe = schedules.named(recipe) if isinstance(recipe, str) else recipe
        schedules.check_name(recipe)
        if not recipe.is_applicable(program, target):
            raise ValueError(f"recipe '{recipe.name}' does not apply to {cell!r} on {target.key}")
    elif knobs is None and database is not False:
        record = _tuned(program, target, database)
        if record is not None:
            recipe, knobs = schedules.named(record.recipe), record.knobs
    if recipe is None:
        candidates = schedules.recipes_for(program, target)
        if not candidates:
            raise ValueError(f"no built-in recipe applies to {cell!r} on {target}")
        recipe = candidates[0]
    given, knobs = knobs, recipe.resolve(program, target, knobs)
    if not recipe.runs(program, target, knobs):
        raise ValueError(f"recipe '{recipe.name}' cannot run knobs {given} for {cell!r} on {target.key}: a tile or grid "
                         f"past the target's limits (threads, registers, shared memory, co-residency)")
    layout = recipe.layout(program, target, knobs)
    if layout != program.layout:
        program = lower(cell, steps, int(batch), dtype, plan, layout, allow_tf32)
    from . import cache

    def build():
        schedule = recipe.apply(program, target, **knobs)
        if schedule is None:
            raise ValueError(f"recipe '{recipe.name}' does not apply to {cell!r} on {target}")
        mod, scratch = lift_module(schedule.mod, target)
        module = target.build(mod, **getattr(recipe, "build_options", {}))
        return CompiledCell(program, target, recipe, knobs, schedule, module, record, scratch.get("main", ()))

    return cache.forward(program, target, recipe, knobs, record, build)


def check_problem(cell: Cell, steps, batch, dtype, any_steps: bool = True) -> None:
    """Reject a cell, shape or dtype that cannot be compiled, naming what is wrong; ``any_steps``:
    steps may be None (a function for every sequence length)."""
    check_cell(cell)
    for name, value in (("steps", steps), ("batch", batch)):
        if name == "steps" and value is None and any_steps:
            continue
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            either = " or None (any)" if name == "steps" and any_steps else ""
            raise ValueError(f"{name} must be a positive integer{either}, got {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _tuned(program: Program, target, database) -> Record | None:
    """The best record for this problem among the built-in and registered recipes, else
    the best at the nearest sequence length (``database.nearest_steps``), if its knobs pass the
    recipe's ``check_knobs`` here. One that does not (a stale record: another version of halstm or
    another machine wrote it; or one written by hand) is passed over with a warning, as are a
    malformed line and a database that cannot be read: the defaults are used."""
    db = database if isinstance(database, Database) else Database(database)
    try:
        records = db.records()
    except OSError as e:
        warnings.warn(f"{db.path}: the tuning database cannot be read ({e.strerror or e}); using the defaults",
                      stacklevel=4)
        return None
    key = tuning_key(program.cell, program.nominal_steps, program.batch, program.dtype, target, program.allow_tf32)
    recipes = schedules.known()
    record = best(records, key, set(recipes)) or nearest_steps(records, key, set(recipes))
    if record is None:
        return None
    why = recipes[record.recipe].check_knobs(program, target, record.knobs)
    if why is None:
        return record
    warnings.warn(f"{db.path}:{record.line}: the tuned {record.candidate} does not run here; using the defaults: "
                  f"{why}", stacklevel=4)
    return None


class CompiledCell(SequenceFunction):
    """``halstm.compile``'s result: the sequence function with how it was made (``program``,
    ``recipe``, ``knobs``, ``schedule``: ``print(f.schedule.trace)`` lists every rewrite; ``record``:
    the tuning record the recipe and knobs came from, None where they did not; ``cached``: the
    compiled-module cache's entry it was loaded from, None where it was built)."""

    cached = None

    def __init__(self, program: Program, target, recipe, knobs, schedule, module, record: Record | None = None,
                 scratch: tuple = ()):
        super().__init__(module["main"], signature(program, scratch), target.device())
        self.program, self.target, self.recipe, self.knobs = program, target, recipe, knobs
        self.schedule, self.module, self.record = schedule, module, record

    cell = property(lambda self: self.program.cell)
    plan = property(lambda self: self.program.plan)

    def __repr__(self):
        p = self.program
        return (f"<compiled {p.cell!r} T={p.steps or 'any'} B={p.batch} {p.dtype}{' (TF32)' * p.allow_tf32} on {self.target.key} "
                f"with {self.recipe.name} {self.knobs}>")


def signature(program: Program, scratch: tuple = ()) -> Signature:
    """The compiled function's signature: the program's arguments, then the ``scratch`` buffers
    (``halstm.scratch``) its schedule needs."""
    cell = program.cell
    return Signature(cell.name, tuple(cell.states), cell.output, cell.input_size, cell.hidden_size,
                     program.steps, program.batch, program.dtype, (*program.args, *scratch),
                     None if program.steps else program.longest)
