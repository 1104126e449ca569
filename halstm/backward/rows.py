"""rows: the forward step differentiated over all T*B rows from the reversed loop's D_{t+1}."""

from __future__ import annotations

import functools
import math

import tvm
import tvm_ffi
from tvm import te

from ..adjoint import zeros
from ..autodiff import adjoints, derive, rebuild
from ..cell import placeholders
from ..layout import ACCUMULATE, PackedLayout, packed_gemm
from ..lowering import (Program, Skeleton, prim_func_of, stored_as, trace_hoisted, trace_step,
                        view_script)
from ..plan import Gemm
from ..runtime import Arg
from .common import (
    between_dtype,
    numel,
    or_zeros,
    over_all_rows,
    param_args,
    reversed_row,
    sequence_arg,
    steps_args,
    stored_operand,
    transposed_weights,
    x_in_step_args,
)
from .plan import BackwardPlan


def lower_rows(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tuple[Program, list[str], dict]:
    """The step differentiated over all T*B rows at once from D_{t+1}, the parameters whose
    adjoints it keeps, and the GEMM whose result's adjoint each GEMM's is (``_rows_step``)."""
    cell, forward, H = plan.cell, plan.forward, plan.cell.hidden_size
    step, kept, loop_seqs, shared = _rows_step(plan, T, B, dtype, layout)
    stored = [g for g in forward.gemms if shared[g.name] == g.name]
    recurrent = [(i, g) for i, g in enumerate(forward.gemms) if g.stage > 0]
    args = [*steps_args(T), sequence_arg("x", T, B, 0, cell.input_size, dtype, "x"), *param_args(cell, dtype)]
    args += [sequence_arg(f"{s}_seq", T, B, 1, H, dtype, "seq") for s in cell.states]
    args += [sequence_arg("adjoint_x", T, B, 1, plan.adjoint.input_size, dtype, "buffer")]  # prepare's
    args += [sequence_arg(f"d{s}_seq", T, B, 2, H, dtype, "buffer") for s in cell.states]  # the adjoint's
    args += [sequence_arg(name, T, B, 2, H, dtype, "buffer") for name in loop_seqs]  # the adjoint's too
    between = between_dtype(plan, dtype)
    args += [sequence_arg(f"d{g.name}_seq", T, B, 0, g.rows, between, "buffer") for g in stored]
    args += [sequence_arg(f"a_{g.name}_seq", T, B, 0, g.depth, between, "buffer") for g in plan.stored_operands]
    args += [Arg(f"d{p}_sum", (1, numel(cell.parameters()[p])), ACCUMULATE, "buffer") for p in kept]
    args += x_in_step_args(forward, T, B)
    operands = plan.rows_operands
    allocs = [f'w_packed{i} = T.alloc_buffer({layout.shape(g.depth, g.rows)}, "{dtype}")'
              for i, g in recurrent if g.stage > 1]
    allocs += [f'w_packed_t{i} = T.alloc_buffer({layout.shape(g.rows, g.depth)}, "{dtype}")'
               for i, g in recurrent if g in operands]
    views = []
    if forward.x_in_step:
        views += [view_script("x_t", "x", "0", T * B, cell.input_size, dtype),
                  view_script("dx_t", "dx_seq", "0", T * B, cell.input_size, ACCUMULATE)]
    views += [view_script(f"{s}_t", f"{s}_seq", "0", T * B, H, dtype) for s in cell.states]
    views += [view_script(f"d{g.name}_t", f"d{g.name}_seq", "0", T * B, g.rows, between) for g in stored]
    views += [view_script(f"a_{g.name}_t", f"a_{g.name}_seq", "0", T * B, g.depth, between)
              for g in plan.stored_operands]
    views += [view_script(f"d{p}_t", f"d{p}_sum", "0", 1, numel(cell.parameters()[p]), ACCUMULATE) for p in kept]
    frame = Skeleton(args, allocs, [], views, _rows_prologue(plan, T, B, dtype, layout))
    return over_all_rows(plan.rows_plan(), T, B, dtype, layout, frame, step), kept, shared


def _rows_prologue(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tvm.tirx.PrimFunc | None:
    """The later stages' weights packed, and transposed those of the GEMMs whose operands' adjoints
    the step computes (None: nothing to do)."""
    cell, forward, operands = plan.cell, plan.forward, plan.rows_operands
    x, states, params = placeholders(cell, T * B, dtype)
    hoisted = trace_hoisted(forward, x, states, params, layout)
    outputs = [hoisted.packed[g.name] for g in forward.gemms if g.stage > 1]
    outputs += [transposed_weights(g, params, layout, f"w_packed_t{i}")
                for i, g in enumerate(forward.gemms) if g in operands]
    if not outputs:
        return None
    inputs = [x, *params.values()]
    return prim_func_of(inputs, outputs, [t.op.name for t in inputs + outputs])


def _rows_step(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tuple[tvm.tirx.PrimFunc, list, list, dict]:
    """The step over all T*B rows, differentiated from D_{t+1} (the adjoint's d<s> sequences, whose
    steps run reversed, one row block on: row block T - t), the parameters it keeps adjoints of, the
    reversed loop's sequences it reads (``_loop_adjoints``), and by GEMM the first GEMM whose result's
    adjoint it writes for that one (itself, but where two are one tensor).
    The hoisted and first-stage GEMMs' results are the columns prepare wrote for the adjoint cell
    (``adjoint_x``, in the storage dtype), not computed again; a hoisted result whose sum with a
    first-stage one those columns hold reads as zeros (``AdjointCell.summed``)."""
    cell, forward, H, rows, adjoint = plan.cell, plan.forward, plan.cell.hidden_size, T * B, plan.adjoint
    adjoint_x = te.placeholder(((T + 1) * B, adjoint.input_size), dtype, name="adjoint_x")

    def read(g: Gemm):  # its result at row r's step, from the reversed loop's input
        start = adjoint.where[g.name][0]
        return te.compute((rows, g.rows), lambda r, n: adjoint_x[reversed_row(r, T, B), start + n].astype(ACCUMULATE),
                          name=f"{g.name}_read")

    given = {g.name: zeros(rows, g.rows, f"{g.name}_summed") if g.name in adjoint.summed else read(g)
             for g in forward.gemms if g.stage <= 1}
    step = trace_step(forward, rows, dtype, layout, autodiff=True, given=given)
    transposed = {
        g.name: te.placeholder(layout.shape(g.rows, g.depth), dtype, name=f"w_packed_t{i}")
        for i, g in enumerate(forward.gemms)
        if g in plan.rows_operands
    }
    adjoint_seqs = [te.placeholder(((T + 2) * B, H), dtype, name=f"d{s}_seq") for s in cell.states]
    def after_step(s, d):  # D_{t+1} of row r's step t
        return te.compute((rows, H), lambda r, j: d[reversed_row(r, T, B) + B, j].astype(ACCUMULATE),
                          name=f"d{s}_next")

    d_next = [after_step(s, d) for s, d in zip(cell.states, adjoint_seqs)]

    def operand_rule(g: Gemm):
        def rule(d_result):
            d_operand = packed_gemm(d_result, transposed[g.name], layout, g.depth, f"grad_a_{g.name}")
            return [(step.operands[g.name], d_operand)]
        return rule

    rules = {step.gemms[g.name].op: operand_rule(g) for g in plan.rows_operands}
    results = [given[g.name] if g.name in given else step.gemms[g.name] for g in forward.gemms]
    x_t = [step.x] if step.x is not None else []  # the step's rows of x, where its math reads x itself
    wrt = [*results, *step.params.values(), *x_t]
    known, loop_seqs = _loop_adjoints(plan, T, B, dtype, derive(step.traced.next_states, d_next, wrt, rules), given)
    found = adjoints(step.traced.next_states, d_next, wrt, rules, known=known)
    d_x_t, found = (found[-1:], found[:-1]) if x_t else ([], found)
    d_results, d_params = found[: len(results)], dict(zip(step.params, found[len(results):]))
    kept = [p for p, d in d_params.items() if d is not None]

    # a GEMM result whose adjoint is an earlier one's (LSTM's hoisted and recurrent gates: both terms
    # of one sum) shares that one's buffer
    shared = {g.name: next(h.name for h, e in zip(forward.gemms, d_results) if h is g or _same(e, d))
              for g, d in zip(forward.gemms, d_results)}
    outputs = [stored_operand(plan, dtype, or_zeros(d, r), f"d{g.name}_t")
               for g, r, d in zip(forward.gemms, results, d_results) if shared[g.name] == g.name]
    outputs += [stored_as(step.operands[g.name], between_dtype(plan, dtype), f"a_{g.name}_t")
                for g in plan.stored_operands]
    outputs += _parameter_rows(d_params, kept)
    outputs += [stored_as(or_zeros(d, x), ACCUMULATE, "dx_t") for x, d in zip(x_t, d_x_t)]
    inputs = [*step.inputs, adjoint_x, *transposed.values(), *adjoint_seqs, *loop_seqs]
    return (prim_func_of(inputs, outputs, [t.op.name for t in inputs + outputs]), kept, [t.op.name for t in loop_seqs],
            shared)


def _same(a: te.Tensor | None, b: te.Tensor | None) -> bool:
    return a is not None and b is not None and a.same_as(b)


def _parameter_rows(d_params: dict, kept: list) -> list:
    """Each kept parameter's adjoint as one row (``d<p>_t``). One whose sum is another's over the same
    tensors (LSTM's two biases: each the gates' adjoint summed down the rows) reads that one's sum
    instead of summing again."""
    sums = {}
    for p in kept:
        sums[p] = next((sums[q] for q in sums if _equal_sums(sums[q], d_params[p])), d_params[p])
    return [_flat(sums[p], f"d{p}_t") for p in kept]


def _equal_sums(a: te.Tensor, b: te.Tensor) -> bool:
    """Whether a and b are one computation: the same tensor, or computed alike (shape and body) from
    inputs that are one computation in turn (float16 biases: each sum scaled by its cast's 1)."""
    if a.same_as(b):
        return True
    if not (isinstance(a.op, te.ComputeOp) and isinstance(b.op, te.ComputeOp)
            and tvm_ffi.structural_equal(list(a.shape), list(b.shape))
            and len(a.op.input_tensors) == len(b.op.input_tensors)
            and all(_equal_sums(x, y) for x, y in zip(a.op.input_tensors, b.op.input_tensors))):
        return False
    body = list(b.op.body)
    if not all(x.same_as(y) for x, y in zip(a.op.input_tensors, b.op.input_tensors)):
        inputs = {y.op: x for x, y in zip(a.op.input_tensors, b.op.input_tensors)}
        try:  # b's body reading a's inputs (TVM compares reads of one tensor, not of two alike)
            body = [rebuild(e, {}, lambda t: inputs.get(t.op, t)) for e in body]
        except NotImplementedError:  # a reduction over inputs of its own
            return False
    return tvm_ffi.structural_equal(list(a.op.body), body, map_free_vars=True)


def _loop_adjoints(plan: BackwardPlan, T, B: int, dtype: str, derived: dict, given: dict) -> tuple[dict, list]:
    """The adjoints the reversed loop stored, which rows takes instead of deriving them again: each
    first-stage GEMM result's (the loop's states d<g>_<j>, gate blocks side by side), for every op
    whose adjoint the derivation found to be that same tensor (LSTM's gates, a sum of that result and
    the hoisted GEMM's: then rows derives nothing from D_{t+1} and reads nothing of the adjoint
    cell's input). (known adjoints by op, the loop's sequences that they read)."""
    H, known, seqs = plan.cell.hidden_size, {}, []
    for g in plan.adjoint.first:
        d = derived.get(given[g.name].op)
        if d is None:
            continue
        blocks = [te.placeholder(((T + 2) * B, H), dtype, name=f"d{g.name}_{j}_seq") for j in range(g.rows // H)]
        seqs += blocks
        stored = te.compute((T * B, g.rows), functools.partial(_gate_blocks, blocks, T, B), name=f"d{g.name}_stored")
        known |= {op: stored for op, a in derived.items() if a.same_as(d)}
    return known, seqs


def _gate_blocks(blocks: list, T, B: int, r, n):
    """Column n of row r's step t from the loop's states, one a gate block of H columns: the loop's
    step T - 1 - t, stored one row block on."""
    H = int(blocks[0].shape[1])
    row = reversed_row(r, T, B) + B
    value = blocks[-1][row, n % H]
    for j in reversed(range(len(blocks) - 1)):
        value = tvm.tirx.if_then_else(n // H == j, blocks[j][row, n % H], value)
    return value.astype(ACCUMULATE)


def _flat(t: te.Tensor, name: str) -> te.Tensor:
    """t as one row, (1, numel), in row-major order."""
    shape = [int(d) for d in t.shape]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

    def at(_, j):
        return t(*((j // s) % n if d else j // s for d, (s, n) in enumerate(zip(strides, shape))))

    return te.compute((1, numel(shape)), at, name=name)
