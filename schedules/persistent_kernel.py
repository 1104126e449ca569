"""The persistent kernel as TensorIR, built for one program and one setting of the knobs of its
recipe (``cuda_persistent.py``, which describes the kernel and what was measured): its buffers,
setup and time loop, built with TVM's IR builder, the calls TVMScript's parser makes, from the
lowering's step program read as IR (``step_program.py``: the GEMMs' operands, the elementwise math,
whose reads of GEMM results move on chip, the packed weights' values), each step GEMM as a block
computes it (``block_gemm.py``, ``persistent_gemms.py``), the reductions across the grid
(``persistent_reductions.py``)."""

from __future__ import annotations

import copy
import functools
import itertools

import tvm
import tvm_ffi
from tvm.ir import TensorLoad
from tvm.s_tir.stmt import SBlockRealize
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from halstm.lowering import skeleton
from halstm.runtime import STEPS

from .block_gemm import FRAG, VECTOR, BlockGemm, staged_operands
from .cuda_tensorcore import BYTES
from .persistent_gemms import STAGING_UNROLL, StepGemms
from .persistent_reductions import GridReductions
from .step_program import Elementwise, Reduction, RowMath, StepGemm, per_program, rewrite, step_blocks
from .tir_build import complete, loop, named, named_buffers, round_up, sync_grid, sync_threads, when, zero

# Every shared buffer's size is a multiple of this many bytes. TVM merges the shared allocations
# (MergeSharedMemoryAllocations) back to back, so each then starts 32-byte aligned, as the WMMA
# fragment loads and stores need. It also keeps buffers above 32 bits: TVM's merge gives no offset to
# one of 32 bits or less (its planner keeps such "small arrays", meant for registers, out of the free
# lists it lays out, and rewriting their accesses fails its check, merge_shared_memory_allocations.cc:684;
# ResetBeforeGRU at B=1, H=50 has a one-float split-K sum). Setup zeroes every buffer whole, so TVM's
# compaction of a buffer to the region its accesses touch keeps the padding.
SHARED_GRANULE = 32

# The bits a polled state's sequence holds until its value is written (``PersistentKernel.polled``), by width:
# a NaN with every bit set, which no arithmetic produces (canonical NaNs are positive).
SENTINEL = {16: 0xFFFF, 32: 0xFFFFFFFF}

_TIME_LOOP = '''    with T.sblock("time_loop"):
        T.evaluate(0)'''  # where ``PersistentKernel.func`` puts the kernel

# The knobs that size the prologue alone (its hoisted GEMM), which the kernel's plan does not read
PROLOGUE_KNOBS = ("tc_hoisted_frags", "wgmma")
PLANS_KEPT = 64  # the most recent plans of a program (``PersistentKernel.plan``) kept


def _on_chip(analysed: list, H: int) -> bool:
    """Whether each block of the step's math reads only what its block holds (``RowMath.on_chip``)."""
    gemms = {b.gemm.name for b in analysed if isinstance(b, StepGemm)}
    reductions = {b.buffer for b in analysed if isinstance(b, Reduction)}
    return all(b.on_chip(gemms, reductions, H) for b in analysed if isinstance(b, RowMath))


