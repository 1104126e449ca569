"""The questions a CUDA GEMM's schedule asks of the problem and the knobs: tensor cores or FFMA
cores (``use_tensor_cores``), wgmma on Hopper (``on_wgmma``, ``gemm_wgmma_tile``) or WMMA, float32 as
TF32 or as three TF32 products (``tf32_gemms``, ``split_tf32``), the tensor-core tiles of the
hoisted GEMM and the step's and their pipelined defaults. ``gemm_rules.py`` schedules a GEMM block
by them; the recipes ask them to choose their defaults and layouts (the persistent kernel of its
hoisted GEMMs).
"""

from __future__ import annotations

from .cuda_tensorcore import BYTES, TensorCoreTile, tensor_cores_available
from .wgmma import ROW_BYTES, WgmmaTile, wgmma_available, wgmma_tile

# the step GEMM uses tensor cores from one full 16-row fragment up: below, most of each mma_sync
# would multiply padding rows, and the FFMA tile at small B is bound by latency, not arithmetic
TENSOR_CORE_MIN_ROWS = 16


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


def pipelined_defaults(knobs: dict, program, target) -> dict:
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
        if hoisted_tensor_core_tile(k).for_rows(program.nominal_steps * program.batch).fits(size, target):
            return {n: k[n] for n in ("tc_stages", "tc_k", "tc_hoisted_frags")}
    return {}


