"""The autotuner: measures recipe choices and knob settings for one cell, shape, dtype and target.

Each candidate is compiled, checked against the float64 reference and timed (median after warm-up)
in worker processes (``halstm.tuner_workers``). The search goes in rounds (``next_round``): each
recipe's default, then the settings nearest the fastest measured so far; at the end the fastest few
and each recipe's default are timed again side by side in one process (``runoff``), and
``Database.best`` picks from that. With ``builders`` > 1 a round's candidates (as many as builders)
are compiled and exported by that many processes at once (compiling is most of a candidate's time:
2.9-4.4 s a CUDA function on an H100 host, 14 at once). A CUDA candidate is timed as soon as it is
built, by the measuring process of a free GPU (``gpus``); one timed while others compile is timed
again, if it is a finalist, with nothing else running. A CPU candidate, whose function runs on every
core, is timed once the round's builds are done. Tuning LSTM fp16 (100,64,1024) on 2 x H200 took
76 s on one GPU and 79 s on two: compiling bounds it (docs/results.md#tuning-on-every-gpu). Every
result, failures included, is appended to the database at once: an interrupted run resumes where it
stopped, and ``halstm.compile`` picks up the best record by itself.

Split with TVM's meta_schedule: meta_schedule searches the schedule of one operator; the choice here
is across whole-sequence strategies (step loop or persistent kernel) whose knobs also change the
lowering (the packed weight layout), which its search space cannot express. So halstm enumerates
its own recipes' knobs, small grids that the recipes prune, and measures whole sequences. Where one
operator would fit, the hoisted input GEMM, meta_schedule's tensor-core search (64 trials in a 214 s
call, H100, fp16 25600 x 4096 x 1024) found 1056 us against the recipe's WMMA schedule at 678-708 us
and its wgmma kernel at 387 us: its
tensor-core rules know WMMA's intrinsics, not Hopper's wgmma.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import tempfile

import numpy as np

from .database import Database, Record, candidate_id, tuning_key
from .tuner_workers import Job, Worker, measure_jobs, module_path

NEAR = 1.25  # recipes whose best is within this factor of the fastest are searched first (next_round)
# The fastest candidates timed again at the end, side by side with the recipes' defaults, FINAL_REPEAT
# times the calls of their first timing each (``finalists``). Why: H100, fp16, T=100, 20 candidates a
# shape timed one after another, five calls each, the GRU pick was 0-2 % slower than the default when
# the two were then timed side by side, on 5 shapes of 5; with this, 0-5 % faster on 3 of 3. The two
# values are a choice, not compared with others.
FINALISTS = 4
FINAL_REPEAT = 4
def tune(cell, steps: int, batch: int, dtype: str = "float32", target="cpu", *, database=None,
         recipes=None, trials: int | None = 24, repeat: int = 5, timeout: float = 300.0, seed: int = 0,
         log=None, allow_tf32: bool = False, builders: int | None = None, gpus=None) -> Record | None:
    """Tune ``cell`` for this shape, dtype and target; returns the best record (None if all failed).

    ``recipes`` are the recipes to search (the built-in ones by default; a user's own recipe
    objects work too). Candidates already in the database for this key are not measured again (so
    a run resumes); ``trials`` bounds how many are tried in total (None: every one), in rounds
    (``next_round``: the defaults, then the settings nearest the fastest so far), then the fastest
    few are timed again side by side (``_final``). ``timeout`` (seconds) ends a candidate that hangs
    (its compile, or its check and timing). ``builders`` processes compile the candidates, each
    measured as soon as it is built on a GPU, after the round's builds on the CPU (default: the CPU's cores less one a measuring GPU; 1 compiles
    each in the measuring process). ``gpus`` (a CUDA target): the GPUs that measure candidates at
    once, one process each, as indices of the visible devices or "all"; they must be of the
    target's kind, whose key the records carry (default: the first visible one). The final
    side-by-side timing runs on the first. ``allow_tf32`` as for ``halstm.compile`` (its own
    records). A problem or setting that cannot be tuned is refused with ValueError, and a database
    that cannot be written with OSError, before any worker process starts.
    """
    from halstm import schedules, targets

    from .compiler import check_problem
    from .lowering import lower
    from .oracle import reference
    from .schedules.cuda_tensorcore import PROBED, tensorize_works

    check_problem(cell, steps, batch, dtype, any_steps=False)  # a tuning run times one T
    _check_search(trials, repeat, timeout, builders)
    steps, batch = int(steps), int(batch)  # NumPy integers too: the key is written as JSON
    log = log or _print
    target = targets.resolve(target)
    gpus = measuring_gpus(gpus, target)
    db = database if isinstance(database, Database) else Database(database)
    key = tuning_key(cell, steps, batch, dtype, target, allow_tf32)
    builders = max(1, (os.cpu_count() or 1) - len(gpus)) if builders is None else builders
    cuda = target.kind == "cuda"
    program = lower(cell, steps, batch, dtype, allow_tf32=allow_tf32)
    searched = spaces(program, target, recipes or schedules.BUILTIN, seed)
    size = sum(len(settings) for _, settings in searched)
    total = size if trials is None else min(trials, size)
    records = db.records(key)
    results = {r.candidate: r.ms for r in records}
    if len(results) >= total and (not records or records[-1].final):  # searched, and the finalists timed
        log(f"{len(results)} candidates already measured in {db.path}")
        return db.best(key)
    _check_writable(db.path)

    env = {PROBED: str(int(tensorize_works()))} if cuda else {}  # the workers' compiles need not probe again
    with contextlib.ExitStack() as stack:
        # started before the reference is computed: they import the compiler (and load CUDA) meanwhile
        measurers = [stack.enter_context(Worker(gpu, cuda=cuda, env=env)) for gpu in gpus]
        compilers = [stack.enter_context(Worker(env=env)) for _ in range(builders if builders > 1 else 0)]
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="halstm-tune-"))  # the modules
        rng = np.random.default_rng(seed)
        x, params, states = _inputs(cell, steps, batch, dtype, rng)
        expected, _ = reference(cell, x, params, states)
        best = db.best(key)
        job = lambda recipe, knobs: Job(cell, steps, batch, dtype, target, recipe, knobs,  # noqa: E731
                                        (x, params, states), expected, repeat, allow_tf32)
        while len(results) < total and (todo := next_round(searched, results, builders)):
            jobs = [job(recipe, knobs) for recipe, knobs in todo[:total - len(results)]]
            for candidate, ms, error, gpu in measure_jobs(jobs, measurers, compilers, timeout, log, folder,
                                                      overlap=cuda):
                record = Record(key, candidate.recipe.name, candidate.knobs, ms, error)
                db.append(record)
                results[record.candidate] = ms
                if ms is not None and (best is None or ms < best.ms):
                    best = record
                bar = "#" * (20 * len(results) // total)
                on = f" GPU {gpu}" if len(gpus) > 1 else ""
                log(f"|{bar:<20}| [{len(results)}/{total}]{on} {record.recipe} {record.knobs}: "
                    + (f"{ms:.3f} ms" if ms is not None else f"failed ({error})")
                    + (f" | best {best.ms:.3f} ms ({best.recipe} {best.knobs})" if best else ""))
        _final(db, key, searched, job, folder, measurers[0], timeout, log)
    return db.best(key)


def tune_training(cell, steps: int, batch: int, dtype: str = "float32", target="cpu", *, database=None,
                  log=None, **search) -> tuple[Record | None, Record | None]:
    """Tune a training problem (``halstm tune --training``): the forward (``tune``), then the backward's
    reversed time loop, the adjoint cell that ``compile_backward`` compiles for ``steps + 1`` steps
    (``gradients.reversed_loop``), each recorded under its own key in ``database``; ``search`` as
    for ``tune``. Returns both best records (forward, reversed loop). ``compile_backward`` and
    ``halstm.nn`` then use the reversed loop's record; the functions around the loop keep the
    step-loop recipe's defaults."""
    from .gradients import reversed_loop

    log = log or _print
    db = database if isinstance(database, Database) else Database(database)
    forward = tune(cell, steps, batch, dtype, target, database=db, log=log, **search)
    adjoint = reversed_loop(cell, int(steps), int(batch), dtype, target, allow_tf32=search.get("allow_tf32", False))
    log(f"the backward's reversed loop: {adjoint.name}, {int(steps) + 1} steps")
    return forward, tune(adjoint, int(steps) + 1, batch, dtype, target, database=db, log=log, **search)


