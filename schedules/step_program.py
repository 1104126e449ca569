"""The lowering's step program read as IR, for recipes that build their own kernel from it (the
persistent kernel): its blocks in order, each step GEMM's operand (``StepGemm``), each elementwise
block's value (``Elementwise``), each sum over a row's columns (``Reduction``: a layer norm's), the
packed weights' values; found with ``isinstance`` and the block names the lowering gives, and
rewritten by substitution (``rewrite``)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm import sym, tirx
from tvm.tirx import IterVar
from tvm.ir import TensorLoad
from tvm.s_tir import Schedule

from halstm.layout import packing_function
from halstm.plan import Gemm

from .recipe import inline_elementwise, is_reduction

@dataclass(frozen=True)
class StepGemm:
    """A step GEMM as the step program computes it, ``acc + operand(row, k) * weight``: the operand's
    value over the block's variables ``row`` and ``k``; ``view``, the buffer it is where it reads one
    as stored; ``reads_state``, whether it reads a state's view (then from the state's sequence)."""

    gemm: Gemm
    row: tirx.Var
    k: tirx.Var
    operand: tirx.PrimExpr
    dtype: str
    view: str | None
    reads_state: bool


@dataclass(frozen=True)
class RowMath:
    """A block of the step that computes ``value`` at (row, unit) of the batch and of a row's columns."""

    buffer: str
    row: tirx.Var
    unit: tirx.Var
    value: tirx.PrimExpr

    def gate_column(self, load, H: int) -> int | None:
        """c where ``load`` reads [row, unit + c] with c a whole number of H (a gate's column of the
        own unit), else None."""
        if len(load.indices) != 2:
            return None
        row, column = load.indices
        if not row.same_as(self.row):
            return None
        if column.same_as(self.unit):
            return 0
        if isinstance(column, tirx.Add) and column.a.same_as(self.unit) and isinstance(column.b, tirx.IntImm):
            return column.b.value if column.b.value % H == 0 else None
        return None

    def on_chip(self, gemms: set[str], reductions: set[str], H: int) -> bool:
        """Whether it reads the step GEMMs' results (``gemms``) only at its own row and a gate column
        of its own unit, and the step's reductions only at its own row: what a block holds of them
        in shared memory."""
        return not any((load.source.name in gemms and self.gate_column(load, H) is None)
                       or (load.source.name in reductions
                           and not (len(load.indices) == 1 and load.indices[0].same_as(self.row)))
                       for load in loads(self.value))


@dataclass(frozen=True)
class Elementwise(RowMath):
    """An elementwise block of the step over (B, H): it stores ``value`` at (row, unit + ``column``) of
    ``buffer`` (``column`` a whole number of H: a gate's columns of a kept GEMM result)."""

    column: int = 0


@dataclass(frozen=True)
class Reduction(RowMath):
    """A sum over a row's columns: ``buffer[row]`` is the sum of ``value`` over unit < ``width``, a
    whole number of H (a gate's columns, or several gates')."""

    width: int = 0


_cache: dict[tuple, tuple] = {}


def per_program(what: str, program, key, compute):
    """compute() once per program (or another object: a step function) and key (the tuner checks
    many knob settings of one program); the object is held with the result, so that its id is not
    reused while cached."""
    hit = _cache.get((what, id(program), key))
    if hit is None or hit[0] is not program:
        if len(_cache) > 32:
            _cache.clear()
        hit = _cache[(what, id(program), key)] = (program, compute())
    return hit[1]


def step_blocks(program) -> list | None:
    """The step's blocks in order, knob-independent: ``StepGemm`` and ``Elementwise``. None when the
    step has math a block cannot do on its own units: a cell's own reduction, a GEMM whose columns are
    not whole gates, a block not over (B, H), no step GEMM."""
    return _analysis(program)[0]


def packings(program) -> dict:
    """By GEMM index, the step GEMMs' packed weights at (k, n) as the lowering's prologue computes
    them: (the variables of k and n, the value), read in place of the packed copy."""
    return _analysis(program)[1]


def _analysis(program):
    """``_analyse``'s, once a step function: a problem and the program lowered from it share theirs
    where the step GEMMs' layouts, which both read, are the same (``Problem.lowered``)."""
    return per_program("analysis", program.step, None, lambda: _analyse(program))


