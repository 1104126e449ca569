"""The CUDA schedules of the blocks that are not GEMMs: elementwise blocks a thread an output
(``bind_flat``) or LANES adjacent ones (``bind_lanes``), a cell's own reductions a thread block an
output (``bind_reduction``), sums down columns in two coalesced kernels (``bind_column_reduction``)
and transposing copies through shared tiles (``schedule_transpose``: the packed weights, the
backward's transposed copies).
"""

from __future__ import annotations

from tvm.s_tir import Schedule
from tvm.tirx import IntImm, IterVar, floordiv

from .cuda_tensorcore import WARP
from .recipe import divides, pow2_at_least, transposing_nest


def bind_flat(sch: Schedule, block, threads: int) -> None:
    """One thread per output element; any reduction of the block runs serially inside its thread
    (its reduce loops are innermost, as te.create_prim_func makes them)."""
    loops = sch.get_loops(block)
    reduce = sum(iv.iter_type == IterVar.CommReduce for iv in sch.get(block).iter_vars)
    fused = sch.fuse(*loops[: len(loops) - reduce])
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


LANES = 4  # a thread's adjacent outputs in ``bind_lanes``: a float32 vector of 16 bytes


def bind_lanes(sch: Schedule, block, threads: int, lanes: int = LANES) -> None:
    """An elementwise block, ``lanes`` adjacent outputs of a row a thread, as one vector (LANES:
    16-byte float32 loads; TVM 0.27 prints an eight-lane float32 constant as a make_ulonglong4 of
    eight floats, which nvcc rejects). The innermost loop is split first, so that a condition on a
    column range that ``lanes`` divides (a slice of a concatenation, ``lowering.hoisted_rows``'
    padding) stays one condition a thread and the block vectorised. Blocks with a reduction, or whose
    rows ``lanes`` does not divide, a thread an output (``bind_flat``)."""
    loops = sch.get_loops(block)
    if not loops or any(iv.iter_type != IterVar.DataPar for iv in sch.get(block).iter_vars):
        bind_flat(sch, block, threads)
        return
    inner = sch.get(loops[-1]).extent
    if not isinstance(inner, IntImm) or inner.value % lanes:
        bind_flat(sch, block, threads)
        return
    outer, lane = sch.split(loops[-1], [None, lanes])
    bx, tx = sch.split(sch.fuse(*loops[:-1], outer) if len(loops) > 1 else outer, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(lane)


COPY_BYTES = 16  # what a thread of a row copy moves at once


def bind_row_copy(sch: Schedule, block, threads: int, size: int) -> None:
    """A ``copies_rows`` block (no float32 math between load and store), COPY_BYTES a thread where a
    row holds whole vectors of them (``size`` bytes an element: ``bind_lanes``), else an element a
    thread. Not timed against one element a thread."""
    bind_lanes(sch, block, threads, COPY_BYTES // size)


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
        elements *= sch.get(loop).extent
    # over rows of symbolic extent (a function for any T: n_steps * B), every thread of the block
    fixed = isinstance(elements, int | IntImm)
    width = min(threads, max(WARP, pow2_at_least(int(elements)))) if fixed else threads
    _, tx = sch.split(sch.fuse(*reduced) if len(reduced) > 1 else reduced[0], [None, width])
    if spatial:
        sch.bind(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0], "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


COLUMN_SLICE = 64  # rows a thread sums in a column reduction's first kernel
MIN_COLUMN_SLICE = 8  # the fewest, where symbolic rows take no COLUMN_SLICE (``column_slice``)


def column_slice(sch: Schedule, block, threads: int) -> int:
    """The rows a thread sums in a ``reduces_columns`` block's first kernel where it splits without
    remainder (its rows into slices, slices x columns into thread blocks), else 0: a remainder's
    predicates leave the scope no stage pipeline for a tensor-core GEMM's compute_at (TVM 0.27:
    ResetBeforeGRU fp16 T=5, B=16, H=32); such a block keeps ``bind_reduction``. COLUMN_SLICE rows,
    or where the rows are symbolic (n_steps * B, a function for any T), the most of COLUMN_SLICE,
    its halves down to MIN_COLUMN_SLICE that divide them for every T (B's power-of-two factor)."""
    columns, rows = (sch.get(loop).extent for loop in sch.get_loops(block))
    slices = [COLUMN_SLICE]
    while not isinstance(rows, IntImm) and slices[-1] > MIN_COLUMN_SLICE:
        slices.append(slices[-1] // 2)
    return next((n for n in slices if divides(rows, n) and divides(floordiv(rows, n) * columns, threads)), 0)


def bind_column_reduction(sch: Schedule, block, threads: int, rows: int = COLUMN_SLICE) -> None:
    """A ``reduces_columns`` block out[j] = sum over r of in[r, j] in two kernels whose warps read
    consecutive columns (whole lines):

        partial[s, j] = sum of in[r, j] over the ``rows`` rows of slice s         (rfactor)
            a thread an (s, j) (bind_flat, columns inner), its sum in a register
        out[j] = sum over s of partial[s, j]
            WARP columns a thread block (threadIdx.x), threads / WARP lanes (threadIdx.y)
            striding over the slices, combined by TVM's cross-thread reduction

    The register (cache_write) is placed before the columns are split: placed under a split's
    thread loop, its copy to partial went past the columns (TVM 0.27 left it unguarded). One
    thread block a column, its threads striding over rows (bind_reduction), loaded a 32-byte
    sector an element: 178 us for 6400 x 4096 float32 on an H200."""
    _, loop = sch.get_loops(block)
    partial = sch.rfactor(sch.split(loop, [None, rows])[0], factor_axis=0)
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


TRANSPOSE_TILE = 32
TRANSPOSE_ROWS = 8  # tile rows a round: 8 x 32 = 256 threads a block, 4 rounds a tile


def schedule_transpose(sch: Schedule, block) -> bool:
    """A ``transposes`` loop nest (a ``w_packed*`` block, w_packed[k, n] = stacked weights[n, k],
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
    nest = transposing_nest(sch, block)
    if not nest:
        return False
    loops = sch.get_loops(block)
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
