"""A diagonal cell's whole sequence as a scan: no time loop of dependent steps (``Plan.diagonal``).

The function's blocks, in order::

    prologue   the hoisted GEMMs over all T*B rows (``lowering.skeleton(hoisted_only=True)``)
    initial    the initial values of the states the scan does not write
    first      the states computed from x alone (``Diagonal.first``), over all T*B rows
    scan       each scanned state s: its coefficients a, b over all T*B rows, taken from the cell's
               own expression of s' (``diagonal.split_affine``), then per element (b, j)
                   s_t = a_t * s_{t-1} + b_t        in float32, stored in the state's dtype
               with ``chunk`` = 0 one serial loop over T an element; with ``chunk`` = L three passes
               over chunks of L steps: each chunk's product of a and its scan from zero (``chunk_s``),
               the state entering each chunk, serially over the chunks (``carry_s``), each chunk
               again from it (``apply_s``): T / L times the parallelism for one more read of a, b;
               the chunks' products, partial scans and carries in float64 (``CARRY``)
    derived    the other states from x and the states' values, over all T*B rows

The scan passes are blocks over the elements (and chunks), spatial, each running its steps in a
loop inside: a recipe tiles, binds and vectorises them as any elementwise block, and inlines the
coefficients' math into them (``schedules.scan``). The chunked form never divides by a product of
a's, so a product that underflows stands for a carry that has decayed away (float64 checks at
T = 65536 in tests/test_scan.py).
"""

from __future__ import annotations

import textwrap

import tvm
from tvm import te

from .cell import upstream
from .diagonal import split_affine
from .layout import ACCUMULATE
from .lowering import (Program, indent, prim_func_of, script_body, sequence_rows, skeleton, steps_var,
                       stored_as, trace_step, view_script)
from .runtime import STEPS

# The chunks' products, partial scans and carries. MinGRU at T = 65536 with a from 1 - 6e-6 (a state
# kept 1e5 steps) to 0, against float64 (tests/test_scan.py): chunks of 64 carried in float32 2.5e-5,
# in float64 7.1e-7; the serial scan 1.9e-6
CARRY = "float64"