def _analyse(program):
    """(``step_blocks``, ``packings``) from the program's one-step function (``Program.step``) and
    its packed weights (``layout.packing_function``), neither parsed from the program's text:
    choosing LSTM fp16 (100,16,512)'s recipe took 0.40-0.60 s with the program lowered and parsed,
    0.05-0.06 s without (the 2-core CPU machine, a fresh process each, alternating)."""
    sch, packings = Schedule(packing_function(program.plan, program.dtype, program.layout)), {}
    for i, gemm in enumerate(program.plan.gemms):
        if gemm.stage > 0:
            block = sch.get(sch.get_sblock(f"w_packed{i}"))
            packings[i] = [iv.var for iv in block.iter_vars], block.body.value
    step = Schedule(tvm.IRModule({"main": copy.deepcopy(program.step)}))  # scheduled in place
    return _analyse_step(program, step), packings


def _analyse_step(program, sch: Schedule) -> list | None:
    H, B = program.cell.hidden_size, program.batch
    root = sch.get_sblock("root")
    inline_elementwise(sch, root)
    gemms = {g.name: g for g in program.plan.gemms}
    for b in sch.get_child_blocks(root):  # a gathered operand (a concatenation of states) staged
        block = sch.get(b)                  # from where they are
        if (block.name_hint.removesuffix("_operand") in gemms and block.name_hint.endswith("_operand")
                and [int(iv.dom.extent) for iv in block.iter_vars] != [B, H] and not is_reduction(sch, b)):
            sch.compute_inline(b)
    state_views = [f"{s}_t" for s in program.cell.states]
    blocks, deferred = [], []
    apart = _named_apart(sch, root)
    for b in sch.get_child_blocks(root):
        block = sch.get(b)
        ivs = [iv.var for iv in block.iter_vars]
        store = apart(block.body)
        if block.name_hint in gemms:
            blocks, deferred = blocks + deferred, []
            gemm = gemms[block.name_hint]
            update = store.value  # lowering's packed_gemm: acc + operand * weight
            if not (isinstance(update, tirx.Add) and isinstance(update.b, tirx.Mul)):
                return None
            operand, weight = update.b.a, update.b.b
            if gemm.rows % H or not any(load.source.name == f"w_packed{program.plan.gemms.index(gemm)}"
                                        for load in loads(weight)):
                return None
            # staged in its storage dtype: a state's fp16/bf16 copy, not its float32 view
            if isinstance(operand, tirx.Cast) and isinstance(operand.value, TensorLoad):
                operand = operand.value
            as_stored = (isinstance(operand, TensorLoad) and len(operand.indices) == 2
                         and operand.indices[0].same_as(ivs[0]) and operand.indices[1].same_as(ivs[2]))
            reads_state = any(load.source.name in state_views for load in loads(operand))
            blocks.append(StepGemm(gemm, ivs[0], ivs[2], operand, str(operand.ty),
                                   operand.source.name if as_stored else None, reads_state))
        elif is_reduction(sch, b):
            reduction = _row_sum(block, ivs, B, H)
            if reduction is None:
                return None
            blocks.append(reduction)
        elif block.name_hint.removesuffix("_kept") in gemms and block.name_hint.endswith("_kept"):
            kept = _kept_gates(block, ivs, B, H)
            if kept is None:
                return None
            deferred += kept  # stored after the stage's math: off the path to the next state
        elif [int(iv.dom.extent) for iv in block.iter_vars] != [B, H]:
            return None
        else:
            blocks.append(Elementwise(store.buffer.name, ivs[0], ivs[1], store.value))
    blocks += deferred
    if not any(isinstance(b, StepGemm) for b in blocks):
        return None  # nothing to keep on chip: the step loop runs it
    return [_simplified(b, B, H) if isinstance(b, RowMath) else b for b in blocks]


def _named_apart(sch: Schedule, root):
    """A function that renames, in a block's store, each buffer the step allocates whose name another
    buffer shares (te names many ``T_add``) to ``step_<the block that writes it>``: the persistent
    kernel allocates and finds the step's buffers by name."""
    allocated = list(sch.get(root).alloc_buffers)
    names = [a.name for a in allocated] + [p.name for p in sch.mod["main"].params]
    renamed = []
    for b in sch.get_child_blocks(root):
        node = sch.get(b)
        written = node.writes[0].source
        if names.count(written.name) > 1 and any(written.same_as(a) for a in allocated):
            renamed.append((written, tirx.decl_buffer(written.shape, written.dtype, f"step_{node.name_hint}")))

    def load(x):
        new = next((n for old, n in renamed if x.source.same_as(old)), None)
        return x if new is None else new[list(x.indices)]

    def apart(store):
        value = tvm_ffi.structural_map(store.value, (TensorLoad, load))
        buffer = next((n for old, n in renamed if store.buffer.same_as(old)), store.buffer)
        return tirx.BufferStore(buffer, value, list(store.indices))

    return apart


