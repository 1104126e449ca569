"""Backward through time, lowered like the forward.

Given the forward's state sequences and the gradient of a loss with respect to each state at each
step (``g<s>_seq``, (T+1)*B rows, the initial state first, as the forward stores them), four
functions compute the gradients with respect to x, every parameter and the initial states:

  prepare   over all T*B rows, no recurrence: the hoisted and first-stage GEMMs recomputed from x
            and the stored states, and with the states and the gradients written, the steps
            reversed, as the input of the adjoint cell (``halstm.adjoint``); its initial states
            (the final states' gradients) and its weights (the recurrent ones, transposed).
  adjoint   the reversed time loop: ``AdjointCell``, a cell compiled as any forward is (the
            persistent kernel, tensor cores, the tuner), for T + 1 steps; its states hold the
            adjoints D_{t+1} of the states after each step, the last one D_0.
  rows      over all T*B rows, no recurrence: the forward step differentiated from D_{t+1}, as
            ``halstm.autodiff`` derives it from the step's expressions, where a recurrent GEMM
            G = A W^T passes dA = dG W: each GEMM result's adjoint dG, each recurrent GEMM's operand
            A, the elementwise parameters' adjoints and, where the step's math reads x itself
            (``Plan.x_in_step``: a residual ``+ x``, a highway), the adjoint of that read.
  weights   per GEMM dW = dG^T A; per hoisted GEMM dA = dG W, then back through the hoisted
            operand's expression to x and the parameters; dx is the hoisted GEMMs' part plus the
            steps' own.

With ``steps=None`` the functions serve any T: their first argument is T (``runtime.STEPS``), the rows
of every buffer that grows with T follow it, and the reversed loop is compiled for any T (called for
T + 1 steps).

The buffers between the functions are float32, but for the adjoint cell's (in the storage dtype, as
any cell's) and the weight gradients' GEMM operands (in the storage dtype, on tensor cores: ``_between``);
gradients come out in the storage dtype.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, replace

import tvm
import tvm_ffi
from tvm import te

from .adjoint import AdjointCell, zeros
from .autodiff import adjoints, derive, rebuild
from .cell import Cell, placeholders, upstream
from .lowering import (
    ACCUMULATE,
    INT32_ELEMENTS,
    NOMINAL_STEPS,
    ROW_QUANTUM,
    PackedLayout,
    Program,
    Skeleton,
    _body,
    _gemm,
    _padded,
    _prim_func,
    _storage,
    _view,
    hoisted_rows,
    indent,
    stacked,
    steps_var,
    tf32_big,
    trace_hoisted,
    trace_step,
    zero_past,
)
from .plan import Gemm, Plan, make_plan
from .runtime import STEPS, Arg
from .scratch import dimension_of


@dataclass(frozen=True)
class GradGemm:
    """A GEMM of the backward: ``name = left @ right``, giving ``gives``; ``rows`` is its result's
    width and ``depth`` its K, as for a forward ``Gemm``: an operand's adjoint sums over the forward
    GEMM's N; a weight's adjoint over the sequence's T * B rows, which the plan does not know (0)."""

    name: str
    left: str
    right: str
    gives: str
    rows: int
    depth: int

    def __str__(self):
        return f"{self.name} = {self.left} @ {self.right} -> {self.gives}"


