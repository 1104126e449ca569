"""The persistent kernel as TVMScript, written for one program and one setting of the knobs of its
recipe (``cuda_persistent.py``, which describes the kernel and what was measured): each step GEMM as
a block computes it (``BlockGemm``), the kernel's buffers, setup and time loop as text
(``PersistentKernel``), and what that text is printed from, the lowering's step program: its blocks
in order, the elementwise math re-indexed onto a block's units, the packed weights' values
(``_analyse_step``, ``_on_chip``, ``_packings``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import tvm
from tvm.s_tir import Schedule

from halstm.lowering import indent, skeleton

from .cuda_tensorcore import BYTES
from .recipe import inline_elementwise, is_reduction
from .wmma import FRAG

# Every shared buffer's size is a multiple of this many bytes. TVM merges the shared allocations
# (MergeSharedMemoryAllocations) back to back, so each then starts 32-byte aligned, as the WMMA
# fragment loads and stores need. It also keeps buffers above 32 bits: TVM's merge gives no offset to
# one of 32 bits or less (its planner keeps such "small arrays", meant for registers, out of the free
# lists it lays out, and rewriting their accesses fails its check, merge_shared_memory_allocations.cc:684;
# ResetBeforeGRU at B=1, H=50 has a one-float split-K sum). Setup zeroes every buffer whole, so TVM's
# compaction of a buffer to the region its accesses touch keeps the padding.
SHARED_GRANULE = 32

VECTOR = 4  # k a thread moves at once: operand staging, and shared memory to registers in the GEMM
# Rounds of the step's loads from global memory (the operand, the input projection) a thread has in
# flight at once. H100, LSTM fp16 T=100 B=64 H=1024, tensor cores: one load at a time (a rolled loop, 32
# rounds of 16 bytes a thread for the 128 KB operand) left 25 us a step whatever the GEMM's threads
# (128, 256, 512: 2.8, 2.5, 2.5 ms), against 4.4 us at B=16, H=512 (16 KB).
STAGING_UNROLL = 8
# Weight fragments a warp may keep in registers for all steps (knob resident_weights): 4 registers
# each at fp16/bf16 (16 x 16 halfs over 32 lanes), 64 at most beside the accumulators: a budget chosen,
# not compared with others (ptxas: 58 registers a thread at LSTM fp16 B=16 H=512, 4 fragments a warp).
MAX_RESIDENT_FRAGS = 16
# The bits a polled state's sequence holds until its value is written (``PersistentKernel.polled``), by width:
# a NaN with every bit set, which no arithmetic produces (canonical NaNs are positive).
SENTINEL = {16: 0xFFFF, 32: 0xFFFFFFFF}


def _warp_frags(row_tiles: int, frags: int, warps: int, most: int) -> int:
    """Column fragments a warp: of the divisors of the block's ``frags`` up to ``most``, the fewest whose
    tiles share out evenly among the warps (no warp idle), else the most. H100, fp16 T=100:
    GRU (100,64,1024), 16 units x 2 row blocks, 48 columns: 1 fragment (6 tiles for 8 warps) 0.862 ms, 3
    (2 tiles, 4 split-K parts) 0.713; LSTM there (64 columns: 8 tiles) 1 fragment 0.929; LSTM (100,256,1024)
    streamed (8 x 4 fragments) 4 fragments 2.78-2.89, 2 3.81-3.87."""
    options = [f for f in range(1, most + 1) if frags % f == 0]
    return next((f for f in options if warps % (row_tiles * frags // f) == 0), options[-1])


@dataclass
class BlockGemm:
    """One step GEMM as a block computes it: B x C outputs (its rows of the batch, its units' columns
    of every gate) over K, in tiles of tm x tn: a thread's registers (FFMA), or a warp's 16 x 16
    fragments (tensor cores: ``frags`` of them side by side, tn = 16 x frags)."""

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
    tensor_cores: bool = False
    view: str | None = None  # the buffer the operand is, read as stored at (row, k): h_t, or a scratch
    resident: bool = False  # the warp's weight fragments in registers for all steps (tensor cores)

    @classmethod
    def sized(cls, index, gemm, operand, dtype, view, B, C, knobs, weights_dtype) -> BlockGemm:
        """The sizes that run for these knobs: the tile shrunk to the batch and to a divisor of the
        block's columns (FFMA) or 16 x 16 x ``_warp_frags`` fragments (tensor cores: the operand staged
        in the weights' dtype, a state as it is, a computed r * h rounded to it as a torch cell in that
        dtype rounds it); the most split-K parts (a power of two, at most ``max_split``) whose tiles the
        threads (warps) can hold, each part at least one chunk of K."""
        NT, K = knobs["threads"], gemm.depth
        tc = knobs["tensor_cores"]
        if tc:
            tm, tn = FRAG, FRAG * _warp_frags(-(-B // FRAG), -(-C // FRAG), NT // 32, knobs["warp_frags"])
            if dtype != weights_dtype:
                operand, dtype, view = f'T.Cast("{weights_dtype}", {operand})', weights_dtype, None
        else:
            tm = min(knobs["tile_rows"], B)
            tn = max(t for t in range(1, knobs["tile_cols"] + 1) if C % t == 0)
        g = cls(index, gemm.name, operand, dtype, B, C, K, tm, tn, 1, NT, tc, view)
        while 2 * g.split <= knobs["max_split"] and 2 * g.split * g.tiles <= g.workers and 2 * g.split * g.width <= K:
            g.split *= 2
        g.resident = knobs["resident_weights"] and g.fits_registers
        return g

    @property
    def fits_registers(self) -> bool:
        """Whether a warp's weight fragments fit in registers for all steps (``resident``): tensor
        cores, one tile a warp, at most MAX_RESIDENT_FRAGS fragments over its chunks of K."""
        return self.tensor_cores and self.rounds == 1 and self.chunks * self.frags <= MAX_RESIDENT_FRAGS

    @property
    def workers(self) -> int:
        """What computes one tile: a thread, or a warp on tensor cores."""
        return self.threads // 32 if self.tensor_cores else self.threads

    @property
    def width(self) -> int:
        """k of one chunk: VECTOR a thread loads at once, or a fragment's 16."""
        return FRAG if self.tensor_cores else VECTOR

    @property
    def ldc(self) -> int:
        """Columns of the result buffers: C, padded to whole fragments on tensor cores."""
        return -(-self.C // FRAG) * FRAG if self.tensor_cores else self.C

    @property
    def frags(self) -> int:
        """16-column fragments in a warp's tile (tensor cores)."""
        return self.tn // FRAG

    @property
    def streams(self) -> bool:
        """Whether tensor cores can load the operand's fragments straight from global memory: a
        buffer read as stored, whole fragments of rows and of K (WMMA loads 32-byte aligned rows)."""
        return self.tensor_cores and self.view is not None and self.B % FRAG == 0 and self.K % FRAG == 0

    @property
    def row_tiles(self) -> int:
        return -(-self.B // self.tm)

    @property
    def tiles(self) -> int:
        return self.row_tiles * (self.ldc // self.tn)

    @property
    def rounds(self) -> int:
        """Tiles each worker computes one after the other (more than one only when S = 1)."""
        return -(-self.tiles * self.split // self.workers)

    @property
    def idle(self) -> bool:
        """Whether some workers have no tile in the last round."""
        return self.tiles * self.split < self.rounds * self.workers

    @property
    def chunks(self) -> int:
        """Chunks of k each part walks."""
        return -(-self.K // (self.split * self.width))

    @property
    def stride(self) -> int:
        """Row stride of the weight columns and of the staged operand (the widest of the GEMMs that
        share it): K padded to whole chunks of every part (zeros past K), plus 16 bytes so that rows
        start in different banks (a multiple of 8 elements, 16 bytes, as WMMA's loads need)."""
        pad = 8 if self.tensor_cores else VECTOR
        return self.chunks * self.split * self.width + pad

    @property
    def partial_stride(self) -> int:
        """Elements per part in the partial buffer: rows for every worker's tile, including workers
        without one (FFMA threads store zeros past the batch), padded to 1 mod 32 banks; on tensor
        cores whole fragments (then 32-byte aligned)."""
        if self.tensor_cores:
            return self.row_tiles * self.tm * self.ldc
        thread_tiles = -(-self.rounds * self.threads // self.split)
        rows = -(-thread_tiles // (self.C // self.tn)) * self.tm
        return rows * self.C + (1 - rows * self.C) % 32

    @property
    def partial_size(self) -> int:
        """The partial buffer: every part, and on tensor cores room for one more fragment (16 rows
        of ldc) that idle warps store to (a shared store is never inside a condition)."""
        spare = FRAG * self.ldc if self.tensor_cores and self.idle else 0
        return self.split * self.partial_stride + spare

    def result(self, q: str) -> str:
        """The GEMM's result at q = row * ldc + column, as the elementwise math reads it: its S
        partials added there. A pass of all threads adding them into a buffer first, and two more
        block barriers a step, was 2-9 % slower (H100, T=100, prepared ms: fp16 LSTM
        (1024,16,768) 2.531 / 2.633, (512,64,512) 1.630 / 1.724, GRU (100,64,1024) 0.590 / 0.624
        with waiters, ResetBeforeGRU (100,16,512) 0.468 / 0.488; (100,16,512) 0.222 / 0.225)."""
        return "(" + " + ".join(f"part{self.index}[{s * self.partial_stride} + {q}]" for s in range(self.split)) + ")"


@dataclass(frozen=True)
class _Operand:
    """A staged-operand buffer, a_s[row * stride + k]: rows x stride elements of dtype."""

    name: str
    dtype: str
    rows: int
    stride: int


def _staged_operands(gemms: list[BlockGemm]) -> dict[int, _Operand]:
    """Each GEMM's staged-operand buffer, by GEMM index: one a dtype, shared by the GEMMs that stage
    it (ResetBeforeGRU's h and r * h on tensor cores), so that shared memory holds the largest operand,
    not their sum. The GEMMs run one after the other (a sync ends each one's reads before the next
    stages), and with the rows and stride of the largest, k past K and rows past B stay zero for all."""
    out = {}
    for dtype in dict.fromkeys(g.operand_dtype for g in gemms):
        users = [g for g in gemms if g.operand_dtype == dtype]
        operand = _Operand(f"a_s{users[0].index}", dtype, max(g.row_tiles * g.tm for g in users),
                           max(g.stride for g in users))
        out |= {g.index: operand for g in users}
    return out


class PersistentKernel:
    """The planned persistent kernel: its knobs, the step's blocks in order, as text."""

    def __init__(self, program, target, knobs, blocks, hoisted, staged):
        self.p, self.target, self.blocks, self.staged = program, target, blocks, staged
        self.hoisted = hoisted  # (index, name, columns a block) of the hoisted GEMMs prefetched a step
        self.operands = _staged_operands(self.gemms)
        self.threads, self.units, self.row_blocks = knobs["threads"], knobs["units"], knobs["row_blocks"]
        self.poll, self.waiters = knobs["poll_states"], knobs["poll_waiters"]
        self.H = program.cell.hidden_size
        self.groups = self.H // self.units  # unit groups; block p_bx has group p_bx % groups
        self.rows = program.batch // self.row_blocks  # rows of the batch a block; from row p_bx // groups * rows
        self.grid = self.groups * self.row_blocks

    @property
    def gemms(self) -> list[BlockGemm]:
        return [b for b in self.blocks if isinstance(b, BlockGemm)]

    @classmethod
    def plan(cls, program, target, knobs):
        """None when the step has math a block cannot do on its own units (see ``_step_blocks``) or
        the block's buffers do not fit in shared memory. The operands are staged in shared memory
        where they fit (and ``stage_operand``); else read from global memory, which on tensor cores
        needs every GEMM's operand to be a buffer as stored (``BlockGemm.streams``)."""
        H, U = program.cell.hidden_size, knobs["units"]
        rows = program.batch // knobs["row_blocks"]
        analysed = _step_blocks(program)
        if analysed is None:
            return None
        blocks = [BlockGemm.sized(program.plan.gemms.index(what), what, text, dtype, view, rows, what.rows // H * U,
                              knobs, program.dtype)
                  if kind == "gemm" else (kind, what, ivs, text) for kind, what, ivs, text, dtype, view in analysed]
        gemms = [g for g in blocks if isinstance(g, BlockGemm)]
        # the hoisted GEMMs' gate columns of the own units are prefetched with the operand
        hoisted = [(program.plan.gemms.index(g), g.name, g.rows // H * U) for g in program.plan.hoisted
                   if g.rows % H == 0]
        for n, b in enumerate(blocks):
            if not isinstance(b, BlockGemm):
                kind, name, ivs, value = b
                value = _on_chip(value, ivs, gemms, hoisted, H, U)
                if value is None:
                    return None
                blocks[n] = (kind, name, ivs, value)
        kernel = cls(program, target, knobs, blocks, hoisted, staged=True)
        if ((kernel.shared_bytes() > target.shared_memory or not knobs["stage_operand"])
                and (not knobs["tensor_cores"] or all(g.streams for g in gemms))):
            kernel.staged = False
        return kernel if kernel.shared_bytes() <= target.shared_memory else None

    # --- sizes -------------------------------------------------------------------------------
    def shared_bytes(self) -> int:
        return sum(size * BYTES[dtype] for _, size, dtype, scope in self.buffers() if scope == "shared.dyn")

    # --- text --------------------------------------------------------------------------------
    @property
    def first_unit(self) -> str:
        """The block's first hidden unit."""
        group = "p_bx" if self.row_blocks == 1 else f"p_bx % {self.groups}"
        return f"{group} * {self.units}"

    def global_column(self, c: str) -> str:
        """Column of the GEMM result for local column c of this block."""
        return f"({c}) // {self.units} * {self.H} + {self.first_unit} + ({c}) % {self.units}"

    def global_row(self, r: str) -> str:
        """Row of the batch for local row r of this block."""
        return r if self.row_blocks == 1 else f"p_bx // {self.groups} * {self.rows} + ({r})"

    @property
    def polled(self) -> tuple[str, ...]:
        """The states whose values synchronise the step instead of a grid sync at its end (knob
        poll_states): where the step has one stage and every GEMM stages a state as stored, the
        sequence of each such state is filled with SENTINEL before the time loop (then one grid sync),
        and a block stages the next step's rows by reading them past L1 until no value is the
        sentinel (``poll_operand``); a stored value that happens to be the sentinel's bits is stored
        as another NaN. Every block still reads only what was written before it, and none runs more
        than a step ahead. Needs sm_70's relaxed loads."""
        gemms = self.gemms
        first_elementwise = next((n for n, b in enumerate(self.blocks) if not isinstance(b, BlockGemm)), len(self.blocks))
        states = tuple(dict.fromkeys(g.view[:-2] for g in gemms if g.view and g.view[:-2] in self.p.cell.states))
        one_stage = all(isinstance(b, BlockGemm) for b in self.blocks[:first_elementwise]) and not any(
            isinstance(b, BlockGemm) for b in self.blocks[first_elementwise:])
        if (not self.poll or not self.staged or not one_stage or self.target.compute_capability < 70
                or any(g.view is None or g.view[:-2] not in states for g in gemms)):
            return ()
        return states

    @property
    def polled_bytes(self) -> int:
        """Bytes of the operands a block stages a step (polled: every GEMM's)."""
        return sum(g.B * g.K * BYTES[g.operand_dtype] for g in self.gemms)

    def flat(self, count: int, body, unroll: int = 1) -> list[str]:
        """A loop of all threads over ``count`` items, the index clamped (no condition around stores);
        ``unroll`` rounds at a time unrolled, so that a thread's loads of them are in flight together."""
        rounds = -(-count // self.threads)
        unroll = min(unroll, rounds)
        if unroll == 1:
            q = f"T.min(p_r * {self.threads} + p_tx, {count - 1})"
            return [f"for p_r in range({rounds}):", *indent(body(q), 4).splitlines()]
        q = f"T.min((p_r * {unroll} + p_u) * {self.threads} + p_tx, {count - 1})"
        return [f"for p_r in range({-(-rounds // unroll)}):", f"    for p_u in T.unroll({unroll}):",
                *indent(body(q), 8).splitlines()]

    def load_weights(self, g: BlockGemm) -> list[str]:
        """Columns k-contiguous: w_s[c * stride + k], zeros past K and past C (the columns padded to
        whole fragments), read where they are (the value ``lowering.stacked`` packs: the parameter
        (N, K) itself for a GEMM of one matmul), k fastest: coalesced."""
        (k_iv, n_iv), weight = _packings(self.p)[g.index]

        def body(q):
            c, k = f"{q} // {g.stride}", f"{q} % {g.stride}"
            inside = f"{k} < {g.K}" + (f" and {c} < {g.C}" if g.ldc > g.C else "")
            column = self.global_column(f"T.min({c}, {g.C - 1})" if g.ldc > g.C else c)
            value = substitute(weight, {k_iv: f"T.min({k}, {g.K - 1})", n_iv: column})
            return [f'w_s{g.index}[{q}] = T.if_then_else({inside}, {value}, T.Cast("{self.p.dtype}", T.float32(0)))']

        return self.flat(g.ldc * g.stride, body)

    def zero(self, name: str, size: int, dtype: str) -> list[str]:
        return self.flat(size, lambda q: [f'{name}[{q}] = T.Cast("{dtype}", T.float32(0))'])

    def prefetch(self, i: int, name: str, columns: int, q: str) -> list[str]:
        """The step's row block of a hoisted GEMM, the block's units' gate columns, into x_s[row * C + c]."""
        row, column = self.global_row(f"{q} // {columns}"), self.global_column(f"{q} % {columns}")
        return [f"x_s{i}[{q}] = {name}_t[{row}, {column}]"]

    def stage_operand(self, g: BlockGemm) -> list[str]:
        """The step's B x K operand into a_s[row * stride + k], VECTOR at a time where rows allow
        (16 bytes on tensor cores, whose rows are whole 16 bytes)."""
        v = self.staging_vector(g)
        if self.polled:
            return self.poll_operand(g, v) + ['T.tvm_storage_sync("shared")']
        per_row, count, a = g.K // v, g.B * g.K // v, self.operands[g.index]

        def body(q):
            lines = [f"for p_v in T.vectorized({v}):"] if v > 1 else []
            k = f"({q}) % {per_row} * {v}" + (" + p_v" if v > 1 else "")
            value = substitute(g.operand, {"p_row": self.global_row(f"{q} // {per_row}"), "p_k": k})
            store = f"{a.name}[({q}) // {per_row} * {a.stride} + {k}] = {value}"
            return lines + [("    " if v > 1 else "") + store]

        return self.flat(count, body, STAGING_UNROLL) + ['T.tvm_storage_sync("shared")']

    def staging_vector(self, g: BlockGemm) -> int:
        """Elements of the operand a thread stages at once."""
        v = 16 // BYTES[g.operand_dtype] if g.tensor_cores else VECTOR
        return v if g.K % v == 0 and self.H % v == 0 else 1

    def poll_operand(self, g: BlockGemm, v: int) -> list[str]:
        """The staging of ``stage_operand`` through the helpers of targets/cuda.py, from the second
        step (the first stages the initial state): after a block barrier, a thread's STAGING_UNROLL
        vectors of v elements are loaded together and reloaded until none holds the sentinel
        (``halstm_poll_stage``); with ``poll_waiters``, before that barrier one thread per unit group
        waits for the first value that group's block writes of this block's rows
        (``halstm_wait_value``). Without waiters the barrier still waits for the step's input
        projection (``prefetch``, issued first), which spaces the first polls from the step's end
        by a global load: polling at once is 1.4-1.6x slower (H100; the loads crowd L2 while the
        producers write), after the barrier 1-12 % faster than the waiters, whose phase was a third
        of the step (H100 fp16 T=100, prepared ms, LSTM
        (100,16,512) 0.234 / 0.265, (100,8,512) 0.228 / 0.240, (1024,16,768) 2.608 / 2.748, GRU
        (100,16,512) 0.226 / 0.230)."""
        per_row, count, a, word = g.K // v, g.B * g.K // v, self.operands[g.index], BYTES[g.operand_dtype]
        lines = ['T.tvm_storage_sync("shared")']
        if self.waiters:
            waiter = f"p_w * {self.threads} + p_tx"
            first = f'{g.view}.access_ptr("r", offset=({self.global_row("0")}) * {g.K} + ({waiter}) * {self.units})'
            lines = [f"for p_w in range({-(-self.groups // self.threads)}):", f"    if {waiter} < {self.groups}:",
                     f'        T.evaluate(T.call_extern("void", "halstm_wait_value<{word}>", t > 0, {first}))',
                     *lines]
        rounds = -(-count // self.threads)
        unroll = min(STAGING_UNROLL, rounds)
        pointers = []
        for u in range(unroll):
            q = f"T.min((p_r * {unroll} + {u}) * {self.threads} + p_tx, {count - 1})"
            row, k = f"{q} // {per_row}", f"{q} % {per_row} * {v}"
            pointers += [f'{a.name}.access_ptr("w", offset={row} * {a.stride} + {k})',
                         f'{g.view}.access_ptr("r", offset=({self.global_row(row)}) * {g.K} + {k})']
        call = f'T.call_extern("void", "halstm_poll_stage<{v * word}, {word}>", t > 0, {", ".join(pointers)})'
        return lines + [f"for p_r in range({-(-rounds // unroll)}):", f"    T.evaluate({call})"]

    def over_grid(self, rows: int, store, v: int = 1) -> list[str]:
        """``store(row, column)`` for every element of ``rows`` x H, shared out over the grid's
        threads, v at once."""
        H = self.H
        total, per_round = rows * H // v, self.grid * self.threads
        i = f"((p_r * {self.grid} + p_bx) * {self.threads} + p_tx)"
        e = f"({i} * {v} + p_v)"
        return [f"for p_r in range({-(-total // per_round)}):", f"    if {i} < {total}:",
                f"        for p_v in T.vectorized({v}):", f"            {store(f'{e} // {H}', f'{e} % {H}')}"]

    def copy_initial(self, state: str) -> list[str]:
        """The initial state into the first rows of its sequence, where the first step reads it (an
        element at a time: the caller's buffer need not be 16-byte aligned)."""
        return self.over_grid(self.p.batch, lambda r, c: f"{state}_seq[{r}, {c}] = {state}0[{r}, {c}]")

    def fill_sentinel(self, state: str) -> list[str]:
        """The state's sequence past the initial state, SENTINEL everywhere, 16 bytes a store where
        rows allow (the sequence is halstm's own allocation)."""
        B, H, dtype = self.p.batch, self.H, self.p.dtype
        v = 16 // BYTES[dtype] if H % (16 // BYTES[dtype]) == 0 else 1
        sentinel = f'T.reinterpret("{dtype}", T.uint{8 * BYTES[dtype]}({SENTINEL[8 * BYTES[dtype]]}))'
        return self.over_grid(self.p.steps * B, lambda r, c: f"{state}_seq[{B} + {r}, {c}] = {sentinel}", v)

    def gemm_text(self, g: BlockGemm) -> list[str]:
        """The GEMM's partial tiles and a sync (the elementwise math adds the partials: ``result``)."""
        return (self.tensor_core_text(g) if g.tensor_cores else self.register_tile_text(g)) + [
            'T.tvm_storage_sync("shared")']

    def warp_tile(self, g: BlockGemm) -> tuple[str, str, str, str, str]:
        """(work, part, row, column, k of chunk p_c) of this warp's tile on tensor cores."""
        warp = "p_tx // 32"
        work = warp if g.rounds == 1 else f"(p_t * {g.workers} + {warp})"
        part, tile = f"{work} % {g.split}", f"{work} // {g.split}"
        row, col = f"{tile} // {g.ldc // g.tn} * {FRAG}", f"{tile} % {g.ldc // g.tn} * {g.tn}"
        return work, part, row, col, f"(p_c * {g.split} + {part}) * {FRAG}"

    def load_fragment(self, frag: str, index: str, buffer: str, offset: str, stride, layout: str) -> str:
        """WMMA's load of fragment ``index`` of ``frag`` from ``buffer`` at ``offset``."""
        pointer = f'{buffer}.access_ptr("r", ptr_type="{self.p.dtype}", offset={offset})'
        return (f"T.evaluate(T.tvm_load_matrix_sync({frag}.data, 16, 16, 16, {index}, {pointer}, {stride}, "
                f'"{layout}", dtype="void"))')

    def resident_weights(self, g: BlockGemm) -> list[str]:
        """Before the time loop: the weight fragments of each of this warp's chunks into wf (registers),
        which the step's GEMM then uses in place of loads from w_s. Measured (H100, LSTM fp16
        (100,16,512)): cuDNN's persistent kernel keeps its weights in registers (144 a thread) and
        issued a third of the instructions of this kernel reloading them from shared memory;
        resident, the kernel took 3-12 % less (0.249 ms against 0.264 there, 2.754 against 3.128 at
        (1024,16,768))."""
        work, _, _, col, k = self.warp_tile(g)
        F, i = g.frags, g.index
        load = self.load_fragment(f"wf{i}", f"p_c * {F} + p_f", f"w_s{i}", f"({col} + p_f * {FRAG}) * {g.stride} + {k}",
                                  g.stride, "col_major")
        lines = [f"for p_c in T.unroll({g.chunks}):", f"    for p_f in T.unroll({F}):", f"        {load}"]
        if g.idle:
            lines = [f"if {work} < {g.tiles * g.split}:", *indent(lines, 4).splitlines()]
        size = {name: n for name, n, *_ in self.buffers()}
        return [f'with T.sblock("resident_weights{i}"):', f"    T.reads(w_s{i}[0:{size[f'w_s{i}']}])",
                f"    T.writes(wf{i}[0:{size[f'wf{i}']}])", *indent(lines, 4).splitlines()]

    def tensor_core_text(self, g: BlockGemm) -> list[str]:
        """Warp (tile, part) multiplies 16 x 16 fragments of the operand (row-major: staged, or the
        state in global memory) and of the weight columns (column-major: k contiguous) into its tile's
        ``frags`` accumulators, fp32, each operand fragment feeding all of them, and stores its tile to
        part[part][row * ldc + column]; warps without a tile store zeros to the spare fragments."""
        S, i, F = g.split, g.index, g.frags
        work, part, row, col, k = self.warp_tile(g)
        load = self.load_fragment
        if self.staged:
            a = self.operands[i]
            source, load_a = a.name, load("a_f", "0", a.name, f"({row}) * {a.stride} + {k}", a.stride, "row_major")
        else:  # each fragment straight from global memory (a deeper ring of them in flight: no faster)
            source = g.view
            load_a = load("a_f", "0", g.view, f"({self.global_row(row)}) * {g.K} + {k}", g.K, "row_major")
        if g.resident:  # unrolled: a fragment's index must be a constant to stay in registers
            b, loop, load_b = (f"wf{i}", f"p_c * {F} + p_f"), f"T.unroll({g.chunks})", []
        else:
            b, loop = ("b_f", "0"), f"range({g.chunks})"
            load_b = ["        " + load("b_f", "0", f"w_s{i}", f"({col} + p_f * {FRAG}) * {g.stride} + {k}", g.stride,
                                        "col_major")]
        compute = [f"for p_c in {loop}:", f"    {load_a}", f"    for p_f in T.unroll({F}):", *load_b,
                   f"        T.evaluate(T.tvm_mma_sync(acc_f.data, p_f, a_f.data, 0, {b[0]}.data, {b[1]}, acc_f.data, "
                   'p_f, dtype="void"))']
        target = f"{part} * {g.partial_stride} + ({row}) * {g.ldc} + {col}"
        if g.idle:
            compute = [f"if {work} < {g.tiles * S}:", *indent(compute, 4).splitlines()]
            target = f"T.if_then_else({work} < {g.tiles * S}, {target}, {S * g.partial_stride})"
        lines = [f"for p_f in T.unroll({F}):",
                 '    T.evaluate(T.tvm_fill_fragment(acc_f.data, 16, 16, 16, p_f, T.float32(0), dtype="void"))',
                 *compute,
                 f"for p_f in T.unroll({F}):",
                 f'    T.evaluate(T.tvm_store_matrix_sync(acc_f.data, 16, 16, 16, p_f, part{i}.access_ptr("w", '
                 f'ptr_type="float32", offset={target} + p_f * {FRAG}), {g.ldc}, "row_major", dtype="void"))']
        if g.rounds > 1:
            lines = [f"for p_t in range({g.rounds}):", *indent(lines, 4).splitlines()]
        # its own block: TVM cannot infer what the fragment calls read and write (pointers)
        size = {name: n for name, n, *_ in self.buffers()}
        read = f"{source}[0:{size[source]}]" if self.staged else f"{source}[0:{self.p.batch}, 0:{g.K}]"
        dtype = self.p.dtype
        fragments = [f'{name} = T.sblock_alloc_buffer(({n * FRAG * FRAG},), "{dt}", scope="wmma.{scope}")'
                     for name, n, dt, scope in (("a_f", 1, dtype, "matrix_a"), ("b_f", 1, dtype, "matrix_b"),
                                                ("acc_f", F, "float32", "accumulator"))
                     if not (name == "b_f" and g.resident)]
        weights = f"wf{i}" if g.resident else f"w_s{i}"
        return [f'with T.sblock("tensor_core_gemm{i}"):',
                f"    T.reads({read}, {weights}[0:{size[weights]}])",
                f"    T.writes(part{i}[0:{size[f'part{i}']}])",
                *indent(fragments + lines, 4).splitlines()]

    def register_tile_text(self, g: BlockGemm) -> list[str]:
        """Thread (tile, part) accumulates its tm x tn outputs in registers and stores them to
        part[part][row * C + column]."""
        S, tm, tn, V, i = g.split, g.tm, g.tn, VECTOR, g.index
        work = "p_tx" if g.rounds == 1 else f"(p_t * {self.threads} + p_tx)"
        part, tile = f"{work} % {S}", f"{work} // {S}"
        row, col = f"{tile} // {g.C // tn} * {tm} + p_i", f"{tile} % {g.C // tn} * {tn} + p_j"
        k = f"(p_c * {S} + {part}) * {V} + p_v"
        if self.staged:
            operand = self.operands[i]
            a = f"{operand.name}[({row}) * {operand.stride} + {k}]"
        else:  # read from global memory, clamped: past the batch or K the weights or results are unused
            a = substitute(g.operand, {"p_row": self.global_row(f"T.min({row}, {g.B - 1})"),
                                       "p_k": f"T.min({k}, {g.K - 1})"})
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
        return lines

    def elementwise_text(self, run) -> list[str]:
        """Consecutive elementwise blocks in one loop over the block's (row, unit) items: the gate
        math they share is written once per thread and the compiler computes it once."""
        B, U, NT = self.rows, self.units, self.threads
        work = f"(p_r * {NT} + p_tx)"
        local, ul = f"{work} // {U}", f"{work} % {U}"
        row, unit = self.global_row(local), f"{self.first_unit} + {ul}"
        polled = {f"{s}_next" for s in self.polled}

        def stored(name, value):  # the polled states never hold the sentinel's bits
            return f'T.call_extern("{self.p.dtype}", "halstm_not_sentinel", {value})' if name in polled else value

        stores = [f"{name}[{row}, {unit}] = "
                  + stored(name, substitute(value, {ivs[0]: row, ivs[1]: unit, "p_lr": local, "p_ul": ul}))
                  for _, name, ivs, value in run]
        return [f"for p_r in range({-(-B * U // NT)}):", f"    if {work} < {B * U}:",
                *indent(stores, 8).splitlines()]

    def buffers(self) -> list[tuple[str, int, str, str]]:
        """(name, elements, dtype, scope) of the block's shared buffers and registers."""
        gemms = self.gemms
        out = []
        for g in gemms:
            i = g.index
            out += [(f"w_s{i}", g.ldc * g.stride, self.p.dtype, "shared.dyn"),
                    (f"part{i}", g.partial_size, "float32", "shared.dyn")]
        if self.staged:
            out += [(a.name, a.rows * a.stride, a.dtype, "shared.dyn")
                    for a in dict.fromkeys(self.operands.values())]
        out += [(f"x_s{i}", self.rows * C, "float32", "shared.dyn") for i, _, C in self.hoisted]
        out = [(name, _round_up(size, SHARED_GRANULE // BYTES[dtype]), dtype, scope)
               for name, size, dtype, scope in out]
        # registers: the FFMA tile (the WMMA fragments: tensor_core_text)
        ffma = [g for g in gemms if not g.tensor_cores]
        if ffma:
            out += [("acc", max(g.tm * g.tn for g in ffma), "float32", "local"),
                    ("a_r", max(g.tm for g in ffma) * VECTOR, "float32", "local"),
                    ("w_r", max(g.tn for g in ffma) * VECTOR, "float32", "local")]
        out += [(f"wf{g.index}", g.chunks * g.frags * FRAG * FRAG, self.p.dtype, "wmma.matrix_b")
                for g in gemms if g.resident]
        return out

    def setup(self) -> list[str]:
        """Before the time loop: the weights, and zeros in every other shared buffer; the initial
        states into their sequences, then a grid sync. The operand's padding (columns past K) must
        stay zero for all steps; and a buffer first written inside the loop is one that TVM's merge
        of the shared allocations may place over another (it put ResetBeforeGRU's second partial
        buffer over the first): written before the loop, all of them stay live through it, apart, as
        ``shared_bytes`` counts them."""
        lines = []
        for state in self.p.cell.states:
            lines += self.copy_initial(state)
        for g in self.gemms:
            lines += self.load_weights(g)
        for name, size, dtype, scope in self.buffers():
            if scope == "shared.dyn" and not name.startswith("w_s"):
                lines += self.zero(name, size, dtype)
        for state in self.polled:
            lines += self.fill_sentinel(state)
        resident = [g for g in self.gemms if g.resident]
        if resident:  # from the weights in shared memory, once they are all there
            lines.append('T.tvm_storage_sync("shared")')
        for g in resident:
            lines += self.resident_weights(g)
        return lines + ["T.cuda.grid_sync()"]

    def step(self) -> list[str]:
        """One step: per stage the GEMM, then its elementwise blocks in one loop; grid syncs where a
        block reads what others wrote."""
        lines, stored, run = [], False, []
        for i, name, C in self.hoisted:  # read after the first GEMM's syncs
            lines += self.flat(self.rows * C, partial(self.prefetch, i, name, C), STAGING_UNROLL)
        for b in self.blocks + [None]:
            if b is not None and not isinstance(b, BlockGemm):
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
        # polled: the next step's staging waits for the states; the block's own buffers, for its threads
        return lines + ['T.tvm_storage_sync("shared")' if self.polled else "T.cuda.grid_sync()"]

    def func(self) -> tvm.tirx.PrimFunc:
        p, B, H = self.p, self.p.batch, self.H
        frame = skeleton(p.plan, p.steps, B, p.dtype, p.layout, hoisted_only=True)
        outputs = {f"{s}_next" for s in p.cell.states}
        allocs = [f'{b[1]} = T.alloc_buffer(({B}, {H}), "float32")'
                  for b in self.blocks if not isinstance(b, BlockGemm) and b[1] not in outputs]
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


_cache: dict[tuple, tuple] = {}


def per_program(what: str, program, key, compute):
    """compute() once per program and key (the tuner checks many knob settings of one program); the
    program is held with the result, so that its id is not reused while cached."""
    hit = _cache.get((what, id(program), key))
    if hit is None or hit[0] is not program:
        if len(_cache) > 32:
            _cache.clear()
        hit = _cache[(what, id(program), key)] = (program, compute())
    return hit[1]


def _step_blocks(program):
    """The step's blocks in order, knob-independent: ("gemm", Gemm, ivs, operand as text of (p_row,
    p_k), the operand's dtype, the buffer the operand is where it is read as stored at (row, k), else
    None) or ("elementwise", buffer, ivs, value, None, None). None when the step has math a block
    cannot do on its own units: a cell's own reduction, a GEMM whose columns are not whole gates, a
    block not over (B, H), no step GEMM."""
    return per_program("analysis", program, None, lambda: _analyse(program))[0]


def _packings(program) -> dict[int, tuple[list[str], str]]:
    """By GEMM index, the step GEMMs' packed weights at (k, n) as the lowering's prologue computes
    them: (the iteration variables for k and n, the printed value), read in place of the packed copy."""
    return per_program("analysis", program, None, lambda: _analyse(program))[1]


def _analyse(program):
    """(``_step_blocks``, ``_packings``) from one parse of the program."""
    sch, packings = Schedule(program.mod), {}
    for i, gemm in enumerate(program.plan.gemms):
        if gemm.stage > 0:
            block = sch.get(sch.get_sblock(f"w_packed{i}"))
            packings[i] = [iv.var.name for iv in block.iter_vars], str(block.body.value)
    return _analyse_step(program, sch), packings


def _analyse_step(program, sch: Schedule):
    H, B = program.cell.hidden_size, program.batch
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
            view = None
            if type(operand).__name__ in ("BufferLoad", "TensorLoad") and \
                    [str(i) for i in operand.indices] == [ivs[0], ivs[2]]:
                view = operand.source.name
            text = re.sub(r"\b(\w+)\[", lambda m: f"{seq.get(m.group(1), m.group(1))}[", str(operand))
            rows = {ivs[0]: "p_row", ivs[2]: "p_k"}
            if any(f"{s}_seq[" in text for s in program.cell.states):  # a state's view: its sequence's rows
                rows[ivs[0]] = f"t * {B} + p_row"
            blocks.append(("gemm", gemm, ivs, substitute(text, rows), str(operand.ty), view))
        elif is_reduction(sch, b) or extents != [B, H]:
            blocks = None
            break
        else:
            blocks.append(("elementwise", store.buffer.name, ivs, str(store.value), None, None))
    if blocks is not None and not any(b[0] == "gemm" for b in blocks):
        blocks = None  # nothing to keep on chip: the step loop runs it
    return blocks


def _on_chip(value: str, ivs, gemms, hoisted, H: int, U: int) -> str | None:
    """The elementwise math's reads of GEMM results and of the hoisted input projection at the own
    row and a gate column of the own unit (``unit + gate * H``), re-indexed into their shared buffers:
    the row's place in the block (``p_lr``), local column gate * U + the unit's place (``p_ul``).
    None when it reads a step GEMM's result anywhere else; other input-projection reads stay global."""
    row, unit = ivs

    def rewrite(value, buffer, read, columns):
        def gate(m):
            column = int(m.group(1) or 0)
            if column % H:
                return m.group(0)
            return read(f"p_lr * {columns} + {column // H * U} + p_ul")

        return re.sub(rf"\b{buffer}\[{row}, {unit}(?: \+ (\d+))?\]", gate, value)

    for g in gemms:
        value = rewrite(value, g.name, g.result, g.ldc)
        if re.search(rf"\b{g.name}\[", value):
            return None
    for i, name, columns in hoisted:
        value = rewrite(value, f"{name}_t", lambda q, i=i: f"x_s{i}[{q}]", columns)
    return value


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def substitute(text: str, names: dict[str, str]) -> str:
    """Replace whole-word variable names in printed TIR by parenthesised expressions."""
    if not names:
        return text
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
    return pattern.sub(lambda m: f"({names[m.group(1)]})", text)
