"""The FFMA GEMM schedule of the CUDA recipes: C[M, N] = A[M, K] @ W[K, N] with W the packed (K, N)
weights, tiled in shared memory and registers on CUDA cores (``gemm_tiled``), and its tiles
(``GemmTile``; the step loop's from its knobs: ``step_tile``, ``hoisted_tile``). The step loop runs
its GEMMs so where they are not on tensor cores (cuda_gemm.py), greedy decoding and the
convolutions always:

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

from dataclasses import dataclass

from tvm.s_tir import Schedule
from tvm.tirx import IntImm

from .recipe import divides, is_pure_copy, pow2_at_least

VECTOR = 4  # elements a thread fetches at once into shared memory


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


def gemm_tiled(sch: Schedule, block, tile: GemmTile, views=()) -> None:
    """The tiled GEMM above. Operands in ``views`` (``T.match_buffer`` row blocks) are read from
    global memory, not staged: TVM 0.27's reindex gives a view's shared copy the view's symbolic
    offset. The step loop reads states through a ``<gemm>_operand`` copy (lowering makes it) that is
    staged and then inlined into its tile: at B=64, H=1024 unstaged states left the step GEMM at
    6.6 TFLOP/s (H100, ncu)."""
    b, n, k = sch.get_loops(block)
    cols, depth = (sch.get(loop).extent for loop in (n, k))
    cols = int(cols)
    # a symbolic K (the backward's weight gradients over T*B rows for any T, padded to a multiple of
    # ROW_QUANTUM: ``backward.weights._k_rows``) is split by the K tile exactly
    depth = int(depth) if isinstance(depth, IntImm) else depth
    bk = min(tile.bk, depth) if isinstance(depth, int) else tile.bk

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
            tiles.append((staged, False, divides(depth, VECTOR) and bk % VECTOR == 0))

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
