"""A schedule recipe of one's own: GEMMs parallel over batch rows, on the CPU.

The built-in CPU recipe (``halstm.schedules.CpuStepLoop``) splits each GEMM into tasks over column
strips x row tiles. This one gives each task whole rows: a task owns ``rows`` rows of the result
and walks every column strip of them, so the cores split the batch and each streams all of the
weights. It compiles an LSTM (or a GRU) with it, prints what it did (the rewrites of ``sch.trace``),
checks the result against the float64 reference and times it against the built-in recipe.

    python examples/my_recipe.py                                  # small shapes, a few seconds
    python examples/my_recipe.py --steps 100 --batch 64 --hidden 512 --input 512 --repeat 10
    python examples/my_recipe.py --tune 8         # the tuner races its knobs against the built-in's

docs/writing-a-recipe.md walks through it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
import tvm
from tvm.s_tir import Schedule

import halstm
from halstm import targets
from halstm.layout import PackedLayout
from halstm.schedules import CpuStepLoop, Recipe
from halstm.schedules.cpu import parallel_rows
from halstm.schedules.recipe import child_blocks, inline_elementwise, merge_next_states


class CpuBatchRows(Recipe):
    """Each GEMM as tasks of ``rows`` whole rows: per task, column strip by column strip, a
    ``rows`` x (``vectors`` SIMD vectors) accumulator tile over K. The elementwise math as the
    built-in recipe schedules it: fused, rows across cores, hidden units in SIMD lanes."""

    name = "cpu-batch-rows"
    knobs = {"rows": (2, 1, 4, 8), "vectors": (2, 1, 4)}  # the first value of each is the default

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cpu"

    def layout(self, program, target, knobs) -> PackedLayout:
        # weights in strips as wide as the tile: a strip's K x cols weights are contiguous
        return PackedLayout(tile=knobs["vectors"] * target.lanes)

    def valid(self, program, target, knobs) -> bool:
        # the accumulators, one row of weights and one broadcast operand must fit the SIMD registers
        registers = 32 if target.lanes == 16 else 16
        return knobs["rows"] * knobs["vectors"] + knobs["vectors"] + 1 < registers

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        sch = Schedule(program.mod)
        for scope in ("prologue", "step"):  # the lowering's two scope blocks
            inline_elementwise(sch, sch.get_sblock(scope))
            gemms, others = child_blocks(sch, scope, program)
            for gemm in gemms:
                row_tasks(sch, gemm, k["rows"], k["vectors"] * target.lanes)
            for block in merge_next_states(sch, sch.get_sblock(scope), others):
                parallel_rows(sch, block, target.lanes)
        return sch


def row_tasks(sch: Schedule, block, rows: int, cols: int) -> None:
    """A GEMM block (loops b, n, k) as: parallel over row tiles; in each, column strip after
    column strip, a rows x cols tile accumulated in registers over k."""
    b, n, k = sch.get_loops(block)
    b_outer, b_inner = sch.split(b, [None, rows])
    n_outer, n_inner = sch.split(n, [None, cols])
    sch.reorder(b_outer, n_outer, k, b_inner, n_inner)
    acc = sch.cache_write(block, 0, "local")  # the tile, which LLVM keeps in registers
    sch.reverse_compute_at(acc, n_outer)
    sch.parallel(b_outer)
    sch.unroll(b_inner)
    sch.vectorize(n_inner)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(block, k)


LOOKUPS = ("get_child_blocks", "get_consumers", "get_producers", "get_loops")


def rewrites(trace) -> list[str]:
    """The lines of a schedule's trace that change the program, under the scope block they work in
    (looked up by name); the other lookups left out, a run of ``compute_inline``s on one line."""
    out, scope, inlined = [], None, 0
    for line in str(trace).splitlines()[2:]:  # after the header, 'def apply_trace(sch): ...'
        line = line.strip()
        if "sch.compute_inline(" in line:
            inlined += 1
            continue
        if any(f"sch.{lookup}(" in line for lookup in LOOKUPS):
            continue
        if inlined:
            out.append(f"  sch.compute_inline(...) x {inlined}  (the elementwise blocks fused)")
            inlined = 0
        if "sch.get_sblock(" in line:
            name = line.split('name="')[1].split('"')[0]
            if name != scope:
                out.append(f"in {name}:")
            scope = name
        else:
            out.append("  " + line)
    return out


def loop_nest(sch: Schedule, block: str) -> str:
    """The loops around a block, outermost first: name, kind (unless serial) and extent."""
    kinds = {0: "", 1: "parallel ", 2: "vectorized ", 3: "unrolled "}  # tvm.tirx.ForKind
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock(block))]
    return " > ".join(f"{loop.loop_var.name} {kinds.get(int(loop.kind), '')}({loop.extent})" for loop in loops)


def replayed(program, schedule: Schedule) -> tvm.IRModule:
    """The program scheduled again by replaying ``schedule``'s trace on a fresh schedule."""
    fresh = Schedule(program.mod)
    schedule.trace.apply_to_schedule(fresh, remove_postproc=False)
    return fresh.mod


