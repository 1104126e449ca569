"""CUDA persistent-kernel recipe: one cooperative launch runs all T steps.

Block ``bx`` owns hidden units [g * U, g * U + U), g = bx % (H / U), and rows [r * R, r * R + R) of
the batch, r = bx // (H / U), R = B / row_blocks (U divides H, H / U x row_blocks blocks <= SMs, one
block per SM, so the grid is co-resident). Before the time loop it copies the C = gates * U columns of
the recurrent weights that feed its units into shared memory, k contiguous per column, in their
storage dtype, read from the parameters where they are (no packed copy), and the grid copies the
initial states into the sequences. Then per step and stage:

    stage the operand     the R x K rows the step GEMM reads (h, written by every block before the
                          grid sync) into shared memory, all threads, VECTOR elements at a time
                          (read from global memory in the GEMM where it does not fit beside the
                          weights; one buffer a dtype serves the step's GEMMs one after the other);
                          the step's input projection of the block's units with it
    __syncthreads
    register-tiled GEMM   thread (tile, part): a tm x tn tile of (row, column) outputs, fp32
                          accumulators in registers, over the K chunks part, part + S, ... of VECTOR
                          k each (S split-K parts, fastest in the thread index: a warp's loads are
                          consecutive chunks; more tiles than threads: in rounds); each thread's
                          tile to shared memory
    __syncthreads
      or on tensor cores  (fp16/bf16, knob "tensor_cores") warp (tile, part): a 16 x 16F output tile
                          in F WMMA accumulators (knob "warp_frags"), over the 16-wide k fragments
                          part, part + S, ... (S split-K parts over the warps; the batch padded to 16
                          rows with zeros, the columns to 16), each operand fragment (staged, or where
                          it does not fit loaded straight from the state in global memory) feeding
                          the F mma; the weight fragments loaded once before the time loop and kept
                          in registers where they fit (knob "resident_weights"); stored to shared
                          memory (store_matrix_sync)
    __syncthreads
    fused elementwise     the expression of the cell's own block, printed from the step program, its
                          GEMM columns read from shared memory, the S partials of each added there
    grid sync             before the next stage's GEMM and at the end of the step; or, at the end of
                          the step (knob "poll_states"), none: the next step's staging waits for
                          the state values themselves (``_Kernel.polled``)

Measured (H100, T=100, docs/gpu-results.md): the first kernel, one output a thread walking all of K
with a global load of h per multiply-add, took 17-24 us a step at B=16, H=512 (cuDNN fp32 20.5, fp16
2.8); the register tile 6.1 us (fp32, fourth run); fp16 on tensor cores 3.5 us, and at B=64, H=1024
7.6 us a step for the kernel itself (ncu, sixth run). What is left at B=16 is a chain of latencies:
the grid sync, the operand's L2 round trip, the __syncthreads, the elementwise math's global loads.
Prefetching the states that math reads at the block's units (LSTM's c) with the input projection
measured no faster (eleventh run, run 26): that load is not on the critical path. At B=256, H=1024
fp16 (twelfth run) the weights take 132 of the 227 KB and the operand streams from global memory:
2.78-2.89 ms at T=100 against cuDNN's 1.75-2.26, its 8 warps a SM mostly waiting on global loads (ncu:
64 % of the stalls on L1TEX); a deeper ring of fragments in flight was no faster. The grid as one thread
block cluster of at most 16 blocks, h pushed into every block's shared memory and a cluster barrier a
step (280b8a4, reverted), was 1.1-1.7x slower (H200, twenty-first run): at B=16, H=512 its step GEMM on
16 SMs alone took as long as this kernel's whole exchange of h through L2.

Shared stores are never inside a condition (the shared-memory sync planner cannot handle that): loops
over a buffer clamp the index (the spare threads repeat the last element), and threads without a tile
store zero accumulators to rows of the partial buffer that nobody reads.

The step's math is not written here: the step program of ``halstm.lowering`` is scheduled only to inline
its elementwise math (``inline_elementwise``), and each block's expression is re-indexed onto the
block's units. The prologue, the hoisted input GEMM (and its weights' packing) alone
(``lowering.skeleton(hoisted_only=True)``), keeps the step-loop recipe's schedule, but for the hoisted
GEMM's tensor-core fragments (knob tc_hoisted_frags); in exact float32 on Hopper that GEMM runs as
three TF32 products on wgmma (``CudaPersistent.layout``). The step's weight packing and the copies of
the initial states, kernels of their own before (three at LSTM: W_hh's packing, h's and c's copies), took
5-14 % of a prepared call at T=100, B <= 16 (H100, runs 115-116, prepared ms, before / now: LSTM fp16 (100,16,512) 0.236, 0.223 / 0.207, 0.208; (100,8,512)
0.232, 0.229 / 0.199, 0.200; GRU fp16 (100,16,512) 0.208, 0.203 / 0.192, 0.192; LSTM fp32 (100,1,256)
0.169 / 0.157, 0.156; at (1024,16,768) no change, 2.464, 2.514 / 2.475, 2.456).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import tvm
from tvm.s_tir import Schedule

from halstm.lowering import PackedLayout, indent, skeleton

from .cuda import (BYTES, CudaStepLoop, bind_flat, epilogue_units, hoisted_tensor_core_tile, on_wgmma,
                   schedule_gemm, schedule_transpose, split_tf32, use_tensor_cores)
from .cuda_tensorcore import tensor_cores_available
from .recipe import Recipe, child_blocks, inline_elementwise, is_reduction
from .wgmma import wgmma_available
from .wmma import FRAG

# Every shared buffer's size is a multiple of this many bytes. TVM merges the shared allocations
# (MergeSharedMemoryAllocations) back to back, so each then starts 32-byte aligned, as the WMMA
# fragment loads and stores need. It also keeps buffers above 32 bits: TVM's merge gives no offset to
# one of 32 bits or less (its planner keeps such "small arrays", meant for registers, out of the free
# lists it lays out, and rewriting their accesses fails its check, merge_shared_memory_allocations.cc:684;
# ResetBeforeGRU at B=1, H=50 has a one-float split-K sum). Setup zeroes every buffer whole, so TVM's
# compaction of a buffer to the region its accesses touch keeps the padding.
SHARED_GRANULE = 32

# Largest batch at which ``recipes_for`` puts this recipe first. H100, 2026-11-22 (docs/gpu-results.md):
# faster than the step loop at B=1 (2.8-3.9x), B=16, H=512 (2.9-5.2x), (T, B, H) = (1024, 16, 768)
# (2.9-5.8x) and B=64, H=1024 (1.1-2.3x), every cell, fp32 and fp16 (fourth run, FFMA); with the
# step GEMMs of both recipes on tensor cores, fp16 at B=64, H=1024 2.2-5.3 ms against 2.7-7.1 and
# (512, 64, 512) 3.7-9.0 against 7.9-19.8 (sixth run). Above it, and below it where its step GEMM
# would read the operand from global memory on FFMA cores against the step loop's tensor cores, see
# ``CudaPersistent.preferred``. A size rule only; the tuner measures both.
PREFERRED_MAX_BATCH = 64

# Smallest batch whose step GEMM the defaults put on tensor cores (the batch padded to a fragment's 16
# rows), below it the FFMA register tile. H100, fp16, T=100, prepared ms, FFMA / tensor cores with
# resident weights (fourteenth run, docs/gpu-results.md): B=1 H=256 LSTM 0.217 / 0.245, GRU 0.187 /
# 0.203; H=512 LSTM B=2 0.206 / 0.225, B=4 0.226 / 0.213, B=8 0.288 / 0.253, GRU B=4 0.245 / 0.204,
# B=8 0.298 / 0.221; PeepholeLSTM B=4 0.228 / 0.237 (the one exception), B=8 0.306 / 0.270.
TENSOR_CORE_MIN_BATCH = 4
VECTOR = 4  # k a thread moves at once: operand staging, and shared memory to registers in the GEMM
# Rounds of the step's loads from global memory (the operand, the input projection) a thread has in
# flight at once. H100, LSTM fp16 T=100 B=64 H=1024, tensor cores: one load at a time (a rolled loop, 32
# rounds of 16 bytes a thread for the 128 KB operand) left 25 us a step whatever the GEMM's threads
# (128, 256, 512: 2.8, 2.5, 2.5 ms), against 4.4 us at B=16, H=512 (16 KB).
STAGING_UNROLL = 8
MAX_TILE_REGISTERS = 64  # accumulators + operand registers a thread may hold (spills beyond)
# Weight fragments a warp may keep in registers for all steps (knob resident_weights): 4 registers
# each at fp16/bf16 (16 x 16 halfs over 32 lanes), 64 at most beside the accumulators: a budget chosen,
# not compared with others (ptxas: 58 registers a thread at LSTM fp16 B=16 H=512, 4 fragments a warp).
MAX_RESIDENT_FRAGS = 16
# Staged bytes a block polls a step above which the defaults put one waiter a producer first (knob
# poll_waiters; ``_Kernel.poll_operand``). H100 fp16 T=100, prepared ms, without / with waiters (runs
# 101-102): 16-32 KiB, LSTM (100,16,512) 0.222 / 0.231, (1024,16,768) 2.531 / 2.693, (512,64,512)
# 1.630 / 1.687 (GRU (100,16,512) 0.207 and LSTM (100,8,512) 0.229 against 0.224 and 0.223 for the
# kernel before, with waiters and a separate split-K sum); 64 KiB, GRU (100,64,1024) 0.700 / 0.590,
# LSTM there 0.814 / 0.812: a block's repeated polls of 64 KiB crowd L2.
POLL_WAITERS_ABOVE_BYTES = 32 * 1024
# The bits a polled state's sequence holds until its value is written (``_Kernel.polled``), by width:
# a NaN with every bit set, which no arithmetic produces (canonical NaNs are positive).
SENTINEL = {16: 0xFFFF, 32: 0xFFFFFFFF}


class CudaPersistent(Recipe):
    """Knobs: ``threads`` a block; ``units`` hidden units a block (the grid is H / units: fewer blocks,
    a cheaper grid sync, more work each); ``row_blocks`` splits the batch over that many blocks a
    unit group (the grid is H / units x row_blocks: each block stages and multiplies B / row_blocks
    rows with its weights); the register tile ``tile_rows`` x ``tile_cols`` (rows of the batch x
    columns of the block's gates); ``max_split`` caps the split-K parts (each output then sums that
    many partials serially); ``stage_operand`` stages the step's operand in shared memory where it
    fits beside the weights (else the GEMM reads it from global memory); ``poll_states`` ends a step
    without a grid sync where the next one can wait for the states it stages (``_Kernel.polled``);
    ``warp_frags`` caps the 16-column fragments a warp accumulates on tensor cores (each operand
    fragment it loads feeds that many mma; ``_warp_frags`` picks them); ``resident_weights`` keeps a
    warp's weight fragments in registers for all steps where at most MAX_RESIDENT_FRAGS fit;
    ``poll_waiters`` puts one waiter a producer before the polled staging (``poll_operand``)."""

    name = "cuda-persistent"
    knobs = {
        "threads": (256, 512, 128),
        "units": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
        "tile_rows": (4, 2, 1, 8),
        "tile_cols": (4, 2, 8, 1),
        "max_split": (32, 8, 128),
        "row_blocks": (1, 2, 4),
        # the step GEMM on tensor cores (fp16/bf16; the register tile's knobs then change nothing)
        "tensor_cores": (True, False),
        "stage_operand": (True, False),
        # the step's end synchronised through the staged states' values instead of a grid sync
        "poll_states": (True, False),
        # polled: one thread a producer first waits for its first value, then the staging polls
        "poll_waiters": (False, True),
        "warp_frags": (4, 1, 2),
        # a warp's weight fragments loaded once into registers, not from shared memory every step
        "resident_weights": (True, False),
        # the hoisted input GEMM's fragments on tensor cores (WMMA), or the GEMM on wgmma (Hopper),
        # as the step loop's knobs (cuda.py)
        "tc_hoisted_frags": (2, 4, 1),
        "wgmma": (True, False),
    }
    build_options = {"cooperative": True}
    switches = ("wgmma",)

    def defaults(self, program, target, switches: dict | None = None) -> dict:
        """The fewest units that keep the grid within the SMs (the largest grid); the largest row tile
        within the batch; the largest column tile that divides the block's columns; tensor cores
        where the dtype and arch allow them from TENSOR_CORE_MIN_BATCH rows; the hoisted
        GEMM's fragments as the step loop's. On tensor cores the batch over row blocks too
        (``_row_blocks``). Waiters before a polled staging above POLL_WAITERS_ABOVE_BYTES, or where
        no input projection is prefetched first (``poll_operand``)."""
        H, B = program.cell.hidden_size, program.batch
        k = super().defaults(program, target, switches)
        k["tc_hoisted_frags"] = _step_loop_defaults(program, target, k["wgmma"])["tc_hoisted_frags"]
        k["units"] = next(u for u in range(1, H + 1) if H % u == 0 and H // u <= target.sms)
        k.update(_register_tile(program, k["units"]))
        k["tensor_cores"] = tensor_cores_available(program.dtype, target) and B >= TENSOR_CORE_MIN_BATCH
        if k["tensor_cores"] and not self.valid(program, target, k):  # the operand does not fit on chip
            k["tensor_cores"] = False
        if k["tensor_cores"]:
            k = _row_blocks(self, program, target, k)
        kernel = _Kernel.plan(program, target, k)
        k["poll_waiters"] = bool(kernel and kernel.polled) and (kernel.polled_bytes > POLL_WAITERS_ABOVE_BYTES
                                                              or not kernel.hoisted)
        return k

    def preferred(self, program, target) -> bool:
        """Whether ``recipes_for`` puts this recipe before the step loop: up to PREFERRED_MAX_BATCH
        rows, above it where it streams the step's operand on tensor cores and the step loop's
        elementwise math does not fuse into its GEMM's kernel (fifteenth run, fp16 B=256 H=1024,
        this recipe / the step loop, ms: GRU, three gates in a tile, 2.294-2.300 / 2.497-2.576;
        fused, LSTM 2.753-2.804 / 2.658-2.695 in three runs, PeepholeLSTM 2.778 / 2.699; twelfth
        run, before the step loop's 8 warps: LSTM 2.78-2.89 / 2.99-3.18); not where its step GEMM
        would read the operand from global memory on FFMA cores while the step loop's runs on
        tensor cores, for a step of one stage. H100, T=100, fourteenth run, ms, this recipe / the
        step loop: fp16 GRU (100,64,2048) 14.4 / 2.8 (the tensor-core tile did not fit beside the weights); TF32
        (not in this recipe) at (100,64,1024) LSTM 5.09 / 3.31, GRU 4.87 / 3.34, PeepholeLSTM 5.21 /
        3.33; with two stages, ResetBeforeGRU there, 4.08 / 5.63 (the step loop launches twice the
        kernels a step); strict fp32 there (FFMA in both) LSTM 6.27 / 6.65. Nor where the step loop's
        step GEMM runs on wgmma (Hopper, run 83: GRU (100,256,1024) 2.078 ms against this recipe's
        2.294-2.300 of the fifteenth run), exact float32 included, as three TF32 products (run 94, LSTM
        (100,64,1024) 6.243 / 4.911, GRU 5.717 / 4.099; ResetBeforeGRU 5.005 / 7.138)."""
        k, step_loop = self.defaults(program, target), _step_loop_defaults(program, target)
        if _Kernel.plan(program, target, k).staged:
            return program.batch <= PREFERRED_MAX_BATCH
        as_run = CudaStepLoop().lowered(program, target, step_loop)  # its layout: split_tf32's
        if k["tensor_cores"]:  # streamed: first unless the step loop runs a step as one kernel or on wgmma
            return (epilogue_units(step_loop, as_run, target) is None
                    and not on_wgmma(step_loop, as_run, target, step=True))
        step_loop_on_tensor_cores = use_tensor_cores(step_loop, as_run, target, program.batch)
        return program.batch <= PREFERRED_MAX_BATCH and not (step_loop_on_tensor_cores
                                                             and len(program.plan.stages) == 1)

    def layout(self, program, target, knobs) -> PackedLayout:
        """(K, N) rows, which the kernel's FFMA step reads (``load_weights``). For exact float32
        where the hoisted GEMMs run on TF32 wgmma (knob wgmma), those as three TF32 products each,
        their weights (N, K) (``PackedLayout.hoisted_only``): the step stays FFMA. H100, T=100,
        prepared ms, this / FFMA (run 105): LSTM (100,16,512) 0.440 / 0.517, (512,64,512) 5.679 /
        7.385, (1024,16,768) 7.209 / 9.093, GRU (100,16,512) 0.366 / 0.444; errors against float64
        5.6e-6 to 5.9e-6 / 5.5e-6 to 5.6e-6."""
        if split_tf32(_prologue_knobs(program, target, knobs), program, target, hoisted_only=True):
            return PackedLayout(k_major=True, tf32x3=True, hoisted_only=True)
        return PackedLayout()

    def valid(self, program, target, knobs) -> bool:
        """It runs; tc_hoisted_frags stays at its first value where the hoisted GEMM is not on
        WMMA tensor cores, wgmma where there is none, stage_operand, poll_states, resident_weights
        and poll_waiters where they change nothing (the operand is not staged anyway, or cannot
        stream; no state is polled; no warp's weight fragments fit in registers): each would only
        repeat a candidate."""
        first = {n: knobs[n] == self.knobs[n][0] for n in ("tc_hoisted_frags", "wgmma")}
        hoisted = _prologue_knobs(program, target, knobs)
        wmma = use_tensor_cores(hoisted, program, target) and not on_wgmma(hoisted, program, target)
        wgmma = (wgmma_available(program.dtype, target, program.allow_tf32)
                 or split_tf32(_prologue_knobs(program, target, {**knobs, "wgmma": True}), program, target, True))
        if not ((first["tc_hoisted_frags"] or wmma) and (first["wgmma"] or wgmma)
                and self.runs(program, target, knobs)):
            return False
        kernel = _Kernel.plan(program, target, knobs)
        if not (knobs["poll_states"] or _Kernel.plan(program, target, {**knobs, "poll_states": True}).polled):
            return False
        if not (knobs["resident_weights"] or any(g.fits_registers for g in kernel.gemms)):
            return False
        if knobs["poll_waiters"] and not kernel.polled:
            return False
        staged = _Kernel.plan(program, target, {**knobs, "stage_operand": True}).staged
        return knobs["stage_operand"] or staged and not kernel.staged

    def runs(self, program, target, knobs) -> bool:
        """Co-resident (a grid of at most the SMs), whole units, a register tile that runs as chosen
        (no more rows than the batch, columns dividing the block's) or tensor cores that take the
        dtype, registers and shared memory (tensor cores need the operand there), the hoisted GEMM's
        tile within the target's limits."""
        H, B, U, P = program.cell.hidden_size, program.batch, knobs["units"], knobs["row_blocks"]
        if H % U or B % P or H // U * P > target.sms or knobs["threads"] > target.max_threads:
            return False
        tm, tn = knobs["tile_rows"], knobs["tile_cols"]
        if knobs["tensor_cores"]:
            if not tensor_cores_available(program.dtype, target):
                return False
        elif tm > B // P or (_widest(program) // H * U) % tn:
            return False
        hoisted = _prologue_knobs(program, target, knobs)
        return (tm * tn + (tm + tn) * VECTOR <= MAX_TILE_REGISTERS
                and (not use_tensor_cores(hoisted, program, target)
                     or hoisted_tensor_core_tile(hoisted).fits(BYTES[program.dtype], target))
                and _Kernel.plan(program, target, knobs) is not None)

    def space(self, program, target) -> list[dict]:
        """As Recipe.space, but the knobs that change nothing are not enumerated (they stay at their
        first value): the register tile on tensor cores, warp_frags and resident_weights on FFMA;
        poll_waiters is added to the settings whose kernel polls (where alone it is valid)."""
        out = []
        for on in self.knobs["tensor_cores"]:
            moot = ("tensor_cores", "tile_rows", "tile_cols") if on else ("tensor_cores", "warp_frags", "resident_weights")
            names = [n for n in self.knobs if n not in moot + ("poll_waiters",)]
            for k in self.settings(names, {"tensor_cores": on}):
                if self.valid(program, target, k):
                    out.append(k)
                    if _Kernel.plan(program, target, k).polled:
                        out.append({**k, "poll_waiters": not k["poll_waiters"]})
        return out

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cuda" and self.valid(program, target, self.defaults(program, target))

    def apply(self, program, target, **knobs) -> Schedule | None:
        k = self.resolve(program, target, knobs)
        kernel = _Kernel.plan(program, target, k)
        if kernel is None:
            return None
        sch = Schedule(tvm.IRModule({"main": kernel.func()}))
        prologue = _prologue_knobs(program, target, k)
        inline_elementwise(sch, sch.get_sblock("prologue"))
        gemms, others = child_blocks(sch, "prologue", program)
        for gemm in gemms:  # the hoisted GEMM as the step loop runs it (tensor cores for fp16/bf16)
            schedule_gemm(sch, gemm, prologue, program, target, step=False)
        for block in others:
            if not schedule_transpose(sch, block):
                bind_flat(sch, block, prologue["threads"])
        return sch


def _warp_frags(row_tiles: int, frags: int, warps: int, most: int) -> int:
    """Column fragments a warp: of the divisors of the block's ``frags`` up to ``most``, the fewest whose
    tiles share out evenly among the warps (no warp idle), else the most. H100, fp16 T=100, twelfth run:
    GRU (100,64,1024), 16 units x 2 row blocks, 48 columns: 1 fragment (6 tiles for 8 warps) 0.862 ms, 3
    (2 tiles, 4 split-K parts) 0.713; LSTM there (64 columns: 8 tiles) 1 fragment 0.929; LSTM (100,256,1024)
    streamed (8 x 4 fragments) 4 fragments 2.78-2.89, 2 3.81-3.87."""
    options = [f for f in range(1, most + 1) if frags % f == 0]
    return next((f for f in options if warps % (row_tiles * frags // f) == 0), options[-1])


def _row_blocks(recipe, program, target, knobs) -> dict:
    """Units and row blocks on tensor cores: the largest grid, and in it the fewest unit groups (each
    block reads its B / row_blocks rows of the operand every step: fewer groups read less); a split
    batch gives each block a multiple of 32 rows (two fragments). H100, fp16, T=100, twelfth run, ms,
    these defaults / the fewest units in one row block: (B, H) = (64, 1024), 16 units x 2 row blocks,
    LSTM 0.929 / 1.012, GRU 0.862 / 0.972 (1 fragment a warp both), ResetBeforeGRU 1.033 / 1.390;
    (64, 512), 8 x 2, LSTM 2.189 / 2.506; (256, 1024), streamed, 16 x 2, LSTM 2.81-2.89 / 4.17-4.29."""
    H, B = program.cell.hidden_size, program.batch
    settings = [{**knobs, "units": u, "row_blocks": p} for u in range(knobs["units"], H + 1) if H % u == 0
                for p in recipe.knobs["row_blocks"] if p == 1 or B % (2 * p * FRAG) == 0]
    return max((k for k in settings if recipe.runs(program, target, k)),
               key=lambda k: (H // k["units"] * k["row_blocks"], k["units"]), default=knobs)


def _step_loop_defaults(program, target, wgmma: bool = True) -> dict:
    return _per_program("step loop", program, (target, wgmma),
                        lambda: CudaStepLoop().defaults(program, target, {"wgmma": wgmma}))


def _prologue_knobs(program, target, knobs) -> dict:
    """The step loop's defaults for the prologue, with this recipe's hoisted-GEMM knobs."""
    return {**_step_loop_defaults(program, target, knobs["wgmma"]), "tc_hoisted_frags": knobs["tc_hoisted_frags"]}


def _widest(program) -> int:
    return max((g.rows for g in program.plan.step_gemms), default=program.cell.hidden_size)


def _register_tile(program, units: int) -> dict:
    """The FFMA GEMM's default register tile: the largest row tile within the batch, the largest
    column tile that divides a block's columns."""
    columns = _widest(program) // program.cell.hidden_size * units
    return {"tile_rows": max(t for t in (4, 2, 1) if t <= program.batch),
            "tile_cols": max(t for t in (4, 2, 1) if columns % t == 0)}


@dataclass
class _Gemm:
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
    def sized(cls, index, gemm, operand, dtype, view, B, C, knobs, weights_dtype) -> _Gemm:
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
        block barriers a step, was 2-9 % slower (H100, T=100, prepared ms, runs 101-102: fp16 LSTM
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


def _staged_operands(gemms: list[_Gemm]) -> dict[int, _Operand]:
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


class _Kernel:
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
    def gemms(self) -> list[_Gemm]:
        return [b for b in self.blocks if isinstance(b, _Gemm)]

    @classmethod
    def plan(cls, program, target, knobs):
        """None when the step has math a block cannot do on its own units (see ``_step_blocks``) or
        the block's buffers do not fit in shared memory. The operands are staged in shared memory
        where they fit (and ``stage_operand``); else read from global memory, which on tensor cores
        needs every GEMM's operand to be a buffer as stored (``_Gemm.streams``)."""
        H, U = program.cell.hidden_size, knobs["units"]
        rows = program.batch // knobs["row_blocks"]
        analysed = _step_blocks(program)
        if analysed is None:
            return None
        blocks = [_Gemm.sized(program.plan.gemms.index(what), what, text, dtype, view, rows, what.rows // H * U,
                              knobs, program.dtype)
                  if kind == "gemm" else (kind, what, ivs, text) for kind, what, ivs, text, dtype, view in analysed]
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
        first_elementwise = next((n for n, b in enumerate(self.blocks) if not isinstance(b, _Gemm)), len(self.blocks))
        states = tuple(dict.fromkeys(g.view[:-2] for g in gemms if g.view and g.view[:-2] in self.p.cell.states))
        one_stage = all(isinstance(b, _Gemm) for b in self.blocks[:first_elementwise]) and not any(
            isinstance(b, _Gemm) for b in self.blocks[first_elementwise:])
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

    def load_weights(self, g: _Gemm) -> list[str]:
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

    def stage_operand(self, g: _Gemm) -> list[str]:
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

    def staging_vector(self, g: _Gemm) -> int:
        """Elements of the operand a thread stages at once."""
        v = 16 // BYTES[g.operand_dtype] if g.tensor_cores else VECTOR
        return v if g.K % v == 0 and self.H % v == 0 else 1

    def poll_operand(self, g: _Gemm, v: int) -> list[str]:
        """The staging of ``stage_operand`` through the helpers of targets/cuda.py, from the second
        step (the first stages the initial state): after a block barrier, a thread's STAGING_UNROLL
        vectors of v elements are loaded together and reloaded until none holds the sentinel
        (``halstm_poll_stage``); with ``poll_waiters``, before that barrier one thread per unit group
        waits for the first value that group's block writes of this block's rows
        (``halstm_wait_value``). Without waiters the barrier still waits for the step's input
        projection (``prefetch``, issued first), which spaces the first polls from the step's end
        by a global load: polling at once was 1.4-1.6x slower (run 101: the loads crowd L2 while
        the producers write, as session 12 saw), after the barrier 1-12 % faster than the waiters,
        whose phase was a third of the step (runs 99-100, H100 fp16 T=100, prepared ms, LSTM
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

    def gemm_text(self, g: _Gemm) -> list[str]:
        """The GEMM's partial tiles and a sync (the elementwise math adds the partials: ``result``)."""
        return (self.tensor_core_text(g) if g.tensor_cores else self.register_tile_text(g)) + [
            'T.tvm_storage_sync("shared")']

    def warp_tile(self, g: _Gemm) -> tuple[str, str, str, str, str]:
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

    def resident_weights(self, g: _Gemm) -> list[str]:
        """Before the time loop: the weight fragments of each of this warp's chunks into wf (registers),
        which the step's GEMM then uses in place of loads from w_s. Measured (H100, LSTM fp16
        (100,16,512)): cuDNN's persistent kernel keeps its weights in registers (144 a thread) and
        issued a third of the instructions of this kernel reloading them from shared memory (runs 46-47);
        resident, the kernel took 3-12 % less (0.249 ms against 0.264 there, 2.754 against 3.128 at
        (1024,16,768), run 48)."""
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

    def tensor_core_text(self, g: _Gemm) -> list[str]:
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

    def register_tile_text(self, g: _Gemm) -> list[str]:
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
        # polled: the next step's staging waits for the states; the block's own buffers, for its threads
        return lines + ['T.tvm_storage_sync("shared")' if self.polled else "T.cuda.grid_sync()"]

    def func(self) -> tvm.tirx.PrimFunc:
        p, B, H = self.p, self.p.batch, self.H
        frame = skeleton(p.plan, p.steps, B, p.dtype, p.layout, hoisted_only=True)
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


_cache: dict[tuple, tuple] = {}


def _per_program(what: str, program, key, compute):
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
    return _per_program("blocks", program, None, lambda: _analyse_step(program))


def _packings(program) -> dict[int, tuple[list[str], str]]:
    """By GEMM index, the step GEMMs' packed weights at (k, n) as the lowering's prologue computes
    them: (the iteration variables for k and n, the printed value), read in place of the packed copy."""

    def analyse():
        sch, out = Schedule(program.mod), {}
        for i, gemm in enumerate(program.plan.gemms):
            if gemm.stage > 0:
                block = sch.get(sch.get_sblock(f"w_packed{i}"))
                out[i] = [iv.var.name for iv in block.iter_vars], str(block.body.value)
        return out

    return _per_program("packings", program, None, analyse)


def _analyse_step(program):
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
