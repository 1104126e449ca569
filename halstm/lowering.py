"""Lowering: a planned cell becomes one TensorIR function for the whole sequence.

``te.scan`` cannot be lowered in TVM 0.27, so the time loop is built here. The cell is traced twice
more, each time with a tracer that turns its matmuls into what the plan decided:

  prologue (batch T*B): the hoisted GEMMs over all steps, the recurrent weights packed (K, N), the
      initial states copied into row block 0 of each state sequence (a recipe whose kernel does the
      last two itself takes the hoisted GEMMs alone: ``skeleton(hoisted_only=True)``);
  step (batch B): per stage, the combined GEMM over the packed weights, and the elementwise math
      (which reads the step's rows of x too, ``x_t``, where the cell uses x outside a matmul).

Each trace becomes a PrimFunc through ``te.create_prim_func``; their bodies are placed, as TVMScript,
into one function whose ``for t`` loop holds an opaque ``step`` block. That block binds the step's
buffers to row blocks of the sequences with ``T.match_buffer``, so the blocks inside index only their
views and stay ordinary spatial/reduction blocks that every schedule primitive accepts.

All buffers are 2-D: x is (T*B, I), the sequence of each state s is ``s_seq`` ((T+1)*B, H) with the
initial state in rows 0..B-1 and the state after step t in rows (t+1)*B.., so that the next step reads
what the last one wrote without copies.

With ``steps=None`` T is the function's symbolic variable ``STEPS`` (``n_steps``): one function serves
every sequence length, its buffers' rows and its time loop following the x it is given.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import math
import textwrap
from dataclasses import dataclass
from typing import NamedTuple

import tvm
from tvm import te

from .cell import Cell, Params, Trace, placeholders, trace
from .layout import ACCUMULATE, PackedLayout, columns_of, packed_gemm, packed_weights, tf32_split
from .ops import plain_matmul
from .plan import Gemm, Plan, make_plan
from .runtime import STEPS, Arg
from .splice import PART, splice

NOMINAL_STEPS = 100  # the sequence length a function for any T makes its choices for (tiles, tuning records)


@functools.lru_cache(maxsize=16)
def parsed(source: str) -> tvm.tirx.PrimFunc:
    """TVMScript parsed, once a process for a source: parsing is most of lowering (0.16 of 0.17 s,
    LSTM H=512), and the tuner compiles many knob settings of one program; ``Program.mod`` gives
    each schedule a copy (docs/results.md#tuner-on-the-cpu: tuning on the CPU took 10.2-12.5 s against
    14.3-15.5 s parsing each candidate's program). The parser's check of well-formedness, which reads
    the source a second time, is left to tests/test_splice.py, over what the lowering writes: a
    parse without it took 0.78 s against 0.94 (LSTM's backward, I = 16, H = 32, the 2-core CPU)."""
    return tvm.script.from_source(source, check_well_formed=False)


_SPLICED: dict[str, tvm.tirx.PrimFunc] = {}  # by source, the most recent SPLICED_KEPT
SPLICED_KEPT = 16


def spliced(source: str, build) -> tvm.tirx.PrimFunc:
    """The function named ``source``, ``build()`` once a process (as ``parsed``)."""
    func = _SPLICED.pop(source, None)
    if func is None:
        func = build()
        while len(_SPLICED) >= SPLICED_KEPT:
            del _SPLICED[next(iter(_SPLICED))]
    _SPLICED[source] = func  # the most recent last
    return func


spliced.cache_clear = _SPLICED.clear  # as ``parsed``'s (functools.lru_cache)


def _math_view(t: te.Tensor) -> te.Tensor:
    """t in float32 for the cell's math: t itself when already float32, else a cast (inlined later)."""
    if t.dtype == ACCUMULATE:
        return t
    return te.compute(t.shape, lambda *i: t(*i).astype(ACCUMULATE), name=f"{t.op.name}_f32")


def stored_as(t: te.Tensor, dtype: str, name: str) -> te.Tensor:
    return te.compute(t.shape, lambda *i: t(*i).astype(dtype), name=name)


@dataclass
class Problem:
    """What a recipe, its knobs and a weight layout are chosen for before the program is lowered
    (``halstm.compile``): the cell, its plan, the sizes, the dtype and the options, and the step as
    IR (``step``); ``lowered`` lowers it for the layout chosen."""

    cell: Cell
    plan: Plan
    steps: int | None  # None: any sequence length (the function's variable ``STEPS``)
    batch: int
    dtype: str
    layout: PackedLayout = PackedLayout()
    allow_tf32: bool = False  # fp32 GEMMs may run on tensor cores as TF32 (operands to 10 mantissa bits)
    keeps_results: bool = False  # the first stage's GEMM results of every step stay (``kept_results``)

    def __getattr__(self, name: str):
        getter = getattr(type(self), name, None)
        if isinstance(getter, property):  # it raised AttributeError itself: that error, said as what it is
            try:
                return getter.fget(self)
            except AttributeError as error:
                raise RuntimeError(f"{type(self).__name__}.{name}: {error!r}") from error
        if name in _LOWERED:
            raise AttributeError(f"'{name}' is a lowered program's: a recipe's is_applicable, resolve, runs and "
                                 f"layout get the problem before it is lowered (halstm.lowering.Problem: the cell, "
                                 f"plan, sizes, dtype, options and the step as IR, problem.step)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @functools.cached_property
    def step(self) -> tvm.tirx.PrimFunc:
        """One step (``step_function``), which a recipe may read as IR without a whole program parsed."""
        return step_function(self.plan, self.batch, self.dtype, self.layout, self.keeps_results)

    def lowered(self, layout: PackedLayout, keep_results: bool = False) -> Program:
        """The program lowered with ``layout``: its step, where its step GEMMs' layouts are this
        problem's, the step already built."""
        same = keep_results == self.keeps_results and _step_layouts(self.plan, layout) == _step_layouts(
            self.plan, self.layout)
        return lower(self.cell, self.steps, self.batch, self.dtype, self.plan, layout, self.allow_tf32, keep_results,
                     self.step if same else None)

    @property
    def longest(self) -> int:
        """The longest sequence the function takes: its T, or ``max_steps`` where it serves any."""
        return self.steps or max_steps(self.plan, self.batch, self.layout)

    @property
    def nominal_steps(self) -> int:
        """The sequence length the function's choices are made for: its T, or ``NOMINAL_STEPS``
        where it serves any."""
        return self.steps or NOMINAL_STEPS


@dataclass(kw_only=True)
class Program(Problem):
    """The lowered, unscheduled function and what is needed to call it."""

    source: str  # the TVMScript of ``func``: what names it (cache keys, ``cell_hash``)
    args: list[Arg]
    shell: str | None = None  # where given, ``func`` is this text parsed, its blocks taking ``parts``' bodies
    parts: dict = dataclasses.field(default_factory=dict)  # block name -> function (``splice``)

    @property
    def kept(self) -> list[str]:
        """The scratch buffers a caller may keep after a call (``sequences_keeping``): the hoisted
        GEMMs' results and, with ``keeps_results``, the first stage's (``kept_results``)."""
        return [g.name for g in self.plan.hoisted] + (kept_results(self.plan) if self.keeps_results else [])

    @property
    def func(self) -> tvm.tirx.PrimFunc:
        """Built on first use, once a process for a source: its shell parsed and its parts spliced in
        (``spliced``), or its source parsed (``parsed``)."""
        if self.shell is None:
            return parsed(self.source)
        return spliced(self.source, lambda: splice(parsed(self.shell), self.parts))

    @property
    def mod(self) -> tvm.IRModule:
        """A module of its own copy of ``func``: a schedule made on it changed the blocks of the
        function it was given in place (TVM 0.27: a second ``recipe.apply`` of a backward's weights
        function then failed), 14-70 ms a copy."""
        return tvm.IRModule({"main": copy.deepcopy(self.func)})


_LOWERED = ("source", "args", "shell", "parts", "func", "mod", "kept")  # what a Program has and a Problem has not


def _step_layouts(plan: Plan, layout: PackedLayout) -> tuple:
    """The layouts of the step GEMMs' weights, which the step function reads."""
    return tuple(layout.of(g) for g in plan.gemms if g.stage > 0)


class _Tracer:
    """Answers each matmul call with a column slice of the GEMM the plan put it in."""

    def __init__(self, plan: Plan, gemm_result, layout: PackedLayout):
        self.plan, self.gemm_result, self.layout, self.calls = plan, gemm_result, layout, 0

    def matmul(self, a, weight):
        index, self.calls = self.calls, self.calls + 1
        if index >= len(self.plan.matmuls) or self.plan.matmuls[index].weight != weight.op.name:
            raise RuntimeError(
                f"{self.plan.cell.name}.step made different matmuls on a second trace: a cell's "
                "step must be a pure function of its arguments"
            )
        m = self.plan.matmuls[index]
        gemm = self.plan.gemm_of(index)
        result = self.gemm_result(gemm, a, weight)
        if result is None:  # not computed in this trace
            return plain_matmul(a, weight)
        return columns_of(result, gemm.offset(m), m.rows, f"{gemm.name}_{m.weight}", self.layout)


def script_body(func: tvm.tirx.PrimFunc) -> str:
    """The TVMScript of a function's body, without its signature."""
    lines = func.script().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("T.func_attr")) + 1
    return textwrap.dedent("\n".join(lines[start:]))


def prim_func_of(inputs, outputs, expected: list[str]) -> tvm.tirx.PrimFunc:
    func = te.create_prim_func(list(inputs) + list(outputs))
    names = [p.name for p in func.params]
    if names != expected:
        raise ValueError(
            f"a name in the cell clashes with one halstm reserves: expected buffers {expected}, "
            f"got {names}"
        )
    return func


def _cell_params(plan: Plan, params: Params) -> Params:
    """The parameters as the cell's math sees them: matmul weights stay in storage dtype (the GEMMs
    convert per element while accumulating), the others are float32 views."""
    weights = {m.weight for m in plan.matmuls}
    return Params({n: p if n in weights else _math_view(p) for n, p in params.items()})


def _trace_with(plan: Plan, x, state_views, params, gemm_result, layout: PackedLayout):
    """The cell traced on float32 views of x and the parameters, and the states' views given."""
    return trace(plan.cell, _math_view(x), state_views, _cell_params(plan, params), _Tracer(plan, gemm_result, layout))


@dataclass
class Hoisted:
    """A trace over all T*B rows: the hoisted GEMMs (results and operands) and every GEMM's packed
    weights, by GEMM name."""

    gemms: dict
    operands: dict
    packed: dict


def trace_hoisted(plan: Plan, x, states, params, layout: PackedLayout) -> Hoisted:
    packed = {g.name: packed_weights(g, params, layout.of(g), f"w_packed{i}") for i, g in enumerate(plan.gemms)}
    gemms, operands = {}, {}

    def gemm_result(gemm, a, _weight):
        if gemm.stage != 0:
            return None
        if gemm.name not in gemms:
            operand = tf32_split(a, f"{gemm.name}_operand") if layout.of(gemm).tf32x3 else a
            gemms[gemm.name] = packed_gemm(operand, packed[gemm.name], layout.of(gemm), gemm.rows, gemm.name)
            operands[gemm.name] = a
        return gemms[gemm.name]

    _trace_with(plan, x, [_math_view(s) for s in states], params, gemm_result, layout)
    return Hoisted(gemms, operands, packed)


def _first_rows(t: te.Tensor, rows, name: str) -> te.Tensor:
    """t's first ``rows`` rows."""
    return te.compute((rows, t.shape[1]), lambda r, n: t[r, n], name=name)


def zero_past(r, rows, value):
    """value() where row r < rows, else a zero of its dtype: a buffer read past its rows, as padding."""
    v = value()
    return te.if_then_else(r < rows, v, te.const(0, str(v.ty)))


def padded_rows(x: te.Tensor, rows, name: str = "x_padded") -> te.Tensor:
    """x with ``rows`` rows, zeros past its own (``x_padded``)."""
    return te.compute((rows, x.shape[1]), lambda r, k: zero_past(r, x.shape[0], lambda: x(r, k)), name=name)


def _prologue(plan: Plan, steps: int | None, batch: int, dtype: str, layout: PackedLayout,
              hoisted_only: bool) -> tvm.tirx.PrimFunc | None:
    """Hoisted GEMMs over all T*B rows; unless ``hoisted_only``, packed recurrent weights and initial
    states into the sequences."""
    cell = plan.cell
    x, _, params = placeholders(cell, steps_var(steps) * batch, dtype)
    rows = hoisted_rows(steps, batch)[0]
    states = [te.placeholder((rows, cell.hidden_size), dtype, name=s) for s in cell.states]
    inits = [te.placeholder((batch, cell.hidden_size), dtype, name=f"{s}0") for s in cell.states]
    hoisted = trace_hoisted(plan, x if steps is not None else padded_rows(x, rows), states, params, layout)
    outputs = [hoisted.gemms[g.name] for g in plan.hoisted]
    if not hoisted_only:
        outputs += [hoisted.packed[g.name] for g in plan.gemms if g.stage > 0]
        outputs += [stored_as(p, dtype, f"{s}_init") for s, p in zip(cell.states, inits)]
    if not outputs:  # hoisted_only, and x enters the step without a matmul
        return None
    inputs = [x, *inits, *params.values()]
    return prim_func_of(inputs, outputs, [t.op.name for t in inputs + outputs])


def step_function(plan: Plan, batch: int, dtype: str, layout: PackedLayout, keep_results: bool = False) -> tvm.tirx.PrimFunc:
    """One step, its buffers named as the step's views of the sequence function that ``lower``
    writes around it (``Program.step``, which recipes read without parsing the whole function):
    per stage the combined GEMM, then the elementwise math; with
    ``keep_results`` the first stage's GEMM results copied to views of their own too (``<gemm>_kept``;
    the GEMM writing such a view itself, the CPU recipe's register tile could not match it)."""
    step = trace_step(plan, batch, dtype, layout, split_k=True)
    nexts = [stored_as(t, dtype, f"{s}_next") for s, t in zip(plan.cell.states, step.traced.next_states)]
    kept = [_copy(step.gemms[g.name], f"{g.name}_kept") for g in plan.step_gemms if g.stage == 1] if keep_results else []
    return prim_func_of(step.inputs, kept + nexts, [t.op.name for t in step.inputs + kept + nexts])


def _copy(t: te.Tensor, name: str) -> te.Tensor:
    return te.compute(t.shape, lambda *i: t(*i), name=name)


def kept_results(plan: Plan) -> list[str]:
    """The buffers of the first stage's GEMM results over all steps that a function lowered with
    ``keep_results`` writes (``<gemm>_steps``: rows as the hoisted GEMMs' results, float32), which
    the backward reads instead of computing them again (``compile_backward(..., given_hoisted=True)``)."""
    return [f"{g.name}_steps" for g in plan.step_gemms if g.stage == 1]


@dataclass
class StepTrace:
    """One step traced on row-block views: its placeholders, the planned GEMMs of its stages (results
    and operands, by GEMM name) and the cell's math."""

    x_proj: dict
    states: list
    params: Params
    packed: dict
    gemms: dict
    operands: dict
    traced: Trace
    x: te.Tensor | None = None  # the step's rows of x, where its math reads x itself (Plan.x_in_step)

    @property
    def inputs(self) -> list:
        x = [self.x] if self.x is not None else []
        return [*self.x_proj.values(), *x, *self.states, *self.params.values(), *self.packed.values()]


def trace_step(plan: Plan, batch: int, dtype: str, layout: PackedLayout, autodiff: bool = False,
               given: dict | None = None, rows=None, split_k: bool = False) -> StepTrace:
    """The step traced. A GEMM operand that is a state's float32 view is copied from the state itself,
    in its own dtype (the GEMM widens it): an fp16 state's tile is then a plain copy, which the
    tensor-core GEMM fetches 16 bytes at a time with cp.async, where a cast to fp32 and back was a load
    and two conversions. With ``autodiff`` the operands read the views, the ops the adjoints flow
    through. ``given``: GEMM results by name that the step reads instead of computing them (tensors
    of (batch, rows) float32; their operands are still traced and recorded). ``rows``: the GEMMs it
    computes over that many rows, their operands read as zeros past ``batch`` (the backward's
    first-stage GEMMs over all T*B rows of a function for any T, padded as ``hoisted_rows``).
    ``split_k``: the GEMMs sum K in the layout's ``split_k`` slices (the step loop's step), where
    those divide it."""
    cell, given = plan.cell, given or {}
    _, _, params = placeholders(cell, batch, dtype)
    x = te.placeholder((batch, cell.input_size), dtype, name="x_t")
    states = [te.placeholder((batch, cell.hidden_size), dtype, name=f"{s}_t") for s in cell.states]
    x_proj = {g.name: te.placeholder((batch, g.rows), ACCUMULATE, name=f"{g.name}_t")
              for g in plan.hoisted if g.name not in given}
    packed = {
        g.name: te.placeholder(layout.of(g).shape(g.depth, g.rows), dtype, name=f"w_packed{i}")
        for i, g in enumerate(plan.gemms)
        if g.stage > 0 and g.name not in given
    }
    gemms, operands, seen = {}, {}, {}
    views = [_math_view(s) for s in states]
    viewed = {} if autodiff else {view.op: s for view, s in zip(views, states)}

    def gemm_result(gemm, a, _weight):
        if gemm.name in given:
            if gemm.stage > 0 and gemm.name not in gemms:
                gemms[gemm.name], operands[gemm.name] = given[gemm.name], a
            return given[gemm.name]
        if gemm.stage == 0:
            return x_proj[gemm.name]
        if gemm.name not in gemms:
            source = viewed.get(a.op, a)
            if rows is None:
                operand = _operand(source, gemm, layout.of(gemm))
            elif layout.of(gemm).tf32x3:
                operand = _operand(padded_rows(source, rows, f"{gemm.name}_padded"), gemm, layout.of(gemm))
            else:  # one block, the operand itself (a padding block apart failed to inline into its copy)
                operand = padded_rows(source, rows, f"{gemm.name}_operand")
            slices = layout.of(gemm).split_k if split_k else 1
            slices = slices if int(operand.shape[1]) % slices == 0 else 1
            gemms[gemm.name] = packed_gemm(operand, packed[gemm.name], layout.of(gemm), gemm.rows, gemm.name, slices)
            operands[gemm.name] = a
            if rows is not None:  # the step's math reads its own rows
                seen[gemm.name] = _first_rows(gemms[gemm.name], batch, f"{gemm.name}_rows")
        return seen.get(gemm.name, gemms[gemm.name])

    traced = _trace_with(plan, x, views, params, gemm_result, layout)
    return StepTrace(x_proj, states, params, packed, gemms, operands, traced, x if plan.x_in_step else None)


def _operand(a: te.Tensor, gemm: Gemm, layout: PackedLayout) -> te.Tensor:
    """A step GEMM's operand as its own block (``<gemm>_operand``), a copy recipes inline or keep
    (``tf32x3``: ``tf32_split``). A GPU recipe stages it in shared memory: a tile read straight from a
    state's row-block view would copy the view's symbolic offset with it (TVM 0.27's
    reindex/cache_read)."""
    name = f"{gemm.name}_operand"
    return tf32_split(a, name) if layout.tf32x3 else te.compute(a.shape, lambda b, k: a[b, k], name=name)


_STEPS_VAR = tvm.tirx.Var(STEPS, "int32")


def steps_var(steps: int | None):
    """T as lowering writes it into expressions: ``steps``, or the symbolic ``STEPS`` (one variable,
    which every expression of a function shares)."""
    return _STEPS_VAR if steps is None else steps


ROW_QUANTUM = 128  # a function for any T pads its hoisted GEMMs' T*B rows to a multiple of this


def hoisted_rows(steps: int | None, batch: int):
    """The rows of the hoisted GEMMs' results: T*B, or where T is any, T*B padded to a multiple of
    ``ROW_QUANTUM`` (x read as zeros past its rows): a GEMM tile of up to that many rows then divides
    them, where T*B rows would leave every tile's rows predicated. The expression, and its TVMScript."""
    if steps is not None:
        return steps * batch, str(steps * batch)
    q = ROW_QUANTUM
    expr = tvm.tirx.floordiv(steps_var(None) * batch + (q - 1), q) * q
    return expr, f"({STEPS} * {batch} + {q - 1}) // {q} * {q}"


def sequence_rows(steps: int | None, batch: int, ahead: int = 0):
    """The rows of a sequence buffer over ``steps`` (+ ``ahead``) steps of ``batch`` rows: a number,
    or TVMScript's text of it in ``STEPS`` where T is any."""
    if steps is not None:
        return (steps + ahead) * batch
    return f"({STEPS} + {ahead}) * {batch}" if ahead else f"{STEPS} * {batch}"


def view_script(name: str, buffer: str, row: str, rows: int, cols: int, dtype: str) -> str:
    return (f'{name} = T.match_buffer({buffer}[{row}:{row} + {rows}, 0:{cols}], ({rows}, {cols}), '
            f'"{dtype}", offset_factor=1)')


class StepView(NamedTuple):
    """Step t's rows of a sequence buffer: ``name`` is ``buffer[t * rows + ahead : ... + rows, 0:cols]``
    (``ahead`` rows on: a next state's rows). ``str()`` is its TVMScript declaration."""

    name: str
    buffer: str
    rows: int
    cols: int
    dtype: str
    ahead: int = 0

    def __str__(self) -> str:
        first = f"t * {self.rows}" + (f" + {self.ahead}" if self.ahead else "")
        return view_script(self.name, self.buffer, first, self.rows, self.cols, self.dtype)


@dataclass
class Skeleton:
    """A sequence function around its time loop: signature, buffers, the prologue (its views, then
    the body of ``prologue_func``), and the views one step works on. ``lower`` puts the step loop in
    it; a recipe that writes its own loop (the persistent kernel, with ``skeleton(hoisted_only=True)``)
    takes it as it is."""

    args: list[Arg]
    allocs: list[str]
    prologue: list[str]
    step_views: list[StepView | str]
    prologue_func: tvm.tirx.PrimFunc | None = None

    def source(self, loop: str, extra_allocs: list[str] = ()) -> str:
        """The function's TVMScript with ``loop`` (written at indentation 4) after the prologue, the
        prologue's body printed: the text that names the function (``Program.source``)."""
        body = script_body(self.prologue_func) if self.prologue_func is not None else PART
        return self._text(loop, extra_allocs, body)

    def shell(self, loop: str, extra_allocs: list[str] = ()) -> str:
        """``source`` with a placeholder where the prologue's body goes (``splice``)."""
        return self._text(loop, extra_allocs, PART)

    @property
    def parts(self) -> dict:
        """The functions whose bodies the shell's blocks take, by block."""
        return {} if self.prologue_func is None else {"prologue": self.prologue_func}

    def function(self, loop: str, extra_allocs: list[str] = (), parts: dict | None = None) -> tvm.tirx.PrimFunc:
        """The function with ``loop``: its shell parsed, the prologue's body and ``parts``' (by block)
        spliced in."""
        return splice(parsed(self.shell(loop, extra_allocs)), {**self.parts, **(parts or {})})

    def _text(self, loop: str, extra_allocs, prologue_body: str) -> str:
        signature = ", ".join(_parameter(a) for a in self.args)
        return f"""
@T.prim_func(s_tir=True)
def main({signature}):
    T.func_attr({{"tirx.noalias": True, "global_symbol": "main"}})
{indent([*self.allocs, *extra_allocs], 4)}
    with T.sblock("prologue"):
{indent([*self.prologue, prologue_body], 8)}
{loop}
"""


def _parameter(arg: Arg) -> str:
    """An argument as the signature declares it (rows in ``STEPS`` where T is any)."""
    if arg.role == "steps":
        return f"{arg.name}: T.{arg.dtype}"
    if arg.extra_steps is not None:
        shape = f"({sequence_rows(None, *arg.shape[:1], arg.extra_steps)}, {', '.join(map(str, arg.shape[1:]))})"
    else:
        shape = f"({', '.join(_script(d) for d in arg.shape)},)"
    return f'{arg.name}: T.Buffer({shape}, "{arg.dtype}")'


def _script(dim) -> str:
    """A dimension (``runtime.dimension``'s: an int, "T", or (operator, left, right)) in TVMScript."""
    if type(dim) is int:
        return str(dim)
    if dim == "T":
        return STEPS
    op, left, right = dim
    if op in ("min", "max"):
        return f"T.{op}({_script(left)}, {_script(right)})"
    return f"({_script(left)} {op} {_script(right)})"


def indent(lines, n: int) -> str:
    return textwrap.indent("\n".join(map(str, lines)), " " * n)


def skeleton(plan: Plan, steps: int | None, batch: int, dtype: str, layout: PackedLayout,
             hoisted_only: bool = False, keep_results: bool = False) -> Skeleton:
    """``hoisted_only``: the prologue computes the hoisted GEMMs alone; the time loop reads the step's
    weights where they are and copies the initial states itself (the persistent kernel).
    ``keep_results``: the buffers ``kept_results`` and a step's view of each."""
    cell, T, B, H = plan.cell, steps, batch, plan.cell.hidden_size
    args = [Arg(STEPS, (), "int32", "steps")] if T is None else []  # T, which the buffers' rows follow
    args += [Arg.sequence("x", T, B, 0, cell.input_size, dtype, "x")]
    args += [Arg(f"{s}0", (B, H), dtype, "state") for s in cell.states]
    args += [Arg(n, tuple(shape), dtype, "param") for n, shape in cell.parameters().items()]
    args += [Arg.sequence(f"{s}_seq", T, B, 1, H, dtype, "output") for s in cell.states]
    allocs = [f'{g.name} = T.alloc_buffer(({hoisted_rows(T, B)[1]}, {g.rows}), "{ACCUMULATE}")' for g in plan.hoisted]
    first = [g for g in plan.step_gemms if g.stage == 1] if keep_results else []
    allocs += [f'{g.name}_steps = T.alloc_buffer(({hoisted_rows(T, B)[1]}, {g.rows}), "{ACCUMULATE}")' for g in first]
    allocs += [
        f'w_packed{i} = T.alloc_buffer({layout.of(g).shape(g.depth, g.rows)}, "{dtype}")'
        for i, g in enumerate(plan.gemms)
        if g.stage > 0 and not hoisted_only
    ]
    prologue = [] if hoisted_only else [view_script(f"{s}_init", f"{s}_seq", "0", B, H, dtype) for s in cell.states]
    views = [StepView(f"{g.name}_t", g.name, B, g.rows, ACCUMULATE) for g in plan.hoisted]
    if plan.x_in_step:
        views.append(StepView("x_t", "x", B, cell.input_size, dtype))
    views += [StepView(f"{s}_t", f"{s}_seq", B, H, dtype) for s in cell.states]
    views += [StepView(f"{s}_next", f"{s}_seq", B, H, dtype, ahead=B) for s in cell.states]
    views += [StepView(f"{g.name}_kept", f"{g.name}_steps", B, g.rows, ACCUMULATE) for g in first]
    return Skeleton(args, allocs, prologue, views, _prologue(plan, T, B, dtype, layout, hoisted_only))


INT32_ELEMENTS = 2**31 - 1


def _sized_buffers(plan: Plan, layout: PackedLayout) -> tuple[dict, dict]:
    """The buffers whose sizes int32 indexing bounds: those of fixed shape (what, shape), and those
    that grow with T (what, steps ahead of T, columns), by name."""
    cell = plan.cell
    per_step = {"x": ("the input", 0, cell.input_size)}
    per_step |= {f"{s}_seq": ("a state sequence", 1, cell.hidden_size) for s in cell.states}
    fixed = {n: ("a parameter", tuple(shape)) for n, shape in cell.parameters().items()}
    for g in plan.hoisted:
        per_step[g.name] = ("a hoisted GEMM's result", 0, g.rows)
        if layout.of(g).tf32x3:
            per_step[f"{g.name}_operand"] = ("a hoisted GEMM's operand split for TF32", 0, 3 * g.depth)
    for i, g in enumerate(plan.gemms):
        fixed[f"w_packed{i}"] = ("packed weights", layout.of(g).shape(g.depth, g.rows))
    return fixed, per_step


def check_sizes(plan: Plan, steps: int, batch: int, layout: PackedLayout = PackedLayout()) -> None:
    """Refuse a problem one of whose buffers holds more than 2^31 - 1 elements, naming it: the
    function indexes its buffers with int32, and TVM failed deep inside the build ("Literal value
    2147549184 exceeds range of int32")."""
    fixed, per_step = _sized_buffers(plan, layout)
    grown = {n: (what, ((steps + ahead) * batch, cols)) for n, (what, ahead, cols) in per_step.items()}
    for buffers, advice in ((fixed, "a smaller cell"), (grown, "shorter calls, each starting from the "
                                                               "last one's final states, or a smaller batch")):
        for name, (what, shape) in buffers.items():
            count = math.prod(shape)
            if count > INT32_ELEMENTS:
                raise ValueError(
                    f"{plan.cell!r} at T={steps}, B={batch}: '{name}' ({what}, shape {shape}) would hold {count} "
                    f"elements, past the {INT32_ELEMENTS} (2^31 - 1) that int32 indexing reaches: use {advice}"
                )


def max_steps(plan: Plan, batch: int, layout: PackedLayout = PackedLayout()) -> int:
    """The longest sequence ``check_sizes`` accepts, less the steps that the hoisted GEMMs' padding
    (``hoisted_rows``) may add: a function for any T refuses calls past it."""
    _, per_step = _sized_buffers(plan, layout)
    padding = -(-ROW_QUANTUM // batch)
    return min(INT32_ELEMENTS // (batch * cols) - ahead - padding for _, ahead, cols in per_step.values())


def lower(
    cell: Cell,
    steps: int | None,
    batch: int,
    dtype: str = "float32",
    plan: Plan | None = None,
    layout: PackedLayout = PackedLayout(),
    allow_tf32: bool = False,
    keep_results: bool = False,
    step: tvm.tirx.PrimFunc | None = None,
) -> Program:
    """The whole sequence as one PrimFunc ``main`` (unscheduled); ``steps=None``: for any T.
    ``keep_results``: every step's first-stage GEMM results stay in buffers of their own
    (``kept_results``), where the step loop computes them whole (no K slices). ``step``: the
    step's function (``step_function``) where it is already built (``Problem.lowered``)."""
    plan = plan or make_plan(cell)
    check_sizes(plan, steps or 1, batch, layout)
    if keep_results and layout.split_k > 1:
        raise ValueError("keep_results: a step's GEMM results are kept whole, not in K slices (split_k)")
    frame = skeleton(plan, steps, batch, dtype, layout, keep_results=keep_results)
    step = step or step_function(plan, batch, dtype, layout, keep_results)

    def loop(body: str) -> str:
        return f"""    for t in range({steps or STEPS}):
        with T.sblock("step"):
{indent(frame.step_views, 12)}
{indent([body], 12)}"""

    program = Program(cell, plan, steps, batch, dtype, layout, allow_tf32, keep_results,
                      source=frame.source(loop(script_body(step))), args=frame.args, shell=frame.shell(loop(PART)),
                      parts={**frame.parts, "step": step})
    program.step = step  # built: ``Problem.step`` would build it again
    return program


def cell_hash(cell: Cell) -> str:
    """A stable hash of the cell's expressions and sizes: the TVMScript text of its lowered one-step
    program, as lowering writes it (not parsed: parsing is most of lowering's time)."""
    return hashlib.sha256(lower(cell, steps=1, batch=1).source.encode()).hexdigest()[:16]
