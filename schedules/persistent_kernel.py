"""The persistent kernel as TensorIR, built for one program and one setting of the knobs of its
recipe (``cuda_persistent.py``, which describes the kernel and what was measured): its buffers,
setup and time loop, built with TVM's IR builder, the calls TVMScript's parser makes, from the
lowering's step program read as IR (``step_program.py``: the GEMMs' operands, the elementwise math,
whose reads of GEMM results move on chip, the packed weights' values), each step GEMM as a block
computes it (``block_gemm.py``)."""

from __future__ import annotations

import functools
import itertools
import operator
from contextlib import nullcontext

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir import TensorLoad
from tvm.s_tir.stmt import SBlockRealize
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from halstm.lowering import skeleton
from halstm.runtime import STEPS

from .block_gemm import FRAG, VECTOR, BlockGemm, staged_operands
from .cuda_tensorcore import BYTES
from .step_program import (Elementwise, Reduction, RowMath, StepGemm, loads, mean_of, packings, per_program,
                           rewrite, step_blocks)
from .tir_build import complete, loop, named, named_buffers, round_up, sync_grid, sync_threads, when, zero

# Every shared buffer's size is a multiple of this many bytes. TVM merges the shared allocations
# (MergeSharedMemoryAllocations) back to back, so each then starts 32-byte aligned, as the WMMA
# fragment loads and stores need. It also keeps buffers above 32 bits: TVM's merge gives no offset to
# one of 32 bits or less (its planner keeps such "small arrays", meant for registers, out of the free
# lists it lays out, and rewriting their accesses fails its check, merge_shared_memory_allocations.cc:684;
# ResetBeforeGRU at B=1, H=50 has a one-float split-K sum). Setup zeroes every buffer whole, so TVM's
# compaction of a buffer to the region its accesses touch keeps the padding.
SHARED_GRANULE = 32

# Rounds of the step's loads from global memory (the operand, the input projection) a thread has in
# flight at once. H100, LSTM fp16 T=100 B=64 H=1024, tensor cores: one load at a time (a rolled loop, 32
# rounds of 16 bytes a thread for the 128 KB operand) left 25 us a step whatever the GEMM's threads
# (128, 256, 512: 2.8, 2.5, 2.5 ms), against 4.4 us at B=16, H=512 (16 KB).
STAGING_UNROLL = 8
# The bits a polled state's sequence holds until its value is written (``PersistentKernel.polled``), by width:
# a NaN with every bit set, which no arithmetic produces (canonical NaNs are positive).
SENTINEL = {16: 0xFFFF, 32: 0xFFFFFFFF}

_TIME_LOOP = '''    with T.sblock("time_loop"):
        T.evaluate(0)'''  # where ``PersistentKernel.func`` puts the kernel


def _on_chip(analysed: list, H: int) -> bool:
    """Whether each block of the step's math reads only what its block holds (``RowMath.on_chip``)."""
    gemms = {b.gemm.name for b in analysed if isinstance(b, StepGemm)}
    reductions = {b.buffer for b in analysed if isinstance(b, Reduction)}
    return all(b.on_chip(gemms, reductions, H) for b in analysed if isinstance(b, RowMath))


