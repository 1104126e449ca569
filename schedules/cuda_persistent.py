"""CUDA persistent-kernel recipe: one cooperative launch runs all T steps.

Block ``bx`` owns hidden units [bx * U, bx * U + U) (U divides H, H / U blocks <= SMs, one block per
SM, so the grid is co-resident). It copies the columns of the packed recurrent weights that feed its
units (every gate of each unit) into shared memory once, then per step and stage:

    gemm (its columns only)       threads over (row, column) x split-K parts, partials in shared
    __syncthreads
    fused elementwise (its units) the expression of the cell's own block, printed from the step program
    grid sync                     before the next stage's GEMM and at the end of the step

The step's math is not written here: the step program of ``halstm.lowering`` is scheduled only to inline
its elementwise math (``inline_elementwise``), and each block's expression is re-indexed onto the
block's units. The prologue (hoisted input GEMM, weight packing, state copies) keeps the step-loop
recipe's schedule.
"""

from __future__ import annotations

import math
import re

import tvm
from tvm.s_tir import Schedule

from halstm.lowering import ACCUMULATE, indent, skeleton

from .cuda import BYTES, CudaStepLoop, bind_flat, gemm_tiled, hoisted_tile
from .recipe import Recipe, child_blocks, inline_elementwise, is_reduction

# Largest batch at which ``recipes_for`` puts this recipe first. H100, 2026-11-22 (docs/gpu-results.md,
# tiled step loop): faster than the step loop at B=1 (3.3-4.5x), B=8 (1.5-3.5x) and B=16 (1.3-2.8x);
# slower at B=64, H=1024 (1.0-2.1x) and B=256 (2.6-4.6x): one thread walks all of K per output.
# A size rule only: the third run found it slower at (T, B, H) = (1024, 16, 768) too (50 against 30 us
# a step, six hidden units a block); the tuner measures both.
PREFERRED_MAX_BATCH = 16


class CudaPersistent(Recipe):
    name = "cuda-persistent"
    knobs = {"threads": (256, 512, 128)}
    build_options = {"cooperative": True}

    def is_applicable(self, program, target) -> bool:
        if target.kind != "cuda":
            return False
        kernel = _Kernel.plan(program, target, self.defaults(program, target)["threads"])
        return kernel is not None and kernel.shared_bytes() <= target.shared_memory

    def apply(self, program, target, **knobs) -> Schedule | None:
        k = self.resolve(program, target, knobs)
        kernel = _Kernel.plan(program, target, k["threads"])
        if kernel is None or kernel.shared_bytes() > target.shared_memory:
            return None
        sch = Schedule(tvm.IRModule({"main": kernel.func()}))
        step = CudaStepLoop().defaults(program, target)
        inline_elementwise(sch, sch.get_sblock("prologue"))
        gemms, others = child_blocks(sch, "prologue", program)
        for gemm in gemms:
            gemm_tiled(sch, gemm, hoisted_tile(step))
        for block in others:
            bind_flat(sch, block, step["threads"])
        return sch


