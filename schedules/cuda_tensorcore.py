"""Tensor-core GEMM with fp32 accumulation (WMMA: fp16/bf16 operands 16x16x16, fp32 operands as TF32
16x16x8 where the program allows TF32), after TVM's
dlight ``MatmulTensorization``: C[M, N] = A[M, K] @ W[K, N], W the packed (K, N) weights.

    pad M, N, K up to the block tile (pad_einsum: zero rows/columns, results cut back)
    for block (bm x bn tile):                                  blockIdx.x
      for warp (warps_m x warps_n, each fm x fn fragments):   threadIdx.y
        acc[fm, fn] = 0                                        "wmma.accumulator"
        for ko in K / bk:
          A_s[bm, bk], W_s[bk, bn] = tiles of A, W             "shared.dyn", all threads, vectorised
                                                               (prefetch: tile ko+1 loaded into
                                                               registers before, stored after, the
                                                               mma of tile ko; _prefetch. Or
                                                               stages > 1: cp.async, stages - 1
                                                               tiles ahead; _pipeline)
          for kk in bk / 16 (TF32: bk / 8):
            a[fm], w[fn] = fragments of A_s, W_s               "wmma.matrix_a/b" (load_matrix_sync)
            acc[r, c] += a[r] @ w[c]                           mma_sync
        acc -> C_s (shared.dyn, over A_s, W_s) -> C            store_matrix_sync, then all threads

The intrinsics are in wmma.py (bf16 fragments need sm_80+). The step GEMM (B rows) is latency-bound
(K / bk serial round trips to L2 in few blocks): its tile narrows to fill the SMs (``filling``), stages
K in large tiles and prefetches them (cuda.py's knobs tc_fill, tc_step_k, tc_prefetch).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass, replace

import tvm
import tvm_ffi
from tvm.s_tir import Schedule
from tvm.tirx import IntImm

from .recipe import divides, is_pure_copy
from .wmma import FRAG, TILE_SCOPE, frag_k, fragment_dtype, intrinsics

WARP = 32
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
VECTOR = 8  # a shared tile's row padding in elements (16 bytes of fp16/bf16)
FETCH_BYTES = 16  # a thread's vector fetch into shared memory
MAX_PREFETCH_REGISTERS = 64  # a thread's registers for the next A and W tiles (prefetch)
# WMMA with fp32 accumulation: fp16 fragments from Volta (sm_70), bf16 and TF32 from Ampere (sm_80)
MIN_ARCH = {"float16": 70, "bfloat16": 80, "float32": 80}
ASYNC_COPY_MIN_ARCH = 80  # cp.async (pipelined K tiles, TensorCoreTile.stages > 1)


def tensor_cores_available(dtype: str, target, tf32: bool = False) -> bool:
    """Whether GEMMs of ``dtype`` operands can run on ``target``'s tensor cores here; fp32 ones only
    as TF32, and only with ``tf32`` (it rounds the operands to 10 mantissa bits)."""
    if target.kind != "cuda" or dtype not in MIN_ARCH or (dtype == "float32" and not tf32):
        return False
    return target.compute_capability >= MIN_ARCH[dtype] and tensorize_works()


PROBED = "HALSTM_TENSORIZE_WORKS"  # "1" or "0": the probe's answer, handed to the tuner's worker processes
# tensorize_works by (TVM, apache-tvm-ffi) version, where they were tried
TENSORIZE_WORKS_WITH = {("0.27.0.post1", "0.1.14.post0"): True, ("0.27.0.post1", "0.1.15.post2"): False}


@functools.cache
def tensorize_works() -> bool:
    """Whether ``Schedule.tensorize`` can run here. It copies the intrinsic through JSON, and with
    apache-tvm-ffi 0.1.15.post2 serialising any dtype segfaults (0.1.14.post0 works with TVM 0.27):
    known for the versions in TENSORIZE_WORKS_WITH, else probed once in a subprocess, since a
    segfault would take the compiler's process down (the subprocess imports TVM: 5.4 s on the 2-core
    CPU machine, 7.3 s on an H200 host, each process that compiles for CUDA); a process whose
    environment has the answer in ``PROBED`` (a tuner's worker: its parent found it) takes it."""
    given = os.environ.get(PROBED)
    if given in ("0", "1"):
        return given == "1"
    known = TENSORIZE_WORKS_WITH.get((tvm.__version__, tvm_ffi.__version__))
    if known is not None:
        return known
    probe = "import tvm; tvm.ir.save_json(tvm.ir.PrimType('int32'))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


@dataclass(frozen=True)
class TensorCoreTile:
    """A block of warps_m x warps_n warps, each fm x fn 16x16 fragments; K staged bk at a time."""

    warps_m: int
    warps_n: int
    fm: int
    fn: int
    bk: int
    prefetch: bool = False  # the next K tile's global loads into registers before the mma of this one
    stages: int = 1  # K tiles in flight: > 1 fetches them with cp.async, stages - 1 ahead of the mma

    @property
    def bm(self) -> int:
        return self.warps_m * self.fm * FRAG

    @property
    def bn(self) -> int:
        return self.warps_n * self.fn * FRAG

    @property
    def threads(self) -> int:
        return self.warps_m * self.warps_n * WARP

    def operand_bytes(self, size: int) -> int:
        """The A and W tiles, one of each per stage, their rows padded against bank conflicts as
        gemm_tensorcore aligns them: to VECTOR more than a multiple of 32 elements (a K tile of 16
        takes rows of 40)."""
        def row(n):
            return n + (VECTOR - n) % 32
        return (self.bm * row(self.bk) + self.bk * row(self.bn)) * size * self.stages

    def shared_bytes(self, size: int) -> int:
        """The block's shared memory, all of it dynamic (the operand tiles in TILE_SCOPE, the fp32
        C tile): TVM's merge of the dynamic allocations lays the C tile over the operand tiles, dead
        once it is written, so the larger of the two (as TVM allocated them: 128 x 128 fp16 with K 32
        in two stages 64 KiB, the C tile; 64 x 64 with K 32 in two stages 19 KiB, the operands)."""
        return max(self.operand_bytes(size), self.bm * self.bn * 4)

    def prefetch_registers(self, size: int) -> int:
        """32-bit registers a thread holds the next A and W tiles in (with ``prefetch``)."""
        return (self.bm + self.bn) * self.bk * size // (self.threads * 4) if self.prefetch else 0

    def fits(self, size: int, target) -> bool:
        """Threads within the block limit; shared memory within the block's maximum (all of it
        dynamic, which TVM's CUDA runtime opts the kernel in to past 48 KiB: cuda_module.cc. With
        static operand tiles beside a dynamic C tile it did not when the dynamic part alone was under
        48 KiB, and six such settings failed to launch on an H100); the prefetched tiles within a
        quarter of a thread's 255 registers; more than one stage from Ampere (cp.async)."""
        return (self.threads <= target.max_threads and self.shared_bytes(size) <= target.shared_memory
                and (self.stages == 1 or target.compute_capability >= ASYNC_COPY_MIN_ARCH)
                and self.prefetch_registers(size) <= MAX_PREFETCH_REGISTERS)

    def for_rows(self, rows: int) -> "TensorCoreTile":
        """The tile with its row extent shrunk (fragments first, then warps) while it exceeds the
        rows rounded up to 16: the step GEMM has only B rows."""
        warps_m, fm = self.warps_m, self.fm
        while warps_m * fm * FRAG >= 2 * _round_up(rows, FRAG):
            if fm > 1:
                fm //= 2
            else:
                warps_m //= 2
        return replace(self, warps_m=warps_m, fm=fm)

    def filling(self, rows: int, cols: int, sms: int) -> "TensorCoreTile":
        """The tile with its column extent halved (fragments first, then warps) while its grid over
        rows x cols leaves half the SMs or more idle: the step GEMM at B=64, N=4096 made 64 blocks
        of 64 x 64 for 132 SMs."""
        tile = self
        while 2 * tile.blocks(rows, cols) <= sms and (tile.fn > 1 or tile.warps_n > 1):
            tile = replace(tile, fn=tile.fn // 2) if tile.fn > 1 else replace(tile, warps_n=tile.warps_n // 2)
        return tile

    def blocks(self, rows: int, cols: int) -> int:
        return -(-rows // self.bm) * -(-cols // self.bn)


def store_operand_in(sch: Schedule, block, dtype: str) -> None:
    """The GEMM's operand A, where its block computes it in float32 (r * h; the step's
    ``<gemm>_operand`` of an fp32 view), stored in ``dtype`` instead: rounded, as a torch cell in
    ``dtype`` rounds it."""
    a_buffer = sch.get(block).reads[0].source
    if a_buffer.dtype != dtype:
        producer = next(p for p in sch.get_producers(block) if sch.get(p).writes[0].source.same_as(a_buffer))
        sch.unsafe_set_dtype(producer, 0, dtype)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def gemm_tensorcore(sch: Schedule, block, tile: TensorCoreTile, dtype: str, epilogue: bool = False) -> None:
    """The tensor-core GEMM above on ``block`` (loops b, n, k; A read first, W second). The step's
    ``<gemm>_operand`` (fp32: lowering widens it) is stored in ``dtype`` instead: a copy of a state
    exactly (the state is ``dtype`` already), a computed one (r * h) rounded, as a torch cell in
    ``dtype`` rounds it. Ragged M, N, K are padded
    with zeros; an operand that needs padding is fetched one predicated element at a time (a
    vector load could run past the end of its buffer), the others 16 bytes at a time.

    With ``epilogue`` the GEMM is one tile (bm x bn, K whole tiles) placed under the caller's
    block loop (``compute_at``) before the elementwise math that reads its result: that math reads
    the C tile, and the result never goes to global memory (cuda_epilogue.py, ``fuse_epilogue``)."""
    store_operand_in(sch, block, dtype)
    rows, cols, depth = (sch.get(loop).extent for loop in sch.get_loops(block)[-3:])
    # rows may be symbolic, padded to whole tiles (lowering.hoisted_rows), and K (the backward's weight
    # gradients over them): the caller checks that the tile divides both for every T
    cols = int(cols)
    whole = {0: divides(rows, tile.bm) and divides(depth, tile.bk), 1: divides(depth, tile.bk) and cols % tile.bn == 0}
    if not epilogue and isinstance(depth, IntImm):
        sch.pad_einsum(block, [tile.bm, tile.bn, tile.bk])

    b, n, k = sch.get_loops(block)[-3:]
    b, b_frag = sch.split(b, [None, FRAG])
    n, n_frag = sch.split(n, [None, FRAG])
    depth_frag = frag_k(dtype)
    k, k_frag = sch.split(k, [None, depth_frag])
    sch.reorder(b, n, k, b_frag, n_frag, k_frag)
    inner = block
    outer = sch.blockize(b_frag)
    b_block, b_warp, b_inner = sch.split(b, [None, tile.warps_m, tile.fm])
    n_block, n_warp, n_inner = sch.split(n, [None, tile.warps_n, tile.fn])
    k_outer, k_inner = sch.split(k, [None, tile.bk // depth_frag])
    sch.reorder(b_block, n_block, b_warp, n_warp, k_outer, k_inner, b_inner, n_inner)
    if not epilogue:
        sch.bind(sch.fuse(b_block, n_block), "blockIdx.x")
    warp = sch.fuse(b_warp, n_warp)
    sch.bind(warp, "threadIdx.y")

    fetches = []
    for index in (0, 1):
        staged = sch.cache_read(outer, index, TILE_SCOPE)
        fetches.append(staged)
        sch.compute_at(staged, k_outer)
        _inline_copies(sch, staged)
        fused = sch.fuse(*sch.get_loops(staged)[-2:])
        vector = FETCH_BYTES // BYTES[dtype] if whole[index] else 1
        _, ty, tx, vec = sch.split(fused, [None, tile.warps_m * tile.warps_n, WARP, vector])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(vec)
        sch.storage_align(staged, 0, axis=-2, factor=32, offset=VECTOR)
    a_frag = sch.cache_read(outer, 0, "wmma.matrix_a")
    w_frag = sch.cache_read(outer, 1, "wmma.matrix_b")
    sch.compute_at(a_frag, k_inner)
    sch.compute_at(w_frag, k_inner)
    if fragment_dtype(dtype) != dtype:  # TF32: operand fragments typed as wmma.py says
        for frag in (a_frag, w_frag):
            sch.unsafe_set_dtype(frag, 0, fragment_dtype(dtype))

    # C's tile in the operands' scope: TVM merges the three into one dynamic allocation, C over the
    # operand tiles (TensorCoreTile.shared_bytes); the CUDA target turns TVM's storage rewrite off,
    # which would instead reuse A's fp16 tile for C and fail on the fp32 pointer into it
    c_shared = sch.cache_write(outer, 0, TILE_SCOPE)
    acc = sch.cache_write(outer, 0, "wmma.accumulator")
    sch.reverse_compute_at(acc, warp)
    sch.reverse_compute_at(c_shared, warp)
    init = sch.decompose_reduction(outer, k_outer)
    if tile.prefetch:
        _prefetch(sch, k_outer, fetches)
    elif tile.stages > 1 and all(whole.values()):
        _pipeline(sch, k_outer, tile.stages)

    names = intrinsics(dtype)
    for frag, role, (rows, cols) in ((a_frag, "load_a", (FRAG, depth_frag)), (w_frag, "load_b", (depth_frag, FRAG)),
                                     (acc, "store", (FRAG, FRAG))):
        i, j = sch.get_loops(frag)[-2:]
        i0, i1 = sch.split(i, [None, rows])
        j0, j1 = sch.split(j, [None, cols])
        sch.reorder(i0, j0, i1, j1)
        sch.tensorize(i1, names[role])
    sch.tensorize(sch.get_loops(sch.get_child_blocks(init)[0])[-2], names["init"])
    sch.tensorize(sch.get_loops(inner)[-3], names["compute"])

    if epilogue:
        sch.compute_inline(c_shared)  # no write-back: the elementwise math reads the C tile
        return
    for consumer in sch.get_consumers(c_shared):  # the copy of the padded result back to M x N
        if sch.get(consumer).reads[0].source.name.endswith("_pad"):
            sch.reverse_compute_inline(consumer)
    fused = sch.fuse(*sch.get_loops(c_shared)[-2:])
    _, tx = sch.split(fused, [None, WARP])
    sch.bind(tx, "threadIdx.x")


def _pipeline(sch: Schedule, k_outer, stages: int) -> None:
    """Software-pipeline ``k_outer`` over ``stages`` K tiles as meta_schedule's multi-level tiling
    does: the A and W fetches (stage 0, asynchronous: cp.async, which the CUDA target's build turns
    on) run stages - 1 tiles ahead of the fragment loads and mma (the last stage); TVM's pipeline
    pass gives each fetch a buffer per stage and the waits. Only for operands fetched 16 bytes at a
    time (cp.async copies 4, 8 or 16 bytes; a padded operand is fetched an element at a time)."""
    sch.annotate(k_outer, "software_pipeline_stage", [0, 0, stages - 1])
    sch.annotate(k_outer, "software_pipeline_order", [0, 1, 2])
    sch.annotate(k_outer, "software_pipeline_async_stages", [0])


def _prefetch(sch: Schedule, k_outer, fetches) -> None:
    """Software-pipeline ``k_outer`` as TVM's dlight MatmulTensorization does (without its async
    copies, which need the tirx.use_async_copy build option): each fetch gets a register stage
    (global -> registers -> shared), and the loop body runs the global loads of tile k+1 into
    registers (stage 0), a barrier, the mma of tile k from shared memory (stage 1), a barrier, then
    the stores of tile k+1 from registers into shared memory. The loads are in flight during the
    mma; TVM's pipeline pass keeps one shared buffer each (the stores follow the reads)."""
    for staged in fetches:
        sch.annotate(staged, "tirx.manifest_shared_memory_local_stage", 1)
    # k_outer's body once manifested: A to registers, A to shared, W to registers, W to shared,
    # the k_inner loop (fragment loads, mma)
    sch.annotate(k_outer, "software_pipeline_stage", [0, 0, 0, 0, 1])
    sch.annotate(k_outer, "software_pipeline_order", [0, 3, 1, 4, 2])


def fetches_its_operand(sch: Schedule, block, tile: TensorCoreTile, dtype: str) -> bool:
    """Whether ``tile`` can fetch the GEMM's A operand: an input, a plain copy (a state's operand
    copy) or a computed one (ResetBeforeGRU's r * h) that needs no padding, computed for this GEMM
    alone, with weights in ``dtype``: gemm_tensorcore stores a computed operand in ``dtype``, an
    input must be in it already (the backward's fp32 adjoints, read by other blocks too, and the
    fp32 operands of its weight gradients stay on FFMA). pad_einsum pads a computed operand with a
    block that reads it over the padded rows and K, past what its producer writes; the scope then
    fails the region cover that compute_at of the shared fetch checks (B=17, H=40 with 32 x 64
    tiles)."""
    a_buffer, w_buffer = (r.source for r in sch.get(block).reads[:2])
    rows, _, depth = (sch.get(loop).extent for loop in sch.get_loops(block))
    producers = [p for p in sch.get_producers(block) if sch.get(p).writes[0].source.same_as(a_buffer)]
    if w_buffer.dtype != dtype or (a_buffer.dtype != dtype and not producers):
        return False  # an fp32 input: tensor cores take the storage dtype only
    if any(len(sch.get_consumers(p)) > 1 for p in producers):
        return False  # retyped to the storage dtype, it would change what its other readers see
    return (divides(rows, tile.bm) and divides(depth, tile.bk)) or all(is_pure_copy(sch, p) for p in producers)


def _inline_copies(sch: Schedule, block) -> None:
    """Inline the zero padding and the plain copies (a state's operand copy) that feed a fetch."""
    for producer in sch.get_producers(block):
        if sch.get(producer).name_hint.endswith("_pad") or is_pure_copy(sch, producer):
            sch.compute_inline(producer)
            return _inline_copies(sch, block)
