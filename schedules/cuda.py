"""CUDA step-loop recipe: the hoisted GEMM once, then per step one GEMM kernel and one fused
elementwise kernel per stage, launched from the compiled host loop over t (no Python per step). On
tensor cores the elementwise math runs in its GEMM's kernel where a column tile holds every gate of
its units (tc_epilogue, ``fuse_epilogue``: cuda_epilogue.py): one kernel a stage.

fp16/bf16 GEMMs run on tensor cores (WMMA, fp32 accumulation; cuda_tensorcore.py, knob
"tensor_cores"): the hoisted one always, the step's from B >= 16 rows, a computed operand
(ResetBeforeGRU's r * h) rounded to the storage dtype (as a torch cell in that dtype rounds it) where
it needs no padding; ragged shapes are zero-padded. The hoisted GEMM's block is 2 x 2 warps
(HOISTED_WARPS) of tc_hoisted_frags fragments; the step's its own warps and fragments (tc_warps_m,
tc_warps_n, tc_frags), K tile,
prefetch (off: slower where measured) and column narrowing (tc_step_k, tc_prefetch, tc_fill; defaults
from the target's SMs and shared memory: ``_step_tensor_core_defaults``). Both are pipelined over four
K tiles by default, two for TF32 (tc_stages, cp.async, from sm_80: ``pipelined_defaults``). fp32
GEMMs run there too as TF32 when the program allows it (``allow_tf32``). On Hopper the GEMMs run on
wgmma instead (wgmma.py, knob "wgmma", ``on_wgmma``), their weights packed (N, K) where all do
(``layout``), and exact float32 then as three TF32 products each (``split_tf32``); a step GEMM whose
grid leaves SMs idle (the reversed loop's, N = H) in K slices that its elementwise math adds up
(knob "wgmma_step_split", ``step_split_k``). The others use the FFMA schedule (cuda_ffma.py).

The recipe's helpers, one job a module: cuda_gemm.py chooses each GEMM's schedule and tile,
cuda_epilogue.py fuses a step's elementwise math into its GEMM's kernel, cuda_blocks.py schedules
the blocks that are not GEMMs (elementwise, reductions, transposing copies).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from tvm.s_tir import Schedule

from halstm.layout import PackedLayout

from .cuda_blocks import (bind_column_reduction, bind_lanes, bind_reduction, bind_row_copy, column_slice,
                          schedule_transpose)
from .cuda_epilogue import epilogue_units, fuse_epilogue
from .cuda_ffma import hoisted_tile, step_tile
from .cuda_gemm import (PIPELINED_K_BYTES, PIPELINED_K_TILES, STEP_K_BYTES, STEP_WARPS_M, STEP_WIDE_COLUMNS,
                        hoisted_tensor_core_tile, on_wgmma, pipelined_defaults, rows_and_gemms, split_tf32,
                        step_split_k, step_tensor_core_tile, step_tiles_fit, tf32_gemms, use_tensor_cores)
from .cuda_tensorcore import BYTES, tensor_cores_available
from .gemm_rules import schedule_gemm
from .recipe import (Recipe, child_blocks, copies_rows, inline_elementwise, is_pure_copy, is_reduction,
                     merge_next_states, reduces_columns)
from .row_kernel import schedule_rows
from .wgmma import wgmma_available, wgmma_tile


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
        # the step GEMMs' K summed in that many slices, each a grid row of the GEMM's kernel, the
        # slices added by the elementwise math that reads the result (PackedLayout.split_k); "auto":
        # step_split_k's choice, which fills the SMs where the GEMM's few rows and columns do not
        "wgmma_step_split": ("auto", 1, 2, 4, 8),
    }
    _FFMA_STEP = ("block_rows", "block_cols", "thread_rows", "thread_cols", "k_chunk")
    _FFMA_HOISTED = ("hoisted_block", "hoisted_thread")
    _TENSOR_CORE = ("tc_hoisted_frags", "tc_k", "tc_stages")
    _TENSOR_CORE_STEP = ("tc_warps_m", "tc_warps_n", "tc_frags", "tc_step_k", "tc_prefetch", "tc_fill",
                         "tc_epilogue")
    _WGMMA = ("wgmma", "wgmma_hoisted", "wgmma_step", "wgmma_step_split")
    switches = ("tensor_cores", "wgmma")

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cuda"

    def defaults(self, program, target, switches: dict | None = None) -> dict:
        """The first value of each knob, but the step GEMM's column tile halved (down to 32) while
        its grid leaves SMs idle: at B=64, H=1024 (N=4096) 64 x 64 tiles made 64 blocks for the
        H100's 132 SMs and the step GEMM ran at 5.8 TFLOP/s (ncu: 92 us a step); and widened until
        a block has a warp's threads. Tensor-core GEMMs pipelined (``pipelined_defaults``); the WMMA knobs
        of GEMMs on wgmma at their first value (``_moot_wmma``), those of GEMMs off it (wgmma False
        in ``switches``) tuned as here."""
        k = super().defaults(program, target, switches)
        program = self.lowered(program, target, k) if target is not None else program
        if target is not None and use_tensor_cores(k, program, target):
            k.update(pipelined_defaults(k, program, target))
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

            fitting = [bk for bk in self.knobs["tc_step_k"] if step_tiles_fit(with_k(bk), program, target, size)]
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
                and not (knobs["wgmma_step_split"] != "auto"
                         and self._split_k(program, target, knobs) == self._split_k(
                             program, target, {**knobs, "wgmma_step_split": "auto"}))
                and self.runs(program, target, knobs))

    def _repeats_auto(self, program, target, knobs, step: bool) -> bool:
        name = knobs["wgmma_step" if step else "wgmma_hoisted"]
        rows, gemms = rows_and_gemms(program, step)
        return name != "auto" and all(wgmma_tile(rows, g.rows, target).name == name for g in gemms)

    def runs(self, program, target, knobs) -> bool:
        """The tiles that run fit: the hoisted GEMM's (tensor cores or FFMA), the step GEMM's FFMA
        tile as it runs (it does on tensor cores too where a computed operand, r * h, would need
        padding) and its WMMA tiles where a step GEMM runs on them."""
        size = BYTES[program.dtype]
        on = use_tensor_cores(knobs, program, target)
        hoisted = hoisted_tensor_core_tile(knobs) if on else hoisted_tile(knobs)
        return (hoisted.fits(size, target) and step_tile(knobs, program.batch).fits(size, target)
                and self._split_k(program, target, knobs) is not None
                and (not use_tensor_cores(knobs, program, target, program.batch)
                     or on_wgmma(knobs, program, target, step=True)
                     or step_tiles_fit(knobs, program, target, size)))

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
            tiles += ("wgmma_step_split",) if not wgmma[1] else ()
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
        TF32 products (``tf32x3``, ``split_tf32``). The step GEMMs' K in ``_split_k`` slices."""
        split = split_tf32(knobs, program, target)
        if split or (on_wgmma(knobs, program, target) and on_wgmma(knobs, program, target, step=True)):
            return PackedLayout(k_major=True, tf32x3=split, split_k=self._split_k(program, target, knobs) or 1)
        units = epilogue_units(knobs, program, target)
        if units:
            return PackedLayout(units=units, width=program.cell.hidden_size)
        if program.dtype == "float32":  # TF32 wgmma reads no (K, N) weights: FFMA's GEMMs are whole
            return PackedLayout()
        return PackedLayout(split_k=self._split_k(program, target, knobs) or 1)

    def _split_k(self, program, target, knobs) -> int | None:
        """``step_split_k`` for ``program`` as lowered before its layout is chosen (its K once over
        where the layout will hold three TF32 products)."""
        return step_split_k(knobs, program, target, tf32x3=split_tf32(knobs, program, target))

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
            columns = {b: column_slice(sch, b, k["threads"]) for b in elementwise if reduces_columns(sch, b)}
            columns = {b: rows for b, rows in columns.items() if rows}
            elementwise = [b for b in elementwise if b not in columns]
            for block, rows in columns.items():
                bind_column_reduction(sch, block, k["threads"], rows)
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
                elif scope == "prologue" and copies_rows(sch, block):  # buffers of its own: aligned
                    bind_row_copy(sch, block, k["threads"], BYTES[sch.get(block).writes[0].source.dtype])
                elif not schedule_transpose(sch, block):
                    bind_lanes(sch, block, k["threads"])
        return sch
