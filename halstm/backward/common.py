"""What the backward's functions share: their arguments over T*B rows (T a number or ``STEPS``), the
reversed rows, one step over all rows, the dtype and packing of the weight gradients' GEMM operands."""

from __future__ import annotations

import math

import tvm
from tvm import te

from ..cell import Cell
from ..layout import ACCUMULATE, PackedLayout, stacked, tf32_big
from ..lowering import NOMINAL_STEPS, Program, Skeleton, hoisted_rows, indent, script_body
from ..splice import PART
from ..plan import Gemm, Plan
from ..runtime import STEPS, Arg
from .plan import BackwardPlan


def numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def param_args(cell: Cell, dtype: str) -> list[Arg]:
    return [Arg(n, tuple(shape), dtype, "param") for n, shape in cell.parameters().items()]


def any_steps(T) -> bool:
    """Whether T is the symbolic ``STEPS`` (a function for any T), not a number."""
    return not isinstance(T, int)


def sequence_arg(name: str, T, B: int, extra_steps: int, cols: int, dtype: str, role: str) -> Arg:
    """A buffer of B rows a step over T + ``extra_steps`` steps (``Arg.sequence``)."""
    return Arg.sequence(name, None if any_steps(T) else T, B, extra_steps, cols, dtype, role)


def steps_args(T) -> list[Arg]:
    """The argument that is T, first, where the function serves any."""
    return [Arg(STEPS, (), "int32", "steps")] if any_steps(T) else []


def x_in_step_args(forward: Plan, T, B: int) -> list[Arg]:
    """``dx_seq``, the adjoint of the steps' own reads of x (``Plan.x_in_step``), where there are any."""
    return [sequence_arg("dx_seq", T, B, 0, forward.cell.input_size, ACCUMULATE, "buffer")] if forward.x_in_step else []


def over_all_rows(plan: Plan, T, B: int, dtype, layout, frame: Skeleton, step: tvm.tirx.PrimFunc) -> Program:
    """The frame's function with ``step`` run once, over all T*B rows (its "step" block, the frame's
    views first); where T is any, the rows that choices are made for are ``NOMINAL_STEPS`` * B (the
    function's own follow ``STEPS``)."""
    rows = NOMINAL_STEPS * B if any_steps(T) else T * B
    return Program(plan.cell, plan, 1, rows, dtype, layout, source=frame.source(_one_step(frame, script_body(step))),
                   args=frame.args, shell=frame.shell(_one_step(frame, PART)), parts={**frame.parts, "step": step})


def _one_step(frame: Skeleton, body: str) -> str:
    return f"""    with T.sblock("step"):
{indent([*frame.step_views, body], 8)}"""


def reversed_row(r, T, B: int):
    """The row of step T - 1 - r // B, batch row r % B: the steps' order reversed (T a number or
    the symbolic ``STEPS``)."""
    return (T - 1 - r // B) * B + r % B


def hoisted_rows_at(T, B: int):
    """``lowering.hoisted_rows`` for T, a number or ``STEPS``: (the expression, its TVMScript)."""
    return hoisted_rows(None if any_steps(T) else T, B)


def between_dtype(plan: BackwardPlan, dtype: str) -> str:
    """The dtype of what rows passes weights for its GEMMs (each result's adjoint dG, each recurrent
    operand): the storage dtype, so that fp16/bf16 GEMMs run on tensor cores, unless the plan asks
    for float32 (``exact_weights``). With float32 operands the weights function took 5.77 of the
    backward's 9.73 ms (H100, LSTM fp16 (100,64,1024), its functions timed apart with CUDA events);
    on tensor cores it has not been timed apart."""
    return ACCUMULATE if plan.exact_weights else dtype


def weight_operand(plan: BackwardPlan, dtype: str, value):
    """A value of the weight gradients' GEMM operands as stored (``between_dtype``: each dG as rows writes
    it, each operand as the weights function packs it); with ``plan.tf32``
    (TF32 on wgmma, the operands packed (N, K)) rounded to TF32, to nearest: wgmma reads float32
    truncated, and over a weight gradient's T*B rows truncation's bias added up (LSTM
    (20,16,256), H100: d weight_hh 1.1e-3 from float64, 6.0e-4 on WMMA, which rounds)."""
    value = value.astype(between_dtype(plan, dtype))
    return tf32_big(value) if plan.tf32 else value


def stored_operand(plan: BackwardPlan, dtype: str, t: te.Tensor, name: str) -> te.Tensor:
    return te.compute(t.shape, lambda *i: weight_operand(plan, dtype, t(*i)), name=name)


def or_zeros(adjoint, like: te.Tensor) -> te.Tensor:
    if adjoint is not None:
        return adjoint
    return te.compute(like.shape, lambda *i: te.const(0, ACCUMULATE), name=f"d{like.op.name}_zero")


def pack_right(value, depth: int, cols: int, layout: PackedLayout, name: str) -> te.Tensor:
    """value(k, n), k < depth and n < cols, as a GEMM's right operand in ``layout`` (zero-padded)."""

    def at(*i):
        k, n = layout.unpack(*i)
        if layout.tile is None or cols % layout.tile == 0:
            return value(k, n)
        v = value(k, tvm.tirx.min(n, cols - 1))
        return tvm.tirx.if_then_else(n < cols, v, tvm.tirx.const(0, str(v.ty)))

    return te.compute(layout.shape(depth, cols), at, name=name)


def transposed_weights(g: Gemm, params, layout: PackedLayout, name: str, tf32: bool = False) -> te.Tensor:
    """A GEMM's stacked weights W (N, K), packed as the right operand of dA = dG W (``tf32``:
    rounded to TF32, as ``weight_operand``)."""
    def value(n, k):
        w = stacked(g, params, n, k)
        return tf32_big(w) if tf32 else w  # float32: plan.tf32's

    return pack_right(value, g.rows, g.depth, layout, name)
