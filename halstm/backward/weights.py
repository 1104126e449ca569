"""weights: the weight gradients as GEMMs over all T*B rows, and x's through the hoisted GEMMs."""

from __future__ import annotations

import functools
import math
import operator

import tvm
from tvm import te

from ..autodiff import adjoints
from ..cell import placeholders
from ..layout import ACCUMULATE, PackedLayout, packed_gemm
from ..lowering import (Program, Skeleton, padded_rows, prim_func_of, stored_as,
                        trace_hoisted, view_script, zero_past)
from ..plan import Plan
from ..runtime import Arg
from .common import (
    any_steps,
    between_dtype,
    hoisted_rows_at,
    numel,
    or_zeros,
    over_all_rows,
    pack_right,
    param_args,
    sequence_arg,
    steps_args,
    transposed_weights,
    weight_operand,
    x_in_step_args,
)
from .plan import BackwardPlan


def lower_weights(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout, kept: list[str],
             shared: dict) -> Program:
    """``shared``: by GEMM, the GEMM whose result's adjoint rows wrote for it (``rows._rows_step``)."""
    cell, forward = plan.cell, plan.forward
    shapes = cell.parameters()
    args = [*steps_args(T), sequence_arg("x", T, B, 0, cell.input_size, dtype, "x"), *param_args(cell, dtype)]
    between = between_dtype(plan, dtype)
    stored = [g for g in forward.gemms if shared[g.name] == g.name]
    args += [sequence_arg(f"d{g.name}_seq", T, B, 0, g.rows, between, "buffer") for g in stored]
    args += [sequence_arg(f"a_{g.name}_seq", T, B, 0, g.depth, between, "buffer") for g in plan.stored_operands]
    args += [sequence_arg(f"{s}_seq", T, B, 1, cell.hidden_size, dtype, "seq") for s in _operand_states(plan)]
    args += [Arg(f"d{p}_sum", (1, numel(shapes[p])), ACCUMULATE, "buffer") for p in kept]
    args += x_in_step_args(forward, T, B)
    args += [sequence_arg("dx", T, B, 0, cell.input_size, dtype, "output")]
    args += [Arg(f"d{p}", tuple(shape), dtype, "output") for p, shape in shapes.items()]
    # where T is any, the weight gradients' K (the rows) padded as the hoisted GEMMs' rows, and the
    # hoisted GEMMs' transposed weights the prologue's alone (``_weights_prologue``)
    k_rows = hoisted_rows_at(T, B)[1] if any_steps(T) else T * B
    allocs = [] if any_steps(T) else [f'w_packed_t{i} = T.alloc_buffer({layout.shape(g.rows, g.depth)}, "{dtype}")'
                                 for i, g in enumerate(forward.gemms) if g.stage == 0]
    allocs += [f'w_packed_a{i} = T.alloc_buffer(({", ".join(map(str, layout.shape(k_rows, g.depth)))}), "{between}")'
               for i, g in enumerate(forward.gemms)]
    allocs += [f'd{g.name}_transposed = T.alloc_buffer(({g.rows}, {k_rows}), "{between}")' for g in stored]
    views = []
    if any_steps(T):  # the hoisted GEMMs' operand adjoints over padded rows, in the prologue (``_weights_prologue``)
        allocs += [f'grad_a_{g.name} = T.alloc_buffer(({hoisted_rows_at(T, B)[1]}, {g.depth}), "{ACCUMULATE}")'
                   for g in forward.hoisted]
        views += [view_script(f"grad_a_{g.name}_t", f"grad_a_{g.name}", "0", T * B, g.depth, ACCUMULATE)
                  for g in forward.hoisted]
    frame = Skeleton(args, allocs, [], views, _weights_prologue(plan, T, B, dtype, layout, shared))
    step = _weights_step(plan, T, B, dtype, layout, kept, shared)
    return over_all_rows(plan.weights_plan(), T, B, dtype, layout, frame, step)  # one step of T*B rows