class PersistentKernel(StepGemms, GridReductions):
    """The planned persistent kernel: its knobs and the step's blocks in order; ``func`` builds it
    (the step's GEMMs: ``StepGemms``; its reductions across the grid: ``GridReductions``)."""

    def __init__(self, program, target, knobs, blocks, hoisted, staged):
        self.p, self.target, self.blocks, self.staged = program, target, blocks, staged
        self.hoisted = hoisted  # (index, name, columns a block) of the hoisted GEMMs prefetched a step
        self.operands = staged_operands(self.gemms)
        self.threads, self.units, self.row_blocks = knobs["threads"], knobs["units"], knobs["row_blocks"]
        self.poll, self.waiters = knobs["poll_states"], knobs["poll_waiters"]
        self.merge_variances, self.poll_sums = knobs["merge_variances"], knobs["poll_sums"]
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
        which on tensor cores needs every GEMM's operand to be a buffer as stored (``BlockGemm.streams``).
        Each call has a kernel of its own; the most recent PLANS_KEPT plans are kept by the knobs
        they read (a recipe's space asks for one plan under several settings of the prologue's
        knobs, and ``valid`` for its variants). The persistent recipe's space on the 2-core CPU
        machine, without / with them kept, alternating twice: LSTM fp16 B=16 H=512 (21888 settings)
        10.7-14.0 / 4.6-4.8 s, LayerNormGRU B=16 H=128 (68448) 181-210 / 21-24 s."""
        plans = per_program("plans", program, target, dict)
        key = tuple(sorted((n, v) for n, v in knobs.items() if n not in PROLOGUE_KNOBS))
        if key not in plans:
            if len(plans) >= PLANS_KEPT:
                del plans[next(iter(plans))]
            plans[key] = cls._plan(program, target, knobs)
        return copy.copy(plans[key])

    @classmethod
    def _plan(cls, program, target, knobs):
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
    def staged_states(self) -> dict:
        """The staged operands that hold a state as stored, by the state's view (h_t): where the
        block stages its operands, a GEMM stages the state in its own dtype into a buffer no other
        GEMM stages (``staged_operands``). The step's math reads the state at its own units there
        (``on_chip``) instead of from global memory: GRU fp16 (100,1,256), prepared calls, 0.164-0.165
        ms from global memory, 0.154-0.158 from the operand (H200)."""
        if not self.staged:
            return {}
        users = [a.name for a in self.operands.values()]
        return {g.view: self.operands[g.index] for g in self.gemms
                if g.view is not None and g.view[:-2] in self.p.cell.states and g.operand_dtype == self.p.dtype
                and users.count(self.operands[g.index].name) == 1}

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
        if self.reductions:
            out.append(("sums_s", len(self.reductions) * self.rows, "float32", "shared.dyn"))
        if self.reductions and self.poll_sums:
            out.append(("parts_s", max(len(level) for level in self.rounds()) * self.rows * self.groups,
                        "float32", "shared.dyn"))
        out = [(name, round_up(size, SHARED_GRANULE // BYTES[dtype]), dtype, scope)
               for name, size, dtype, scope in out]
        # registers: the FFMA tile (the WMMA fragments: tensor_core_gemm)
        ffma = [g for g in gemms if not g.tensor_cores]
        if ffma:
            out += [("acc", max(g.tm * g.tn for g in ffma), "float32", "local"),
                    ("a_r", max(g.tm for g in ffma) * VECTOR, "float32", "local"),
                    ("w_r", max(g.tn for g in ffma) * VECTOR, "float32", "local")]
        if self.reductions:  # a lane's sums of a reduction and of a variance around it (``over_lanes``)
            out.append(("lane_r", 2, "float32", "local"))
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
        frame = skeleton(p.plan, p.steps, B, p.dtype, p.layout, hoisted_only=True, keep_results=p.keeps_results)
        views = {v.name for v in frame.step_views}  # the next states, kept GEMM results
        allocs = [f'{b.buffer} = T.alloc_buffer(({B}, {H}), "float32")'
                  for b in self.blocks if isinstance(b, Elementwise) and b.buffer not in views]
        if self.reductions:  # a reduction's rows of parts, two halves (``parts_row``); tagged: ``store_part``
            parts = "uint64" if self.poll_sums else "float32"
            allocs.append(f'sum_parts = T.alloc_buffer(({len(self.reductions) * 2 * B}, {self.groups}), "{parts}")')
        shell = frame.function(_TIME_LOOP, allocs)
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
        return complete(shell.with_body(body), whole=("persistent", "step"))

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
        self.clear_parts()
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

    # --- a step ------------------------------------------------------------------------------
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
                    T.buffer_store(self.buf[b.buffer], value, [row, unit + b.column])

    def on_chip(self, b: RowMath, local, unit, first_gate: int = 0, sums: dict | None = None):
        """``b``'s value with its reads of GEMM results and of the hoisted input projection at the own
        row and a gate column of the own unit (``unit + gate * H``) moved into their shared buffers:
        the row's place in the block (``local``), local column gate * U + the unit's place (``unit``),
        the gates counted from ``first_gate`` (a reduction's, over several gates); its reads of the
        step's reductions, their sums of the row in shared memory (or ``sums``' value by name); its
        reads of a state at its own unit, from the operand that stages it (``staged_states``). Other
        input-projection reads stay global."""
        H, U = self.H, self.units
        gemms = {g.name: g for g in self.gemms}
        hoisted = {f"{name}_t": (i, C) for i, name, C in self.hoisted}
        reductions = {r.buffer: r for r in self.reductions}
        states = self.staged_states

        def read(load):
            name, gate = load.source.name, b.gate_column(load, H)
            if name in states and gate == 0 and first_gate == 0:
                a = states[name]
                return self.buf[a.name][local * a.stride + self.first_unit + unit]
            if gate is not None:
                gate = (first_gate + gate // H) * U
            if name in gemms:
                g = gemms[name]
                return g.result(self.buf, local * g.ldc, gate, unit)
            if name in hoisted and gate is not None:
                i, C = hoisted[name]
                return self.buf[f"x_s{i}"][local * C + gate + unit]
            if name in reductions:
                return sums[name] if sums and name in sums else self.sum_of(reductions[name], local)
            return load

        return tvm_ffi.structural_map(b.value, (TensorLoad, read))
