"""CUDA persistent-kernel recipe: one cooperative launch runs all T steps.

Block ``bx`` owns hidden units [bx * U, bx * U + U) (U divides H, H / U blocks <= SMs, one block per
SM, so the grid is co-resident). Before the time loop it copies the C = gates * U columns of the packed
recurrent weights that feed its units into shared memory, k contiguous per column, in their storage
dtype. Then per step and stage:

    stage the operand     the B x K rows the step GEMM reads (h, written by every block before the
                          grid sync) into shared memory, all threads, VECTOR elements at a time
                          (read from global memory in the GEMM where it does not fit beside the
                          weights); the step's input projection of the block's units with it
    __syncthreads
    register-tiled GEMM   thread (tile, part): a tm x tn tile of (row, column) outputs, fp32
                          accumulators in registers, over the K chunks part, part + S, ... of VECTOR
                          k each (S split-K parts, fastest in the thread index: a warp's loads are
                          consecutive chunks; more tiles than threads: in rounds); each thread's
                          tile to shared memory
    __syncthreads
    split-K sum           one thread per output adds the S partial tiles (when S > 1); __syncthreads
    fused elementwise     the expression of the cell's own block, printed from the step program, its
                          GEMM columns read from shared memory
    grid sync             before the next stage's GEMM and at the end of the step

Why (H100, T=100, before this layout): each thread computed one output walking all of K serially with
a global load of h per multiply-add; at B=16, H=512 (U=4, 256 threads) that is 512 dependent FMAs each
waiting on a load, 17-24 us a step (cuDNN fp32 20.5, fp16 2.8). Now a block's step GEMM (16 x 16 x 512
there: 16 tiles of 4 x 4, S = 16, 8 chunks a part) is 512 FMAs a thread from registers with 16
independent accumulators, 8 shared loads of VECTOR per 64 FMAs: about 1k cycles of FMA issue and 1.5k
of shared-memory wavefronts, plus one L2 round trip for the operand and the grid sync; estimated 3-4 us
a step (not yet measured on a GPU).

Shared stores are never inside a condition (the shared-memory sync planner cannot handle that): loops
over a buffer clamp the index (the spare threads repeat the last element), and threads without a tile
store zero accumulators to rows of the partial buffer that nobody reads.

The step's math is not written here: the step program of ``halstm.lowering`` is scheduled only to inline
its elementwise math (``inline_elementwise``), and each block's expression is re-indexed onto the
block's units. The prologue (hoisted input GEMM, weight packing, state copies) keeps the step-loop
recipe's schedule.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import tvm
from tvm.s_tir import Schedule

from halstm.lowering import indent, skeleton

from .cuda import BYTES, CudaStepLoop, bind_flat, gemm_tiled, hoisted_tile
from .recipe import Recipe, child_blocks, inline_elementwise, is_reduction

# Bytes every shared buffer has at least. TVM's merge of the shared allocations
# (MergeSharedMemoryAllocations) gives no offset to one of 32 bits or less: its planner keeps such
# "small arrays" (meant for registers) out of the free lists whose entries it lays out, and rewriting
# their accesses then fails its check (merge_shared_memory_allocations.cc:684). Only the float32 sums
# and the input projection can be that small (weight and operand rows hold 2 * VECTOR elements at
# least), and setup zeroes all of those, so TVM's compaction of a buffer to the region its accesses
# touch keeps the padding.
MIN_SHARED_BYTES = 8

# Largest batch at which ``recipes_for`` puts this recipe first. H100, 2026-11-22, register-tiled kernel
# (docs/gpu-results.md, fourth run): faster than the step loop at B=1 (2.8-3.9x), B=16, H=512 (2.9-5.2x),
# (T, B, H) = (1024, 16, 768) (2.9-5.8x) and B=64, H=1024 (1.1-2.3x, every cell, fp32 and fp16, before the
# step loop's fp16 GEMMs ran on tensor cores: ``recipes_for`` has the rule for those); B=256 is not
# measured with it. A size rule only; the tuner measures both.
PREFERRED_MAX_BATCH = 64

VECTOR = 4  # k a thread moves at once: operand staging, and shared memory to registers in the GEMM
MAX_TILE_REGISTERS = 64  # accumulators + operand registers a thread may hold (spills beyond)


class CudaPersistent(Recipe):
    """Knobs: ``threads`` a block; ``units`` hidden units a block (the grid is H / units: fewer blocks,
    a cheaper grid sync, more work each); the register tile ``tile_rows`` x ``tile_cols`` (rows of
    the batch x columns of the block's gates); ``max_split`` caps the split-K parts (each output then
    sums that many partials serially)."""

    name = "cuda-persistent"
    knobs = {
        "threads": (256, 512, 128),
        "units": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
        "tile_rows": (4, 2, 1, 8),
        "tile_cols": (4, 2, 8, 1),
        "max_split": (32, 8, 128),
    }
    build_options = {"cooperative": True}

    def defaults(self, program, target) -> dict:
        """The fewest units that keep the grid within the SMs (the largest grid); the largest row tile
        within the batch; the largest column tile that divides the block's columns."""
        H, B = program.cell.hidden_size, program.batch
        k = super().defaults(program, target)
        k["units"] = next(u for u in range(1, H + 1) if H % u == 0 and H // u <= target.sms)
        k["tile_rows"] = max(t for t in (4, 2, 1) if t <= B)
        columns = _widest(program) // H * k["units"]
        k["tile_cols"] = max(t for t in (4, 2, 1) if columns % t == 0)
        return k

    def valid(self, program, target, knobs) -> bool:
        """Co-resident (a grid of at most the SMs), whole units, a tile that runs as chosen (no
        more rows than the batch, columns dividing the block's), registers and shared memory."""
        H, B, U = program.cell.hidden_size, program.batch, knobs["units"]
        if H % U or H // U > target.sms or knobs["threads"] > target.max_threads:
            return False
        tm, tn = knobs["tile_rows"], knobs["tile_cols"]
        if tm > B or (_widest(program) // H * U) % tn or tm * tn + (tm + tn) * VECTOR > MAX_TILE_REGISTERS:
            return False
        kernel = _Kernel.plan(program, target, knobs)
        return kernel is not None and kernel.shared_bytes() <= target.shared_memory

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cuda" and self.valid(program, target, self.defaults(program, target))

    def apply(self, program, target, **knobs) -> Schedule | None:
        k = self.resolve(program, target, knobs)
        kernel = _Kernel.plan(program, target, k)
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


def _widest(program) -> int:
    return max((g.rows for stage in program.plan.stages for g in stage), default=program.cell.hidden_size)


@dataclass
class _Gemm:
    """One step GEMM as a block computes it: B x C outputs (its units' columns of every gate) over K."""

    index: int  # w_packed{index}, buffers *{index}
    name: str
    operand: str  # printed expression of (row, k): what is staged, in its own dtype
    operand_dtype: str
    B: int
    C: int
    K: int
    tm: int
    tn: int
    split: int  # S
    threads: int

    @classmethod
    def sized(cls, index, gemm, operand, dtype, B, C, knobs) -> _Gemm:
        """The sizes that run for these knobs: the tile shrunk to the batch and to a divisor of the
        block's columns; the most split-K parts (a power of two, at most ``max_split``) whose tiles
        the threads can hold, each part at least one chunk of K."""
        NT, K = knobs["threads"], gemm.depth
        tm = min(knobs["tile_rows"], B)
        tn = max(t for t in range(1, knobs["tile_cols"] + 1) if C % t == 0)
        tiles = -(-B // tm) * (C // tn)
        S = 1
        while 2 * S <= knobs["max_split"] and 2 * S * tiles <= NT and 2 * S * VECTOR <= K:
            S *= 2
        return cls(index, gemm.name, operand, dtype, B, C, K, tm, tn, S, NT)

    @property
    def row_tiles(self) -> int:
        return -(-self.B // self.tm)

    @property
    def tiles(self) -> int:
        return self.row_tiles * (self.C // self.tn)

    @property
    def rounds(self) -> int:
        """Tiles each thread computes one after the other (more than one only when S = 1)."""
        return -(-self.tiles * self.split // self.threads)

    @property
    def chunks(self) -> int:
        """VECTOR-wide k chunks each part walks."""
        return -(-self.K // (self.split * VECTOR))

    @property
    def stride(self) -> int:
        """Row stride of the staged operand and the weight columns: K padded to whole chunks of every
        part (zeros past K), plus one VECTOR so that rows start in different banks."""
        return self.chunks * self.split * VECTOR + VECTOR

    @property
    def partial_stride(self) -> int:
        """Elements per part in the partial buffer: rows for every thread's tile, including threads
        without one (they store zeros past the batch), padded to 1 mod 32 banks."""
        thread_tiles = -(-self.rounds * self.threads // self.split)
        rows = -(-thread_tiles // (self.C // self.tn)) * self.tm
        return rows * self.C + (1 - rows * self.C) % 32

    @property
    def gates(self) -> str:
        """The buffer the elementwise math reads the GEMM's result from, indexed row * C + column."""
        return f"g_s{self.index}" if self.split > 1 else f"part{self.index}"


class _Kernel:
    """The planned persistent kernel: its knobs, the step's blocks in order, as text."""

    def __init__(self, program, target, knobs, blocks, hoisted, staged):
        self.p, self.target, self.blocks, self.staged = program, target, blocks, staged
        self.hoisted = hoisted  # (index, name, columns a block) of the hoisted GEMMs prefetched a step
        self.threads, self.units = knobs["threads"], knobs["units"]
        self.H = program.cell.hidden_size
        self.grid = self.H // self.units

    @classmethod
    def plan(cls, program, target, knobs):
        """None when the step has math a block cannot do on its own units (see ``_step_blocks``)."""
        H, B, U = program.cell.hidden_size, program.batch, knobs["units"]
        analysed = _step_blocks(program)
        if analysed is None:
            return None
        blocks = [_Gemm.sized(program.plan.gemms.index(what), what, text, dtype, B, what.rows // H * U, knobs)
                  if kind == "gemm" else (kind, what, ivs, text) for kind, what, ivs, text, dtype in analysed]
        gemms = [g for g in blocks if isinstance(g, _Gemm)]
        # the hoisted GEMMs' gate columns of the own units are prefetched with the operand
        hoisted = [(program.plan.gemms.index(g), g.name, g.rows // H * U) for g in program.plan.hoisted
                   if g.rows % H == 0]
        for n, b in enumerate(blocks):
            if not isinstance(b, _Gemm):
                kind, name, ivs, value = b
                value = _on_chip(value, ivs, gemms, hoisted, H, U)
                if value is None:
                    return None
                blocks[n] = (kind, name, ivs, value)
        kernel = cls(program, target, knobs, blocks, hoisted, staged=True)
        if kernel.shared_bytes() > target.shared_memory:  # the operands do not fit beside the weights
            kernel.staged = False
        return kernel

    # --- sizes -------------------------------------------------------------------------------
    def shared_bytes(self) -> int:
        return sum(size * BYTES[dtype] for _, size, dtype, scope in self.buffers() if scope == "shared.dyn")

    # --- text --------------------------------------------------------------------------------
    def global_column(self, c: str) -> str:
        """Column of the GEMM result for local column c of this block."""
        return f"({c}) // {self.units} * {self.H} + p_bx * {self.units} + ({c}) % {self.units}"

    def flat(self, count: int, body) -> list[str]:
        """A loop of all threads over ``count`` items, the index clamped (no condition around stores)."""
        q = f"T.min(p_r * {self.threads} + p_tx, {count - 1})"
        return [f"for p_r in range({-(-count // self.threads)}):", *indent(body(q), 4).splitlines()]

    def load_weights(self, g: _Gemm) -> list[str]:
        """Columns k-contiguous: w_s[c * stride + k], zeros past K; read column-fastest (coalesced)."""
        dtype, total = self.p.dtype, g.C * g.stride
        i = g.index

        def body(q):
            k, c = f"{q} // {g.C}", f"{q} % {g.C}"
            value = (f"T.if_then_else({k} < {g.K}, w_packed{i}[T.min({k}, {g.K - 1}), {self.global_column(c)}], "
                     f'T.Cast("{dtype}", T.float32(0)))')
            return [f"w_s{i}[({c}) * {g.stride} + {k}] = {value}"]

        return self.flat(total, body)

    def zero(self, name: str, size: int, dtype: str) -> list[str]:
        return self.flat(size, lambda q: [f'{name}[{q}] = T.Cast("{dtype}", T.float32(0))'])

    def prefetch(self, i: int, name: str, columns: int, q: str) -> list[str]:
        """The step's row block of a hoisted GEMM, the block's units' gate columns, into x_s[row * C + c]."""
        return [f"x_s{i}[{q}] = {name}_t[{q} // {columns}, {self.global_column(f'{q} % {columns}')}]"]

    def stage_operand(self, g: _Gemm) -> list[str]:
        """The step's B x K operand into a_s[row * stride + k], VECTOR at a time where rows allow."""
        v = VECTOR if g.K % VECTOR == 0 and self.H % VECTOR == 0 else 1
        per_row = g.K // v

        def body(q):
            lines = [f"for p_v in T.vectorized({v}):"] if v > 1 else []
            k = f"({q}) % {per_row} * {v}" + (" + p_v" if v > 1 else "")
            value = substitute(g.operand, {"p_row": f"{q} // {per_row}", "p_k": k})
            store = f"a_s{g.index}[({q}) // {per_row} * {g.stride} + {k}] = {value}"
            return lines + [("    " if v > 1 else "") + store]

        return self.flat(g.B * per_row, body) + ['T.tvm_storage_sync("shared")']

    def gemm_text(self, g: _Gemm) -> list[str]:
        S, tm, tn, V, i = g.split, g.tm, g.tn, VECTOR, g.index
        work = "p_tx" if g.rounds == 1 else f"(p_t * {self.threads} + p_tx)"
        part, tile = f"{work} % {S}", f"{work} // {S}"
        row, col = f"{tile} // {g.C // tn} * {tm} + p_i", f"{tile} % {g.C // tn} * {tn} + p_j"
        k = f"(p_c * {S} + {part}) * {V} + p_v"
        if self.staged:
            a = f"a_s{i}[({row}) * {g.stride} + {k}]"
        else:  # read from global memory, clamped: past the batch or K the weights or results are unused
            a = substitute(g.operand, {"p_row": f"T.min({row}, {g.B - 1})", "p_k": f"T.min({k}, {g.K - 1})"})
        vec = "T.vectorized" if self.staged else "T.unroll"
        compute = [
            f"for p_c in range({g.chunks}):",
            f"    for p_i in T.unroll({tm}):",
            f"        for p_v in {vec}({V}):",
            f'            a_r[p_i * {V} + p_v] = T.Cast("float32", {a})',
            f"    for p_j in T.unroll({tn}):",
            f"        for p_v in T.vectorized({V}):",
            f'            w_r[p_j * {V} + p_v] = T.Cast("float32", w_s{i}[({col}) * {g.stride} + {k}])',
            f"    for p_v in T.unroll({V}):",
            f"        for p_i in T.unroll({tm}):",
            f"            for p_j in T.unroll({tn}):",
            f"                acc[p_i * {tn} + p_j] = acc[p_i * {tn} + p_j] + a_r[p_i * {V} + p_v] * w_r[p_j * {V} + p_v]",
        ]
        if g.tiles * S < g.rounds * self.threads:  # the threads past the tiles only load and sync
            compute = [f"if {work} < {g.tiles * S}:", *indent(compute, 4).splitlines()]
        lines = [f"for p_i in T.unroll({tm * tn}):", "    acc[p_i] = T.float32(0)", *compute,
                 f"for p_i in T.unroll({tm}):",
                 f"    for p_j in T.unroll({tn}):",
                 f"        part{i}[{part} * {g.partial_stride} + ({row}) * {g.C} + {col}] = acc[p_i * {tn} + p_j]"]
        if g.rounds > 1:  # more tiles than threads (then S = 1)
            lines = [f"for p_t in range({g.rounds}):", *indent(lines, 4).splitlines()]
        lines.append('T.tvm_storage_sync("shared")')
        if S > 1:  # split-K sum, four independent chains per output
            chains = min(4, S)

            def body(q):
                return [
                    f"for p_i in T.unroll({chains}):",
                    "    acc[p_i] = T.float32(0)",
                    f"for p_s in range({S // chains}):",
                    f"    for p_i in T.unroll({chains}):",
                    f"        acc[p_i] = acc[p_i] + part{i}[(p_s * {chains} + p_i) * {g.partial_stride} + {q}]",
                    f"g_s{i}[{q}] = " + " + ".join(f"acc[{c}]" for c in range(chains)),
                ]

            lines += self.flat(g.B * g.C, body) + ['T.tvm_storage_sync("shared")']
        return lines

    def elementwise_text(self, run) -> list[str]:
        """Consecutive elementwise blocks in one loop over the block's (row, unit) items: the gate
        math they share is written once per thread and the compiler computes it once."""
        B, U, NT = self.p.batch, self.units, self.threads
        work = f"(p_r * {NT} + p_tx)"
        row, ul = f"{work} // {U}", f"{work} % {U}"
        stores = [f"{name}[{row}, p_bx * {U} + {ul}] = "
                  + substitute(value, {ivs[0]: row, ivs[1]: f"p_bx * {U} + {ul}", "p_ul": ul})
                  for _, name, ivs, value in run]
        return [f"for p_r in range({-(-B * U // NT)}):", f"    if {work} < {B * U}:",
                *indent(stores, 8).splitlines()]

    def buffers(self) -> list[tuple[str, int, str, str]]:
        """(name, elements, dtype, scope) of the block's shared buffers and registers."""
        gemms = [b for b in self.blocks if isinstance(b, _Gemm)]
        out = []
        for g in gemms:
            i = g.index
            out += [(f"w_s{i}", g.C * g.stride, self.p.dtype, "shared.dyn"),
                    (f"part{i}", g.split * g.partial_stride, "float32", "shared.dyn")]
            if g.split > 1:
                out.append((f"g_s{i}", g.B * g.C, "float32", "shared.dyn"))
            if self.staged:
                out.append((f"a_s{i}", g.row_tiles * g.tm * g.stride, g.operand_dtype, "shared.dyn"))
        out += [(f"x_s{i}", self.p.batch * C, "float32", "shared.dyn") for i, _, C in self.hoisted]
        # MIN_SHARED_BYTES at least (ResetBeforeGRU at B=1, H=50: one unit a block, g_s2 holds one sum)
        out = [(name, max(size, -(-MIN_SHARED_BYTES // BYTES[dtype])), dtype, scope)
               for name, size, dtype, scope in out]
        return out + [("acc", max(max(g.tm * g.tn, 4) for g in gemms), "float32", "local"),
                      ("a_r", max(g.tm for g in gemms) * VECTOR, "float32", "local"),
                      ("w_r", max(g.tn for g in gemms) * VECTOR, "float32", "local")]

    def setup(self) -> list[str]:
        """Before the time loop: the weights, and zeros in every other shared buffer. The operand's
        padding (columns past K) must stay zero for all steps; and a buffer first written inside the
        loop is one that TVM's merge of the shared allocations may place over another (it put
        ResetBeforeGRU's second partial buffer over the first): written before the loop, all of them
        stay live through it, apart, as ``shared_bytes`` counts them."""
        lines = []
        for g in (b for b in self.blocks if isinstance(b, _Gemm)):
            lines += self.load_weights(g)
        for name, size, dtype, scope in self.buffers():
            if scope == "shared.dyn" and not name.startswith("w_s"):
                lines += self.zero(name, size, dtype)
        return lines + ['T.tvm_storage_sync("shared")']

    def step(self) -> list[str]:
        """One step: per stage the GEMM, then its elementwise blocks in one loop; grid syncs where a
        block reads what others wrote."""
        lines, stored, run = [], False, []
        for i, name, C in self.hoisted:  # read after the first GEMM's syncs
            lines += self.flat(self.p.batch * C, partial(self.prefetch, i, name, C))
        for b in self.blocks + [None]:
            if b is not None and not isinstance(b, _Gemm):
                run.append(b)
                continue
            if run:
                lines += self.elementwise_text(run)
                stored, run = True, []
            if b is None:
                break
            if stored:  # its operand was written unit by unit across the grid
                lines.append("T.cuda.grid_sync()")
            lines += (self.stage_operand(b) if self.staged else []) + self.gemm_text(b)
        return lines + ["T.cuda.grid_sync()"]

    def func(self) -> tvm.tirx.PrimFunc:
        p, B, H = self.p, self.p.batch, self.H
        frame = skeleton(p.plan, p.steps, B, p.dtype, p.layout)
        outputs = {f"{s}_next" for s in p.cell.states}
        allocs = [f'{b[1]} = T.alloc_buffer(({B}, {H}), "float32")'
                  for b in self.blocks if not isinstance(b, _Gemm) and b[1] not in outputs]
        buffers = [f'{name} = T.sblock_alloc_buffer(({size},), "{dtype}", scope="{scope}")'
                   for name, size, dtype, scope in self.buffers()]
        loop = f"""    for p_bx in T.thread_binding({self.grid}, thread="blockIdx.x"):
        for p_tx in T.thread_binding({self.threads}, thread="threadIdx.x"):
            with T.sblock("persistent"):
{indent(buffers + self.setup(), 16)}
                for t in range({p.steps}):
                    with T.sblock("step"):
{indent(frame.step_views, 24)}
{indent(self.step(), 24)}"""
        return tvm.script.from_source(frame.source(loop, allocs))


_analysed: dict[int, tuple] = {}


def _step_blocks(program):
    """The step's blocks in order, knob-independent (cached: the tuner checks many knob settings):
    ("gemm", Gemm, ivs, operand as text of (p_row, p_k), the operand's dtype) or ("elementwise",
    buffer, ivs, value). None when the step has math a block cannot do on its own units: a cell's
    own reduction, a GEMM whose columns are not whole gates, a block not over (B, H), no step GEMM."""
    hit = _analysed.get(id(program))
    if hit is not None and hit[0] is program:
        return hit[1]
    H, B = program.cell.hidden_size, program.batch
    sch = Schedule(program.mod)
    inline_elementwise(sch, sch.get_sblock("step"))
    names = {g.name: g for g in program.plan.gemms}
    seq = {f"{s}_t": f"{s}_seq" for s in program.cell.states}
    blocks = []
    for b in sch.get_child_blocks(sch.get_sblock("step")):
        block = sch.get(b)
        ivs = [iv.var.name for iv in block.iter_vars]
        extents = [int(iv.dom.extent) for iv in block.iter_vars]
        store = block.body
        if block.name_hint in names:
            gemm = names[block.name_hint]
            operand, weight = store.value.b.a, store.value.b.b  # lowering's _gemm: acc + operand * weight
            if gemm.rows % H or f"w_packed{program.plan.gemms.index(gemm)}[" not in str(weight):
                blocks = None
                break
            # staged in its storage dtype: a state's fp16/bf16 copy, not its float32 view
            if type(operand).__name__ == "Cast" and type(operand.value).__name__ in ("BufferLoad", "TensorLoad"):
                operand = operand.value
            text = re.sub(r"\b(\w+)\[", lambda m: f"{seq.get(m.group(1), m.group(1))}[", str(operand))
            rows = {ivs[0]: "p_row", ivs[2]: "p_k"}
            if any(f"{s}_seq[" in text for s in program.cell.states):  # a state's view: its sequence's rows
                rows[ivs[0]] = f"t * {B} + p_row"
            blocks.append(("gemm", gemm, ivs, substitute(text, rows), str(operand.ty)))
        elif is_reduction(sch, b) or extents != [B, H]:
            blocks = None
            break
        else:
            blocks.append(("elementwise", store.buffer.name, ivs, str(store.value), None))
    if blocks is not None and not any(b[0] == "gemm" for b in blocks):
        blocks = None  # nothing to keep on chip: the step loop runs it
    if len(_analysed) > 16:
        _analysed.clear()
    _analysed[id(program)] = (program, blocks)
    return blocks


def _on_chip(value: str, ivs, gemms, hoisted, H: int, U: int) -> str | None:
    """The elementwise math's reads of GEMM results and of the hoisted input projection at the own
    row and a gate column of the own unit (``unit + gate * H``), re-indexed into their shared buffers:
    local column gate * U + the unit's place in the block (``p_ul``). None when it reads a step GEMM's
    result anywhere else; other input-projection reads stay global."""
    row, unit = ivs

    def rewrite(value, buffer, shared, columns):
        def gate(m):
            column = int(m.group(1) or 0)
            if column % H:
                return m.group(0)
            return f"{shared}[{row} * {columns} + {column // H * U} + p_ul]"

        return re.sub(rf"\b{buffer}\[{row}, {unit}(?: \+ (\d+))?\]", gate, value)

    for g in gemms:
        value = rewrite(value, g.name, g.gates, g.C)
        if re.search(rf"\b{g.name}\[", value):
            return None
    for i, name, columns in hoisted:
        value = rewrite(value, f"{name}_t", f"x_s{i}", columns)
    return value


def substitute(text: str, names: dict[str, str]) -> str:
    """Replace whole-word variable names in printed TIR by parenthesised expressions."""
    if not names:
        return text
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return pattern.sub(lambda m: f"({names[m.group(1)]})", text)
