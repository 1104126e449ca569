"""CUDA step-loop recipe: the hoisted GEMM once, then per step one GEMM kernel and one fused
elementwise kernel per stage, launched from the compiled host loop over t (no Python per step).

GEMMs (the hoisted one and the step's) share one tiled schedule, C[M, N] = A[M, K] @ W[K, N] with W
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

from tvm.s_tir import Schedule
from tvm.tirx import IterVar

from .recipe import Recipe, child_blocks, inline_elementwise, merge_next_states

BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
STATIC_SHARED = 48 * 1024  # "shared" scope allocations are static: at most 48 KiB a block
VECTOR = 4  # elements a thread fetches at once into shared memory


class CudaStepLoop(Recipe):
    name = "cuda-step-loop"
    knobs = {
        "block_rows": (64, 32, 128, 16),
        "block_cols": (64, 128, 32),
        "thread_rows": (4, 2, 8, 1),
        "thread_cols": (4, 2, 8, 1),
        "k_chunk": (16, 8, 32),
        "threads": (256, 128, 512),  # elementwise kernels
    }

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cuda"

    def valid(self, program, target, knobs) -> bool:
        bm, bn, tm, tn, bk = (knobs[k] for k in ("block_rows", "block_cols", "thread_rows", "thread_cols", "k_chunk"))
        threads = (bm // tm) * (bn // tn)
        shared = (bm + bn) * bk * BYTES[program.dtype]
        return (bm % tm == 0 and bn % tn == 0 and 32 <= threads <= target.max_threads
                and tm * tn <= 64 and shared <= min(target.shared_memory, STATIC_SHARED))

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        sch = Schedule(program.mod)
        for scope in ("prologue", "step"):
            inline_elementwise(sch, sch.get_sblock(scope))
            gemms, elementwise = child_blocks(sch, scope, program)
            views = {m.buffer.name for m in sch.get(sch.get_sblock(scope)).match_buffers}
            for gemm in gemms:
                gemm_tiled(sch, gemm, k, views)
            for block in merge_next_states(sch, sch.get_sblock(scope), elementwise):
                _bind_flat(sch, block, k["threads"])
        return sch


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def gemm_tiled(sch: Schedule, block, knobs: dict, views=()) -> None:
    """The tiled GEMM above; ``knobs`` holds the step loop's tile knobs.

    Operands in ``views`` (the step's ``T.match_buffer`` views, the state h_t) are read from global
    memory, not staged: TVM 0.27's reindex/cache_read give the shared copy of a view the view's
    symbolic elem_offset (t * B * H), so the shared tile was indexed out of bounds. At the batch
    sizes where the step GEMM matters that operand is B x K, a few KiB that stay in L1.
    """
    b, n, k = sch.get_loops(block)
    rows, cols, depth = (int(sch.get(loop).extent) for loop in (b, n, k))
    bm = min(knobs["block_rows"], _pow2_at_least(rows))
    row_threads = min(knobs["block_rows"] // knobs["thread_rows"], bm)
    tm = bm // row_threads
    tn, col_threads = knobs["thread_cols"], knobs["block_cols"] // knobs["thread_cols"]
    bk = min(knobs["k_chunk"], depth)

    tiles = []
    for index, region in enumerate(sch.get(block).reads):
        if region.source.name in views:
            continue
        tile = sch.reindex(block, ("read", index))
        sch.set_scope(tile, 0, "shared")
        if region.source.name.startswith("w_packed"):  # reindexed as [n, k]: store it [k, n]
            sch.transform_layout(tile, ("write", 0), lambda n, k: (k, n))
            tiles.append((tile, True, cols % VECTOR == 0))
        else:
            tiles.append((tile, False, depth % VECTOR == 0 and bk % VECTOR == 0))

    b, n, k = sch.get_loops(block)
    b_block, b_thread, b_inner = sch.split(b, [None, row_threads, tm])
    n_block, n_thread, n_inner = sch.split(n, [None, col_threads, tn])
    k_outer, k_inner = sch.split(k, [None, bk])
    sch.reorder(b_block, n_block, b_thread, n_thread, k_outer, k_inner, b_inner, n_inner)
    sch.bind(sch.fuse(b_block, n_block), "blockIdx.x")
    thread = sch.fuse(b_thread, n_thread)
    sch.bind(thread, "threadIdx.x")
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, thread)
    for tile, transposed, aligned in tiles:
        sch.compute_at(tile, k_outer, preserve_unit_loops=True)
        _cooperative_fetch(sch, tile, row_threads * col_threads, transposed, aligned)
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


def _bind_flat(sch: Schedule, block, threads: int) -> None:
    """One thread per output element; a cell's own reduction (a layer norm's sum) runs serially
    inside its thread (its reduce loops are innermost, as te.create_prim_func makes them)."""
    loops = sch.get_loops(block)
    reduce = sum(iv.iter_type == IterVar.CommReduce for iv in sch.get(block).iter_vars)
    fused = sch.fuse(*loops[: len(loops) - reduce])
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