def _kept_gates(block, ivs, B: int, H: int) -> list[Elementwise] | None:
    """A step GEMM's results copied whole to a view of their own (the lowering's ``keep_results``),
    over (B, a whole number of H), as an elementwise block a gate: each stores its gate's columns."""
    extents = [int(iv.dom.extent) for iv in block.iter_vars]
    if len(extents) != 2 or extents[0] != B or extents[1] % H:
        return None
    row, column = ivs
    gates = extents[1] // H
    return [Elementwise(block.body.buffer.name, row, column, tvm_ffi.structural_map(
        block.body.value, (tirx.Var, lambda v, g=g: column + g * H if v.same_as(column) else v)), g * H)
        for g in range(gates)]


def _simplified(b: RowMath, B: int, H: int) -> RowMath:
    """``b`` with its value simplified within the block's domain: selects whose conditions the unit's
    range decides go (an adjoint's of a split, read at one gate, drops its reads of the other gates'
    columns, which a block does not hold). The forward cells' kernels are unchanged by it (the six
    built-in cells, six settings each, B = H = 1 among them, structurally equal)."""
    analyzer = sym.Analyzer()  # constraints, not bindings: a variable of extent 1 stays a variable
    width = b.width if isinstance(b, Reduction) else H
    with analyzer.constraint_scope(tirx.all(b.row >= 0, b.row < B, b.unit >= 0, b.unit < width)):
        value = analyzer.simplify(b.value)
    return dataclasses.replace(b, value=value)


def _row_sum(block, ivs, B: int, H: int) -> Reduction | None:
    """The block as a ``Reduction``: ``R[row] = R[row] + value`` from zero, over (B, a whole number of
    H); else None."""
    store, init = block.body, block.init
    kinds = [(int(iv.iter_type), int(iv.dom.extent)) for iv in block.iter_vars]
    if len(kinds) != 2 or kinds[0] != (IterVar.DataPar, B) or kinds[1][0] != IterVar.CommReduce or kinds[1][1] % H:
        return None
    update = store.value
    if not (isinstance(update, tirx.Add) and isinstance(update.a, TensorLoad)
            and update.a.source.name == store.buffer.name and isinstance(init, tirx.BufferStore)
            and isinstance(init.value, tirx.FloatImm) and init.value.value == 0):
        return None
    return Reduction(store.buffer.name, ivs[0], ivs[1], update.b, kinds[1][1])


def mean_of(variance: Reduction, reductions: list[Reduction]) -> Reduction | None:
    """The reduction among ``reductions`` whose mean ``variance`` centres on, where ``variance`` sums
    squared deviations from it, ``(v - mean[row] / N) * (v - mean[row] / N)`` with ``mean`` the sum
    of the same ``v`` over the same N columns (a layer norm's two sums); else None."""
    value = variance.value
    if not (isinstance(value, tirx.Mul) and tvm_ffi.structural_equal(value.a, value.b) and isinstance(value.a, tirx.Sub)):
        return None
    v, centre = value.a.a, value.a.b
    if not (isinstance(centre, tirx.Div) and isinstance(centre.a, TensorLoad) and isinstance(centre.b, tirx.FloatImm)
            and len(centre.a.indices) == 1 and centre.a.indices[0].same_as(variance.row)
            and centre.b.value == variance.width):
        return None
    mean = next((r for r in reductions if r.buffer == centre.a.source.name), None)
    if mean is None or mean.width != variance.width:
        return None
    same = tvm_ffi.structural_map(mean.value, (tirx.Var, lambda x: variance.row if x.same_as(mean.row)
                                                else variance.unit if x.same_as(mean.unit) else x))
    return mean if tvm_ffi.structural_equal(same, v) else None


def loads(expr) -> list:
    """The buffer reads in ``expr``."""
    found = []
    tvm_ffi.structural_walk(expr, (TensorLoad, found.append))
    return found


def rewrite(expr, variables, buffers: dict):
    """``expr`` with each (old, new) pair of ``variables`` substituted and every read moved to the
    buffer of its name in ``buffers``."""

    def var(v):
        return next((new for old, new in variables if v.same_as(old)), v)

    def read(load):
        return buffers[load.source.name][list(load.indices)]

    return tvm_ffi.structural_map(expr, [(tirx.Var, var), (TensorLoad, read)])
