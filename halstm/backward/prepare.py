"""prepare: the adjoint cell's input over all T*B rows, the steps reversed, and its weights."""

from __future__ import annotations

import functools
import operator

import tvm
from tvm import te

from ..cell import placeholders
from ..layout import ACCUMULATE, PackedLayout, stacked
from ..lowering import (Program, Skeleton, padded_rows, prim_func_of, trace_hoisted, trace_step,
                        view_script)
from ..runtime import Arg
from ..scratch import dimension_of
from .common import (
    any_steps,
    hoisted_rows_at,
    over_all_rows,
    param_args,
    reversed_row,
    sequence_arg,
    steps_args,
)
from .plan import BackwardPlan


def lower_prepare(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> Program:
    cell, forward, H, adjoint = plan.cell, plan.forward, plan.cell.hidden_size, plan.adjoint
    first = [(i, g) for i, g in enumerate(forward.gemms) if g.stage == 1]
    args = [*steps_args(T), sequence_arg("x", T, B, 0, cell.input_size, dtype, "x"), *param_args(cell, dtype)]
    args += [sequence_arg(f"{s}_seq", T, B, 1, H, dtype, "seq") for s in cell.states]
    args += [sequence_arg(f"g{s}_seq", T, B, 1, H, dtype, "grad") for s in cell.states]
    args += [sequence_arg("adjoint_x", T, B, 1, adjoint.input_size, dtype, "buffer")]
    args += [Arg(n, tuple(shape), dtype, "buffer") for n, shape in adjoint.parameters().items()
             if n not in cell.parameters()]
    rows = hoisted_rows_at(T, B)[1]  # where T is any, padded as the forward's (``_prepare_prologue``)
    padded = dimension_of(hoisted_rows_at(T, B)[0], T, "hoisted") if any_steps(T) else T * B
    if plan.given_hoisted:
        args += [Arg(g.name, (padded, g.rows), ACCUMULATE, "hoisted") for g in forward.hoisted]
        allocs = []
    else:
        allocs = [f'{g.name} = T.alloc_buffer(({rows}, {g.rows}), "{ACCUMULATE}")' for g in forward.hoisted]
    if plan.given_results:
        args += [Arg(f"{g.name}_steps", (padded, g.rows), ACCUMULATE, "hoisted") for _, g in first]
    else:
        allocs += [f'w_packed{i} = T.alloc_buffer({layout.shape(g.depth, g.rows)}, "{dtype}")' for i, g in first]
    views = [view_script(f"{g.name}_t", g.name, "0", T * B, g.rows, ACCUMULATE) for g in forward.hoisted]
    if plan.given_results:
        views += [view_script(f"{g.name}_given", f"{g.name}_steps", "0", T * B, g.rows, ACCUMULATE) for _, g in first]
    views += [view_script("x_t", "x", "0", T * B, cell.input_size, dtype)] if forward.x_in_step else []
    views += [view_script(f"{s}_t", f"{s}_seq", "0", T * B, H, dtype) for s in cell.states]
    if adjoint.reads_next:
        views += [view_script(f"{s}_after", f"{s}_seq", str(B), T * B, H, dtype) for s in cell.states]
    views += [view_script(f"g{s}_t", f"g{s}_seq", "0", T * B, H, dtype) for s in cell.states]
    frame = Skeleton(args, allocs, [], views, _prepare_prologue(plan, T, B, dtype, layout))
    return over_all_rows(plan.prepare_plan(), T, B, dtype, layout, frame, _prepare_step(plan, T, B, dtype, layout))


def _prepare_prologue(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tvm.tirx.PrimFunc:
    """The hoisted GEMMs over all rows (where T is any, over the rows padded as the forward pads
    them: ``lowering.hoisted_rows``) unless given, the first stage's weights packed, the adjoint's
    weights."""
    cell, forward, adjoint = plan.cell, plan.forward, plan.adjoint
    x, states, params = placeholders(cell, T * B, dtype)
    x_rows = padded_rows(x, hoisted_rows_at(T, B)[0]) if any_steps(T) else x
    hoisted = trace_hoisted(forward, x_rows, states, params, layout)
    outputs = [] if plan.given_hoisted else [hoisted.gemms[g.name] for g in forward.hoisted]
    if not plan.given_results:
        outputs += [hoisted.packed[g.name] for g in forward.gemms if g.stage == 1]
    first = adjoint.transposed()
    later = {f"{m.weight}_t": params[m.weight] for g in forward.gemms if g.stage > 1 for m in g.members}

    def transposed(name, shape):
        if name in first:
            g, start, _ = first[name]
            return te.compute(shape, lambda k, n: stacked(g, params, start + n, k), name=name)
        return te.compute(shape, lambda k, n: later[name][n, k], name=name)

    outputs += [transposed(n, shape) for n, shape in adjoint.parameters().items() if n in first or n in later]
    inputs = [x, *params.values()]
    return prim_func_of(inputs, outputs, [t.op.name for t in inputs + outputs])


def _prepare_step(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tvm.tirx.PrimFunc:
    """The adjoint's input: per row of the reversed steps, its columns (``AdjointCell.columns``) from
    the forward's values at that step; one step more, zeros but for the initial states where the
    adjoint reads the states after a step."""
    cell, forward, H, adjoint = plan.cell, plan.forward, plan.cell.hidden_size, plan.adjoint
    # where T is any, the first stage's GEMMs over the rows padded as the hoisted GEMMs' (``hoisted_rows``):
    # a GEMM tile then divides them (over n_steps * B rows its tiles' shared stages had symbolic sizes)
    given = {g.name: te.placeholder((T * B, g.rows), ACCUMULATE, name=f"{g.name}_given")
             for g in forward.gemms if g.stage == 1 and plan.given_results}
    step = trace_step(forward, T * B, dtype, layout, given=given,
                      rows=hoisted_rows_at(T, B)[0] if any_steps(T) else None)
    after = [te.placeholder((T * B, H), dtype, name=f"{s}_after") for s in cell.states] if adjoint.reads_next else []
    grads = [te.placeholder((T * B, H), dtype, name=f"g{s}_t") for s in cell.states]
    source = {g.name: step.x_proj[g.name] for g in forward.hoisted}
    source |= {g.name: step.gemms[g.name] for g in forward.gemms if g.stage == 1}
    source |= dict(zip(cell.states, step.states)) | {f"{s}_next": a for s, a in zip(cell.states, after)}
    source |= {f"g{s}": g for s, g in zip(cell.states, grads)}
    if forward.x_in_step:
        source["x"] = step.x
    rows = T * B
    padded = {g.name for g in forward.gemms if g.stage == 1 and g.name not in given} if any_steps(T) else set()

    def at(r, j):  # lazy selects: TVM simplifies a read's index under the conditions that select it
        row, zero = reversed_row(r, T, B), te.const(0, ACCUMULATE)
        value = zero
        for name, (start, width) in reversed(adjoint.where.items()):
            extra = zero  # the extra step's: zeros, but the initial states where the adjoint reads S_{t+1}
            if name.endswith("_next"):
                extra = step.states[cell.states.index(name[:-5])][r % B, j - start].astype(ACCUMULATE)
            # a GEMM over padded rows (T any) read at max(row, 0): its read region then spans the buffer,
            # where TVM 0.27 did not prove T*B rows within the padded ones (the scope was no stage pipeline)
            terms = [source[n][tvm.tirx.max(row, 0) if n in padded else row, j - start].astype(ACCUMULATE)
                     for n in adjoint.summed_into(name)]
            read = te.if_then_else(r < rows, functools.reduce(operator.add, terms), extra)
            value = te.if_then_else(j < start + width, read, value)
        return value.astype(dtype)

    xa = te.compute(((T + 1) * B, adjoint.input_size), at, name="adjoint_x")
    inputs = [*step.inputs, *given.values(), *after, *grads]
    return prim_func_of(inputs, [xa], [t.op.name for t in inputs + [xa]])