def _weights_prologue(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout,
                      shared: dict) -> tvm.tirx.PrimFunc:
    """Every GEMM's operand over all rows and the hoisted GEMMs' weights, packed; where T is any, the
    operands and the results' adjoints over the rows padded to a multiple of ROW_QUANTUM (the weight
    gradients' K: ``_k_rows``) and the hoisted GEMMs' dA."""
    cell, forward, between = plan.cell, plan.forward, between_dtype(plan, dtype)
    x, states, params = placeholders(cell, T * B, dtype)
    stored_operands = {g.name: te.placeholder((T * B, g.depth), between, name=f"a_{g.name}_seq")
                       for g in plan.stored_operands}
    seqs = {s: te.placeholder(((T + 1) * B, cell.hidden_size), dtype, name=f"{s}_seq") for s in _operand_states(plan)}
    state_operands = {g: _rows_of(seqs[s], T * B, between, f"a_{g}") for g, s in plan.state_operands.items()}
    operands = {**trace_hoisted(forward, x, states, params, layout).operands, **stored_operands, **state_operands}
    transposed = {g.name: transposed_weights(g, params, layout, f"w_packed_t{i}", plan.tf32)
                  for i, g in enumerate(forward.gemms) if g.stage == 0}
    d_results = _adjoints_stored(forward, T * B, between, shared)
    stored = _distinct(d_results)
    if not any_steps(T):
        outputs = list(transposed.values())
        outputs += [
            pack_right(lambda k, n, a=operands[g.name]: weight_operand(plan, dtype, a[k, n]), T * B, g.depth, layout,
                  f"w_packed_a{i}")
            for i, g in enumerate(forward.gemms)
        ]
        outputs += [_transpose(d) for d in stored]
    else:
        # the weight gradients' K, T*B rows, padded to a multiple of ROW_QUANTUM (``_k_rows``), both operands
        # zeros past T*B (0 * garbage can be NaN): a K tile of up to that many rows then divides it
        k_rows = _k_rows(T, B)
        outputs = [
            pack_right(lambda k, n, a=operands[g.name]: zero_past(k, T * B, lambda: weight_operand(plan, dtype, a[k, n])),
                  k_rows, g.depth, layout, f"w_packed_a{i}")
            for i, g in enumerate(forward.gemms)
        ]
        outputs += [_transpose(d, k_rows) for d in stored]
        # where T is any, the hoisted GEMMs' dA = dG W here, over their rows padded as the forward's
        # (``lowering.hoisted_rows``, dG read as zeros past its rows; the step reads the rows themselves):
        # a register tile then divides them whatever B, where over n_steps * B rows B=1 left one-row
        # tiles (LSTM (100,1,256), CPU: the weights function 1.37 ms against 0.90 at fixed T)
        rows = hoisted_rows_at(T, B)[0]
        outputs += [packed_gemm(padded_rows(d_results[g.name], rows, f"d{g.name}_padded"), transposed[g.name], layout,
                                g.depth, f"grad_a_{g.name}") for g in forward.hoisted]
    inputs = [x, *params.values(), *stored_operands.values(), *seqs.values(), *stored]
    return prim_func_of(inputs, outputs, [t.op.name for t in inputs + outputs])


def _rows_of(seq: te.Tensor, rows, dtype: str, name: str) -> te.Tensor:
    """The first ``rows`` rows of a state sequence (its steps before the last), as ``dtype``."""
    return te.compute((rows, seq.shape[1]), lambda r, k: seq[r, k].astype(dtype), name=name)


def _operand_states(plan: BackwardPlan) -> list[str]:
    """The states whose sequences weights reads as recurrent GEMMs' operands, in the cell's order."""
    return [s for s in plan.cell.states if s in plan.state_operands.values()]