def _hoisted_fragments(knobs: dict, program, target) -> int:
    """The hoisted GEMM's fragments a warp: 4 x 4 (128 x 128 tiles) where their grid still has a
    block for every SM and the tile fits, else the first value (64 x 64). H100, fp16 T=100, whole
    calls (benchmarks/knob_sweep.py), ms 64 x 64 -> 128 x 128:
    LSTM B=64 H=1024 persistent 1.175 -> 1.101, B=16 H=512 persistent 0.356 -> 0.347, B=256 H=1024
    step loop 3.889 -> 3.441 (ncu, the GEMM alone at B=64: 340 -> 282 us)."""
    rows = program.nominal_steps * program.batch
    cols = max((g.rows for g in program.plan.hoisted), default=0)
    wide = {**knobs, "tc_hoisted_frags": 4}
    tile = hoisted_tensor_core_tile(wide).for_rows(rows)
    blocks = -(-rows // tile.bm) * -(-cols // tile.bn)
    return 4 if blocks >= target.sms and tile.fits(BYTES[program.dtype], target) else knobs["tc_hoisted_frags"]


def step_tiles_fit(knobs: dict, program, target, size: int) -> bool:
    """Whether the tensor-core tile of each step GEMM fits (one per stage, its own columns)."""
    return all(step_tensor_core_tile(knobs, program.batch, g.rows, target).fits(size, target)
               for g in program.plan.step_gemms)

def on_wgmma(knobs: dict, program, target, step: bool = False) -> bool:
    """Whether the hoisted GEMMs (with ``step``, the step's, at B rows) all run on wgmma
    (schedule_gemm): tensor cores and the knob on, a Hopper GPU, fp16/bf16 or float32 as TF32
    (``tf32_gemms``), every such GEMM's tile fitting its N and K. ``gemm_wgmma`` also needs the
    operand as given or computed for that GEMM alone: one that other blocks read too goes to FFMA
    (WMMA refuses it as well), which reads any layout."""
    return _on_wgmma(knobs, program, target, step, tf32_gemms(program, step))


def _on_wgmma(knobs: dict, program, target, step: bool, tf32: bool) -> bool:
    rows, gemms = rows_and_gemms(program, step)
    return (use_tensor_cores(knobs, program, target, rows if step else None, tf32)
            and all(gemm_wgmma_tile(knobs, program, target, rows, g.rows, g.depth, step, tf32) for g in gemms))


# the most K slices of a step GEMM (PackedLayout.split_k), and the fewest K tiles a slice keeps
MAX_SPLIT_K = 8
MIN_SLICE_TILES = 8


def step_split_k(knobs: dict, program, target, tf32x3: bool = False) -> int | None:
    """How many K slices the step's GEMMs sum (PackedLayout.split_k; ``tf32x3``: their K three times
    over): the knob wgmma_step_split where every step GEMM is on wgmma (else 1), None where a number
    it names does not cut each K into slices of at least MIN_SLICE_TILES whole K tiles. "auto": the
    most, a power of two up to MAX_SPLIT_K, that keep each GEMM's blocks within one wave of the SMs
    and such slices. The reversed loop's GEMM has N = H: at LSTM (100,64,1024) TF32 16 blocks of
    1x64x4 for 132 SMs, eight slices; its training step (benchmarks/training_gpu.py, H100) 8.73 ->
    6.30 ms, cuDNN 5.96."""
    tf32 = tf32x3 or tf32_gemms(program, step=True)
    if not _on_wgmma(knobs, program, target, True, tf32):
        return 1
    rows, gemms = rows_and_gemms(program, True)
    bk = ROW_BYTES // BYTES[program.dtype]
    depths = [g.depth * (3 if tf32x3 else 1) for g in gemms]

    def whole(slices, depth):
        return depth % (slices * bk) == 0 and depth // slices >= MIN_SLICE_TILES * bk

    if knobs["wgmma_step_split"] != "auto":
        slices = int(knobs["wgmma_step_split"])
        return slices if all(whole(slices, d) for d in depths) else None

    def most(g, depth):
        blocks = _chosen_tile(knobs, rows, g.rows, target, True).blocks(rows, g.rows)
        slices = 1
        while 2 * slices <= MAX_SPLIT_K and 2 * slices * blocks <= target.sms and whole(2 * slices, depth):
            slices *= 2
        return slices

    return min((most(g, d) for g, d in zip(gemms, depths)), default=1)


def tf32_gemms(program, step: bool = False) -> bool:
    """Whether float32 GEMMs (with ``step``, the step's) may run on TF32 tensor cores: ``allow_tf32``,
    or exact float32 lowered as three TF32 products each (PackedLayout.tf32x3, which the recipe's
    ``layout`` chooses where ``split_tf32``; the hoisted GEMMs' alone with ``hoisted_only``): every
    operand of those TF32 holds exactly, so any GEMM schedule computes them as float32 does."""
    layout = program.layout
    return program.allow_tf32 or (layout.tf32x3 and not (step and layout.hoisted_only))


def split_tf32(knobs: dict, program, target, hoisted_only: bool = False) -> bool:
    """Whether exact float32 GEMMs run as three TF32 products each (``layout.tf32_split``): no
    allow_tf32, and every GEMM, hoisted and step (with ``hoisted_only``, hoisted), on TF32 wgmma.
    H100, T=100, whole calls, FFMA / three TF32 products (one process): LSTM (100,256,1024)
    15.525 / 7.050 ms, (100,64,2048) 21.910 / 12.004, GRU (100,64,1024) 6.138 / 4.139; relative
    errors against float64 5.5e-6 / 6.0e-6, 5.5e-6 / 7.1e-6, 4.5e-6 / 5.1e-6. cuDNN without TF32
    11.281, 11.508, 4.523 ms."""
    steps = (False,) if hoisted_only else (False, True)
    return (program.dtype == "float32" and not program.allow_tf32
            and all(_on_wgmma(knobs, program, target, step, tf32=True) for step in steps))


def rows_and_gemms(program, step: bool) -> tuple[int, list]:
    """The rows and the GEMMs of the step (B rows) or, without ``step``, of the hoisted GEMMs (T x B)."""
    if step:
        return program.batch, program.plan.step_gemms
    return program.nominal_steps * program.batch, program.plan.hoisted


def gemm_wgmma_tile(knobs: dict, program, target, rows: int, cols: int, depth: int, step: bool,
                tf32: bool) -> WgmmaTile | None:
    """The wgmma tile of a rows x cols x depth GEMM (a step's with ``step``) where the knob is on,
    the target and dtype have wgmma (float32 where ``tf32``) and the tile (wgmma_hoisted,
    wgmma_step) fits; else None."""
    if not (knobs["wgmma"] and wgmma_available(program.dtype, target, tf32)):
        return None
    tile = _chosen_tile(knobs, rows, cols, target, step, depth)
    return tile if tile.fits(cols, depth, program.dtype, target) else None


def _chosen_tile(knobs: dict, rows: int, cols: int, target, step: bool, depth=None) -> WgmmaTile:
    name = knobs["wgmma_step" if step else "wgmma_hoisted"]
    return wgmma_tile(rows, cols, target, depth) if name == "auto" else WgmmaTile.parse(name)


def use_tensor_cores(knobs: dict, program, target, step_rows: int | None = None, tf32: bool | None = None) -> bool:
    """Whether a GEMM runs on tensor cores: the knob on, the target's tensor cores able to take the
    dtype (tensor_cores_available; float32 where ``tf32``, by default ``tf32_gemms``), and for the
    step GEMM (``step_rows`` given) at least TENSOR_CORE_MIN_ROWS rows."""
    tf32 = tf32_gemms(program, step_rows is not None) if tf32 is None else tf32
    return (knobs["tensor_cores"] and tensor_cores_available(program.dtype, target, tf32)
            and (step_rows is None or step_rows >= TENSOR_CORE_MIN_ROWS))