def measuring_gpus(gpus, target) -> list[str | None]:
    """The CUDA_VISIBLE_DEVICES entry of each GPU that measures (``tune``'s ``gpus``: None, "all",
    or indices of the visible devices): [None] for None, the worker seeing the parent's devices.
    Refuses GPUs for a CPU target, an index that is not a visible device or is repeated, and a
    GPU of another kind than the target (its architecture, SMs and name)."""
    if gpus is None:
        return [None]
    if target.kind != "cuda":
        raise ValueError(f"gpus: only a CUDA target measures on GPUs, not {target.key}")
    from halstm.targets.cuda import visible_gpus

    found = visible_gpus()
    indices = list(range(len(found))) if gpus == "all" else [] if isinstance(gpus, str) else list(gpus)
    valid = all(isinstance(i, (int, np.integer)) and 0 <= i < len(found) for i in indices)
    if not (indices and valid and len(set(indices)) == len(indices)):
        raise ValueError(f"gpus: expected 'all' or distinct indices of the {len(found)} visible CUDA devices, got {gpus!r}")
    for i in indices:
        gpu = found[i]
        if (gpu.arch, gpu.sms) != (target.arch, target.sms) or target.name and gpu.name != target.name:
            raise ValueError(f"gpus: GPU {i} is {gpu.key}, the target {target.key}: candidates are "
                             f"measured on GPUs of the target's kind")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",")] if visible else [str(i) for i in range(len(found))]
    return [entries[i] for i in indices]