def _weights_step(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout, kept: list[str], shared: dict):
    """dW = dG^T A per GEMM; dA = dG W per hoisted GEMM, on to x and the parameters."""
    cell, forward, rows, between = plan.cell, plan.forward, T * B, between_dtype(plan, dtype)
    x, states, params = placeholders(cell, rows, dtype)
    hoisted = trace_hoisted(forward, x, states, params, layout)
    d_results = _adjoints_stored(forward, rows, between, shared)
    k_rows = _k_rows(T, B)
    packed = {
        g.name: te.placeholder(layout.shape(k_rows, g.depth), between, name=f"w_packed_a{i}")
        for i, g in enumerate(forward.gemms)
    }
    transposed = {  # where T is any, the prologue's alone
        g.name: te.placeholder(layout.shape(g.rows, g.depth), dtype, name=f"w_packed_t{i}")
        for i, g in enumerate(forward.gemms)
        if g.stage == 0 and not any_steps(T)
    }
    d_steps = {p: te.placeholder((1, numel(params[p].shape)), ACCUMULATE, name=f"d{p}_sum") for p in kept}
    d_x_steps = [te.placeholder((rows, cell.input_size), ACCUMULATE, name="dx_seq")] if forward.x_in_step else []

    if any_steps(T):  # computed by the prologue
        d_operands = [te.placeholder((rows, g.depth), ACCUMULATE, name=f"grad_a_{g.name}_t") for g in forward.hoisted]
    else:
        d_operands = [packed_gemm(d_results[g.name], transposed[g.name], layout, g.depth, f"grad_a_{g.name}")
                      for g in forward.hoisted]
    dx, *found = adjoints([hoisted.operands[g.name] for g in forward.hoisted], d_operands, [x, *params.values()])
    by_row = {g.name: te.placeholder((g.rows, k_rows), between, name=f"d{g.name}_transposed")
              for g in forward.gemms if shared[g.name] == g.name}
    by_row = {g.name: by_row[shared[g.name]] for g in forward.gemms}
    d_weights = {
        g.name: _weight_gemm(by_row[g.name], packed[g.name], layout, g.depth, f"grad_w_{g.name}")
        for g in forward.gemms
    }
    if d_x_steps:  # the steps' own reads of x, besides the hoisted GEMMs'
        outputs = [_total(([] if dx is None else [dx]) + d_x_steps, x.shape, dtype, "dx")]
    else:
        outputs = [stored_as(or_zeros(dx, x), dtype, "dx")]
    for (name, p), d in zip(params.items(), found):
        terms = [] if d is None else [d]
        terms += [_from_row(d_weights[g.name], g.offset(m)) for g in forward.gemms for m in g.members if m.weight == name]
        if name in kept:
            terms.append(_unflattened(d_steps[name], p.shape))
        outputs.append(_total(terms, p.shape, dtype, f"d{name}"))
    inputs = [x, *params.values(), *_distinct(d_results), *packed.values(), *transposed.values(), *d_steps.values(),
              *d_x_steps, *_distinct(by_row), *(d_operands if any_steps(T) else [])]
    return prim_func_of(inputs, outputs, [t.op.name for t in inputs + outputs])


def _adjoints_stored(forward: Plan, rows, dtype: str, shared: dict) -> dict:
    """By GEMM, the buffer of its result's adjoint that rows wrote (``d<g>_seq``; shared ones one
    placeholder)."""
    own = {g.name: te.placeholder((rows, g.rows), dtype, name=f"d{g.name}_seq")
           for g in forward.gemms if shared[g.name] == g.name}
    return {g.name: own[shared[g.name]] for g in forward.gemms}


def _distinct(tensors: dict) -> list:
    return list({t.op.name: t for t in tensors.values()}.values())


def _weight_gemm(operand: te.Tensor, packed: te.Tensor, layout: PackedLayout, rows: int, name: str) -> te.Tensor:
    """A weight gradient's GEMM (``layout.packed_gemm``), its K the T*B rows: symbolic where T is any."""
    depth = operand.shape[1]
    if isinstance(depth, tvm.tirx.IntImm):
        return packed_gemm(operand, packed, layout, rows, name)
    k = te.reduce_axis((0, depth), name="k")
    return te.compute(
        (operand.shape[0], rows),
        lambda b, n: te.sum(operand[b, k].astype(ACCUMULATE) * layout.load(packed, k, n).astype(ACCUMULATE), axis=k),
        name=name,
    )


def _from_row(t: te.Tensor, start: int):
    """Rows start.. of t, as a function of the indices (a matmul's weights in its GEMM's dW)."""
    return lambda n, k: t[n + start, k]


def _transpose(t: te.Tensor, rows=None) -> te.Tensor:
    """t transposed; with ``rows``, over that many of its rows, zeros past its own."""
    name = f"{t.op.name.removesuffix('_seq')}_transposed"
    if rows is None:
        return te.compute((t.shape[1], t.shape[0]), lambda n, r: t[r, n], name=name)
    return te.compute((t.shape[1], rows), lambda n, r: zero_past(r, t.shape[0], lambda: t(r, n)), name=name)


def _k_rows(T, B: int):
    """The weight gradients' K: T*B, or where T is any, T*B padded as the hoisted GEMMs' rows."""
    return hoisted_rows_at(T, B)[0] if any_steps(T) else T * B


def _unflattened(flat: te.Tensor, shape) -> te.Tensor:
    """A (1, numel) row in ``shape``, row-major."""
    strides = [math.prod(int(d) for d in shape[d + 1:]) for d in range(len(shape))]
    return lambda *i: flat[0, sum(v * s for v, s in zip(i, strides))]


def _total(terms: list, shape, dtype: str, name: str) -> te.Tensor:
    """The sum of the terms (tensors or functions of the indices) in ``dtype``; zero without terms."""

    def at(*i):
        total = functools.reduce(operator.add, (t(*i) for t in terms)) if terms else tvm.tirx.const(0, ACCUMULATE)
        return total.astype(dtype)

    return te.compute(shape, at, name=name)