@dataclass
class BackwardPlan:
    """The forward's plan and the GEMMs the backward adds to it; ``gathered``: the form of the
    adjoint cell's operand GEMMs (``AdjointCell``); ``exact_weights``: see ``_between``."""

    forward: Plan
    gathered: bool = True
    exact_weights: bool = False  # the weight gradients' GEMM operands in float32 whatever the dtype
    tf32: bool = False  # those operands rounded to TF32 (``_operand``)
    given_hoisted: bool = False  # the hoisted GEMMs' results are arguments: the forward's, kept
    given_results: bool = False  # so are the first stage's (``lowering.kept_results``)

    @property
    def cell(self) -> Cell:
        return self.forward.cell

    @property
    def recurrent(self) -> list[Gemm]:
        return [g for g in self.forward.gemms if g.stage > 0]

    @functools.cached_property
    def state_operands(self) -> dict[str, str]:
        """Recurrent GEMMs whose operand is a state as it is (LSTM's and GRU's h), by name: that
        state. weights reads its sequence; rows stores the other recurrent GEMMs' operands
        (``a_<gemm>_seq``)."""
        step = trace_step(self.forward, 1, "float32", PackedLayout(), autodiff=True)
        names = {t.op: s for s, t in zip(self.cell.states, step.states)}
        return {g.name: names[step.operands[g.name].op] for g in self.recurrent if step.operands[g.name].op in names}

    @property
    def stored_operands(self) -> list[Gemm]:
        """The recurrent GEMMs whose operands rows stores for weights (``state_operands``' aside)."""
        return [g for g in self.recurrent if g.name not in self.state_operands]

    @property
    def rows_operands(self) -> list[Gemm]:
        """The recurrent GEMMs whose operands' adjoints the rows function computes: the later stages'
        (they pass adjoints on to earlier results), and the first stage's where the operand reads x
        or a parameter (its adjoint into the states is the reversed loop's)."""
        return [g for g in self.recurrent
                if g.stage > 1 or any(isinstance(op, te.PlaceholderOp) and op.name not in self.cell.states
                                      for op in upstream(g.operand))]

    @property
    def each_step(self) -> list[GradGemm]:
        return [_operand_adjoint(g) for g in self.rows_operands]

    @property
    def after_loop(self) -> list[GradGemm]:
        return [_weight_adjoint(g) for g in self.forward.gemms] + [_operand_adjoint(g) for g in self.forward.hoisted]

    @functools.cached_property
    def adjoint(self) -> AdjointCell:
        return AdjointCell(self.forward, self.gathered)

    def prepare_plan(self) -> Plan:
        """The prepare function's GEMMs: the hoisted ones in its prologue (unless given), the first
        stage's in its step."""
        hoisted = [] if self.given_hoisted else self.forward.hoisted
        return Plan(self.cell, self.forward.matmuls, hoisted, [] if self.given_results else self.forward.stages[:1])

    def rows_plan(self) -> Plan:
        """The rows function's GEMMs as recipes read a plan: the forward's later stages and the
        operands' adjoints in its step (the hoisted and first-stage GEMMs' results it reads from the
        reversed loop's input)."""
        return Plan(self.cell, self.forward.matmuls, [], [*self.forward.stages[1:], self.each_step],
                    self.forward.x_in_step)

    def weights_plan(self) -> Plan:
        """The weights function's GEMMs, all in its step."""
        return Plan(self.cell, [], [], [self.after_loop])

    def __str__(self):
        given = [g for g in self.forward.gemms
                 if g.stage == 0 and self.given_hoisted or g.stage == 1 and self.given_results]
        recomputed = ", ".join(g.name for g in self.forward.gemms if g.stage <= 1 and g not in given)
        given = ", ".join(g.name for g in given)
        read = ", ".join(g.name for g in self.forward.gemms if g.stage <= 1 and g.name not in self.adjoint.summed)
        lines = [f"backward plan for {self.cell!r}",
                 "  prepare, over all T*B rows: " + (f"{given} given (the forward's); " if given else "")
                 + (f"{recomputed} recomputed; " if recomputed else "") + "the adjoint cell's input, steps reversed"
                 + "".join(f" ({h} + {g} as one sum)" for h, g in self.adjoint.summed.items()),
                 "  the reversed time loop (T + 1 steps), compiled as a cell: "
                 + str(make_plan(self.adjoint)).replace("\n", "\n  "),
                 f"  rows, over all T*B rows: {read} read from the adjoint cell's input"
                 + (", the later stages' GEMMs recomputed" if len(self.forward.stages) > 1 else "")
                 + "; the step's adjoints from D_{t+1}"
                 + (", with" if self.each_step else "")]
        lines += [f"    {g}" for g in self.each_step]
        if self.forward.x_in_step:
            lines.append("    d x_t, the adjoint of the step's own read of x -> dx_seq")
        lines.append("  weights, over all T*B rows:")
        lines += [f"    {g}" for g in self.after_loop]
        if self.forward.x_in_step:
            lines.append("    d x += dx_seq (the steps' own reads of x)")
        return "\n".join(lines)


def _weights_of(g: Gemm) -> str:
    return "[" + " | ".join(m.weight for m in g.members) + "]"


def _operand_adjoint(g: Gemm) -> GradGemm:
    return GradGemm(f"grad_a_{g.name}", f"d{g.name}", _weights_of(g), f"d {g.operand.op.name}", g.depth, g.rows)


def _weight_adjoint(g: Gemm) -> GradGemm:
    return GradGemm(f"grad_w_{g.name}", f"d{g.name}^T", g.operand.op.name, f"d {_weights_of(g)}", g.depth, 0)


