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
    fused elementwise     the expression of the cell's own block, taken from the step program, its
                          GEMM columns read from shared memory, the S partials of each added there
    reductions            a cell's own sums over a row (a layer norm's), in rounds: the block's partial
                          sums of its units (warp lanes, added by shuffles) into global memory, a grid
                          sync or polls of the parts, the unit groups' parts added by the lanes into
                          shared memory, where the math reads them (``PersistentKernel.reduce``)
    grid sync             before the next stage's GEMM and at the end of the step; or, at the end of
                          the step (knob "poll_states"), none: the next step's staging waits for
                          the state values themselves (``PersistentKernel.polled``)

At B=16 a step's time is a chain of latencies: the exchange of h through L2, the
__syncthreads, the elementwise math's global loads (``benchmarks/step_phases.py`` stamps each phase;
docs/results.md#where-the-time-goes). At B=256, H=1024 fp16 the weights take 132 of the 227 KB and
the operand streams from global memory, its 8 warps a SM mostly waiting on global loads; there the
step loop runs instead (``preferred``). The choices measured against their alternatives, and those
tried and not kept (h exchanged through a thread block cluster's shared memory among them), are in
docs/results.md#design-choices-measured.

Where a step has several GEMMs (the backward's reversed loop, a GEMM a gate's adjoint, each polling
its state), each stages and multiplies before the next polls: staging all four first, their polls in flight together, was
slower (H200, fp16, LSTM's reversed loop of T=100, whole calls, ms, one after the other / together:
B=16, H=512 0.52-0.53 / 0.65-0.69, B=8 0.43 / 0.53-0.57; B=1 0.34 / 0.35-0.37 on FFMA), and so was
polling them one after another before the GEMMs (0.75-0.84 at B=16): a GEMM between the polls
overlaps the next gate's arrival.

Shared stores are never inside a condition (the shared-memory sync planner cannot handle that): loops
over a buffer clamp the index (the spare threads repeat the last element), and threads without a tile
store zero accumulators to rows of the partial buffer that nobody reads.

The step's math is not written here: the step program of ``halstm.lowering`` is scheduled only to inline
its elementwise math (``inline_elementwise``), and each block's expression is re-indexed onto the
block's units. The prologue, the hoisted input GEMM (and its weights' packing) alone
(``lowering.skeleton(hoisted_only=True)``), keeps the step-loop recipe's schedule, but for the hoisted
GEMM's tensor-core fragments (knob tc_hoisted_frags); in exact float32 on Hopper that GEMM runs as
three TF32 products on wgmma (``CudaPersistent.layout``). The step's weights are read from the
parameters where they lie and the kernel copies the initial states itself: an LSTM call is three
kernels (the hoisted GEMM's weights packed, that GEMM, this kernel).
"""

from __future__ import annotations

import tvm
from tvm.s_tir import Schedule

from halstm.layout import PackedLayout

from .cuda import CudaStepLoop
from .cuda_blocks import bind_flat, schedule_transpose
from .cuda_epilogue import epilogue_units
from .cuda_gemm import hoisted_tensor_core_tile, on_wgmma, split_tf32, use_tensor_cores
from .cuda_tensorcore import BYTES, tensor_cores_available
from .gemm_rules import schedule_gemm
from .block_gemm import VECTOR
from .persistent_kernel import PROLOGUE_KNOBS, PersistentKernel
from .step_program import Reduction, per_program, step_blocks
from .recipe import Recipe, child_blocks, inline_elementwise
from .wgmma import wgmma_available
from .wmma import FRAG

# Largest batch at which ``recipes_for`` puts this recipe first. H100, 2026-11-22 (docs/results.md):
# faster than the step loop at B=1 (2.8-3.9x), B=16, H=512 (2.9-5.2x), (T, B, H) = (1024, 16, 768)
# (2.9-5.8x) and B=64, H=1024 (1.1-2.3x), every cell, fp32 and fp16 (FFMA); with the
# step GEMMs of both recipes on tensor cores, fp16 at B=64, H=1024 2.2-5.3 ms against 2.7-7.1 and
# (512, 64, 512) 3.7-9.0 against 7.9-19.8. Above it, and below it where its step GEMM
# would read the operand from global memory on FFMA cores against the step loop's tensor cores, see
# ``CudaPersistent.preferred``. A size rule only; the tuner measures both.
PREFERRED_MAX_BATCH = 64

# Smallest batch whose step GEMM the defaults put on tensor cores (the batch padded to a fragment's 16
# rows), below it the FFMA register tile. H100, fp16, T=100, prepared ms, FFMA / tensor cores with
# resident weights (docs/results.md#design-choices-measured): B=1 H=256 LSTM 0.217 / 0.245, GRU 0.187 /
# 0.203; H=512 LSTM B=2 0.206 / 0.225, B=4 0.226 / 0.213, B=8 0.288 / 0.253, GRU B=4 0.245 / 0.204,
# B=8 0.298 / 0.221; PeepholeLSTM B=4 0.228 / 0.237 (the one exception), B=8 0.306 / 0.270.
TENSOR_CORE_MIN_BATCH = 4
# Most unit groups the defaults give a step with reductions of its own (a layer norm): every block
# reads each group's partial sums of its rows a round, dearer with more blocks.
REDUCING_GRID_GROUPS = 32
# Row fragments (16 rows) a block the defaults split the batch into for such a step, on tensor cores
# (else ``_row_blocks``' two): each block then sums and reads the parts of fewer rows a round. H200,
# fp16 T=100 I=H=512, prepared ms, 2 row blocks of 32 rows / 4 of 16 (16 units a block, 512 / 256
# threads), one process each, two processes: B=64 LayerNormGRU 0.645-0.660 / 0.528, LayerNormLSTM
# 0.912-0.921 / 0.751-0.761; B=32 LayerNormLSTM, 1 / 2 row blocks, 512 threads both, 0.856 / 0.718.
# Only where the operand stays staged.
REDUCING_ROW_FRAGMENTS = 1
# Fewest threads a block the defaults give such a step for each row of its batch, up to the most the
# knob offers: the block's threads share its rows' sums (``GridReductions.lanes``). H200, fp16 T=100
# I=H=512, prepared ms, 256 / 512 threads, two runs in one process: at B=64 (two row blocks of 32 rows)
# LayerNormGRU 0.798-0.812 / 0.715-0.724, LayerNormLSTM 1.029-1.038 / 0.919-0.925; at B=16 (16 rows)
# 0.416-0.443 / 0.500-0.508 and 0.658-0.669 / 0.702-0.730.
REDUCING_THREADS_A_ROW = 16
# Most unit groups the defaults give a step that polls several states (the backward's reversed loop,
# a GEMM a gate's adjoint): each block stages every gate's adjoint of its rows a step, four times the
# forward's h for LSTM, and fewer blocks read less of it. H200, fp16, the reversed loop of T=100,
# prepared, ms, the largest grid within the SMs / at most 64 groups, two rounds alternating in one
# command: LSTM (B, H) = (1, 256) 0.293-0.302 / 0.300-0.301, (4, 512) 0.339-0.343 / 0.336-0.339,
# (16, 512) 0.476-0.517 / 0.434-0.438, (16, 1024) 0.743-0.749 / 0.719-0.720; GRU 0.328-0.344 /
# 0.272-0.273, 0.317-0.331 / 0.283-0.295, 0.420-0.454 / 0.370-0.373, 0.584-0.588 / 0.575-0.578.
POLLING_GRID_GROUPS = 64
# Most rows for which the defaults poll several states (``poll_states``); from more, a step ends in a
# grid sync instead, which costs less than polling each gate's adjoint. H200, fp16, the reversed loop
# of T=100, prepared, ms, polling / a grid sync, two runs in one command: LSTM (B, H) = (16, 512)
# 0.431-0.447 / 0.414-0.432, (16, 1024) 0.720-0.744 / 0.672-0.707, (32, 512) 0.705-0.709 /
# 0.614-0.615, (64, 1024) 1.443-1.460 / 1.165-1.192; GRU (8, 512) 0.318-0.330 / 0.349-0.367,
# (16, 512) 0.386-0.389 / 0.392-0.396, (16, 1024) 0.572-0.587 / 0.491-0.506, (64, 1024) 0.923-0.952 /
# 0.808-0.831 (``benchmarks/knob_sweep.py --reversed-loop``).
POLLING_MAX_BATCH = 8
MAX_TILE_REGISTERS = 64  # accumulators + operand registers a thread may hold (spills beyond)
# Staged bytes a block polls a step above which the defaults put one waiter a producer first (knob
# poll_waiters; ``PersistentKernel.poll_operand``). H100 fp16 T=100, prepared ms, without / with waiters:
# 16-32 KiB, LSTM (100,16,512) 0.222 / 0.231, (1024,16,768) 2.531 / 2.693, (512,64,512)
# 1.630 / 1.687 (GRU (100,16,512) 0.207 and LSTM (100,8,512) 0.229 against 0.224 and 0.223 for the
# kernel before, with waiters and a separate split-K sum); 64 KiB, GRU (100,64,1024) 0.700 / 0.590,
# LSTM there 0.814 / 0.812: a block's repeated polls of 64 KiB crowd L2.
# Not where several GEMMs poll, a state each (the backward's reversed loop, one GEMM a gate). H100
# fp16, LSTM's reversed loop, T=101, prepared ms, without / with waiters: (101,16,512) 0.562 / 0.621, (101,64,1024) 1.426 / 1.598.
POLL_WAITERS_ABOVE_BYTES = 32 * 1024


class CudaPersistent(Recipe):
    """Knobs: ``threads`` a block; ``units`` hidden units a block (the grid is H / units: fewer blocks,
    a cheaper grid sync, more work each); ``row_blocks`` splits the batch over that many blocks a
    unit group (the grid is H / units x row_blocks: each block stages and multiplies B / row_blocks
    rows with its weights); the register tile ``tile_rows`` x ``tile_cols`` (rows of the batch x
    columns of the block's gates); ``max_split`` caps the split-K parts (each output then sums that
    many partials serially); ``stage_operand`` stages the step's operand in shared memory where it
    fits beside the weights (else the GEMM reads it from global memory); ``poll_states`` ends a step
    without a grid sync where the next one can wait for the states it stages (``PersistentKernel.polled``);
    ``warp_frags`` caps the 16-column fragments a warp accumulates on tensor cores (each operand
    fragment it loads feeds that many mma; ``block_gemm._warp_frags`` picks them); ``resident_weights`` keeps a
    warp's weight fragments in registers for all steps where at most MAX_RESIDENT_FRAGS fit;
    ``poll_waiters`` puts one waiter a producer before the polled staging (``poll_operand``);
    ``merge_variances`` sums a variance of the step's own reductions in its mean's round
    (``PersistentKernel.variances``; prepared ms, fp16 T=100 I=H=512, H100, merged / the kernel
    before the knob, a round each: LayerNormGRU B=16 0.72-0.74 / 0.77-0.80, B=64 0.88-0.91 /
    0.85-0.86, LayerNormLSTM B=16 1.05-1.07 / 1.08-1.10, B=64 1.17-1.25 / 1.33-1.34); ``poll_sums``
    has a block read a round's partial sums as they arrive, tagged with their step, instead of after
    a grid sync (``GridReductions.stage_parts``; prepared ms, the same shapes, H200, with / without
    it, two runs in one process: LayerNormGRU B=16 0.410-0.414 / 0.482-0.484, LayerNormLSTM B=16
    0.647-0.678 / 0.722-0.752, at B=64 within 3 % of each other)."""

    name = "cuda-persistent"
    keeps_results = True
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
        # a layer norm's variance summed in its mean's round (one grid sync for both), or a round after
        "merge_variances": (True, False),
        # a round's partial sums read as they arrive, tagged with their step, instead of after a grid sync
        "poll_sums": (True, False),
    }
    build_options = {"cooperative": True}
    switches = ("wgmma",)

    def defaults(self, program, target, switches: dict | None = None) -> dict:
        """The fewest units that keep the grid within the SMs (the largest grid); the largest row tile
        within the batch; the largest column tile that divides the block's columns; tensor cores
        where the dtype and arch allow them from TENSOR_CORE_MIN_BATCH rows; the hoisted
        GEMM's fragments as the step loop's. On tensor cores the batch over row blocks too
        (``_row_blocks``). Where the step has reductions of its own, a grid of at most
        REDUCING_GRID_GROUPS unit groups, its blocks REDUCING_ROW_FRAGMENTS of rows each where the
        batch splits, where it polls several states at most POLLING_GRID_GROUPS
        (``_row_blocks``, which keeps the knobs where no such grid runs) and, on tensor cores,
        REDUCING_THREADS_A_ROW threads a row of a block's batch where they run, and a grid sync a step instead
        of the polls above POLLING_MAX_BATCH rows. Waiters before a polled staging above
        POLL_WAITERS_ABOVE_BYTES, or where no input projection is prefetched first (``poll_operand``),
        where one GEMM polls."""
        H, B = program.cell.hidden_size, program.batch
        k = super().defaults(program, target, switches)
        k["tc_hoisted_frags"] = step_loop_defaults(program, target, k["wgmma"])["tc_hoisted_frags"]
        k["units"] = next(u for u in range(1, H + 1) if H % u == 0 and H // u <= target.sms)
        k.update(_register_tile(program, k["units"]))
        k["tensor_cores"] = tensor_cores_available(program.dtype, target) and B >= TENSOR_CORE_MIN_BATCH
        if k["tensor_cores"] and not self.valid(program, target, k):  # the operand does not fit on chip
            k["tensor_cores"] = False
        if k["tensor_cores"]:
            k = _row_blocks(self, program, target, k)
        kernel = PersistentKernel.plan(program, target, k)
        if kernel and kernel.reductions:
            split = _row_blocks(self, program, target, k, REDUCING_GRID_GROUPS, REDUCING_ROW_FRAGMENTS)
            planned = PersistentKernel.plan(program, target, split)
            k = split if planned and planned.staged else _row_blocks(self, program, target, k, REDUCING_GRID_GROUPS)
            rows = B // k["row_blocks"] if k["tensor_cores"] else 0  # the FFMA tile's threads: not measured
            more = [{**k, "threads": n} for n in sorted(self.knobs["threads"])
                    if k["threads"] < n <= max(REDUCING_THREADS_A_ROW * rows, k["threads"])]
            k = next((m for m in reversed(more) if self.runs(program, target, m)), k)
            kernel = PersistentKernel.plan(program, target, k)
        elif kernel and len(kernel.polled) > 1:
            k = _row_blocks(self, program, target, k, POLLING_GRID_GROUPS)
            k["poll_states"] = B <= POLLING_MAX_BATCH
            kernel = PersistentKernel.plan(program, target, k)
        k["poll_waiters"] = (bool(kernel and kernel.polled) and len(kernel.gemms) == 1
                             and (kernel.polled_bytes > POLL_WAITERS_ABOVE_BYTES or not kernel.hoisted))
        return k

    def preferred(self, program, target) -> bool:
        """Whether ``recipes_for`` puts this recipe before the step loop: up to PREFERRED_MAX_BATCH
        rows, above it where it streams the step's operand on tensor cores and the step loop's
        elementwise math does not fuse into its GEMM's kernel (H100, fp16 B=256 H=1024,
        this recipe / the step loop, ms: GRU, three gates in a tile, 2.294-2.300 / 2.497-2.576;
        fused, LSTM 2.753-2.804 / 2.658-2.695 in three runs, PeepholeLSTM 2.778 / 2.699); not where
        its step GEMM would read the operand from global memory on FFMA cores while the step loop's
        runs on tensor cores, for a step of one stage. H100, T=100, ms, this recipe / the step loop:
        fp16 GRU (100,64,2048) 14.4 / 2.8 (the tensor-core tile did not fit beside the weights); TF32
        (not in this recipe) at (100,64,1024) LSTM 5.09 / 3.31, GRU 4.87 / 3.34, PeepholeLSTM 5.21 /
        3.33; with two stages, ResetBeforeGRU there, 4.08 / 5.63 (the step loop launches twice the
        kernels a step); strict fp32 there (FFMA in both) LSTM 6.27 / 6.65. The same for a step
        with reductions of its own (a layer norm; ``PersistentKernel.reduce``) on a grid of at most
        REDUCING_GRID_GROUPS unit groups, staged (H200, fp16 T=100 I=H=512, whole calls, ms, this
        recipe / the step loop: LayerNormGRU B=16 0.620 / 0.901, B=64 0.816 / 0.991; LayerNormLSTM
        B=16 0.868 / 1.199, B=64 1.231 / 1.224), not streamed. Nor where the step loop's step GEMM
        runs on wgmma (Hopper; H100: GRU (100,256,1024) 2.078 ms against this recipe's 2.294-2.300),
        exact float32 included, as three TF32 products (LSTM (100,64,1024) 6.243 / 4.911, GRU 5.717 /
        4.099; ResetBeforeGRU 5.005 / 7.138)."""
        k, step_loop = self.defaults(program, target), step_loop_defaults(program, target)
        kernel = PersistentKernel.plan(program, target, k)
        if kernel.staged:
            return program.batch <= PREFERRED_MAX_BATCH
        if kernel.reductions:
            return False
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
        prepared ms, this / FFMA: LSTM (100,16,512) 0.440 / 0.517, (512,64,512) 5.679 /
        7.385, (1024,16,768) 7.209 / 9.093, GRU (100,16,512) 0.366 / 0.444; errors against float64
        5.6e-6 to 5.9e-6 / 5.5e-6 to 5.6e-6."""
        if split_tf32(prologue_knobs(program, target, knobs), program, target, hoisted_only=True):
            return PackedLayout(k_major=True, tf32x3=True, hoisted_only=True)
        return PackedLayout()

    def valid(self, program, target, knobs) -> bool:
        """It runs; tc_hoisted_frags stays at its first value where the hoisted GEMM is not on
        WMMA tensor cores, wgmma where there is none, stage_operand, poll_states, resident_weights
        poll_waiters, merge_variances and poll_sums where they change nothing (the operand is not
        staged anyway, or cannot stream; no state is polled; no warp's weight fragments fit in
        registers; no variance; no reduction): each would only repeat a candidate."""
        if not (hoisted_knobs_matter(self, program, target, knobs) and self.runs(program, target, knobs)):
            return False
        kernel = PersistentKernel.plan(program, target, knobs)
        if not (knobs["poll_states"] or PersistentKernel.plan(program, target, {**knobs, "poll_states": True}).polled):
            return False
        if not (knobs["resident_weights"] or any(g.fits_registers for g in kernel.gemms)):
            return False
        if knobs["poll_waiters"] and not kernel.polled:
            return False
        if not knobs["merge_variances"] and not PersistentKernel.plan(
                program, target, {**knobs, "merge_variances": True}).variances:
            return False
        if not knobs["poll_sums"] and not kernel.reductions:
            return False
        staged = PersistentKernel.plan(program, target, {**knobs, "stage_operand": True}).staged
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
        return (tm * tn + (tm + tn) * VECTOR <= MAX_TILE_REGISTERS and _hoisted(program, target, knobs)[2]
                and PersistentKernel.plan(program, target, knobs) is not None)

    def space(self, program, target) -> list[dict]:
        """As Recipe.space, but the knobs that change nothing are not enumerated (they stay at their
        first value): the register tile on tensor cores, warp_frags and resident_weights on FFMA,
        merge_variances where the step has no sums of its own, and poll_sums (polling was as fast as
        the grid sync or faster at every measured shape: the class's docstring; searched, it would
        double the settings of a step with sums); poll_waiters is added to the settings whose kernel
        polls (where alone it is valid). The prologue's knobs vary fastest: the settings of one
        kernel come one after another (``PersistentKernel.plan`` keeps the last few)."""
        out, analysed = [], step_blocks(program) or []
        sums = ("poll_sums",) if any(isinstance(b, Reduction) for b in analysed) else ("merge_variances", "poll_sums")
        for on in self.knobs["tensor_cores"]:
            moot = ("tensor_cores", "tile_rows", "tile_cols") if on else ("tensor_cores", "warp_frags", "resident_weights")
            names = [n for n in self.knobs if n not in moot + sums + ("poll_waiters",) + PROLOGUE_KNOBS]
            names += list(PROLOGUE_KNOBS)
            for k in self.settings(names, {"tensor_cores": on}):
                if self.valid(program, target, k):
                    out.append(k)
                    if PersistentKernel.plan(program, target, k).polled:
                        out.append({**k, "poll_waiters": not k["poll_waiters"]})
        return out

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cuda" and self.valid(program, target, self.defaults(program, target))

    def apply(self, program, target, **knobs) -> Schedule | None:
        k = self.resolve(program, target, knobs)
        kernel = PersistentKernel.plan(program, target, k)
        if kernel is None:
            return None
        sch = Schedule(tvm.IRModule({"main": kernel.func()}))
        schedule_prologue(sch, program, target, k)
        return sch


def schedule_prologue(sch: Schedule, program, target, knobs: dict) -> None:
    """The hoisted GEMMs alone (``skeleton(hoisted_only=True)``), as the step loop runs them (tensor
    cores for fp16/bf16), with ``knobs``' tc_hoisted_frags and wgmma."""
    prologue = prologue_knobs(program, target, knobs)
    inline_elementwise(sch, sch.get_sblock("prologue"))
    gemms, others = child_blocks(sch, "prologue", program)
    for gemm in gemms:
        schedule_gemm(sch, gemm, prologue, program, target, step=False)
    for block in others:
        if not schedule_transpose(sch, block):
            bind_flat(sch, block, prologue["threads"])


def hoisted_knobs_matter(recipe, program, target, knobs: dict) -> bool:
    """Whether ``knobs``' tc_hoisted_frags and wgmma each are at the recipe's first value or change
    the hoisted GEMM (on WMMA tensor cores; wgmma where there is one): a setting that only repeats
    another is not worth measuring."""
    first = {n: knobs[n] == recipe.knobs[n][0] for n in ("tc_hoisted_frags", "wgmma")}
    wmma, wgmma, _ = _hoisted(program, target, knobs)
    return (first["tc_hoisted_frags"] or wmma) and (first["wgmma"] or wgmma)


def _hoisted(program, target, knobs: dict) -> tuple[bool, bool, bool]:
    """Whether the hoisted GEMM runs on WMMA tensor cores with ``knobs``, whether wgmma could run it,
    and whether its tensor-core tile (where it runs on tensor cores) fits the target: computed once
    a program and setting of the knobs ``prologue_knobs`` reads, not once a candidate."""
    def compute():
        hoisted = prologue_knobs(program, target, knobs)
        cores = use_tensor_cores(hoisted, program, target)
        wmma = cores and not on_wgmma(hoisted, program, target)
        wgmma = (wgmma_available(program.dtype, target, program.allow_tf32)
                 or split_tf32(prologue_knobs(program, target, {**knobs, "wgmma": True}), program, target, True))
        fits = not cores or hoisted_tensor_core_tile(hoisted).fits(BYTES[program.dtype], target)
        return wmma, wgmma, fits

    return per_program("hoisted GEMM", program, (target, knobs["wgmma"], knobs["tc_hoisted_frags"]), compute)


def _row_blocks(recipe, program, target, knobs, most_groups: int | None = None, fragments: int = 2) -> dict:
    """Units and row blocks: the largest grid (of at most ``most_groups`` unit groups), and in it
    the fewest unit groups (each block reads its B / row_blocks rows of the operand every step: fewer
    groups read less); on tensor cores a split batch gives each block a multiple of ``fragments``
    fragments of rows (16 each), on FFMA cores the register tile follows the units. ``knobs`` where
    no setting runs.
    H100, fp16, T=100, ms, these defaults / the fewest units in one row block: (B, H) = (64, 1024),
    16 units x 2 row blocks, LSTM 0.929 / 1.012, GRU 0.862 / 0.972 (1 fragment a warp both),
    ResetBeforeGRU 1.033 / 1.390; (64, 512), 8 x 2, LSTM 2.189 / 2.506; (256, 1024), streamed, 16 x 2,
    LSTM 2.81-2.89 / 4.17-4.29."""
    H, B, split = program.cell.hidden_size, program.batch, knobs["tensor_cores"]
    settings = [{**knobs, "units": u, "row_blocks": p, **({} if split else _register_tile(program, u))}
                for u in range(knobs["units"], H + 1) if H % u == 0 and H // u <= (most_groups or H)
                for p in recipe.knobs["row_blocks"] if p == 1 or split and B % (fragments * p * FRAG) == 0]
    return max((k for k in settings if recipe.runs(program, target, k)),
               key=lambda k: (H // k["units"] * k["row_blocks"], k["units"]), default=knobs)


def step_loop_defaults(program, target, wgmma: bool = True) -> dict:
    return per_program("step loop", program, (target, wgmma),
                        lambda: CudaStepLoop().defaults(program, target, {"wgmma": wgmma}))


def prologue_knobs(program, target, knobs) -> dict:
    """The step loop's defaults for the prologue, with this recipe's hoisted-GEMM knobs."""
    return {**step_loop_defaults(program, target, knobs["wgmma"]), "tc_hoisted_frags": knobs["tc_hoisted_frags"]}


def _widest(program) -> int:
    return max((g.rows for g in program.plan.step_gemms), default=program.cell.hidden_size)


def _register_tile(program, units: int) -> dict:
    """The FFMA GEMM's default register tile: the largest row tile within the batch, the largest
    column tile that divides a block's columns."""
    columns = _widest(program) // program.cell.hidden_size * units
    return {"tile_rows": max(t for t in (4, 2, 1) if t <= program.batch),
            "tile_cols": max(t for t in (4, 2, 1) if columns % t == 0)}