def median_ms(calls: dict, repeat: int, warmup: int = 2) -> dict[str, float]:
    """Each call's median ms, the calls made in turn so that other load falls on all alike."""
    times = {name: [] for name in calls}
    for i in range(warmup + repeat):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if i >= warmup:
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cell", default="LSTM", choices=("LSTM", "GRU"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=20, help="timed calls of each (after 2 warm-up calls)")
    parser.add_argument("--tune", type=int, default=0, metavar="TRIALS",
                        help="then tune: this many candidates of this recipe and the built-in one")
    parser.add_argument("--database", help="the tuning records (--tune; default: a temporary file)")
    args = parser.parse_args(argv)

    cell = getattr(halstm, args.cell)(input_size=args.input, hidden_size=args.hidden)
    T, B = args.steps, args.batch
    target = targets.resolve("cpu")
    recipe = CpuBatchRows()
    program = halstm.lower(cell, T, B)
    print(f"{cell!r}, T={T}, B={B}, on {target.key} ({target.lanes} float32 lanes)")
    print(f"recipe '{recipe.name}': applicable {recipe.is_applicable(program, target)}, "
          f"default knobs {recipe.defaults(program, target)}, {len(recipe.space(program, target))} valid settings")

    f = halstm.compile(cell, T, B, recipe=recipe)  # a Recipe object; its default knobs
    print(f"compiled: {f!r}")
    print("what the recipe did (f.schedule.trace: its rewrites, the lookups left out):")
    for line in rewrites(f.schedule.trace):
        print("   ", line)
    gemm = f.plan.step_gemms[0].name
    print(f"the step's GEMM {gemm} after it: {loop_nest(f.schedule, gemm + '_update')}")
    tvm.ir.assert_structural_equal(replayed(f.program, f.schedule), f.schedule.mod)
    print("structural check: replaying the trace gives the same module")

    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, B, cell.input_size)).astype(np.float32)
    params = cell.init_parameters(seed=1)
    states = {s: (0.5 * rng.standard_normal((B, cell.hidden_size))).astype(np.float32) for s in cell.states}
    y, final = f(x, params, states)
    y_ref, final_ref = halstm.reference(cell, x, params, states)
    error = max(rel_err(y, y_ref), *(rel_err(final[s], final_ref[s]) for s in cell.states))
    assert error < 1e-5, error
    print(f"relative error against float64: {error:.2e}")

    builtin = halstm.compile(cell, T, B, recipe="cpu-step-loop")
    # prepare: the arguments checked and converted once, so that the calls time the kernels
    ms = median_ms({"mine": f.prepare(x, params, states), "builtin": builtin.prepare(x, params, states)}, args.repeat)
    print(f"median of {args.repeat} calls: {recipe.name} {ms['mine']:.3f} ms, {builtin.recipe.name} "
          f"{ms['builtin']:.3f} ms ({recipe.name} {ms['builtin'] / ms['mine']:.2f}x the built-in's speed)")
    if args.tune:
        tune(cell, T, B, recipe, args.tune, args.database)


def tune(cell, T: int, B: int, recipe: Recipe, trials: int, database: str | None) -> None:
    """Measure ``trials`` candidates of ``recipe`` and the built-in CPU recipe (each checked against
    float64 and timed in a worker process), then compile the fastest. ``halstm.compile`` looks up
    the built-in recipes' records by itself, not a recipe of one's own: it is passed with its knobs."""
    with tempfile.TemporaryDirectory(prefix="my-recipe-") as folder:
        db = database or os.path.join(folder, "tuning.jsonl")
        best = halstm.tune(cell, T, B, recipes=[recipe, CpuStepLoop()], database=db, trials=trials)
        if best is None:
            print("tuning: every candidate failed")
            return
        chosen = recipe if best.recipe == recipe.name else best.recipe  # an object, or a built-in's name
        f = halstm.compile(cell, T, B, recipe=chosen, knobs=best.knobs)
        print(f"tuned: {best.recipe} {best.knobs} {best.ms:.3f} ms; compiled: {f!r}")


if __name__ == "__main__":
    main()