class PersistentKernel:
    """The planned persistent kernel: its knobs and the step's blocks in order; ``func`` builds it."""

    def __init__(self, program, target, knobs, blocks, hoisted, staged):
        self.p, self.target, self.blocks, self.staged = program, target, blocks, staged
        self.hoisted = hoisted  # (index, name, columns a block) of the hoisted GEMMs prefetched a step
        self.operands = staged_operands(self.gemms)
        self.threads, self.units, self.row_blocks = knobs["threads"], knobs["units"], knobs["row_blocks"]
        self.poll, self.waiters = knobs["poll_states"], knobs["poll_waiters"]
        self.merge_variances = knobs["merge_variances"]
        self.H = program.cell.hidden_size
        self.groups = self.H // self.units  # unit groups; block p_bx has group p_bx % groups
        self.rows = program.batch // self.row_blocks  # rows of the batch a block; from row p_bx // groups * rows
        self.grid = self.groups * self.row_blocks

    @property
    def gemms(self) -> list[BlockGemm]:
        return [b for b in self.blocks if isinstance(b, BlockGemm)]

    @property
    def reductions(self) -> list[Reduction]:
        return [b for b in self.blocks if isinstance(b, Reduction)]

    @property
    def elementwise_blocks(self) -> list[Elementwise]:
        return [b for b in self.blocks if isinstance(b, Elementwise)]

    @classmethod
    def plan(cls, program, target, knobs):
        """None when the step has math a block cannot do on its own units (see ``step_blocks``,
        ``Elementwise.on_chip``) or the block's buffers do not fit in shared memory. The operands are
        staged in shared memory where they fit (and ``stage_operand``); else read from global memory,
        which on tensor cores needs every GEMM's operand to be a buffer as stored (``BlockGemm.streams``)."""
        H, U = program.cell.hidden_size, knobs["units"]
        rows = program.batch // knobs["row_blocks"]
        analysed = step_blocks(program)
        if analysed is None or not per_program("on chip", program, None, lambda: _on_chip(analysed, H)):
            return None
        reductions = [b for b in analysed if isinstance(b, Reduction)]
        if reductions:  # one stage: its GEMMs, then the math and the reductions' exchanges in order
            if len({b.gemm.stage for b in analysed if isinstance(b, StepGemm)}) > 1:
                return None
            analysed = ([b for b in analysed if isinstance(b, StepGemm)]
                        + [b for b in analysed if not isinstance(b, StepGemm)])
        blocks = [BlockGemm.sized(program.plan.gemms.index(b.gemm), b, rows, b.gemm.rows // H * U, knobs, program.dtype)
                  if isinstance(b, StepGemm) else b for b in analysed]
        # the hoisted GEMMs' gate columns of the own units are prefetched with the operand
        hoisted = [(program.plan.gemms.index(g), g.name, g.rows // H * U) for g in program.plan.hoisted
                   if g.rows % H == 0]
        kernel = cls(program, target, knobs, blocks, hoisted, staged=True)
        if ((kernel.shared_bytes() > target.shared_memory or not knobs["stage_operand"])
                and (not knobs["tensor_cores"] or all(g.streams for g in kernel.gemms))):
            kernel.staged = False
        return kernel if kernel.shared_bytes() <= target.shared_memory else None

    # --- sizes -------------------------------------------------------------------------------
    def shared_bytes(self) -> int:
        return sum(size * BYTES[dtype] for _, size, dtype, scope in self.buffers() if scope == "shared.dyn")

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
        out += [(f"{r.buffer}_s", self.rows, "float32", "shared.dyn") for r in self.reductions]
        if self.reductions:
            out.append(("sum_s", self.scratch_size(), "float32", "shared.dyn"))
        out = [(name, round_up(size, SHARED_GRANULE // BYTES[dtype]), dtype, scope)
               for name, size, dtype, scope in out]
        # registers: the FFMA tile (the WMMA fragments: tensor_core_gemm)
        ffma = [g for g in gemms if not g.tensor_cores]
        if ffma:
            out += [("acc", max(g.tm * g.tn for g in ffma), "float32", "local"),
                    ("a_r", max(g.tm for g in ffma) * VECTOR, "float32", "local"),
                    ("w_r", max(g.tn for g in ffma) * VECTOR, "float32", "local")]
        out += [(f"wf{g.index}", g.chunks * g.frags * FRAG * FRAG, self.p.dtype, "wmma.matrix_b")
                for g in gemms if g.resident]
        return out

    # --- the function ----------------------------------------------------------------------------
    def func(self) -> tvm.tirx.PrimFunc:
        """The lowering's function around its time loop (``skeleton(hoisted_only=True)``: the prologue
        computes the hoisted GEMMs), its time loop replaced by the kernel::

            for p_bx in blockIdx.x, p_tx in threadIdx.x:       the grid, one block an SM
              with sblock("persistent"):                       shared buffers, registers
                setup                                          weights on chip, initial states
                for t in range(T): with sblock("step"):        the step's views of the sequences
                  step
        """
        p, B, H = self.p, self.p.batch, self.H
        frame = skeleton(p.plan, p.steps, B, p.dtype, p.layout, hoisted_only=True)
        outputs = {f"{s}_next" for s in p.cell.states}
        allocs = [f'{b.buffer} = T.alloc_buffer(({B}, {H}), "float32")'
                  for b in self.blocks if isinstance(b, Elementwise) and b.buffer not in outputs]
        allocs += [f'{r.buffer}_parts = T.alloc_buffer(({2 * B}, {self.groups}), "float32")' for r in self.reductions]
        shell = tvm.script.from_source(frame.source(_TIME_LOOP, allocs))
        self.buf = named_buffers(shell)
        self.steps = p.steps or self.buf[STEPS]  # the function's variable where it serves any T
        with IRBuilder() as builder:
            with loop(T.thread_binding, self.grid, "p_bx", thread="blockIdx.x") as self.bx:
                with loop(T.thread_binding, self.threads, "p_tx", thread="threadIdx.x") as self.tx:
                    with T.sblock("persistent"):
                        for name, size, dtype, scope in self.buffers():
                            self.buf[name] = named(name, T.sblock_alloc_buffer((size,), dtype, scope=scope,
                                                                                layout=None))
                        self.setup()
                        with loop(T.serial, self.steps, "t") as self.t:
                            with T.sblock("step"):
                                for v in frame.step_views:
                                    first = self.t * v.rows + v.ahead if v.ahead else self.t * v.rows
                                    region = self.buf[v.buffer][first:first + v.rows, 0:v.cols]
                                    self.buf[v.name] = named(v.name, T.match_buffer(
                                        region, (v.rows, v.cols), v.dtype, offset_factor=1, layout=None))
                                self.step()
        kernel = builder.get()
        body = tvm_ffi.structural_map(
            shell.body, (SBlockRealize, lambda r: kernel if r.block.name_hint == "time_loop" else r))
        return complete(shell.with_body(body))

    def setup(self) -> None:
        """Before the time loop: the weights, and zeros in every other shared buffer; the initial
        states into their sequences, then a grid sync. The operand's padding (columns past K) must
        stay zero for all steps; and a buffer first written inside the loop is one that TVM's merge
        of the shared allocations may place over another (it put ResetBeforeGRU's second partial
        buffer over the first): written before the loop, all of them stay live through it, apart, as
        ``shared_bytes`` counts them."""
        for state in self.p.cell.states:
            self.copy_initial(state)
        for g in self.gemms:
            self.load_weights(g)
        for name, size, dtype, scope in self.buffers():
            if scope == "shared.dyn" and not name.startswith("w_s"):
                self.flat(size, lambda q, name=name, dtype=dtype: T.buffer_store(self.buf[name], zero(dtype), [q]))
        for state in self.polled:
            self.fill_sentinel(state)
        resident = [g for g in self.gemms if g.resident]
        if resident:  # from the weights in shared memory, once they are all there
            sync_threads()
        for g in resident:
            self.resident_weights(g)
        sync_grid()

    def step(self) -> None:
        """One step: per stage the GEMM, then its elementwise blocks in one loop; grid syncs where a
        block reads what others wrote."""
        stored, run = False, []
        for i, name, C in self.hoisted:  # read after the first GEMM's syncs
            self.flat(self.rows * C, functools.partial(self.prefetch, i, name, C), STAGING_UNROLL)
        for b in self.blocks + [None]:
            if isinstance(b, RowMath):
                run.append(b)
                continue
            if run:
                self.row_math(run)
                stored, run = True, []
            if b is None:
                break
            if stored:  # its operand was written unit by unit across the grid
                sync_grid()
            if self.staged:
                self.stage_operand(b)
            self.tensor_core_gemm(b) if b.tensor_cores else self.register_tile_gemm(b)
            sync_threads()  # the elementwise math adds the partials (``BlockGemm.result``)
        # polled: the next step's staging waits for the states; the block's own buffers, for its threads
        sync_threads() if self.polled else sync_grid()

    # --- indices -----------------------------------------------------------------------------
    @property
    def first_unit(self):
        """The block's first hidden unit."""
        return (self.bx if self.row_blocks == 1 else self.bx % self.groups) * self.units

    def global_column(self, c):
        """Column of the GEMM result for local column c of this block."""
        return c // self.units * self.H + self.first_unit + c % self.units

    def global_row(self, r):
        """Row of the batch for local row r of this block."""
        return r if self.row_blocks == 1 else self.bx // self.groups * self.rows + r

    def parts_row(self, r):
        """Row of the reductions' ``parts`` for local row r in this step: the parts alternate between
        two halves step by step, so that a block writing the next step's parts (one grid sync after
        this step's) never writes where another still reads this step's."""
        return self.t % 2 * self.p.batch + self.global_row(r)

    def flat(self, count: int, body, unroll: int = 1) -> None:
        """``body(q)`` for q in [0, count), shared out over the block's threads, the index clamped (no
        condition around stores); ``unroll`` rounds at a time unrolled, so that a thread's loads of
        them are in flight together."""
        rounds = -(-count // self.threads)
        unroll = min(unroll, rounds)
        with loop(T.serial, -(-rounds // unroll), "p_r") as r:
            if unroll == 1:
                body(T.min(r * self.threads + self.tx, count - 1))
                return
            with loop(T.unroll, unroll, "p_u") as u:
                body(T.min((r * unroll + u) * self.threads + self.tx, count - 1))

    def over_grid(self, rows: int, store, v: int = 1) -> None:
        """``store(row, column)`` for every element of ``rows`` x H, shared out over the grid's
        threads, v at once."""
        H = self.H
        total, per_round = rows * H // v, self.grid * self.threads
        with loop(T.serial, -(-total // per_round), "p_r") as r:
            i = (r * self.grid + self.bx) * self.threads + self.tx
            with when(i < total), loop(T.vectorized, v, "p_v") as pv:
                e = i * v + pv
                store(e // H, e % H)

    # --- setup -------------------------------------------------------------------------------
    def copy_initial(self, state: str) -> None:
        """The initial state into the first rows of its sequence, where the first step reads it (an
        element at a time: the caller's buffer need not be 16-byte aligned)."""
        seq, initial = self.buf[f"{state}_seq"], self.buf[f"{state}0"]
        self.over_grid(self.p.batch, lambda r, c: T.buffer_store(seq, initial[r, c], [r, c]))

    def fill_sentinel(self, state: str) -> None:
        """The state's sequence past the initial state, SENTINEL everywhere, 16 bytes a store where
        rows allow (the sequence is halstm's own allocation)."""
        B, H, dtype, seq = self.p.batch, self.H, self.p.dtype, self.buf[f"{state}_seq"]
        v = 16 // BYTES[dtype] if H % (16 // BYTES[dtype]) == 0 else 1
        bits = 8 * BYTES[dtype]
        sentinel = T.reinterpret(dtype, getattr(T, f"uint{bits}")(SENTINEL[bits]))
        self.over_grid(self.steps * B, lambda r, c: T.buffer_store(seq, sentinel, [B + r, c]), v)

    def load_weights(self, g: BlockGemm) -> None:
        """Columns k-contiguous: w_s[c * stride + k], zeros past K and past C (the columns padded to
        whole fragments), read where they are (the value ``lowering.stacked`` packs: the parameter
        (N, K) itself for a GEMM of one matmul), k fastest: coalesced."""
        (k_iv, n_iv), weight = packings(self.p)[g.index]

        def body(q):
            c, k = q // g.stride, q % g.stride
            inside = tirx.And(k < g.K, c < g.C) if g.ldc > g.C else k < g.K
            column = self.global_column(T.min(c, g.C - 1) if g.ldc > g.C else c)
            value = rewrite(weight, [(k_iv, T.min(k, g.K - 1)), (n_iv, column)], self.buf)
            T.buffer_store(self.buf[f"w_s{g.index}"], T.if_then_else(inside, value, zero(self.p.dtype)), [q])

        self.flat(g.ldc * g.stride, body)

    def resident_weights(self, g: BlockGemm) -> None:
        """Before the time loop: the weight fragments of each of this warp's chunks into wf (registers),
        which the step's GEMM then uses in place of loads from w_s. Measured (H100, LSTM fp16
        (100,16,512)): cuDNN's persistent kernel keeps its weights in registers (144 a thread) and
        issued a third of the instructions of this kernel reloading them from shared memory;
        resident, the kernel took 3-12 % less (0.249 ms against 0.264 there, 2.754 against 3.128 at
        (1024,16,768))."""
        work, _, _, col = self.warp_tile(g)
        F, i = g.frags, g.index
        w_s, wf = self.buf[f"w_s{i}"], self.buf[f"wf{i}"]
        with T.sblock(f"resident_weights{i}"):
            T.reads(w_s[0:self.size(f"w_s{i}")])
            T.writes(wf[0:self.size(f"wf{i}")])
            with when(work < g.tiles * g.split) if g.idle else nullcontext():
                with loop(T.unroll, g.chunks, "p_c") as c, loop(T.unroll, F, "p_f") as f:
                    self.load_fragment(wf, c * F + f, w_s, (col + f * FRAG) * g.stride + self.chunk_k(g, c),
                                       g.stride, "col_major")

    # --- a step ------------------------------------------------------------------------------
    def prefetch(self, i: int, name: str, columns: int, q) -> None:
        """The step's row block of a hoisted GEMM, the block's units' gate columns, into x_s[row * C + c]."""
        row, column = self.global_row(q // columns), self.global_column(q % columns)
        T.buffer_store(self.buf[f"x_s{i}"], self.buf[f"{name}_t"][row, column], [q])

    def operand(self, g: BlockGemm, row, k):
        """The step GEMM's operand at (row, k) of the batch and K, as staged: a state's view read from
        its sequence at step t, rounded to the weights' dtype on tensor cores (``BlockGemm.sized``)."""
        step, buffers = g.step, dict(self.buf)
        if step.reads_state:
            row = self.t * self.p.batch + row
            buffers |= {f"{s}_t": self.buf[f"{s}_seq"] for s in self.p.cell.states}
        value = rewrite(step.operand, [(step.row, row), (step.k, k)], buffers)
        return value if g.operand_dtype == step.dtype else T.Cast(g.operand_dtype, value)

    def staging_vector(self, g: BlockGemm) -> int:
        """Elements of the operand a thread stages at once."""
        v = 16 // BYTES[g.operand_dtype] if g.tensor_cores else VECTOR
        return v if g.K % v == 0 and self.H % v == 0 else 1

    def stage_operand(self, g: BlockGemm) -> None:
        """The step's B x K operand into a_s[row * stride + k], VECTOR at a time where rows allow
        (16 bytes on tensor cores, whose rows are whole 16 bytes)."""
        v = self.staging_vector(g)
        if self.polled:
            self.poll_operand(g, v)
            sync_threads()
            return
        per_row, count, a = g.K // v, g.B * g.K // v, self.operands[g.index]

        def store(q, element=None):  # at k = q % per_row * v (+ element)
            k = q % per_row * v if element is None else q % per_row * v + element
            at = q // per_row * a.stride + q % per_row * v
            T.buffer_store(self.buf[a.name], self.operand(g, self.global_row(q // per_row), k),
                           [at if element is None else at + element])

        def body(q):
            if v == 1:
                store(q)
                return
            with loop(T.vectorized, v, "p_v") as element:
                store(q, element)

        self.flat(count, body, STAGING_UNROLL)
        sync_threads()

    def poll_operand(self, g: BlockGemm, v: int) -> None:
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
        per_row, count, word = g.K // v, g.B * g.K // v, BYTES[g.operand_dtype]
        a, view = self.buf[self.operands[g.index].name], self.buf[g.view]
        stride, started = self.operands[g.index].stride, self.t > 0
        if self.waiters:
            with loop(T.serial, -(-self.groups // self.threads), "p_w") as w:
                waiter = w * self.threads + self.tx
                with when(waiter < self.groups):
                    first = view.access_ptr("r", offset=self.global_row(0) * g.K + waiter * self.units)
                    T.evaluate(T.call_extern("void", f"halstm_wait_value<{word}>", started, first))
        sync_threads()
        rounds = -(-count // self.threads)
        unroll = min(STAGING_UNROLL, rounds)
        with loop(T.serial, -(-rounds // unroll), "p_r") as r:
            pointers = []
            for u in range(unroll):
                q = T.min((r * unroll + u) * self.threads + self.tx, count - 1)
                row, k = q // per_row, q % per_row * v
                pointers += [a.access_ptr("w", offset=row * stride + k),
                             view.access_ptr("r", offset=self.global_row(row) * g.K + k)]
            T.evaluate(T.call_extern("void", f"halstm_poll_stage<{v * word}, {word}>", started, *pointers))

    def warp_tile(self, g: BlockGemm, round_=None) -> tuple:
        """(work, part, row, column) of this warp's tile on tensor cores (in round ``round_``)."""
        warp = self.tx // 32
        work = warp if round_ is None else round_ * g.workers + warp
        part, tile = work % g.split, work // g.split
        return work, part, tile // (g.ldc // g.tn) * FRAG, tile % (g.ldc // g.tn) * g.tn

    def chunk_k(self, g: BlockGemm, c, round_=None):
        """k of chunk c of this warp's part on tensor cores."""
        return (c * g.split + self.warp_tile(g, round_)[1]) * FRAG

    def size(self, name: str) -> int:
        return next(n for buffer, n, *_ in self.buffers() if buffer == name)

    def load_fragment(self, frag, index, buffer, offset, stride, layout: str) -> None:
        """WMMA's load of fragment ``index`` of ``frag`` from ``buffer`` at ``offset``."""
        pointer = buffer.access_ptr("r", ptr_type=self.p.dtype, offset=offset)
        T.evaluate(T.tvm_load_matrix_sync(frag.data, 16, 16, 16, index, pointer, stride, layout, dtype="void"))

    def tensor_core_gemm(self, g: BlockGemm) -> None:
        """Warp (tile, part) multiplies 16 x 16 fragments of the operand (row-major: staged, or the
        state in global memory) and of the weight columns (column-major: k contiguous) into its tile's
        ``frags`` accumulators, fp32, each operand fragment feeding all of them, and stores its tile to
        part[part][row * ldc + column]; warps without a tile store zeros to the spare fragments. Its
        own block: TVM cannot infer what the fragment calls read and write (pointers)."""
        S, i, F = g.split, g.index, g.frags
        weights = f"wf{i}" if g.resident else f"w_s{i}"
        source = self.operands[i].name if self.staged else g.view
        with T.sblock(f"tensor_core_gemm{i}"):
            read = (self.buf[source][0:self.size(source)] if self.staged
                    else self.buf[source][0:self.p.batch, 0:g.K])
            T.reads(read, self.buf[weights][0:self.size(weights)])
            T.writes(self.buf[f"part{i}"][0:self.size(f"part{i}")])
            a_f = named("a_f", T.sblock_alloc_buffer((FRAG * FRAG,), self.p.dtype, scope="wmma.matrix_a", layout=None))
            b_f = None if g.resident else named("b_f", T.sblock_alloc_buffer(
                (FRAG * FRAG,), self.p.dtype, scope="wmma.matrix_b", layout=None))
            acc_f = named("acc_f", T.sblock_alloc_buffer((F * FRAG * FRAG,), "float32", scope="wmma.accumulator",
                                                          layout=None))
            with loop(T.serial, g.rounds, "p_t") if g.rounds > 1 else nullcontext() as round_:
                work, part, row, col = self.warp_tile(g, round_)
                with loop(T.unroll, F, "p_f") as f:
                    T.evaluate(T.tvm_fill_fragment(acc_f.data, 16, 16, 16, f, T.float32(0), dtype="void"))
                with when(work < g.tiles * S) if g.idle else nullcontext():
                    # unrolled where resident: a fragment's index must be a constant to stay in registers
                    with loop(T.unroll if g.resident else T.serial, g.chunks, "p_c") as c:
                        k = self.chunk_k(g, c, round_)
                        if self.staged:
                            a = self.operands[i]
                            self.load_fragment(a_f, 0, self.buf[a.name], row * a.stride + k, a.stride, "row_major")
                        else:  # each fragment straight from global memory (a deeper ring in flight: no faster)
                            self.load_fragment(a_f, 0, self.buf[g.view], self.global_row(row) * g.K + k, g.K,
                                               "row_major")
                        with loop(T.unroll, F, "p_f") as f:
                            if g.resident:
                                b, b_index = self.buf[f"wf{i}"], c * F + f
                            else:
                                b, b_index = b_f, 0
                                self.load_fragment(b_f, 0, self.buf[f"w_s{i}"], (col + f * FRAG) * g.stride + k,
                                                   g.stride, "col_major")
                            T.evaluate(T.tvm_mma_sync(acc_f.data, f, a_f.data, 0, b.data, b_index, acc_f.data, f,
                                                      dtype="void"))
                target = part * g.partial_stride + row * g.ldc + col
                if g.idle:
                    target = T.if_then_else(work < g.tiles * S, target, S * g.partial_stride)
                with loop(T.unroll, F, "p_f") as f:
                    pointer = self.buf[f"part{i}"].access_ptr("w", ptr_type="float32", offset=target + f * FRAG)
                    T.evaluate(T.tvm_store_matrix_sync(acc_f.data, 16, 16, 16, f, pointer, g.ldc, "row_major",
                                                       dtype="void"))

    def register_tile_gemm(self, g: BlockGemm) -> None:
        """Thread (tile, part) accumulates its tm x tn outputs in registers and stores them to
        part[part][row * C + column]."""
        S, tm, tn, V, i = g.split, g.tm, g.tn, VECTOR, g.index
        acc, a_r, w_r, w_s = self.buf["acc"], self.buf["a_r"], self.buf["w_r"], self.buf[f"w_s{i}"]
        with loop(T.serial, g.rounds, "p_t") if g.rounds > 1 else nullcontext() as round_:
            work = self.tx if round_ is None else round_ * self.threads + self.tx
            part, tile = work % S, work // S
            row = lambda p_i: tile // (g.C // tn) * tm + p_i  # noqa: E731
            column = tile % (g.C // tn) * tn  # + p_j

            def k(c, v, at=0):  # at + k of vector element v of chunk c, added term by term
                return at + (c * S + part) * V + v

            with loop(T.unroll, tm * tn, "p_i") as p_i:
                T.buffer_store(acc, T.float32(0), [p_i])
            # the threads past the tiles only load and sync
            with when(work < g.tiles * S) if g.tiles * S < g.rounds * self.threads else nullcontext():
                with loop(T.serial, g.chunks, "p_c") as c:
                    with loop(T.unroll, tm, "p_i") as p_i:
                        with loop(T.vectorized if self.staged else T.unroll, V, "p_v") as v:
                            if self.staged:
                                operand = self.operands[i]
                                a = self.buf[operand.name][k(c, v, row(p_i) * operand.stride)]
                            else:  # read from global memory, clamped: past the batch or K the weights or results are unused
                                a = self.operand(g, self.global_row(T.min(row(p_i), g.B - 1)), T.min(k(c, v), g.K - 1))
                            T.buffer_store(a_r, T.Cast("float32", a), [p_i * V + v])
                    with loop(T.unroll, tn, "p_j") as p_j, loop(T.vectorized, V, "p_v") as v:
                        w = w_s[k(c, v, (column + p_j) * g.stride)]
                        T.buffer_store(w_r, T.Cast("float32", w), [p_j * V + v])
                    with loop(T.unroll, V, "p_v") as v, loop(T.unroll, tm, "p_i") as p_i:
                        with loop(T.unroll, tn, "p_j") as p_j:
                            T.buffer_store(acc, acc[p_i * tn + p_j] + a_r[p_i * V + v] * w_r[p_j * V + v],
                                           [p_i * tn + p_j])
            with loop(T.unroll, tm, "p_i") as p_i, loop(T.unroll, tn, "p_j") as p_j:
                T.buffer_store(self.buf[f"part{i}"], acc[p_i * tn + p_j],
                               [part * g.partial_stride + row(p_i) * g.C + column + p_j])

    def row_math(self, run: list[RowMath]) -> None:
        """A stage's elementwise blocks and reductions in order: consecutive elementwise blocks in
        one loop (``elementwise``), consecutive reductions in rounds (``reduce``), a block barrier
        where a reduction reads what the block's other threads wrote."""
        for n, (reduces, blocks) in enumerate(itertools.groupby(run, lambda b: isinstance(b, Reduction))):
            if not reduces:
                self.elementwise(list(blocks))
                continue
            if n > 0:  # after elementwise blocks whose results it sums
                sync_threads()
            self.reduce(list(blocks))

    @functools.cached_property
    def variances(self) -> dict[str, Reduction]:
        """Each reduction that sums squared deviations from another's mean (``step_program.mean_of``: a
        layer norm's variance), by buffer, with that mean's reduction: the two run in one round, each
        unit group's deviations taken from its own mean and merged (``reduce``); none without the
        knob merge_variances."""
        reductions = self.reductions if self.merge_variances else []
        return {r.buffer: m for r in reductions if (m := mean_of(r, reductions)) is not None}

    def rounds(self, reductions: list[Reduction] | None = None) -> list[list[Reduction]]:
        """Consecutive reductions of the step (``reductions``, or every run of them) in rounds: each
        round those that read no reduction of a later one, a variance in its mean's round."""
        if reductions is None:
            runs = itertools.groupby(self.blocks, lambda b: isinstance(b, Reduction))
            return [level for reduces, run in runs if reduces for level in self.rounds(list(run))]
        out, pending = [], list(reductions)
        while pending:
            names = {r.buffer for r in pending}
            out.append([r for r in pending if not (_reads(r) - self._centre(r)) & names])
            pending = [r for r in pending if all(r is not done for done in out[-1])]
        return out

    def _centre(self, r: Reduction) -> set[str]:
        mean = self.variances.get(r.buffer)
        return {mean.buffer} if mean else set()

    def phases(self, level: list[Reduction]) -> list[list[Reduction]]:
        """A round's reductions in the order ``reduce`` sums them: the means and other sums, then the
        variances (each of a mean of the round), those that there are."""
        return [phase for phase in ([r for r in level if r.buffer not in self.variances],
                                    [r for r in level if r.buffer in self.variances]) if phase]

    def scratch_size(self) -> int:
        """Floats of ``sum_s``: a thread's term of every (reduction, row) of a round (the group sums'
        of all its phases at once, the totals' of one)."""
        return max(max(len(level) * self.rows * self.units, *(len(phase) * self.rows * self.lanes(len(phase))
                                                               for phase in self.phases(level)))
                   for level in self.rounds())

    def lanes(self, reductions: int) -> int:
        """Threads that add the unit groups' partial sums of one row of one reduction (``total``):
        the most, a power of two up to a warp, that the block's threads hold for all of a round."""
        room = max(1, self.threads // (reductions * self.rows))
        return min(32, 1 << (min(room, self.groups).bit_length() - 1))

    def reduce(self, reductions: list[Reduction]) -> None:
        """Consecutive reductions, in rounds (``rounds``), one grid sync a round: each block sums its
        own columns of its rows into the round's ``parts`` (a row's partial sum a unit group, in global
        memory); after the grid sync, each block adds the unit groups' parts of its rows into shared
        memory, where the step's math reads them. Both sums in two passes over the block's threads,
        through ``sum_s``: a thread a (row, unit) or (row, lane) term, then a thread a row adding them.
        The parts alternate between two halves step by step (``parts_row``).

        A variance's parts are each group's squared deviations from the group's own mean (its mean's
        part over the group's n columns); with G groups, the row's mean's sum S and the groups' parts
        s_g and q_g, the variance's sum is (Chan, Golub and LeVeque 1979)
        sum_g q_g + sum_g (s_g - S / G)^2 / n."""
        G = self.groups
        group = self.bx if self.row_blocks == 1 else self.bx % G
        for level in self.rounds(reductions):
            phases = self.phases(level)
            for n, phase in enumerate(phases):
                if n:  # the variances' terms read their means' group sums
                    sync_threads()
                self.group_sums(phase, phases[0], group, G)
            sync_grid()
            for phase in phases:
                self.total(phase, G)

    def group_sums(self, phase: list[Reduction], first: list[Reduction], group, G: int) -> None:
        """The block's part of each reduction of ``phase`` for each of its rows, into
        ``<reduction>_parts[row, group]``; a variance's around the block's part of its mean, summed
        again from the terms of the round's first phase (``first``), which the variances' terms
        leave in place."""
        rows, U, scratch = self.rows, self.units, self.buf["sum_s"]
        at = 0 if phase is first else len(first) * rows * U

        def part(i, local, start=at):  # the block's part of reduction i of a phase (from ``start``), row local
            return _sum(scratch[start + (i * rows + local) * U + u] for u in range(U))

        def unit_term(r, local, u):  # the unit's columns of every gate the reduction spans
            row, unit = self.global_row(local), self.first_unit + u
            mean = self.variances.get(r.buffer)
            centres = {} if mean is None else {
                mean.buffer: part(next(n for n, m in enumerate(first) if m is mean), local, 0) * G}
            return functools.reduce(operator.add, (
                rewrite(self.on_chip(r, local, u, gate, centres), [(r.row, row), (r.unit, gate * self.H + unit)],
                        self.buf)
                for gate in range(r.width // self.H)))

        self.over_items(phase, U, lambda i, r, local, u: T.buffer_store(
            scratch, unit_term(r, local, u), [at + (i * rows + local) * U + u]))
        sync_threads()
        self.over_items(phase, 1, lambda i, r, local, _: T.buffer_store(
            self.buf[f"{r.buffer}_parts"], part(i, local), [self.parts_row(local), group]))

    def total(self, phase: list[Reduction], G: int) -> None:
        """Each reduction of ``phase`` over the G groups' parts of each of the block's rows, into
        ``<reduction>_s``; a variance's with each group's deviation from the mean (``reduce``)."""
        rows, scratch, L = self.rows, self.buf["sum_s"], self.lanes(len(phase))

        def lane_term(r, local, lane):  # groups lane, lane + L, ...
            row, parts = self.parts_row(local), self.buf[f"{r.buffer}_parts"]
            mean = self.variances.get(r.buffer)
            if mean is None:
                term = lambda g: parts[row, g]
            else:
                means, S = self.buf[f"{mean.buffer}_parts"], self.buf[f"{mean.buffer}_s"][local]
                n = r.width // self.H * self.units
                term = lambda g: parts[row, g] + (means[row, g] - S / G) * (means[row, g] - S / G) / T.float32(n)
            terms = [term(lane + m * L) for m in range(G // L)]
            if G % L:
                last = lane + G // L * L
                terms.append(T.if_then_else(last < G, term(T.min(last, G - 1)), T.float32(0)))
            return _sum(terms)

        self.over_items(phase, L, lambda i, r, local, lane: T.buffer_store(
            scratch, lane_term(r, local, lane), [(i * rows + local) * L + lane]))
        sync_threads()
        self.over_items(phase, 1, lambda i, r, local, _: T.buffer_store(
            self.buf[f"{r.buffer}_s"], _sum(scratch[(i * rows + local) * L + lane] for lane in range(L)), [local]))
        sync_threads()

    def over_items(self, reductions: list[Reduction], per_row: int, body) -> None:
        """``body(i, reduction i, local row, j)`` for j < ``per_row`` of every row and reduction, a
        thread each."""
        rows, count = self.rows * per_row, len(reductions) * self.rows * per_row
        with loop(T.serial, -(-count // self.threads), "p_r") as r:
            work = r * self.threads + self.tx
            for i, reduction in enumerate(reductions):
                with when(tirx.And(i * rows <= work, work < (i + 1) * rows)):
                    item = work - i * rows
                    body(i, reduction, item // per_row, item % per_row)

    def elementwise(self, run: list[Elementwise]) -> None:
        """Consecutive elementwise blocks in one loop over the block's (row, unit) items: the gate
        math they share is written once per thread and the compiler computes it once."""
        B, U, NT = self.rows, self.units, self.threads
        polled = {f"{s}_next" for s in self.polled}
        with loop(T.serial, -(-B * U // NT), "p_r") as r:
            work = r * NT + self.tx
            with when(work < B * U):
                local, ul = work // U, work % U
                row, unit = self.global_row(local), self.first_unit + ul
                for b in run:
                    value = rewrite(self.on_chip(b, local, ul), [(b.row, row), (b.unit, unit)], self.buf)
                    if b.buffer in polled:  # the polled states never hold the sentinel's bits
                        value = T.call_extern(self.p.dtype, "halstm_not_sentinel", value)
                    T.buffer_store(self.buf[b.buffer], value, [row, unit])

    def on_chip(self, b: RowMath, local, unit, first_gate: int = 0, sums: dict | None = None):
        """``b``'s value with its reads of GEMM results and of the hoisted input projection at the own
        row and a gate column of the own unit (``unit + gate * H``) moved into their shared buffers:
        the row's place in the block (``local``), local column gate * U + the unit's place (``unit``),
        the gates counted from ``first_gate`` (a reduction's, over several gates); its reads of the
        step's reductions, their sums of the row in shared memory (or ``sums``' value by name). Other
        input-projection reads stay global."""
        H, U = self.H, self.units
        gemms = {g.name: g for g in self.gemms}
        hoisted = {f"{name}_t": (i, C) for i, name, C in self.hoisted}
        reductions = {r.buffer for r in self.reductions}

        def read(load):
            name, gate = load.source.name, b.gate_column(load, H)
            if gate is not None:
                gate = (first_gate + gate // H) * U
            if name in gemms:
                g = gemms[name]
                return g.result(self.buf, local * g.ldc, gate, unit)
            if name in hoisted and gate is not None:
                i, C = hoisted[name]
                return self.buf[f"x_s{i}"][local * C + gate + unit]
            if name in reductions:
                return sums[name] if sums and name in sums else self.buf[f"{name}_s"][local]
            return load

        return tvm_ffi.structural_map(b.value, (TensorLoad, read))


def _reads(r: RowMath) -> set[str]:
    return {load.source.name for load in loads(r.value)}


def _sum(terms):
    return functools.reduce(operator.add, terms)