@dataclass
class BackwardProgram:
    """The lowered functions, called in order (the adjoint cell compiled as a forward between
    prepare and rows); they share buffers by name."""

    plan: BackwardPlan
    prepare: Program
    rows: Program
    weights: Program
    steps: int | None  # None: any sequence length (the functions' ``STEPS``, T read off each call)
    batch: int
    dtype: str

    @property
    def adjoint(self) -> AdjointCell:
        return self.plan.adjoint

    @property
    def allow_tf32(self) -> bool:
        return self.prepare.allow_tf32

    @property
    def functions(self) -> dict[str, Program]:
        return {"prepare": self.prepare, "rows": self.rows, "weights": self.weights}

    @property
    def args(self) -> list[Arg]:
        """Every buffer of the three functions once, in order of first use."""
        seen = {}
        for a in self.prepare.args + self.rows.args + self.weights.args:
            seen.setdefault(a.name, a)
        return list(seen.values())

    @property
    def longest(self) -> int:
        """The longest sequence the functions take: T, or where they serve any, the longest whose
        buffers int32 indexing reaches: the arguments' and those the functions allocate over all rows,
        as wide as arguments but for their columns padded to whole strips (rounded up to 64 here) and
        their rows to ``ROW_QUANTUM``."""
        if self.steps is not None:
            return self.steps
        return min((INT32_ELEMENTS // (-(-a.shape[1] // 64) * 64) - ROW_QUANTUM) // a.shape[0] - a.extra_steps
                   for a in self.args if a.extra_steps is not None)


def lower_backward(
    cell: Cell,
    steps: int | None,
    batch: int,
    dtype: str = "float32",
    plan: Plan | None = None,
    layout: PackedLayout | None = None,
    gathered: bool = True,
    exact_weights: bool = False,
    allow_tf32: bool = False,
    given_hoisted: bool = False,
    given_results: bool = False,
) -> BackwardProgram:
    """The backward of ``lower(cell, steps, batch, dtype, plan, layout)`` (unscheduled). Its weights
    are packed in ``layout``'s strips, (K, N) otherwise, the gates' columns in order: columns grouped
    by units (a fused step epilogue's layout) would be gathers that autodiff cannot differentiate,
    and the backward packs its own weights, so it needs neither that grouping nor the forward's
    float32 split (``tf32x3``): exact float32 stays on FFMA here. The forward's (N, K) layout
    (``k_major``) is kept with ``allow_tf32``: TF32 wgmma reads no other (on WMMA instead, the weight
    gradients' GEMMs of LSTM (100,64,1024) took 0.9 ms each on an H100). ``gathered``:
    the reversed loop's operand GEMM one a first-stage GEMM, else one a gate (``AdjointCell``);
    ``exact_weights``: the weight gradients' GEMMs on float32 operands (``_between``);
    ``allow_tf32``: float32 GEMMs may run on tensor cores as TF32 (``halstm.compile``'s);
    ``given_hoisted``: prepare takes the hoisted GEMMs' results as arguments (the forward's, rows as
    ``lowering.hoisted_rows``) instead of computing them again; ``given_results``: the first stage's
    too (a forward lowered with ``keep_results``: ``lowering.kept_results``' buffers).
    ``steps=None``: for any T, each function's rows in its first argument ``STEPS`` (``n_steps``)."""
    k_major = bool(layout and layout.k_major and allow_tf32)
    backward = BackwardPlan(plan or make_plan(cell), gathered, exact_weights, k_major and dtype == "float32",
                            given_hoisted, given_results)
    layout = PackedLayout(tile=layout.tile, k_major=k_major) if layout else PackedLayout()
    T = steps_var(steps)
    prepare = _prepare(backward, T, batch, dtype, layout)
    rows, kept, shared = _rows(backward, T, batch, dtype, layout)
    weights = _weights(backward, T, batch, dtype, layout, kept, shared)
    prepare, rows, weights = (replace(p, allow_tf32=allow_tf32) for p in (prepare, rows, weights))
    return BackwardProgram(backward, prepare, rows, weights, steps, batch, dtype)


def _numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def _param_args(cell: Cell, dtype: str) -> list[Arg]:
    return [Arg(n, tuple(shape), dtype, "param") for n, shape in cell.parameters().items()]


def _any(T) -> bool:
    """Whether T is the symbolic ``STEPS`` (a function for any T), not a number."""
    return not isinstance(T, int)


def _sequence(name: str, T, B: int, extra_steps: int, cols: int, dtype: str, role: str) -> Arg:
    """A buffer of B rows a step over T + ``extra_steps`` steps (``Arg.sequence``)."""
    return Arg.sequence(name, None if _any(T) else T, B, extra_steps, cols, dtype, role)


def _steps_args(T) -> list[Arg]:
    """The argument that is T, first, where the function serves any."""
    return [Arg(STEPS, (), "int32", "steps")] if _any(T) else []


def _x_in_step_args(forward: Plan, T, B: int) -> list[Arg]:
    """``dx_seq``, the adjoint of the steps' own reads of x (``Plan.x_in_step``), where there are any."""
    return [_sequence("dx_seq", T, B, 0, forward.cell.input_size, ACCUMULATE, "buffer")] if forward.x_in_step else []


def _function(plan: Plan, T, B: int, dtype, layout, frame: Skeleton, loop: str) -> Program:
    """One step over all T*B rows; where T is any, the rows that choices are made for are
    ``NOMINAL_STEPS`` * B (the function's own follow ``STEPS``)."""
    rows = NOMINAL_STEPS * B if _any(T) else T * B
    return Program(plan.cell, plan, 1, rows, dtype, layout, frame.source(loop), frame.args)


def _one_step(frame: Skeleton, body: tvm.tirx.PrimFunc) -> str:
    """A function's "step" block run once, with the frame's views."""
    return f"""    with T.sblock("step"):
{indent(frame.step_views, 8)}
{indent([_body(body)], 8)}"""


def _reversed_row(r, T, B: int):
    """The row of step T - 1 - r // B, batch row r % B: the steps' order reversed (T a number or
    the symbolic ``STEPS``)."""
    return (T - 1 - r // B) * B + r % B


# --- prepare: the adjoint's input -----------------------------------------------------------------

def _prepare(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> Program:
    cell, forward, H, adjoint = plan.cell, plan.forward, plan.cell.hidden_size, plan.adjoint
    first = [(i, g) for i, g in enumerate(forward.gemms) if g.stage == 1]
    args = [*_steps_args(T), _sequence("x", T, B, 0, cell.input_size, dtype, "x"), *_param_args(cell, dtype)]
    args += [_sequence(f"{s}_seq", T, B, 1, H, dtype, "seq") for s in cell.states]
    args += [_sequence(f"g{s}_seq", T, B, 1, H, dtype, "grad") for s in cell.states]
    args += [_sequence("adjoint_x", T, B, 1, adjoint.input_size, dtype, "buffer")]
    args += [Arg(n, tuple(shape), dtype, "buffer") for n, shape in adjoint.parameters().items()
             if n not in cell.parameters()]
    rows = _hoisted_rows(T, B)[1]  # where T is any, padded as the forward's (``_prepare_prologue``)
    padded = dimension_of(_hoisted_rows(T, B)[0], T, "hoisted") if _any(T) else T * B
    if plan.given_hoisted:
        args += [Arg(g.name, (padded, g.rows), ACCUMULATE, "hoisted") for g in forward.hoisted]
        allocs = []
    else:
        allocs = [f'{g.name} = T.alloc_buffer(({rows}, {g.rows}), "{ACCUMULATE}")' for g in forward.hoisted]
    if plan.given_results:
        args += [Arg(f"{g.name}_steps", (padded, g.rows), ACCUMULATE, "hoisted") for _, g in first]
    else:
        allocs += [f'w_packed{i} = T.alloc_buffer({layout.shape(g.depth, g.rows)}, "{dtype}")' for i, g in first]
    prologue = [_body(_prepare_prologue(plan, T, B, dtype, layout))]
    views = [_view(f"{g.name}_t", g.name, "0", T * B, g.rows, ACCUMULATE) for g in forward.hoisted]
    if plan.given_results:
        views += [_view(f"{g.name}_given", f"{g.name}_steps", "0", T * B, g.rows, ACCUMULATE) for _, g in first]
    views += [_view("x_t", "x", "0", T * B, cell.input_size, dtype)] if forward.x_in_step else []
    views += [_view(f"{s}_t", f"{s}_seq", "0", T * B, H, dtype) for s in cell.states]
    views += [_view(f"{s}_after", f"{s}_seq", str(B), T * B, H, dtype) for s in cell.states] if adjoint.reads_next else []
    views += [_view(f"g{s}_t", f"g{s}_seq", "0", T * B, H, dtype) for s in cell.states]
    frame = Skeleton(args, allocs, prologue, views)
    return _function(plan.prepare_plan(), T, B, dtype, layout, frame, _one_step(frame, _prepare_step(plan, T, B, dtype, layout)))


def _prepare_prologue(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tvm.tirx.PrimFunc:
    """The hoisted GEMMs over all rows (where T is any, over the rows padded as the forward pads
    them: ``lowering.hoisted_rows``) unless given, the first stage's weights packed, the adjoint's
    weights."""
    cell, forward, adjoint = plan.cell, plan.forward, plan.adjoint
    x, states, params = placeholders(cell, T * B, dtype)
    hoisted = trace_hoisted(forward, _padded(x, _hoisted_rows(T, B)[0]) if _any(T) else x, states, params, layout)
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
    return _prim_func(inputs, outputs, [t.op.name for t in inputs + outputs])


def _prepare_step(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tvm.tirx.PrimFunc:
    """The adjoint's input: per row of the reversed steps, its columns (``AdjointCell.columns``) from
    the forward's values at that step; one step more, zeros but for the initial states where the
    adjoint reads the states after a step."""
    cell, forward, H, adjoint = plan.cell, plan.forward, plan.cell.hidden_size, plan.adjoint
    # where T is any, the first stage's GEMMs over the rows padded as the hoisted GEMMs' (``hoisted_rows``):
    # a GEMM tile then divides them (over n_steps * B rows its tiles' shared stages had symbolic sizes)
    given = {g.name: te.placeholder((T * B, g.rows), ACCUMULATE, name=f"{g.name}_given")
             for g in forward.gemms if g.stage == 1 and plan.given_results}
    step = trace_step(forward, T * B, dtype, layout, given=given, rows=_hoisted_rows(T, B)[0] if _any(T) else None)
    after = [te.placeholder((T * B, H), dtype, name=f"{s}_after") for s in cell.states] if adjoint.reads_next else []
    grads = [te.placeholder((T * B, H), dtype, name=f"g{s}_t") for s in cell.states]
    source = {g.name: step.x_proj[g.name] for g in forward.hoisted}
    source |= {g.name: step.gemms[g.name] for g in forward.gemms if g.stage == 1}
    source |= dict(zip(cell.states, step.states)) | {f"{s}_next": a for s, a in zip(cell.states, after)}
    source |= {f"g{s}": g for s, g in zip(cell.states, grads)}
    if forward.x_in_step:
        source["x"] = step.x
    rows = T * B
    padded = {g.name for g in forward.gemms if g.stage == 1 and g.name not in given} if _any(T) else set()

    def at(r, j):  # lazy selects: TVM simplifies a read's index under the conditions that select it
        row, zero = _reversed_row(r, T, B), te.const(0, ACCUMULATE)
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
    return _prim_func(inputs, [xa], [t.op.name for t in inputs + [xa]])


# --- rows: the step's adjoints over all rows ------------------------------------------------------

def _rows(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tuple[Program, list[str], dict]:
    """The step differentiated over all T*B rows at once from D_{t+1}, the parameters whose
    adjoints it keeps, and the GEMM whose result's adjoint each GEMM's is (``_rows_step``)."""
    cell, forward, H = plan.cell, plan.forward, plan.cell.hidden_size
    step, kept, loop_seqs, shared = _rows_step(plan, T, B, dtype, layout)
    stored = [g for g in forward.gemms if shared[g.name] == g.name]
    recurrent = [(i, g) for i, g in enumerate(forward.gemms) if g.stage > 0]
    args = [*_steps_args(T), _sequence("x", T, B, 0, cell.input_size, dtype, "x"), *_param_args(cell, dtype)]
    args += [_sequence(f"{s}_seq", T, B, 1, H, dtype, "seq") for s in cell.states]
    args += [_sequence("adjoint_x", T, B, 1, plan.adjoint.input_size, dtype, "buffer")]  # prepare's
    args += [_sequence(f"d{s}_seq", T, B, 2, H, dtype, "buffer") for s in cell.states]  # the adjoint's
    args += [_sequence(name, T, B, 2, H, dtype, "buffer") for name in loop_seqs]  # the adjoint's too
    between = _between(plan, dtype)
    args += [_sequence(f"d{g.name}_seq", T, B, 0, g.rows, between, "buffer") for g in stored]
    args += [_sequence(f"a_{g.name}_seq", T, B, 0, g.depth, between, "buffer") for g in plan.stored_operands]
    args += [Arg(f"d{p}_sum", (1, _numel(cell.parameters()[p])), ACCUMULATE, "buffer") for p in kept]
    args += _x_in_step_args(forward, T, B)
    operands = plan.rows_operands
    allocs = [f'w_packed{i} = T.alloc_buffer({layout.shape(g.depth, g.rows)}, "{dtype}")'
              for i, g in recurrent if g.stage > 1]
    allocs += [f'w_packed_t{i} = T.alloc_buffer({layout.shape(g.rows, g.depth)}, "{dtype}")'
               for i, g in recurrent if g in operands]
    before = _rows_prologue(plan, T, B, dtype, layout)
    prologue = [_body(before) if before is not None else "T.evaluate(0)"]
    views = []
    if forward.x_in_step:
        views += [_view("x_t", "x", "0", T * B, cell.input_size, dtype),
                  _view("dx_t", "dx_seq", "0", T * B, cell.input_size, ACCUMULATE)]
    views += [_view(f"{s}_t", f"{s}_seq", "0", T * B, H, dtype) for s in cell.states]
    views += [_view(f"d{g.name}_t", f"d{g.name}_seq", "0", T * B, g.rows, between) for g in stored]
    views += [_view(f"a_{g.name}_t", f"a_{g.name}_seq", "0", T * B, g.depth, between) for g in plan.stored_operands]
    views += [_view(f"d{p}_t", f"d{p}_sum", "0", 1, _numel(cell.parameters()[p]), ACCUMULATE) for p in kept]
    frame = Skeleton(args, allocs, prologue, views)
    return _function(plan.rows_plan(), T, B, dtype, layout, frame, _one_step(frame, step)), kept, shared


def _rows_prologue(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout) -> tvm.tirx.PrimFunc | None:
    """The later stages' weights packed, and transposed those of the GEMMs whose operands' adjoints
    the step computes (None: nothing to do)."""
    cell, forward, operands = plan.cell, plan.forward, plan.rows_operands
    x, states, params = placeholders(cell, T * B, dtype)
    hoisted = trace_hoisted(forward, x, states, params, layout)
    outputs = [hoisted.packed[g.name] for g in forward.gemms if g.stage > 1]
    outputs += [_transposed(g, params, layout, f"w_packed_t{i}") for i, g in enumerate(forward.gemms) if g in operands]
    if not outputs:
        return None
    inputs = [x, *params.values()]
    return _prim_func(inputs, outputs, [t.op.name for t in inputs + outputs])


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
        return te.compute((rows, g.rows), lambda r, n: adjoint_x[_reversed_row(r, T, B), start + n].astype(ACCUMULATE),
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
        return te.compute((rows, H), lambda r, j: d[_reversed_row(r, T, B) + B, j].astype(ACCUMULATE),
                          name=f"d{s}_next")

    d_next = [after_step(s, d) for s, d in zip(cell.states, adjoint_seqs)]

    def operand_rule(g: Gemm):
        def rule(d_result):
            return [(step.operands[g.name], _gemm(d_result, transposed[g.name], layout, g.depth, f"grad_a_{g.name}"))]
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
    outputs = [_stored_operand(plan, dtype, _or_zeros(d, r), f"d{g.name}_t")
               for g, r, d in zip(forward.gemms, results, d_results) if shared[g.name] == g.name]
    outputs += [_storage(step.operands[g.name], _between(plan, dtype), f"a_{g.name}_t") for g in plan.stored_operands]
    outputs += _parameter_rows(d_params, kept)
    outputs += [_storage(_or_zeros(d, x), ACCUMULATE, "dx_t") for x, d in zip(x_t, d_x_t)]
    inputs = [*step.inputs, adjoint_x, *transposed.values(), *adjoint_seqs, *loop_seqs]
    return (_prim_func(inputs, outputs, [t.op.name for t in inputs + outputs]), kept, [t.op.name for t in loop_seqs],
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
    row = _reversed_row(r, T, B) + B
    value = blocks[-1][row, n % H]
    for j in reversed(range(len(blocks) - 1)):
        value = tvm.tirx.if_then_else(n // H == j, blocks[j][row, n % H], value)
    return value.astype(ACCUMULATE)


# --- weights: all T*B rows at once ---------------------------------------------------------------

def _operand(plan: BackwardPlan, dtype: str, value):
    """A value of the weight gradients' GEMM operands as stored (``_between``: each dG as rows writes
    it, each operand as the weights function packs it); with ``plan.tf32``
    (TF32 on wgmma, the operands packed (N, K)) rounded to TF32, to nearest: wgmma reads float32
    truncated, and over a weight gradient's T*B rows truncation's bias added up (LSTM
    (20,16,256), H100: d weight_hh 1.1e-3 from float64, 6.0e-4 on WMMA, which rounds)."""
    value = value.astype(_between(plan, dtype))
    return tf32_big(value) if plan.tf32 else value


def _stored_operand(plan: BackwardPlan, dtype: str, t: te.Tensor, name: str) -> te.Tensor:
    return te.compute(t.shape, lambda *i: _operand(plan, dtype, t(*i)), name=name)


def _between(plan: BackwardPlan, dtype: str) -> str:
    """The dtype of what rows passes weights for its GEMMs (each result's adjoint dG, each recurrent
    operand): the storage dtype, so that fp16/bf16 GEMMs run on tensor cores, unless the plan asks
    for float32 (``exact_weights``). With float32 operands the weights function took 5.77 of the
    backward's 9.73 ms (H100, LSTM fp16 (100,64,1024), its functions timed apart with CUDA events);
    on tensor cores it has not been timed apart."""
    return ACCUMULATE if plan.exact_weights else dtype


def _weights(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout, kept: list[str],
             shared: dict) -> Program:
    """``shared``: by GEMM, the GEMM whose result's adjoint rows wrote for it (``_rows_step``)."""
    cell, forward = plan.cell, plan.forward
    shapes = cell.parameters()
    args = [*_steps_args(T), _sequence("x", T, B, 0, cell.input_size, dtype, "x"), *_param_args(cell, dtype)]
    between = _between(plan, dtype)
    stored = [g for g in forward.gemms if shared[g.name] == g.name]
    args += [_sequence(f"d{g.name}_seq", T, B, 0, g.rows, between, "buffer") for g in stored]
    args += [_sequence(f"a_{g.name}_seq", T, B, 0, g.depth, between, "buffer") for g in plan.stored_operands]
    args += [_sequence(f"{s}_seq", T, B, 1, cell.hidden_size, dtype, "seq") for s in _operand_states(plan)]
    args += [Arg(f"d{p}_sum", (1, _numel(shapes[p])), ACCUMULATE, "buffer") for p in kept]
    args += _x_in_step_args(forward, T, B)
    args += [_sequence("dx", T, B, 0, cell.input_size, dtype, "output")]
    args += [Arg(f"d{p}", tuple(shape), dtype, "output") for p, shape in shapes.items()]
    # where T is any, the weight gradients' K (the rows) padded as the hoisted GEMMs' rows, and the
    # hoisted GEMMs' transposed weights the prologue's alone (``_weights_prologue``)
    k_rows = _hoisted_rows(T, B)[1] if _any(T) else T * B
    allocs = [] if _any(T) else [f'w_packed_t{i} = T.alloc_buffer({layout.shape(g.rows, g.depth)}, "{dtype}")'
                                 for i, g in enumerate(forward.gemms) if g.stage == 0]
    allocs += [f'w_packed_a{i} = T.alloc_buffer(({", ".join(map(str, layout.shape(k_rows, g.depth)))}), "{between}")'
               for i, g in enumerate(forward.gemms)]
    allocs += [f'd{g.name}_transposed = T.alloc_buffer(({g.rows}, {k_rows}), "{between}")' for g in stored]
    views = []
    if _any(T):  # the hoisted GEMMs' operand adjoints over padded rows, in the prologue (``_weights_prologue``)
        allocs += [f'grad_a_{g.name} = T.alloc_buffer(({_hoisted_rows(T, B)[1]}, {g.depth}), "{ACCUMULATE}")'
                   for g in forward.hoisted]
        views += [_view(f"grad_a_{g.name}_t", f"grad_a_{g.name}", "0", T * B, g.depth, ACCUMULATE)
                  for g in forward.hoisted]
    prologue = [_body(_weights_prologue(plan, T, B, dtype, layout, shared))]
    frame = Skeleton(args, allocs, prologue, views)
    step = _weights_step(plan, T, B, dtype, layout, kept, shared)
    loop = _one_step(frame, step) if views else f"""    with T.sblock("step"):
{indent([_body(step)], 8)}"""
    return _function(plan.weights_plan(), T, B, dtype, layout, frame, loop)  # one step of T*B rows


def _weights_prologue(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout,
                      shared: dict) -> tvm.tirx.PrimFunc:
    """Every GEMM's operand over all rows and the hoisted GEMMs' weights, packed; where T is any, the
    operands and the results' adjoints over the rows padded to a multiple of ROW_QUANTUM (the weight
    gradients' K: ``_k_rows``) and the hoisted GEMMs' dA."""
    cell, forward, between = plan.cell, plan.forward, _between(plan, dtype)
    x, states, params = placeholders(cell, T * B, dtype)
    stored_operands = {g.name: te.placeholder((T * B, g.depth), between, name=f"a_{g.name}_seq")
                       for g in plan.stored_operands}
    seqs = {s: te.placeholder(((T + 1) * B, cell.hidden_size), dtype, name=f"{s}_seq") for s in _operand_states(plan)}
    state_operands = {g: _rows_of(seqs[s], T * B, between, f"a_{g}") for g, s in plan.state_operands.items()}
    operands = {**trace_hoisted(forward, x, states, params, layout).operands, **stored_operands, **state_operands}
    transposed = {g.name: _transposed(g, params, layout, f"w_packed_t{i}", plan.tf32)
                  for i, g in enumerate(forward.gemms) if g.stage == 0}
    d_results = _adjoints_stored(forward, T * B, between, shared)
    stored = _distinct(d_results)
    if not _any(T):
        outputs = list(transposed.values())
        outputs += [
            _pack(lambda k, n, a=operands[g.name]: _operand(plan, dtype, a[k, n]), T * B, g.depth, layout,
                  f"w_packed_a{i}")
            for i, g in enumerate(forward.gemms)
        ]
        outputs += [_transpose(d) for d in stored]
    else:
        # the weight gradients' K, T*B rows, padded to a multiple of ROW_QUANTUM (``_k_rows``), both operands
        # zeros past T*B (0 * garbage can be NaN): a K tile of up to that many rows then divides it
        k_rows = _k_rows(T, B)
        outputs = [
            _pack(lambda k, n, a=operands[g.name]: zero_past(k, T * B, lambda: _operand(plan, dtype, a[k, n])),
                  k_rows, g.depth, layout, f"w_packed_a{i}")
            for i, g in enumerate(forward.gemms)
        ]
        outputs += [_transpose(d, k_rows) for d in stored]
        # where T is any, the hoisted GEMMs' dA = dG W here, over their rows padded as the forward's
        # (``lowering.hoisted_rows``, dG read as zeros past its rows; the step reads the rows themselves):
        # a register tile then divides them whatever B, where over n_steps * B rows B=1 left one-row
        # tiles (LSTM (100,1,256), CPU: the weights function 1.37 ms against 0.90 at fixed T)
        rows = _hoisted_rows(T, B)[0]
        outputs += [_gemm(_padded(d_results[g.name], rows, f"d{g.name}_padded"), transposed[g.name], layout, g.depth,
                          f"grad_a_{g.name}") for g in forward.hoisted]
    inputs = [x, *params.values(), *stored_operands.values(), *seqs.values(), *stored]
    return _prim_func(inputs, outputs, [t.op.name for t in inputs + outputs])


def _rows_of(seq: te.Tensor, rows, dtype: str, name: str) -> te.Tensor:
    """The first ``rows`` rows of a state sequence (its steps before the last), as ``dtype``."""
    return te.compute((rows, seq.shape[1]), lambda r, k: seq[r, k].astype(dtype), name=name)


def _operand_states(plan: BackwardPlan) -> list[str]:
    """The states whose sequences weights reads as recurrent GEMMs' operands, in the cell's order."""
    return [s for s in plan.cell.states if s in plan.state_operands.values()]


def _weights_step(plan: BackwardPlan, T, B: int, dtype: str, layout: PackedLayout, kept: list[str], shared: dict):
    """dW = dG^T A per GEMM; dA = dG W per hoisted GEMM, on to x and the parameters."""
    cell, forward, rows, between = plan.cell, plan.forward, T * B, _between(plan, dtype)
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
        if g.stage == 0 and not _any(T)
    }
    d_steps = {p: te.placeholder((1, _numel(params[p].shape)), ACCUMULATE, name=f"d{p}_sum") for p in kept}
    d_x_steps = [te.placeholder((rows, cell.input_size), ACCUMULATE, name="dx_seq")] if forward.x_in_step else []

    if _any(T):  # computed by the prologue
        d_operands = [te.placeholder((rows, g.depth), ACCUMULATE, name=f"grad_a_{g.name}_t") for g in forward.hoisted]
    else:
        d_operands = [_gemm(d_results[g.name], transposed[g.name], layout, g.depth, f"grad_a_{g.name}")
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
        outputs = [_storage(_or_zeros(dx, x), dtype, "dx")]
    for (name, p), d in zip(params.items(), found):
        terms = [] if d is None else [d]
        terms += [_from_row(d_weights[g.name], g.offset(m)) for g in forward.gemms for m in g.members if m.weight == name]
        if name in kept:
            terms.append(_unflattened(d_steps[name], p.shape))
        outputs.append(_total(terms, p.shape, dtype, f"d{name}"))
    inputs = [x, *params.values(), *_distinct(d_results), *packed.values(), *transposed.values(), *d_steps.values(),
              *d_x_steps, *_distinct(by_row), *(d_operands if _any(T) else [])]
    return _prim_func(inputs, outputs, [t.op.name for t in inputs + outputs])


def _adjoints_stored(forward: Plan, rows, dtype: str, shared: dict) -> dict:
    """By GEMM, the buffer of its result's adjoint that rows wrote (``d<g>_seq``; shared ones one
    placeholder)."""
    own = {g.name: te.placeholder((rows, g.rows), dtype, name=f"d{g.name}_seq")
           for g in forward.gemms if shared[g.name] == g.name}
    return {g.name: own[shared[g.name]] for g in forward.gemms}


def _distinct(tensors: dict) -> list:
    return list({t.op.name: t for t in tensors.values()}.values())


def _hoisted_rows(T, B: int):
    """``lowering.hoisted_rows`` for T, a number or ``STEPS``: (the expression, its TVMScript)."""
    return hoisted_rows(None if _any(T) else T, B)


def _weight_gemm(operand: te.Tensor, packed: te.Tensor, layout: PackedLayout, rows: int, name: str) -> te.Tensor:
    """A weight gradient's GEMM (``lowering._gemm``), its K the T*B rows: symbolic where T is any."""
    depth = operand.shape[1]
    if isinstance(depth, tvm.tirx.IntImm):
        return _gemm(operand, packed, layout, rows, name)
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
    return _hoisted_rows(T, B)[0] if _any(T) else T * B


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


def _or_zeros(adjoint, like: te.Tensor) -> te.Tensor:
    if adjoint is not None:
        return adjoint
    return te.compute(like.shape, lambda *i: te.const(0, ACCUMULATE), name=f"d{like.op.name}_zero")


def _flat(t: te.Tensor, name: str) -> te.Tensor:
    """t as one row, (1, numel), in row-major order."""
    shape = [int(d) for d in t.shape]
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

    def at(_, j):
        return t(*((j // s) % n if d else j // s for d, (s, n) in enumerate(zip(strides, shape))))

    return te.compute((1, _numel(shape)), at, name=name)


def _pack(value, depth: int, cols: int, layout: PackedLayout, name: str) -> te.Tensor:
    """value(k, n), k < depth and n < cols, as a GEMM's right operand in ``layout`` (zero-padded)."""

    def at(*i):
        k, n = layout.unpack(*i)
        if layout.tile is None or cols % layout.tile == 0:
            return value(k, n)
        v = value(k, tvm.tirx.min(n, cols - 1))
        return tvm.tirx.if_then_else(n < cols, v, tvm.tirx.const(0, str(v.ty)))

    return te.compute(layout.shape(depth, cols), at, name=name)


def _transposed(g: Gemm, params, layout: PackedLayout, name: str, tf32: bool = False) -> te.Tensor:
    """A GEMM's stacked weights W (N, K), packed as the right operand of dA = dG W (``tf32``:
    rounded to TF32, as ``_operand``)."""
    def value(n, k):
        w = stacked(g, params, n, k)
        return tf32_big(w) if tf32 else w  # float32: plan.tf32's

    return _pack(value, g.rows, g.depth, layout, name)
