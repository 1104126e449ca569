"""``halstm.compile``: plan, lower, schedule and build a cell for one shape, dtype and target."""

from __future__ import annotations

import dataclasses
import functools
import warnings

import numpy as np

from halstm import schedules, targets

from .cell import BUILD_LOCK, Cell, check_cell
from .database import Database, Record, best, nearest_steps, tuning_key
from .layout import PackedLayout
from .lowering import Problem, Program
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
    keep_results: bool = False,
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
    (``_best_record``, ``_choose``). ``keep_results``: where the recipe chosen for the forward can
    (``Recipe.keeps_results``: the CPU's step loop, the persistent kernel), the first stage's GEMM
    results of every step stay, as the hoisted GEMMs' do, for ``sequences_keeping`` to return
    (``lowering.kept_results``; ``program.keeps_results`` says whether they do; a training forward:
    ``compile_backward(..., given_results=True)`` then reads them). The choice is kept in the compiled-module cache
    (``cache.decided``): a later process skips the analysis it takes. Threads may call it at once:
    they compile one at a time (``BUILD_LOCK``).
    """
    check_problem(cell, steps, batch, dtype)
    target = targets.resolve(target)
    plan = make_plan(cell)
    steps = None if steps is None else int(steps)
    problem = Problem(cell, plan, steps, int(batch), dtype, allow_tf32=allow_tf32)
    record = None
    if recipe is not None:
        recipe = schedules.named(recipe) if isinstance(recipe, str) else recipe
        schedules.check_name(recipe)
    elif knobs is None and database is not False:
        database = database if isinstance(database, Database) else Database(database)
        record = _best_record(problem, target, database)
    from . import cache

    choice = cache.decided(problem, target, _question(recipe, knobs, record),
                           lambda: _choose(problem, target, recipe, knobs, record),
                           lambda choice: _usable(choice, recipe))
    if record is not None and choice["stale"] is not None:
        warnings.warn(f"{database.path}:{record.line}: the tuned {record.candidate} does not run here; using the "
                      f"defaults: {choice['stale']}", stacklevel=3)
        record = None
    recipe = recipe or schedules.named(choice["recipe"])
    knobs, layout = choice["knobs"], PackedLayout(**choice["layout"])
    keep_results = keep_results and recipe.keeps_results and layout.split_k == 1
    program = problem.lowered(layout, keep_results)

    def build():
        schedule = recipe.apply(program, target, **knobs)
        if schedule is None:
            raise ValueError(f"recipe '{recipe.name}' does not apply to {cell!r} on {target}")
        mod, scratch = lift_module(schedule.mod, target, kept=tuple(program.kept))
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


def _best_record(program: Problem, target, db: Database) -> Record | None:
    """The best record for this problem among the built-in and registered recipes, else the best at
    the nearest sequence length (``database.nearest_steps``); None, with a warning, where the
    database cannot be read. ``_choose`` checks that its knobs run here."""
    try:
        records = db.records()
    except OSError as e:
        warnings.warn(f"{db.path}: the tuning database cannot be read ({e.strerror or e}); using the defaults",
                      stacklevel=4)
        return None
    key = tuning_key(program.cell, program.nominal_steps, program.batch, program.dtype, target, program.allow_tf32)
    recipes = set(schedules.known())
    return best(records, key, recipes) or nearest_steps(records, key, recipes)


def _question(recipe, knobs: dict | None, record: Record | None) -> dict:
    """What ``_choose`` decides from besides the program and target, as JSON (``cache.decided``): the
    recipe asked for and the code of its file, the knobs asked for, the tuning record's choice."""
    from .cache import recipe_code

    asked = None if recipe is None else {"name": recipe.name, "code": recipe_code(recipe)}
    tuned = None if record is None else {"recipe": record.recipe, "knobs": record.knobs,
                                         "code": recipe_code(schedules.named(record.recipe))}
    return {"recipe": asked, "knobs": knobs, "record": tuned}


def _usable(choice: dict, asked) -> bool:
    """Whether a kept choice names the recipe ``asked`` for (else a known one), knobs and a weight
    layout (a cache entry edited or written by another version is decided again)."""
    try:
        PackedLayout(**choice["layout"])
    except (KeyError, TypeError, ValueError):
        return False
    recipe_ok = choice.get("recipe") == asked.name if asked is not None else choice.get("recipe") in schedules.known()
    return (recipe_ok and isinstance(choice.get("knobs"), dict)
            and isinstance(choice.get("stale"), (str, type(None))))


def _choose(program: Problem, target, recipe, knobs: dict | None, record: Record | None) -> dict:
    """The recipe (``recipe``; else ``record``'s where its knobs run here; else the first built-in
    one that applies), its resolved knobs and weight layout, as JSON, and ``stale``: why ``record``
    was passed over (a record another version of halstm or another machine wrote, or one written by
    hand), else None. Raises where the recipe asked for does not apply or its knobs cannot run."""
    cell, stale = program.cell, None
    if recipe is not None and not recipe.is_applicable(program, target):
        raise ValueError(f"recipe '{recipe.name}' does not apply to {cell!r} on {target.key}")
    if record is not None:
        stale = schedules.named(record.recipe).check_knobs(program, target, record.knobs)
        if stale is None:
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
    return {"recipe": recipe.name, "knobs": knobs, "layout": dataclasses.asdict(layout), "stale": stale}


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