def _check_search(trials, repeat, timeout, builders) -> None:
    """Reject search settings that mean nothing or would record every candidate as failed."""
    for name, value, optional in (("trials", trials, True), ("repeat", repeat, False), ("builders", builders, True)):
        if not (optional and value is None) and (not isinstance(value, (int, np.integer)) or value < 1):
            raise ValueError(f"{name} must be a positive integer{' or None' * optional}, got {value!r}")
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def _check_writable(path) -> None:
    """Refuse a tuning database that cannot be appended to (a folder in its place, a read-only file,
    a parent that is a file), before a candidate's record would fail to be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as e:
        raise OSError(f"cannot write the tuning database {path}: {e.strerror or e}") from e


def finalists(records: list[Record], spaces) -> list[Record]:
    """The records to time again side by side, from one key's ``records`` in the order written (a
    candidate's latest counts) over ``spaces`` (``spaces()``: the searched recipes, their default
    first): the FINALISTS fastest successful ones, and each recipe's default within NEAR of the
    fastest (a default that far behind tells nothing)."""
    defaults = {recipe.name: settings[0] for recipe, settings in spaces}
    latest = {r.candidate: r for r in records if r.recipe in defaults}
    ok = sorted((r for r in latest.values() if r.ms is not None), key=lambda r: r.ms)
    near = [r for r in ok if r.knobs == defaults[r.recipe] and r.ms <= NEAR * ok[0].ms]
    return list({r.candidate: r for r in ok[:FINALISTS] + near}.values())


def _final(db: Database, key: dict, searched, job, folder: str, worker, timeout: float, log) -> None:
    """Time the ``finalists`` again, side by side in one process (``runoff``: FINAL_REPEAT times the
    calls each), and append those records as ``final``: ``Database.best`` picks from them. Separate
    timings of a few calls rank settings within a few percent of each other by noise."""
    chosen = finalists(db.records(key), searched)
    if len(chosen) < 2:
        return
    recipes = {recipe.name: recipe for recipe, _ in searched}
    jobs = [job(recipes[r.recipe], r.knobs) for r in chosen]
    for j in jobs:
        j.repeat *= FINAL_REPEAT
        built = module_path(folder, j)
        j.module = built if os.path.exists(built) else None  # else compiled again
    ms, error = worker.run(jobs, timeout, "runoff")
    if error:
        log(f"the finalists' side-by-side timing failed ({error}): the best stays the fastest timed alone")
        return
    for r, t in zip(chosen, ms):
        db.append(Record(key, r.recipe, r.knobs, t, final=True))
        log(f"final, side by side: {r.recipe} {r.knobs}: {t:.3f} ms (alone {r.ms:.3f} ms)")


def spaces(program, target, recipes, seed: int = 0) -> list[tuple[object, list[dict]]]:
    """Each applicable recipe with its valid settings: its default first, the rest in a fixed shuffle."""
    out = []
    for recipe in (r for r in recipes if r.is_applicable(program, target)):
        default = recipe.defaults(program, target)
        rest = [k for k in recipe.space(program, target) if k != default]
        random.Random(seed).shuffle(rest)
        out.append((recipe, [default, *rest]))
    return out


def next_round(spaces, results: dict[str, float | None], size: int) -> list[tuple[object, dict]]:
    """The next settings to measure, given ``results`` (candidate id: ms, None where it failed):
    every recipe's default first; then up to ``size`` settings nearest (fewest knobs changed) the
    fastest measured setting of their recipe, the recipes within NEAR of the fastest overall first,
    ties in the shuffle's order. The defaults are measured heuristics and the spaces run to
    thousands of settings: a random dozen found nothing faster than the default, and half of them
    went to the recipe that lost by 2-5x at its default."""
    defaults = [(r, settings[0]) for r, settings in spaces if candidate_id(r.name, settings[0]) not in results]
    if defaults:
        return defaults
    ms = {n: {i: results.get(candidate_id(r.name, k)) for i, k in enumerate(settings)} for n, (r, settings) in enumerate(spaces)}
    fastest = min((t for m in ms.values() for t in m.values() if t is not None), default=None)
    ranked = []
    for n, (recipe, settings) in enumerate(spaces):
        timed = [(t, i) for i, t in ms[n].items() if t is not None]
        best_ms, centre = min(timed, default=(None, 0))
        far = best_ms is None or best_ms > NEAR * fastest
        ranked += [((far, _distance(k, settings[centre]), i, n), recipe, k) for i, k in enumerate(settings)
                   if candidate_id(recipe.name, k) not in results]
    return [(recipe, k) for _, recipe, k in sorted(ranked, key=lambda c: c[0])[:size]]


def _distance(a: dict, b: dict) -> int:
    return sum(a.get(n) != b.get(n) for n in {*a, *b})


def _inputs(cell, steps, batch, dtype, rng):
    from .frames import numpy_dtype

    cast = numpy_dtype(dtype)
    x = rng.standard_normal((steps, batch, cell.input_size)).astype(cast)
    params = {k: v.astype(cast) for k, v in cell.init_parameters(seed=int(rng.integers(1 << 31))).items()}
    states = {s: (0.5 * rng.standard_normal((batch, cell.hidden_size))).astype(cast) for s in cell.states}
    return x, params, states


def _print(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
