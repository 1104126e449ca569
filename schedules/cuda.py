"""CUDA step-loop recipe: the hoisted GEMM once, then per step one GEMM kernel and one fused
elementwise kernel per stage, launched from the compiled host loop over t (no Python per step). On
tensor cores the elementwise math runs in its GEMM's kernel where a column tile holds every gate of
its units (tc_epilogue, ``fuse_epilogue``): one kernel a stage.

fp16/bf16 GEMMs run on tensor cores (WMMA, fp32 accumulation; cuda_tensorcore.py, knob
"tensor_cores"): the hoisted one always, the step's from B >= 16 rows, a computed operand
(ResetBeforeGRU's r * h) rounded to the storage dtype (as a torch cell in that dtype rounds it) where
it needs no padding; ragged shapes are zero-padded. The hoisted GEMM's block is 2 x 2 warps
(HOISTED_WARPS) of tc_hoisted_frags fragments; the step's its own warps and fragments (tc_warps_m,
tc_warps_n, tc_frags), K tile,
prefetch (off: slower where measured) and column narrowing (tc_step_k, tc_prefetch, tc_fill; defaults
from the target's SMs and shared memory: ``_step_tensor_core_defaults``). Both are pipelined over four
K tiles by default, two for TF32 (tc_stages, cp.async, from sm_80: ``_pipelined``). fp32 GEMMs run
there too as TF32 when the program allows it (``allow_tf32``). On Hopper the GEMMs run on wgmma
instead (wgmma.py, knob "wgmma", ``on_wgmma``), their weights packed (N, K) where all do
(``layout``), and exact float32 then as three TF32 products each (``split_tf32``). The others use
the FFMA schedule below.

FFMA GEMMs (the hoisted one and the step's) share one tiled schedule, C[M, N] = A[M, K] @ W[K, N] with W
the packed (K, N) weights:

    for block (row tile of bm, column tile of bn):           blockIdx.x
      for thread (bm / tm rows x bn / tn columns):           threadIdx.x
        acc[tm, tn] = 0                                       "local": registers
        for ko in K / bk:
          A_s[bm, bk], W_s[bk, bn] = tiles of A, W            "shared", fetched by all threads,
          sync                                                vectorised where rows are aligned
          for kk in bk, r in tm, c in tn (unrolled):
            acc[r, c] += A_s[thread row r, kk] * W_s[kk, thread column c]
        store acc (fp32; fp16/bf16 operands are widened as they are read)

A thread's tn columns are adjacent. (They were bn / tn apart, to spare W_s bank conflicts, but the
register tile's write-back, placed by reverse_compute_at, then covered the whole span between a
thread's first and last column and stored uninitialised registers over other threads' results: GRU
T=20 came out 85 % wrong on the H100 while T=3 passed.) When a GEMM has fewer rows than bm (the step's
GEMM at small batch), the row tile shrinks to the rows (rounded up to a power of two), with up to
bm / tm row threads, so that a block is not mostly idle threads.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from tvm.s_tir import Schedule
from tvm.tirx import IterVar
from tvm.tirx.analysis import undefined_vars

from halstm.lowering import PackedLayout

from .cuda_tensorcore import (BYTES, WARP, TensorCoreTile, fetches_its_operand, gemm_tensorcore,
                              tensor_cores_available)
from .recipe import (Recipe, child_blocks, inline_elementwise, is_pure_copy, is_reduction, merge_next_states,
                     pow2_at_least)
from .row_kernel import schedule_rows
from .wgmma import WgmmaTile, gemm_wgmma, wgmma_available, wgmma_tile

VECTOR = 4  # elements a thread fetches at once into shared memory
# the step GEMM uses tensor cores from one full 16-row fragment up: below, most of each mma_sync
# would multiply padding rows, and the FFMA tile at small B is bound by latency, not arithmetic
TENSOR_CORE_MIN_ROWS = 16


class CudaStepLoop(Recipe):
    name = "cuda-step-loop"
    knobs = {
        # the step's GEMM (B rows)
        "block_rows": (64, 32, 128, 16),
        "block_cols": (64, 32, 128),
        "thread_rows": (4, 2, 8, 1),
        "thread_cols": (4, 2, 8, 1),
        "k_chunk": (16, 8, 32),
        # the hoisted GEMM (T * B rows): square block and thread tiles
        "hoisted_block": (128, 64),
        "hoisted_thread": (8, 4),
        "threads": (256, 128, 512),  # elementwise kernels
        # fp16/bf16 GEMMs on tensor cores (cuda_tensorcore.py): the step GEMM's block is tc_warps_m x
        # tc_warps_n warps, each tc_frags x tc_frags 16x16 fragments; the hoisted GEMM's HOISTED_WARPS
        # of tc_hoisted_frags x tc_hoisted_frags, K staged tc_k at a time. H100, LSTM fp16 T=100
        # B=64 H=1024, the hoisted GEMM (6400 x 4096 x 1024, ncu): 2 x 2 warps of 2 x 2 fragments
        # (64 x 64) 340 us, of 4 x 4 (128 x 128, its C tile in 66 KiB of dynamic shared memory)
        # 282 us, 2 x 4 warps of 2 x 2 (64 x 128) 298 us; the default is 128 x 128 where its grid
        # fills the SMs (_hoisted_fragments)
        "tensor_cores": (True, False),
        "tc_warps_m": (2, 1, 4),
        "tc_warps_n": (2, 4),
        "tc_frags": (2, 1, 4),
        "tc_hoisted_frags": (2, 4, 1),
        "tc_k": (32, 16),
        # K tiles in flight in both tensor-core GEMMs (cp.async pipelining; 1: fetch, sync, mma)
        "tc_stages": (1, 2, 3, 4),
        # the step GEMM on tensor cores (B rows, latency-bound: K / tc_step_k serial tile fetches):
        # its K tile, the next K tile's loads in flight during the mma (tc_prefetch), its column
        # tile narrowed while half the SMs would idle (tc_fill); the first values are the schedule
        # before these knobs, the defaults come from the target (_step_tensor_core_defaults)
        "tc_step_k": (32, 64, 128, 16),
        "tc_prefetch": (False, True),
        "tc_fill": (False, True),
        # the step's elementwise math in its tensor-core GEMM's kernel (fuse_epilogue), the gates
        # grouped by units (PackedLayout.units). H100 fp16 T=100 (benchmarks/knob_sweep.py), ms
        # on / off: LSTM B=256 H=1024 3.03 / 3.11, B=64 H=2048 3.34 / 3.53, ResetBeforeGRU B=256
        # 3.14 / 3.29, B=64 2.54 / 2.58; GRU does not fuse (3 gates, no whole units in a tile)
        "tc_epilogue": (True, False),
        # fp16/bf16 GEMMs (float32 as TF32) on Hopper's wgmma (wgmma.py) rather than WMMA: alone
        # 18-31 % faster hoisted, 29-35 % at a step's rows (H100); the step's elementwise math then runs in a
        # kernel of its own (tc_epilogue applies to WMMA: epilogue_units). H100 fp16 T=100, prepared
        # ms, wgmma / WMMA: GRU (100,256,1024) 2.078 / 2.964 (cuDNN 2.255)
        "wgmma": (True, False),
        # the wgmma tiles (WgmmaTile.name: warpgroups x columns x stages, "f": a group in flight) of
        # the hoisted GEMMs and of the step's; "auto": wgmma_tile's choice for the shape, the fastest
        # of these alone (H100 fp16, us, with 8-byte stores: 25600 x 4096 x 1024 387 / 422, 256 x 4096
        # x 1024 7.3 / 7.7 / 9.0; 64 x 8192 x 2048 11.7 / 11.1 / 16.8 with 4-byte stores). In the
        # recipe (LSTM (100,256,1024)) the step's 1x64x4
        # measured 1.811 ms against auto's 1.904, equal in the tuner's side-by-side: a shape's tune decides
        "wgmma_hoisted": ("auto", "2x256x4f", "2x128x5f", "1x128x6f", "1x64x4"),
        "wgmma_step": ("auto", "1x128x6f", "1x64x4", "2x128x5f"),
    }
    _FFMA_STEP = ("block_rows", "block_cols", "thread_rows", "thread_cols", "k_chunk")
    _FFMA_HOISTED = ("hoisted_block", "hoisted_thread")
    _TENSOR_CORE = ("tc_hoisted_frags", "tc_k", "tc_stages")
    _TENSOR_CORE_STEP = ("tc_warps_m", "tc_warps_n", "tc_frags", "tc_step_k", "tc_prefetch", "tc_fill",
                         "tc_epilogue")
    _WGMMA = ("wgmma", "wgmma_hoisted", "wgmma_step")
    switches = ("tensor_cores", "wgmma")

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cuda"

    def defaults(self, program, target, switches: dict | None = None) -> dict:
        """The first value of each knob, but the step GEMM's column tile halved (down to 32) while
        its grid leaves SMs idle: at B=64, H=1024 (N=4096) 64 x 64 tiles made 64 blocks for the
        H100's 132 SMs and the step GEMM ran at 5.8 TFLOP/s (ncu: 92 us a step); and widened until
        a block has a warp's threads. Tensor-core GEMMs pipelined (``_pipelined``); the WMMA knobs
        of GEMMs on wgmma at their first value (``_moot_wmma``), those of GEMMs off it (wgmma False
        in ``switches``) tuned as here."""
        k = super().defaults(program, target, switches)
        program = self.lowered(program, target, k) if target is not None else program
        if target is not None and use_tensor_cores(k, program, target):
            k.update(_pipelined(k, program, target))
            if use_tensor_cores(k, program, target, program.batch):
                k.update(self._step_tensor_core_defaults(program, target, k))
            # knobs that change nothing stay at their first value, as valid() wants
            k.update({n: self.knobs[n][0] for n in self._moot_wmma(program, target, k)})
        if target is not None and use_tensor_cores(k, program, target, program.batch):
            return k  # the FFMA step knobs at their first value too
        widest = max((g.rows for g in program.plan.step_gemms), default=0)
        while (target is not None and k["block_cols"] > 32
               and step_tile(k, program.batch).blocks(program.batch, widest) < target.sms):
            k["block_cols"] //= 2
            k["thread_cols"] = max(1, k["thread_cols"] // 2)  # as many threads as before
        while step_tile(k, program.batch).threads < 32:  # at B=1 one row thread: widen to a warp
            k["block_cols"] *= 2
        return k

    def _step_tensor_core_defaults(self, program, target, knobs) -> dict:
        """The step GEMM on tensor cores is latency-bound: each of its K / tc_step_k tiles costs a
        round trip to L2 (global loads, barrier, the tile's mma, barrier) that its few blocks
        cannot overlap with other work. H100, B=64, H=1024 with the first knob values (64 x 64
        tiles, 64 blocks, K staged 32 at a time): 32 tiles in 28.3 us, 0.88 us (~1500 cycles) a
        tile for 8 KiB a block, i.e. ~9 GB/s an SM, far below what an SM can load: latency, not
        bandwidth. So:
        - tc_fill: the column tile narrowed while half the SMs would idle (128 blocks of 64 x 32
          there), each fetching half the bytes a tile;
        - tc_step_k: the fewest tiles (round trips) whose shared memory fits, a tile dividing K
          first where one does (its loads stay 16-byte vectors; a K padded to a tile is fetched
          an element at a time), up to one tile for all of K;
        - tc_prefetch off: measured slower everywhere it was tried;
        - for fp16/bf16, 8 warps a block (tc_warps_m STEP_WARPS_M) and K tiles of STEP_K_BYTES where
          every step GEMM's tile stays STEP_WIDE_COLUMNS wide, else 4 warps (the first value).
        Measured (H100, fp16, benchmarks/knob_sweep.py), T=100,
        ms against the first values (K 32, no fill, no prefetch) and with prefetch on:
        LSTM B=64 H=1024 (64 x 32 tiles, K=128, 8 round trips instead of 32) 2.10 / 2.97 / 2.24;
        LSTM B=256 H=1024 (64 x 64 tiles, 256 blocks already, K=64) 3.79 / 4.32 / 3.90;
        GRU B=256 H=1024 3.41 (with prefetch) / 3.68; LSTM B=64 H=2048 6.48 / 6.71 / 6.71."""
        size = BYTES[program.dtype]
        gemms = program.plan.step_gemms
        depth = max((g.depth for g in gemms), default=0)
        if not depth:
            return {}

        def tiles(bk):
            return -(-depth // bk)

        def setting(warps_m, k_bytes):
            def with_k(bk):
                return {**knobs, "tc_warps_m": warps_m, "tc_fill": True, "tc_prefetch": False, "tc_step_k": bk}

            fitting = [bk for bk in self.knobs["tc_step_k"] if _step_tiles_fit(with_k(bk), program, target, size)]
            pipelined = sorted(bk for bk in fitting if bk >= k_bytes // size)
            if knobs["tc_stages"] > 1 and pipelined:
                # round trips overlap: the shortest K tile that makes at most PIPELINED_K_TILES, else the longest
                return with_k(next((bk for bk in pipelined if tiles(bk) <= PIPELINED_K_TILES), pipelined[-1]))
            if fitting:  # the fewest round trips, a tile dividing K first (its loads stay vectors)
                return with_k(min(fitting, key=lambda bk: (depth % bk != 0 and tiles(bk) > 1, tiles(bk), bk)))
            return None

        wide = setting(STEP_WARPS_M, STEP_K_BYTES) if size == 2 else None
        if wide and all(step_tensor_core_tile(wide, program.batch, g.rows, target).bn >= STEP_WIDE_COLUMNS
                        for g in gemms):
            return {n: wide[n] for n in self._TENSOR_CORE_STEP}
        narrow = setting(self.knobs["tc_warps_m"][0], PIPELINED_K_BYTES)
        return {n: narrow[n] for n in self._TENSOR_CORE_STEP} if narrow else {}

    def valid(self, program, target, knobs) -> bool:
        """It runs; knobs of a GEMM schedule that does not run stay at their first value, and a
        wgmma tile named is not the one "auto" picks for every GEMM of its kind (each would only
        repeat a candidate)."""
        program = self.lowered(program, target, knobs)
        return (all(knobs[name] == self.knobs[name][0] for name in self._unused(program, target, knobs))
                and not any(self._repeats_auto(program, target, knobs, step) for step in (False, True))
                and self.runs(program, target, knobs))

    def _repeats_auto(self, program, target, knobs, step: bool) -> bool:
        name = knobs["wgmma_step" if step else "wgmma_hoisted"]
        rows, gemms = _gemms(program, step)
        return name != "auto" and all(wgmma_tile(rows, g.rows, target).name == name for g in gemms)

    def runs(self, program, target, knobs) -> bool:
        """The tiles that run fit: the hoisted GEMM's (tensor cores or FFMA), the step GEMM's FFMA
        tile as it runs (it does on tensor cores too where a computed operand, r * h, would need
        padding) and its WMMA tiles where a step GEMM runs on them."""
        size = BYTES[program.dtype]
        on = use_tensor_cores(knobs, program, target)
        hoisted = hoisted_tensor_core_tile(knobs) if on else hoisted_tile(knobs)
        return (hoisted.fits(size, target) and step_tile(knobs, program.batch).fits(size, target)
                and (not use_tensor_cores(knobs, program, target, program.batch)
                     or on_wgmma(knobs, program, target, step=True)
                     or _step_tiles_fit(knobs, program, target, size)))

    def space(self, program, target) -> list[dict]:
        """As Recipe.space, but the unused knobs are not enumerated (the full product is 500K
        settings, a minute of valid())."""
        space = []
        for on, wgmma in itertools.product(self.knobs["tensor_cores"], self.knobs["wgmma"]):
            first = self.defaults(program, target, {"tensor_cores": on, "wgmma": wgmma})
            unused = self._unused(self.lowered(program, target, first), target, first)
            if any(first[n] != self.knobs[n][0] and n in unused for n in ("tensor_cores", "wgmma")):
                continue
            names = [n for n in self.knobs if n not in ("tensor_cores", "wgmma") and n not in unused]
            space += [k for k in self.settings(names, {"tensor_cores": on, "wgmma": wgmma})
                      if self.valid(program, target, k)]
        return space

    def _unused(self, program, target, knobs) -> tuple:
        """The knobs that change nothing here, ``program`` as lowered for ``knobs`` (``lowered``)."""
        on = {**knobs, "tensor_cores": True, "wgmma": True}
        if not (tensor_cores_available(program.dtype, target, program.allow_tf32) or split_tf32(on, program, target)):
            return self._TENSOR_CORE + self._TENSOR_CORE_STEP + self._WGMMA + ("tensor_cores",)
        if not use_tensor_cores(knobs, program, target):
            return self._TENSOR_CORE + self._TENSOR_CORE_STEP + self._WGMMA
        step_tc = use_tensor_cores(knobs, program, target, program.batch)
        wgmma = on_wgmma(knobs, program, target), on_wgmma(knobs, program, target, step=True)
        if not wgmma_available(program.dtype, target, tf32_gemms(program)):
            tiles = self._WGMMA
        else:  # a tile knob of GEMMs off wgmma (or whose tile does not fit) changes nothing
            tiles = tuple(name for name, on in zip(("wgmma_hoisted", "wgmma_step"), wgmma) if not on)
        return (self._FFMA_HOISTED + (self._FFMA_STEP if step_tc else ())
                + self._moot_wmma(program, target, knobs, wgmma) + tiles)

    def _moot_wmma(self, program, target, knobs, wgmma: tuple[bool, bool] | None = None) -> tuple:
        """The WMMA knobs of GEMMs that run on wgmma (``wgmma``: ``on_wgmma`` of the hoisted GEMMs
        and of the step's, computed where not given) or FFMA cores (a step of fewer than
        TENSOR_CORE_MIN_ROWS rows): the hoisted GEMM's, the step's, tc_stages where neither runs
        WMMA."""
        hoisted, step = wgmma or (on_wgmma(knobs, program, target), on_wgmma(knobs, program, target, step=True))
        step = step or not use_tensor_cores(knobs, program, target, program.batch)
        return ((("tc_hoisted_frags", "tc_k") if hoisted else ()) + (self._TENSOR_CORE_STEP if step else ())
                + (("tc_stages",) if hoisted and step else ()))

    def layout(self, program, target, knobs) -> PackedLayout:
        """Columns grouped by units (``PackedLayout.units``) where a step GEMM's epilogue fuses:
        the units of one column tile. (N, K) (``k_major``) where every GEMM runs on wgmma: the
        step's weights are packed by the prologue, outside the scope where ``gemm_wgmma`` could
        lay them out so, and TF32 wgmma reads no other layout; exact float32 GEMMs then as three
        TF32 products (``tf32x3``, ``split_tf32``)."""
        split = split_tf32(knobs, program, target)
        if split or (on_wgmma(knobs, program, target) and on_wgmma(knobs, program, target, step=True)):
            return PackedLayout(k_major=True, tf32x3=split)
        units = epilogue_units(knobs, program, target)
        return PackedLayout(units=units, width=program.cell.hidden_size) if units else PackedLayout()

    def lowered(self, program, target, knobs):
        """``program`` as ``halstm.compile`` lowers it for ``knobs`` (its layout)."""
        layout = self.layout(program, target, knobs)
        return program if layout == program.layout else replace(program, layout=layout)

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        sch = Schedule(program.mod)
        operands = {f"{g.name}_operand" for g in program.plan.gemms}
        for scope in ("prologue", "step"):
            inline_elementwise(sch, sch.get_sblock(scope), keep=operands)
            gemms, elementwise = child_blocks(sch, scope, program)
            views = {m.buffer.name for m in sch.get(sch.get_sblock(scope)).match_buffers}
            # a state's copy goes into the GEMM's shared tile (gemm_tiled inlines it there)
            elementwise = [b for b in elementwise
                           if not (sch.get(b).name_hint in operands and is_pure_copy(sch, b))]
            elementwise = merge_next_states(sch, sch.get_sblock(scope), elementwise)
            # before the GEMMs: rfactor refuses a scope that holds a tensorized GEMM's block
            columns = [b for b in elementwise if reduces_columns(sch, b) and _whole_slices(sch, b, k["threads"])]
            elementwise = [b for b in elementwise if b not in columns]
            for block in columns:
                bind_column_reduction(sch, block, k["threads"])
            for gemm in gemms:
                fused = fuse_epilogue(sch, gemm, k, program, target) if scope == "step" else set()
                if not fused:
                    schedule_gemm(sch, gemm, k, program, target, scope == "step", views)
                elementwise = [b for b in elementwise if sch.get(b).name_hint not in fused]
            if scope == "step":
                elementwise = schedule_rows(sch, elementwise, k["threads"])
            for block in elementwise:
                if is_reduction(sch, block):
                    bind_reduction(sch, block, k["threads"])
                elif not schedule_transpose(sch, block):
                    bind_flat(sch, block, k["threads"])
        return sch


@dataclass(frozen=True)
class GemmTile:
    """A block computes bm x bn outputs, each thread tm x tn of them, K staged bk at a time."""

    bm: int
    bn: int
    tm: int
    tn: int
    bk: int

    @property
    def threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    def blocks(self, rows: int, cols: int) -> int:
        return -(-rows // self.bm) * -(-cols // self.bn)

    def fits(self, size: int, target) -> bool:
        shared = (self.bm + self.bn) * self.bk * size
        return (self.bm % self.tm == 0 and self.bn % self.tn == 0 and 32 <= self.threads <= target.max_threads
                and self.tm * self.tn <= 64 and shared <= target.static_shared_memory)


def step_tile(knobs: dict, batch: int) -> GemmTile:
    """The step GEMM's tile: when the batch is below the row tile, the rows shrink to the batch
    (rounded up to a power of two) with up to bm / tm row threads, so a block is not mostly idle."""
    bm = min(knobs["block_rows"], pow2_at_least(batch))
    row_threads = min(knobs["block_rows"] // knobs["thread_rows"], bm)
    return GemmTile(bm, knobs["block_cols"], bm // row_threads, knobs["thread_cols"], knobs["k_chunk"])


def hoisted_tile(knobs: dict) -> GemmTile:
    b, t = knobs["hoisted_block"], knobs["hoisted_thread"]
    return GemmTile(b, b, t, t, knobs["k_chunk"])


# The hoisted GEMM's warps a block. H100, fp16 T=100, the hoisted GEMM alone (torch.profiler,
# benchmarks/kernel_breakdown.py), us with 4 x 4 fragments a
# warp, 2 x 2 / 4 x 2 / 2 x 4 warps (and 4 x 4 warps of 2 x 2): LSTM B=256 H=1024 (25600 x 4096 x
# 1024) 691 / 849 / 811 (902); B=64 H=2048 (6400 x 8192 x 2048) 720 / 815 / 781 (866). When the
# step GEMM shared these warps, its best warps slowed this GEMM down.
HOISTED_WARPS = (2, 2)


def hoisted_tensor_core_tile(knobs: dict) -> TensorCoreTile:
    """The hoisted GEMM's tensor-core tile: HOISTED_WARPS warps of tc_hoisted_frags fragments."""
    frags = knobs["tc_hoisted_frags"]
    return TensorCoreTile(*HOISTED_WARPS, frags, frags, knobs["tc_k"], stages=knobs["tc_stages"])


def step_tensor_core_tile(knobs: dict, rows: int, cols: int, target) -> TensorCoreTile:
    """The step GEMM's tensor-core tile (B rows, ``cols`` columns): tc_warps_m x tc_warps_n warps of
    tc_frags fragments shrunk to the rows, K staged tc_step_k at a time (prefetched with
    tc_prefetch, else pipelined over tc_stages), its columns narrowed while the grid leaves half the
    SMs idle (tc_fill)."""
    frags, prefetch = knobs["tc_frags"], knobs["tc_prefetch"]
    tile = TensorCoreTile(knobs["tc_warps_m"], knobs["tc_warps_n"], frags, frags, knobs["tc_step_k"],
                          prefetch=prefetch, stages=1 if prefetch else knobs["tc_stages"]).for_rows(rows)
    return tile.filling(rows, cols, target.sms) if knobs["tc_fill"] else tile


# the K tile of a pipelined GEMM: 64 bytes a row (32 fp16, 16 fp32 elements); the step GEMM's at
# least STEP_K_BYTES, longer where K would take more than PIPELINED_K_TILES of them (each a round
# trip). H100 T=100, ms (benchmarks/knob_sweep.py, 4 warps a block), K=2048
# fp16, step K 64 / 32: LSTM B=64 3.101 / 3.390, GRU 2.836 / 3.070, ResetBeforeGRU 4.207 / 4.632;
# TF32 step K 32 / 16: LSTM B=64 H=1024 3.331 / 3.428, B=256 7.393 / 7.433, H=2048 (64) 9.374 /
# 9.724; at 32 tiles of 32, doubling did not help with 4 warps (fp16 LSTM B=256 H=1024 3.014 /
# 3.007, GRU 2.686 / 2.612), it did with 8 (STEP_WARPS_M).
PIPELINED_K_BYTES = 64
PIPELINED_K_TILES = 32
# The fp16/bf16 step GEMM's defaults on tensor cores where its tiles stay 64 columns wide: 8 warps a
# block (tc_warps_m 4: 4 x 2), pipelined K tiles of at least 128 bytes a row. H100 fp16 T=100, step
# loop, ms (benchmarks/knob_sweep.py), 4 warps with K
# 32 (64 at H=2048) / 8 warps with K 64: LSTM B=256 H=1024 2.988-3.048 / 2.660-2.667 (2 x 4 warps 2.655,
# K 128 2.829, 16 warps 2.751), GRU B=256 2.587-2.629 / 2.497 (2 x 4: 2.401-2.449), PeepholeLSTM B=256
# 3.013 / 2.699; LSTM B=64 H=2048 3.139-3.140 / 2.979 (K 128 2.977; 16 warps 2.974). Narrower tiles: ResetBeforeGRU
# B=256 (128 x 32 and 128 x 16 tiles of 8 warps) 3.138 / 3.516. GRU B=64 H=2048 2.796 / 2.816; bf16
# LSTM B=256 3.594 / 3.445; TF32 (K tiles unchanged, 8 warps slower: fp16/bf16 only) LSTM B=256 7.315 / 7.494.
STEP_WARPS_M = 4
STEP_K_BYTES = 128
STEP_WIDE_COLUMNS = 64
# K tiles in flight by default: four for fp16 (measured) and bf16 (tiles of the same bytes; not
# measured), two for TF32 (three measured no faster)
PIPELINE_STAGES = {"float16": 4, "bfloat16": 4, "float32": 2}


def _pipelined(knobs: dict, program, target) -> dict:
    """The tensor-core GEMMs' defaults: PIPELINE_STAGES K tiles in flight, each of PIPELINED_K_BYTES
    a row, the hoisted GEMM's fragments as ``_hoisted_fragments`` gives; where that hoisted tile does
    not fit, two stages, then one stage and the first K tile. H100, T=100, whole calls
    (benchmarks/knob_sweep.py), ms. One stage -> two:
    LSTM fp16 B=256 H=1024 3.585 -> 3.201, B=64 H=2048 5.221 -> 4.157, GRU fp16 B=256 H=1024 3.136 ->
    2.787; LSTM TF32 B=64 H=1024 4.104 -> 3.674, B=256 9.324 -> 9.013. Two -> three -> four, with
    all of the tiles in dynamic shared memory: LSTM fp16 B=256 H=1024 3.192 ->
    3.152 -> 3.096, B=64 H=2048 4.215 -> 3.796 -> 3.607, GRU fp16 B=256 H=1024 2.773 -> 2.733 ->
    2.645; LSTM TF32 B=64 H=1024 3.595 -> 3.612 (three)."""
    size = BYTES[program.dtype]
    tries = ((PIPELINE_STAGES[program.dtype], PIPELINED_K_BYTES // size), (2, PIPELINED_K_BYTES // size),
             (1, knobs["tc_k"]))
    for stages, bk in dict.fromkeys(tries):  # TF32's default is the second try
        k = {**knobs, "tc_stages": stages, "tc_k": bk}
        k["tc_hoisted_frags"] = _hoisted_fragments(k, program, target)
        if hoisted_tensor_core_tile(k).for_rows(program.steps * program.batch).fits(size, target):
            return {n: k[n] for n in ("tc_stages", "tc_k", "tc_hoisted_frags")}
    return {}


def _hoisted_fragments(knobs: dict, program, target) -> int:
    """The hoisted GEMM's fragments a warp: 4 x 4 (128 x 128 tiles) where their grid still has a
    block for every SM and the tile fits, else the first value (64 x 64). H100, fp16 T=100, whole
    calls (benchmarks/knob_sweep.py), ms 64 x 64 -> 128 x 128:
    LSTM B=64 H=1024 persistent 1.175 -> 1.101, B=16 H=512 persistent 0.356 -> 0.347, B=256 H=1024
    step loop 3.889 -> 3.441 (ncu, the GEMM alone at B=64: 340 -> 282 us)."""
    rows = program.steps * program.batch
    cols = max((g.rows for g in program.plan.hoisted), default=0)
    wide = {**knobs, "tc_hoisted_frags": 4}
    tile = hoisted_tensor_core_tile(wide).for_rows(rows)
    blocks = -(-rows // tile.bm) * -(-cols // tile.bn)
    return 4 if blocks >= target.sms and tile.fits(BYTES[program.dtype], target) else knobs["tc_hoisted_frags"]


def _step_tiles_fit(knobs: dict, program, target, size: int) -> bool:
    """Whether the tensor-core tile of each step GEMM fits (one per stage, its own columns)."""
    return all(step_tensor_core_tile(knobs, program.batch, g.rows, target).fits(size, target)
               for g in program.plan.step_gemms)


def epilogue_units(knobs: dict, program, target) -> int | None:
    """The units a column tile of the first step GEMM holds when its epilogue fuses (tc_epilogue):
    on WMMA tensor cores, M, N, K whole tiles, N a whole number G of gates of width H, and the tile's
    columns G x units with units dividing H; None otherwise. Not on wgmma (``on_wgmma``): H100
    fp16 T=100, prepared ms, wgmma and a separate elementwise kernel / WMMA with the math
    fused / all WMMA: LSTM (100,256,1024) 2.394 / 2.565 / 3.258, (100,64,2048) 2.397 / 2.711 / 3.545
    (cuDNN 2.174, 2.367 in those processes; the WMMA builds had the hoisted GEMM's fragments at
    their first value). Nor fused into the wgmma kernel (tried in de7e7d6: its C tile stored, a
    barrier, then the math of its units; prepared ms fused / separate: LSTM (100,256,1024)
    2.685 / 2.377, PeepholeLSTM 2.670 / 2.286, LSTM (100,64,2048) 2.402 / 2.399): its step kernel
    took 18.8 us against 10.5 + 3.6 for the two, 128 threads a block (one block an SM) doing the
    math's loads with far less latency hidden than the elementwise kernel's."""
    gemm = next(iter(program.plan.step_gemms), None)
    if (gemm is None or on_wgmma(knobs, program, target, step=True)
            or not (knobs["tc_epilogue"] and use_tensor_cores(knobs, program, target, program.batch))):
        return None
    return _tile_units(step_tensor_core_tile(knobs, program.batch, gemm.rows, target), gemm, program)


def _tile_units(tile: TensorCoreTile, gemm, program) -> int | None:
    width = program.cell.hidden_size
    gates = gemm.rows // width
    whole = program.batch % tile.bm == 0 and gemm.rows % tile.bn == 0 and gemm.depth % tile.bk == 0
    if not whole or gemm.rows % width or tile.bn % gates:
        return None
    units = tile.bn // gates
    return units if width % units == 0 else None


def fuse_epilogue(sch: Schedule, gemm, knobs: dict, program, target):
    """The step GEMM ``gemm`` on tensor cores with the elementwise math that reads it in its kernel:
    the loop nest of that math (its next states, merged) tiled bm rows x units a block, the GEMM's
    tile (bm x G * units columns, the gates of those units: ``PackedLayout.units``) computed under
    it, the math reading the C tile from shared memory. One kernel a step instead of two, and the
    gates never go to global memory. Returns the names of the nest's blocks, none where it does not
    apply: the layout does not group this GEMM's tile, its operand cannot be fetched on tensor cores
    (``fetches_its_operand``), or its readers are not one 2-D elementwise nest that reads no later
    GEMM (ResetBeforeGRU's z gate, read after its second stage's GEMM) and feeds none (the reversed
    loop of ResetBeforeGRU's backward, whose second GEMM's operand that math computes)."""
    layout, name = program.layout, sch.get(gemm).name_hint
    info = next(g for g in program.plan.gemms if g.name == name)
    tile = step_tensor_core_tile(knobs, program.batch, info.rows, target)
    units = _tile_units(tile, info, program) if layout.units else None
    readers = sch.get_consumers(gemm)
    if units is None or units % layout.units or not readers:
        return set()
    if not fetches_its_operand(sch, gemm, tile, program.dtype):
        return set()
    nest = sch.get_loops(readers[0])
    if len(nest) != 2 or any(not sch.get(sch.get_loops(r)[0]).same_as(sch.get(nest[0])) for r in readers):
        return set()
    later = {g.name for g in program.plan.gemms if g.stage >= info.stage} - {name}
    blocks = sch.get_child_blocks(nest[0])
    if any(is_reduction(sch, b) or any(r.source.name in later for r in sch.get(b).reads) for b in blocks):
        return set()
    feeds = later | {f"{g}_operand" for g in later}
    if any(sch.get(c).name_hint in feeds for b in blocks for c in sch.get_consumers(b)):
        return set()
    fused = {sch.get(b).name_hint for b in blocks}
    rows, cols = sch.get_loops(readers[0])
    row_block, row = sch.split(rows, [None, tile.bm])
    col_block, col = sch.split(cols, [None, units])
    sch.reorder(row_block, col_block, row, col)
    block_loop = sch.fuse(row_block, col_block)
    sch.bind(block_loop, "blockIdx.x")
    rounds, ty, tx = sch.split(sch.fuse(row, col), [None, tile.warps_m * tile.warps_n, WARP])
    sch.unroll(rounds)  # a thread's elements: their loads in flight together
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.compute_at(gemm, block_loop)
    gemm_tensorcore(sch, gemm, tile, program.dtype, epilogue=True)
    return fused


def on_wgmma(knobs: dict, program, target, step: bool = False) -> bool:
    """Whether the hoisted GEMMs (with ``step``, the step's, at B rows) all run on wgmma
    (schedule_gemm): tensor cores and the knob on, a Hopper GPU, fp16/bf16 or float32 as TF32
    (``tf32_gemms``), every such GEMM's tile fitting its N and K. ``gemm_wgmma`` also needs the
    operand as given or computed for that GEMM alone: one that other blocks read too goes to FFMA
    (WMMA refuses it as well), which reads any layout."""
    return _on_wgmma(knobs, program, target, step, tf32_gemms(program, step))


def _on_wgmma(knobs: dict, program, target, step: bool, tf32: bool) -> bool:
    rows, gemms = _gemms(program, step)
    return (use_tensor_cores(knobs, program, target, rows if step else None, tf32)
            and all(_wgmma_tile(knobs, program, target, rows, g.rows, g.depth, step, tf32) for g in gemms))


def tf32_gemms(program, step: bool = False) -> bool:
    """Whether float32 GEMMs (with ``step``, the step's) may run on TF32 tensor cores: ``allow_tf32``,
    or exact float32 lowered as three TF32 products each (PackedLayout.tf32x3, which ``layout``
    chooses where ``split_tf32``; the hoisted GEMMs' alone with ``hoisted_only``): every operand of
    those TF32 holds exactly, so any GEMM schedule computes them as float32 does."""
    layout = program.layout
    return program.allow_tf32 or (layout.tf32x3 and not (step and layout.hoisted_only))


def split_tf32(knobs: dict, program, target, hoisted_only: bool = False) -> bool:
    """Whether exact float32 GEMMs run as three TF32 products each (``lowering.tf32_split``): no
    allow_tf32, and every GEMM, hoisted and step (with ``hoisted_only``, hoisted), on TF32 wgmma.
    H100, T=100, whole calls, FFMA / three TF32 products (one process): LSTM (100,256,1024)
    15.525 / 7.050 ms, (100,64,2048) 21.910 / 12.004, GRU (100,64,1024) 6.138 / 4.139; relative
    errors against float64 5.5e-6 / 6.0e-6, 5.5e-6 / 7.1e-6, 4.5e-6 / 5.1e-6. cuDNN without TF32
    11.281, 11.508, 4.523 ms."""
    steps = (False,) if hoisted_only else (False, True)
    return (program.dtype == "float32" and not program.allow_tf32
            and all(_on_wgmma(knobs, program, target, step, tf32=True) for step in steps))


def _gemms(program, step: bool) -> tuple[int, list]:
    """The rows and the GEMMs of the step (B rows) or, without ``step``, of the hoisted GEMMs (T x B)."""
    if step:
        return program.batch, program.plan.step_gemms
    return program.steps * program.batch, program.plan.hoisted


def _wgmma_tile(knobs: dict, program, target, rows: int, cols: int, depth: int, step: bool,
                tf32: bool) -> WgmmaTile | None:
    """The wgmma tile of a rows x cols x depth GEMM (a step's with ``step``) where the knob is on,
    the target and dtype have wgmma (float32 where ``tf32``) and the tile (wgmma_hoisted,
    wgmma_step) fits; else None."""
    if not (knobs["wgmma"] and wgmma_available(program.dtype, target, tf32)):
        return None
    tile = _chosen_tile(knobs, rows, cols, target, step)
    return tile if tile.fits(cols, depth, program.dtype, target) else None


def _chosen_tile(knobs: dict, rows: int, cols: int, target, step: bool) -> WgmmaTile:
    name = knobs["wgmma_step" if step else "wgmma_hoisted"]
    return wgmma_tile(rows, cols, target) if name == "auto" else WgmmaTile.parse(name)


def use_tensor_cores(knobs: dict, program, target, step_rows: int | None = None, tf32: bool | None = None) -> bool:
    """Whether a GEMM runs on tensor cores: the knob on, the target's tensor cores able to take the
    dtype (tensor_cores_available; float32 where ``tf32``, by default ``tf32_gemms``), and for the
    step GEMM (``step_rows`` given) at least TENSOR_CORE_MIN_ROWS rows."""
    tf32 = tf32_gemms(program, step_rows is not None) if tf32 is None else tf32
    return (knobs["tensor_cores"] and tensor_cores_available(program.dtype, target, tf32)
            and (step_rows is None or step_rows >= TENSOR_CORE_MIN_ROWS))


def schedule_gemm(sch: Schedule, block, knobs: dict, program, target, step: bool, views=()) -> None:
    """The hoisted GEMM (T x B rows) or the step's (B rows) on tensor cores where
    ``use_tensor_cores`` allows: wgmma's where it applies (``_wgmma_tile``, ``gemm_wgmma``), else
    WMMA's where the tile can fetch its operand; else the FFMA tile."""
    rows = _gemms(program, step)[0]
    if use_tensor_cores(knobs, program, target, rows if step else None):
        cols, depth = (int(sch.get(loop).extent) for loop in sch.get_loops(block)[-2:])
        wgmma = _wgmma_tile(knobs, program, target, rows, cols, depth, step, tf32_gemms(program, step))
        if wgmma is not None and gemm_wgmma(sch, block, wgmma, program.dtype):
            return
        if step:
            tile = step_tensor_core_tile(knobs, rows, cols, target)
        else:
            tile = hoisted_tensor_core_tile(knobs).for_rows(rows)
        if fetches_its_operand(sch, block, tile, program.dtype):
            gemm_tensorcore(sch, block, tile, program.dtype)
            return
    gemm_tiled(sch, block, step_tile(knobs, program.batch) if step else hoisted_tile(knobs), views)


def gemm_tiled(sch: Schedule, block, tile: GemmTile, views=()) -> None:
    """The tiled GEMM above. Operands in ``views`` (``T.match_buffer`` row blocks) are read from
    global memory, not staged: TVM 0.27's reindex gives a view's shared copy the view's symbolic
    offset. The step loop reads states through a ``<gemm>_operand`` copy (lowering makes it) that is
    staged and then inlined into its tile: at B=64, H=1024 unstaged states left the step GEMM at
    6.6 TFLOP/s (H100, ncu)."""
    b, n, k = sch.get_loops(block)
    cols, depth = (int(sch.get(loop).extent) for loop in (n, k))
    bk = min(tile.bk, depth)

    tiles = []
    for index, region in enumerate(sch.get(block).reads):
        if region.source.name in views:
            continue
        staged = sch.reindex(block, ("read", index))
        sch.set_scope(staged, 0, "shared")
        for producer in sch.get_producers(staged):  # a copy of a state is read straight into the tile
            if is_pure_copy(sch, producer):
                sch.compute_inline(producer)
        if region.source.name.startswith("w_packed"):  # reindexed as [n, k]: store it [k, n]
            sch.transform_layout(staged, ("write", 0), lambda n, k: (k, n))
            tiles.append((staged, True, cols % VECTOR == 0))
        else:
            tiles.append((staged, False, depth % VECTOR == 0 and bk % VECTOR == 0))

    b, n, k = sch.get_loops(block)
    b_block, b_thread, b_inner = sch.split(b, [None, tile.bm // tile.tm, tile.tm])
    n_block, n_thread, n_inner = sch.split(n, [None, tile.bn // tile.tn, tile.tn])
    k_outer, k_inner = sch.split(k, [None, bk])
    sch.reorder(b_block, n_block, b_thread, n_thread, k_outer, k_inner, b_inner, n_inner)
    sch.bind(sch.fuse(b_block, n_block), "blockIdx.x")
    thread = sch.fuse(b_thread, n_thread)
    sch.bind(thread, "threadIdx.x")
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, thread)
    for staged, transposed, aligned in tiles:
        sch.compute_at(staged, k_outer, preserve_unit_loops=True)
        _cooperative_fetch(sch, staged, tile.threads, transposed, aligned)
    for loop in (k_inner, b_inner, n_inner):
        sch.unroll(loop)
    sch.decompose_reduction(block, k_outer)


def _cooperative_fetch(sch: Schedule, tile, threads: int, transposed: bool, aligned: bool) -> None:
    """All threads of the block copy a tile: its two loops fused (the source's contiguous one
    inner), split over the threads, each thread VECTOR consecutive elements at once where the
    rows are whole vectors."""
    loops = sch.get_loops(tile)[-2:]
    if transposed:
        sch.reorder(loops[1], loops[0])
        loops = loops[::-1]
    inner_extent = int(sch.get(loops[-1]).extent)
    fused = sch.fuse(*loops)
    if aligned and inner_extent % VECTOR == 0:
        _, tx, vec = sch.split(fused, [None, threads, VECTOR])
        sch.vectorize(vec)
    else:
        _, tx = sch.split(fused, [None, threads])
    sch.bind(tx, "threadIdx.x")


def bind_flat(sch: Schedule, block, threads: int) -> None:
    """One thread per output element; any reduction of the block runs serially inside its thread
    (its reduce loops are innermost, as te.create_prim_func makes them)."""
    loops = sch.get_loops(block)
    reduce = sum(iv.iter_type == IterVar.CommReduce for iv in sch.get(block).iter_vars)
    fused = sch.fuse(*loops[: len(loops) - reduce])
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def bind_reduction(sch: Schedule, block, threads: int) -> None:
    """A cell's own reduction (a layer norm's sum over a row): a thread block an output, its
    threads (up to ``threads``, a warp at least) striding over the reduced elements, their partial
    results combined by a warp/block all-reduce (TVM's cross-thread reduction). Its reduce loops
    are innermost, as te.create_prim_func makes them."""
    loops = sch.get_loops(block)
    reduce = sum(iv.iter_type == IterVar.CommReduce for iv in sch.get(block).iter_vars)
    spatial, reduced = loops[: len(loops) - reduce], loops[len(loops) - reduce:]
    elements = 1
    for loop in reduced:
        elements *= sch.get(loop).extent.value
    width = min(threads, max(WARP, pow2_at_least(elements)))
    _, tx = sch.split(sch.fuse(*reduced) if len(reduced) > 1 else reduced[0], [None, width])
    if spatial:
        sch.bind(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0], "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


COLUMN_SLICE = 64  # rows a thread sums in a column reduction's first kernel


def reduces_columns(sch: Schedule, block) -> bool:
    """Whether ``block`` sums down columns (a bias gradient over T x B rows, d_bias[j] = sum over r
    of d[r, j]): one spatial and one reduce loop, some read strided along the reduced variable and
    none along the spatial one, so that threads at consecutive columns read consecutive elements
    or one (a row's own value: a layer norm's rstd[r] in its gain's gradient)."""
    iters = sch.get(block).iter_vars
    spatial = [iv.var for iv in iters if iv.iter_type == IterVar.DataPar]
    reduced = [iv.var for iv in iters if iv.iter_type == IterVar.CommReduce]
    if len(sch.get_loops(block)) != 2 or len(spatial) != 1 or len(reduced) != 1:
        return False
    reads = sch.get(block).reads
    return any(_strided(r, reduced[0]) for r in reads) and not any(_strided(r, spatial[0]) for r in reads)


def _whole_slices(sch: Schedule, block, threads: int) -> bool:
    """Whether a ``reduces_columns`` block's first kernel splits without remainder (its rows into
    COLUMN_SLICE slices, slices x columns into thread blocks): a remainder's predicates leave the
    scope no stage pipeline for a tensor-core GEMM's compute_at (TVM 0.27: ResetBeforeGRU fp16
    T=5, B=16, H=32); such a block keeps ``bind_reduction``."""
    columns, rows = (sch.get(loop).extent.value for loop in sch.get_loops(block))
    return rows % COLUMN_SLICE == 0 and rows // COLUMN_SLICE * columns % threads == 0


def bind_column_reduction(sch: Schedule, block, threads: int) -> None:
    """A ``reduces_columns`` block out[j] = sum over r of in[r, j] in two kernels whose warps read
    consecutive columns (whole lines):

        partial[s, j] = sum of in[r, j] over the COLUMN_SLICE rows of slice s    (rfactor)
            a thread an (s, j) (bind_flat, columns inner), its sum in a register
        out[j] = sum over s of partial[s, j]
            WARP columns a thread block (threadIdx.x), threads / WARP lanes (threadIdx.y)
            striding over the slices, combined by TVM's cross-thread reduction

    The register (cache_write) is placed before the columns are split: placed under a split's
    thread loop, its copy to partial went past the columns (TVM 0.27 left it unguarded). One
    thread block a column, its threads striding over rows (bind_reduction), loaded a 32-byte
    sector an element: 178 us for 6400 x 4096 float32 on an H200."""
    _, rows = sch.get_loops(block)
    partial = sch.rfactor(sch.split(rows, [None, COLUMN_SLICE])[0], factor_axis=0)
    column, piece, within = sch.get_loops(partial)
    sch.reorder(piece, column)
    sch.reverse_compute_at(sch.cache_write(partial, 0, "local"), column)
    bind_flat(sch, partial, threads)
    sch.decompose_reduction(partial, within)
    column, piece = sch.get_loops(block)
    column_block, column_thread = sch.split(column, [None, WARP])
    sch.bind(column_block, "blockIdx.x")
    sch.bind(column_thread, "threadIdx.x")
    sch.bind(sch.split(piece, [None, threads // WARP])[1], "threadIdx.y")


def _strided(read, var) -> bool:
    """Whether ``read`` moves by whole rows as ``var`` does: ``var`` in an index but its last."""
    indices = [r.min for r in read.region]
    return bool(indices) and not _uses(indices[-1], var) and any(_uses(e, var) for e in indices[:-1])


def _uses(expr, var) -> bool:
    """Whether ``expr`` reads variable ``var``."""
    return any(v.same_as(var) for v in undefined_vars(expr, []))


TRANSPOSE_TILE = 32
TRANSPOSE_ROWS = 8  # tile rows a round: 8 x 32 = 256 threads a block, 4 rounds a tile


def _transposes(sch: Schedule, block) -> bool:
    """Whether ``block`` writes as rows what it reads as columns: a 2-D write whose row variable is in
    every read's last index and whose column's variables are in none (w_packed[k, n] = weights[n, k],
    an if_then_else over stacked weights; dgemm0_transposed[n, r] = dgemm0_seq[r, n]; a cast of
    one). Packed (N, K) (``PackedLayout.k_major``, or laid out so by the wgmma GEMM: wgmma.py) a
    weight is a copy; a block that also reads along its rows (y[b, n] = a[b, n] * rstd[b], a weight
    gradient's term flat[0, n * K + k]) transposes nothing."""
    write, reads = sch.get(block).writes[0].region, sch.get(block).reads
    if len(write) != 2:
        return False
    row, column = (r.min for r in write)
    return all(r.region and _uses(r.region[-1].min, row)
               and not any(_uses(r.region[-1].min, v) for v in undefined_vars(column, []))
               for r in reads)


def schedule_transpose(sch: Schedule, block) -> bool:
    """A ``_transposes`` loop nest (a ``w_packed*`` block, w_packed[k, n] = stacked weights[n, k],
    or the backward's transposed copies: outputs merged into one nest by merge_next_states each
    get a tile) as a tiled transpose, one 32 x 32 tile a thread block: its threads compute the
    tile, consecutive threads at consecutive k (consecutive elements of a source row: coalesced
    reads), into a shared tile [k, n] with rows padded to 33 elements (storage_align: the 32
    threads of a warp, 33 elements apart, hit 32 banks, at 4 bytes and at 2), then copy it out,
    consecutive threads at consecutive n (coalesced writes). ncu, H100, LSTM B=64 fp16, per
    weight: H=1024 (1024 x 4096) 32.3 us flat (one element a thread, reads strided by K), 7.6 us
    tiled; H=512 10.3 us, 3.8 us.

    32 x 32 for every dtype: a warp reads and writes 32 consecutive elements, whole 32-byte sectors
    at 2 bytes too. The tile holds the block's output (cache_write), not its source (cache_read):
    with several stacked weights the value is an ``if_then_else`` over them, and cache_read stages
    a tile of each weight over all the tile's rows, past the weight's own (TVM 0.27 takes the read
    region without the condition: weight_hz[-50:50] for the second of two 50-row weights). Ragged
    K and N are guarded by the splits' predicates.

    Returns False, leaving the block alone, where the nest has other than two loops (a blocked
    layout, PackedLayout with ``tile``; CUDA does not use it) or a block of it does not transpose."""
    loops = sch.get_loops(block)
    nest = sch.get_child_blocks(loops[0]) if len(loops) == 2 else []
    if not nest or not all(_transposes(sch, b) for b in nest):
        return False
    tiles = [sch.cache_write(b, 0, "shared") for b in nest]
    for b in nest:
        sch.storage_align(b, 0, axis=0, factor=TRANSPOSE_TILE, offset=1)
    k, n = loops
    k_block, k_thread = sch.split(k, [None, TRANSPOSE_TILE])
    n_block, n_round, n_thread = sch.split(n, [None, TRANSPOSE_TILE // TRANSPOSE_ROWS, TRANSPOSE_ROWS])
    sch.reorder(k_block, n_block, n_round, n_thread, k_thread)
    grid = sch.fuse(k_block, n_block)
    sch.bind(grid, "blockIdx.x")
    sch.bind(sch.fuse(n_thread, k_thread), "threadIdx.x")
    for tile in tiles:
        sch.reverse_compute_at(tile, grid)
        # the copy's loops span the tile's part of the output, fewer than 32 where K or N is (24 x 24:
        # 8 x 24 threads bound to the block's 256 read past the tile on an H100); one loop over the
        # part, split by the block's threads, guards any size (a part of one row or column has one loop)
        copy = sch.get_loops(tile)[1:]
        _, thread = sch.split(sch.fuse(*copy) if len(copy) > 1 else copy[0], [None, TRANSPOSE_TILE * TRANSPOSE_ROWS])
        sch.bind(thread, "threadIdx.x")
    return True