def scan_source(program: Program, chunk: int, lanes: int = 1, group: int | None = None) -> str:
    """The TVMScript of ``program``'s sequence as a scan, chunks of ``chunk`` steps (0: none), a
    block of a pass over ``group`` units (``lanes`` by default) in vectors of ``lanes`` (``_Units``)."""
    plan, T, B, dtype = program.plan, program.steps, program.batch, program.dtype
    diagonal = plan.diagonal
    if not diagonal.scans:
        raise ValueError(f"{plan.cell!r} does not scan: {diagonal.reason}")
    frame = skeleton(plan, T, B, dtype, program.layout, hoisted_only=True)
    rows = sequence_rows(T, B)
    steps = T if T is not None else STEPS
    traced = _traced(program)  # one trace over all rows, which each function over them reads
    parts = []
    if diagonal.first or diagonal.derived:  # the scans write their own
        inits = [_init(s, B, plan.cell.hidden_size) for s in (*diagonal.first, *diagonal.derived)]
        parts.append(f'with T.sblock("initial"):\n{indent(inits, 4)}')
    if diagonal.first:
        parts.append(_scope("first", _states(program, traced, diagonal.first), program, rows))
    coefficients = _coefficients(program, traced)
    buffers = [f'{s}_coef_{c}' for s in diagonal.scanned for c in "ab"]
    allocs, scan = [], []
    if fuses(program, chunk):  # the coefficients' blocks in the passes' scope, where they inline
        scan += [f'{b} = T.sblock_alloc_buffer(({rows}, {plan.cell.hidden_size}), "{ACCUMULATE}")' for b in buffers]
        scan += [*_views(coefficients, program, rows), script_body(coefficients)]
    else:
        allocs += [f'{b} = T.alloc_buffer(({rows}, {plan.cell.hidden_size}), "{ACCUMULATE}")' for b in buffers]
        parts.append(_scope("coefficients", coefficients, program, rows))
    chunks = (str(-(-T // chunk)) if T is not None else f"({STEPS} + {chunk - 1}) // {chunk}") if chunk else None
    for s in diagonal.scanned if chunk else ():
        scan += [f'{s}_{c} = T.sblock_alloc_buffer(({chunks} * {B}, {plan.cell.hidden_size}), "{CARRY}")'
                 for c in ("prod", "part", "carry")]
    for s in diagonal.scanned:
        units = _Units(lanes, group or lanes)
        scan.append(_chunked(s, B, plan.cell.hidden_size, dtype, steps, units, chunk, chunks) if chunk
                    else _serial(s, B, plan.cell.hidden_size, dtype, steps, units))
    parts.append(f'with T.sblock("scan"):\n{indent(scan, 4)}')
    if diagonal.derived:
        parts.append(_scope("derived", _states(program, traced, diagonal.derived), program, rows))
    return frame.source(indent(parts, 4), allocs)


def fuses(program: Program, chunk: int) -> bool:
    """Whether the coefficients' math shares the passes' scope, where a recipe inlines it into them:
    not in a chunked scan for any T, whose passes TVM 0.27 could not prove read only what the
    scope writes before them (compute_inline: "not a stage pipeline"); a and b are stored then."""
    return chunk == 0 or program.steps is not None


def _scope(name: str, func: tvm.tirx.PrimFunc, program: Program, rows) -> str:
    return f'with T.sblock("{name}"):\n{indent([*_views(func, program, rows), script_body(func)], 4)}'


def _views(func: tvm.tirx.PrimFunc, program: Program, rows) -> list[str]:
    """Views of rows 0 .. T*B of the sequences for the inputs a function over all rows reads, and of
    rows B .. (T+1)*B for the next states it writes."""
    cell, B, dtype = program.cell, program.batch, program.dtype
    where = {f"{g.name}_t": (g.name, "0", g.rows, ACCUMULATE) for g in program.plan.hoisted}
    where["x_t"] = ("x", "0", cell.input_size, dtype)
    where |= {f"{s}_t": (f"{s}_seq", "0", cell.hidden_size, dtype) for s in cell.states}
    where |= {f"{s}_next": (f"{s}_seq", str(B), cell.hidden_size, dtype) for s in cell.states}
    names = [p.name for p in func.params]
    return [view_script(n, buffer, first, rows, cols, t) for n in names if n in where
            for buffer, first, cols, t in [where[n]]]


def _traced(program: Program):
    """The step traced over all T*B rows: its trace, its next states and the states' float32 views by name."""
    step = trace_step(program.plan, steps_var(program.steps) * program.batch, program.dtype, program.layout)
    return step, dict(zip(program.cell.states, step.traced.next_states)), dict(zip(program.cell.states,
                                                                                   step.traced.states))


def _function(step, outputs: list) -> tvm.tirx.PrimFunc:
    """A function of the outputs over the step's inputs that they read."""
    needed = set().union(*(upstream(t) for t in outputs))
    inputs = [t for t in step.inputs if t.op in needed]
    return prim_func_of(inputs, outputs, [t.op.name for t in inputs + outputs])


def _states(program: Program, traced, names) -> tvm.tirx.PrimFunc:
    """The next values of the states ``names`` over all rows, from the states' values at each step."""
    step, nexts, _ = traced
    return _function(step, [stored_as(nexts[s], program.dtype, f"{s}_next") for s in names])


def _coefficients(program: Program, traced) -> tvm.tirx.PrimFunc:
    """a and b of each scanned state over all rows (``<s>_coef_a``, ``<s>_coef_b``), float32."""
    step, nexts, views = traced
    outputs = []
    for s in program.plan.diagonal.scanned:
        a, b = split_affine(nexts[s], views[s])
        if b is None:
            b = te.compute(a.shape, lambda *i: tvm.tirx.const(0.0, ACCUMULATE), name=f"{s}_zero")
        outputs += [stored_as(a, ACCUMULATE, f"{s}_coef_a"), stored_as(b, ACCUMULATE, f"{s}_coef_b")]
    return _function(step, outputs)


def _init(s: str, B: int, H: int) -> str:
    """Row block 0 of a state's sequence: its initial value."""
    return f'''for r, j in T.grid({B}, {H}):
    with T.sblock("{s}_init"):
        vr, vj = T.axis.remap("SS", [r, j])
        {s}_seq[vr, vj] = {s}0[vr, vj]'''


class _Units:
    """How a pass's block indexes its units: a block an element (``group`` 1), or a block ``group``
    units, ``group / lanes`` vectors of ``lanes``, each statement over them in loops inside the block,
    the lanes' one vectorised. (A running value in a local buffer of one element a block, vectorised
    from outside the block, was taken by TVM 0.27 as one value for every lane: the buffer is compacted
    to the one element a block instance touches.)"""

    def __init__(self, lanes: int, group: int):
        self.lanes, self.group, self.vectors = lanes, group, group // lanes
        within = [f"v * {lanes}"] * (self.vectors > 1) + ["l"] * (lanes > 1)
        self.i = " + ".join(within) or "0"  # a unit's place in the block's running values
        self.j = "vj" if group == 1 else f"vj * {group} + {self.i}"  # the unit, in the block's body

    def blocks(self, H: int) -> int:
        return H // self.group

    def span(self) -> str:
        """The block's units, as a region."""
        return "vj" if self.group == 1 else f"vj * {self.group}:vj * {self.group} + {self.group}"

    def each(self, lines: str, depth: int) -> str:
        """``lines`` (at indentation ``depth``) for each unit of the block."""
        if self.lanes > 1:
            lines = f"{' ' * depth}for l in T.vectorized({self.lanes}):\n" + textwrap.indent(lines, "    ")
        if self.vectors > 1:
            lines = f"{' ' * depth}for v in range({self.vectors}):\n" + textwrap.indent(lines, "    ")
        return lines

    def local(self, name: str, dtype: str = "float32") -> str:
        return f'{name} = T.sblock_alloc_buffer(({self.group},), "{dtype}", scope="local")'


def _serial(s: str, B: int, H: int, dtype: str, steps, u: _Units) -> str:
    j, i = u.j, u.i
    return f'''for r, j in T.grid({B}, {u.blocks(H)}):
    with T.sblock("scan_{s}"):
        vr, vj = T.axis.remap("SS", [r, j])
        T.reads({s}0[vr, {u.span()}], {s}_coef_a[0:{steps} * {B}, {u.span()}],
                {s}_coef_b[0:{steps} * {B}, {u.span()}])
        T.writes({s}_seq[vr:vr + ({steps} + 1) * {B}, {u.span()}])
        {u.local("acc")}
{u.each(f"""        acc[{i}] = T.Cast("float32", {s}0[vr, {j}])
        {s}_seq[vr, {j}] = {s}0[vr, {j}]""", 8)}
        for t in range({steps}):
{u.each(f"""            acc[{i}] = {s}_coef_a[t * {B} + vr, {j}] * acc[{i}] + {s}_coef_b[t * {B} + vr, {j}]
            {s}_seq[(t + 1) * {B} + vr, {j}] = T.Cast("{dtype}", acc[{i}])""", 12)}'''


def _chunked(s: str, B: int, H: int, dtype: str, steps, u: _Units, L: int, chunks) -> str:
    j, i, span = u.j, u.i, u.span()
    row = f"(vc * {L} + t) * {B} + vr"
    first = f"vc * {L * B} + vr"
    within = f"T.min({L}, {steps} - vc * {L})"
    return f'''for c, r, j in T.grid({chunks}, {B}, {u.blocks(H)}):
    with T.sblock("chunk_{s}"):
        vc, vr, vj = T.axis.remap("SSS", [c, r, j])
        T.reads({s}_coef_a[0:{steps} * {B}, {span}], {s}_coef_b[0:{steps} * {B}, {span}])
        T.writes({s}_prod[vc * {B} + vr, {span}], {s}_part[vc * {B} + vr, {span}])
        {u.local("prod", CARRY)}
        {u.local("acc", CARRY)}
{u.each(f"""        prod[{i}] = T.{CARRY}(1)
        acc[{i}] = T.{CARRY}(0)""", 8)}
        for t in range({within}):
{u.each(f"""            prod[{i}] = prod[{i}] * T.Cast("{CARRY}", {s}_coef_a[{row}, {j}])
            acc[{i}] = T.Cast("{CARRY}", {s}_coef_a[{row}, {j}]) * acc[{i}] + T.Cast("{CARRY}", {s}_coef_b[{row}, {j}])""", 12)}
{u.each(f"""        {s}_prod[vc * {B} + vr, {j}] = prod[{i}]
        {s}_part[vc * {B} + vr, {j}] = acc[{i}]""", 8)}
for r, j in T.grid({B}, {u.blocks(H)}):
    with T.sblock("carry_{s}"):
        vr, vj = T.axis.remap("SS", [r, j])
        T.reads({s}0[vr, {span}], {s}_prod[vr:vr + {chunks} * {B}, {span}], {s}_part[vr:vr + {chunks} * {B}, {span}])
        T.writes({s}_seq[vr, {span}], {s}_carry[vr:vr + {chunks} * {B}, {span}])
        {u.local("acc", CARRY)}
{u.each(f"""        acc[{i}] = T.Cast("{CARRY}", {s}0[vr, {j}])
        {s}_seq[vr, {j}] = {s}0[vr, {j}]""", 8)}
        for c in range({chunks}):
{u.each(f"""            {s}_carry[c * {B} + vr, {j}] = acc[{i}]
            acc[{i}] = {s}_prod[c * {B} + vr, {j}] * acc[{i}] + {s}_part[c * {B} + vr, {j}]""", 12)}
for c, r, j in T.grid({chunks}, {B}, {u.blocks(H)}):
    with T.sblock("apply_{s}"):
        vc, vr, vj = T.axis.remap("SSS", [c, r, j])
        T.reads({s}_carry[vc * {B} + vr, {span}], {s}_coef_a[0:{steps} * {B}, {span}],
                {s}_coef_b[0:{steps} * {B}, {span}])
        T.writes({s}_seq[{first} + {B}:{first} + {B} + {within} * {B}, {span}])
        {u.local("acc")}
{u.each(f"""        acc[{i}] = T.Cast("float32", {s}_carry[vc * {B} + vr, {j}])""", 8)}
        for t in range({within}):
{u.each(f"""            acc[{i}] = {s}_coef_a[{row}, {j}] * acc[{i}] + {s}_coef_b[{row}, {j}]
            {s}_seq[{row} + {B}, {j}] = T.Cast("{dtype}", acc[{i}])""", 12)}'''