class _Kernel:
    """The planned persistent kernel: units per block, the step's blocks in order, as text."""

    def __init__(self, program, target, threads, units, blocks):
        self.p, self.target, self.threads, self.units = program, target, threads, units
        self.blocks = blocks
        self.H = program.cell.hidden_size
        self.grid = self.H // units

    @classmethod
    def plan(cls, program, target, threads):
        """None when the step has math a block cannot do on its own units (a cell's own reduction,
        a GEMM whose columns are not whole gates, a block not over (B, H))."""
        H, B = program.cell.hidden_size, program.batch
        units = next(u for u in range(1, H + 1) if H % u == 0 and H // u <= target.sms)
        sch = Schedule(program.mod)
        inline_elementwise(sch, sch.get_sblock("step"))
        names = {g.name: g for g in program.plan.gemms}
        blocks = []
        for b in sch.get_child_blocks(sch.get_sblock("step")):
            block = sch.get(b)
            ivs = [iv.var.name for iv in block.iter_vars]
            extents = [int(iv.dom.extent) for iv in block.iter_vars]
            store = block.body
            if block.name_hint in names:
                if names[block.name_hint].rows % H:
                    return None
                blocks.append(("gemm", names[block.name_hint], ivs, str(store.value)))
            elif is_reduction(sch, b) or extents != [B, H]:
                return None
            else:
                blocks.append(("elementwise", store.buffer.name, ivs, str(store.value)))
        kernel = cls(program, target, threads, units, blocks)
        gemm_names = "|".join(names)
        for kind, _, ivs, value in blocks:
            if kind == "elementwise":  # every GEMM column read must be a gate column of the own unit
                for col in re.findall(rf"\b(?:{gemm_names})\[[^\[\],]+, ([^\[\]]+)\]", value):
                    m = re.fullmatch(rf"{ivs[1]}(?: \+ (\d+))?", col)
                    if not m or int(m.group(1) or 0) % H:
                        return None
        return kernel

    # --- sizes -------------------------------------------------------------------------------
    def columns(self, gemm) -> int:
        return gemm.rows // self.H * self.units

    def split_k(self, gemm) -> int:
        """Split-K parts so that all threads work: the largest power of two <= threads / items
        dividing K (B=1, H=256: 8 items per block, 32 parts of 8)."""
        items = self.p.batch * self.columns(gemm)
        s = 1
        while 2 * s * items <= self.threads and gemm.depth % (2 * s) == 0:
            s *= 2
        return s

    def shared_bytes(self) -> int:
        total = 0
        for kind, gemm, *_ in self.blocks:
            if kind == "gemm":
                rounds = math.ceil(gemm.depth * self.columns(gemm) / self.threads)
                total += rounds * self.threads * BYTES[self.p.dtype]
                if self.split_k(gemm) > 1:
                    total += self.threads * 4
        return total

    # --- text --------------------------------------------------------------------------------
    def global_column(self, gemm, c) -> str:
        """Column of the GEMM result for local column c of this block."""
        return f"({c}) // {self.units} * {self.H} + p_bx * {self.units} + ({c}) % {self.units}"

    def gemm_text(self, i, gemm, ivs, value) -> list[str]:
        B, NT = self.p.batch, self.threads
        C, S = self.columns(gemm), self.split_k(gemm)
        items, ks = B * C, gemm.depth // S
        product = value.split(" + ", 1)[1]
        work = f"(p_r * {NT} + p_tx)"
        item, part = f"{work} % {items}", f"{work} // {items}"
        row, col = f"({item}) // {C}", f"({item}) % {C}"
        k = f"({part}) * {ks} + p_k"
        weight = self.p.plan.gemms.index(gemm)
        product = re.sub(rf"\bw_packed{weight}\[{ivs[2]}, {ivs[1]}\]", f"w_s{weight}[{ivs[2]} * {C} + {col}]", product)
        product = substitute(product, {ivs[0]: row, ivs[1]: self.global_column(gemm, col), ivs[2]: k})
        if S == 1:
            lines = [
                f"for p_r in range({math.ceil(items / NT)}):",
                f"    if {work} < {items}:",
                "        acc[0] = T.float32(0)",
                f"        for p_k in range({ks}):",
                f"            acc[0] = acc[0] + {product}",
                f"        {gemm.name}[{row}, {self.global_column(gemm, col)}] = acc[0]",
                "T.tvm_storage_sync(\"shared\")",
            ]
        else:  # items * S <= threads: one pass, the spare threads redo part S - 1 (stores need no guard)
            product = product.replace(f"({part})", f"T.min({part}, {S - 1})")
            lines = [
                "acc[0] = T.float32(0)",
                f"for p_k in range({ks}):",
                f"    acc[0] = acc[0] + {product.replace('p_r', '0')}",
                f"part{weight}[p_tx] = acc[0]",
                "T.tvm_storage_sync(\"shared\")",
            ]
            w = "(p_r * {} + p_tx)".format(NT)
            lines += [
                f"for p_r in range({math.ceil(items / NT)}):",
                f"    if {w} < {items}:",
                "        acc[0] = T.float32(0)",
                f"        for p_s in range({S}):",
                f"            acc[0] = acc[0] + part{weight}[p_s * {items} + {w}]",
                f"        {gemm.name}[({w}) // {C}, {self.global_column(gemm, f'({w}) % {C}')}] = acc[0]",
                "T.tvm_storage_sync(\"shared\")",
            ]
        return lines

    def elementwise_text(self, name, ivs, value) -> list[str]:
        B, U, NT = self.p.batch, self.units, self.threads
        work = f"(p_r * {NT} + p_tx)"
        row, unit = f"({work}) // {U}", f"p_bx * {U} + ({work}) % {U}"
        value = substitute(value, {ivs[0]: row, ivs[1]: unit})
        return [
            f"for p_r in range({math.ceil(B * U / NT)}):",
            f"    if {work} < {B * U}:",
            f"        {name}[{row}, {unit}] = {value}",
        ]

    def func(self) -> tvm.tirx.PrimFunc:
        p, plan, B, H, T_ = self.p, self.p.plan, self.p.batch, self.H, self.p.steps
        cell, dtype = p.cell, p.dtype
        frame = skeleton(plan, T_, B, dtype, p.layout)
        allocs = [f'{g.name} = T.alloc_buffer(({B}, {g.rows}), "{ACCUMULATE}")'
                  for s in plan.stages for g in s]
        outputs = {f"{s}_next" for s in cell.states}
        allocs += [f'{n} = T.alloc_buffer(({B}, {H}), "{ACCUMULATE}")'
                   for kind, n, *_ in self.blocks if kind == "elementwise" and n not in outputs]
        shared, load = [], []
        for kind, gemm, *_ in self.blocks:
            if kind != "gemm":
                continue
            i, C = plan.gemms.index(gemm), self.columns(gemm)
            # flat and padded to whole passes of the threads: stores without a guard, which the
            # shared-memory sync planner cannot handle inside a condition
            rounds = math.ceil(gemm.depth * C / self.threads)
            shared.append(f'w_s{i} = T.sblock_alloc_buffer(({rounds * self.threads},), "{dtype}", '
                          'scope="shared.dyn")')
            if self.split_k(gemm) > 1:
                shared.append(f'part{i} = T.sblock_alloc_buffer(({self.threads},), "float32", scope="shared.dyn")')
            work = f"T.min(p_r * {self.threads} + p_tx, {gemm.depth * C - 1})"
            load += [
                f"for p_r in range({rounds}):",
                f"    w_s{i}[p_r * {self.threads} + p_tx] = "
                f"w_packed{i}[{work} // {C}, {self.global_column(gemm, f'{work} % {C}')}]",
            ]
        step, stored = [], False
        for kind, what, ivs, value in self.blocks:
            if kind == "gemm":
                if stored:  # its operand was written unit by unit across the grid
                    step.append("T.cuda.grid_sync()")
                step += self.gemm_text(plan.gemms.index(what), what, ivs, value)
            else:
                stored = True
                step += self.elementwise_text(what, ivs, value)
        step.append("T.cuda.grid_sync()")
        loop = f"""    for p_bx in T.thread_binding({self.grid}, thread="blockIdx.x"):
        for p_tx in T.thread_binding({self.threads}, thread="threadIdx.x"):
            with T.sblock("persistent"):
{indent(shared, 16)}
                acc = T.sblock_alloc_buffer((1,), "float32", scope="local")
{indent(load, 16)}
                T.tvm_storage_sync("shared")
                for t in range({T_}):
                    with T.sblock("step"):
{indent(frame.step_views, 24)}
{indent(step, 24)}"""
        return tvm.script.from_source(frame.source(loop, allocs))


def substitute(text: str, names: dict[str, str]) -> str:
    """Replace whole-word variable names in printed TIR by parenthesised expressions."""
    if not names:
        return text
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return pattern.sub(lambda m: f"({names[m.group(1)]})", text)
