"""CPU recipe for the convolutions of ``halstm.models.conv``: each block by the shape its tag names, on
all cores, vectorised along the channels (the contiguous axis of the large buffers), the accumulators
of a task in registers ("local" tiles). Measured on 2 cores of an AMD EPYC (znver3) at the realistic
size (B=32, T=512, C=1024, K=31, H=16):

    GEMM   (the dynamic kernel's Linear and its gradients, 16384 x 496 x 1024): tasks of a panel of
           rows x a strip of columns, the depth in chunks, the operand read along the columns packed
           in contiguous strips. 100-176 GFLOP/s; the cell recipe's micro-kernel (the whole depth
           under one register tile) ran the weight gradient, depth 16384, at 54 GFLOP/s, and
           without the strips the GEMMs ran at 12-77
    taps   out[m, c] = sum_k ...: a tile of 2 rows x 2 vectors a task, the K taps inside: the
           lightweight forward in 55-60 ms; tiles whose rows step in time (B * C * 4 = 128 KiB apart,
           one cache set) ran 2-10x slower
    rows   out[k, c] = sum over the T * B rows: chunks of 512 rows summed in parallel (rfactor), a
           tile of 4 taps x 2 vectors a task: the lightweight weight gradient in 75 ms (400 ms
           with a task one tap and a column strip over all the rows)
    head   out[m, h, k] = sum over the R channels of a head: the channels in SIMD lanes (rfactor),
           then the lanes summed
    others (softmaxes over the K taps, per-head sums): parallel over their first loop
"""

from __future__ import annotations

from tvm.s_tir import Schedule

from halstm.ops import HEAD_TAG, MATMUL_TAG, ROWS_TAG, TAPS_TAG

from .cpu import parallel_rows
from .conv import ConvRecipe


class CpuConv(ConvRecipe):
    name = "cpu-conv"
    kind = "cpu"
    biased = (MATMUL_TAG, TAPS_TAG, ROWS_TAG)
    # register tiles are (rows, vectors)
    knobs = {"taps_tile": ((2, 2), (4, 2), (1, 4), (2, 4)), "sum_tile": ((4, 2), (6, 2), (2, 4)),
             "gemm_tile": ((4, 2), (2, 4), (6, 2)), "panel": (64, 128), "depth": (512, 256, 1024),
             "chunk": (512, 256, 2048)}

    def valid(self, program, target, knobs) -> bool:
        registers = 32 if target.lanes == 16 else 16
        tiles = (knobs["taps_tile"], knobs["sum_tile"], knobs["gemm_tile"])
        return all(rows * vectors + vectors + 1 < registers for rows, vectors in tiles)

    def schedule_block(self, sch, block, tag, target, k) -> None:
        if tag == MATMUL_TAG:
            rows, cols = _tile(k["gemm_tile"], target)
            width = int(sch.get(sch.get_loops(block)[1]).extent)
            # strips that divide the columns: a ragged last strip makes every strip's loop scalar
            cols = next((c for c in range(cols, 0, -target.lanes) if width % c == 0), cols)
            _pack_columns(sch, block, cols)
            _gemm(sch, block, rows, cols, k["panel"], k["depth"])
        elif tag == TAPS_TAG:
            _register_tile(sch, block, *_tile(k["taps_tile"], target))
        elif tag == ROWS_TAG:
            _sum_rows(sch, block, *_tile(k["sum_tile"], target), k["chunk"], target.lanes)
        elif tag == HEAD_TAG:
            _lane_sums(sch, block, target.lanes)
        else:
            parallel_rows(sch, block, target.lanes)


def _tile(tile: tuple[int, int], target) -> tuple[int, int]:
    """(rows, vectors) -> (rows, columns)."""
    return tile[0], tile[1] * target.lanes


def _pack_columns(sch: Schedule, block, tile: int) -> None:
    """Copy the operand a GEMM reads along its columns j into strips (j // tile, depth, j % tile),
    each contiguous, the last one padded with zeros (as the cell GEMMs' packed weights)."""
    _, j, _ = (iv.var for iv in sch.get(block).iter_vars)
    for index, region in enumerate(sch.get(block).reads):
        starts = [r.min for r in region.region]
        if len(starts) != 2 or not any(v.same_as(j) for v in starts):
            continue
        packed = sch.cache_read(block, index, "global")
        if starts[0].same_as(j):
            strips = lambda n, l: (n // tile, l, n % tile)  # noqa: E731
        else:
            strips = lambda l, n: (n // tile, l, n % tile)  # noqa: E731
        sch.transform_layout(block, ("read", index), strips, pad_value=0.0)
        sch.parallel(sch.get_loops(packed)[0])
        return


def _gemm(sch: Schedule, block, rows: int, cols: int, panel: int, depth: int) -> None:
    """Tasks of ``panel`` rows x ``cols`` columns; within a task, the depth in chunks of ``depth``, so
    that the chunk of the column strip stays in L1 and the panel's in L2 while every row tile of the
    panel uses them; a rows x cols tile accumulated in registers across a chunk."""
    i, j, l = sch.get_loops(block)
    i_panel, i_tile, i_in = sch.split(i, [None, max(1, panel // rows), rows])
    j_strip, j_in = sch.split(j, [None, cols])
    extent = int(sch.get(l).extent)
    l_chunk, l_in = sch.split(l, [None, -(-extent // -(-extent // depth))])  # equal chunks of at most depth
    sch.reorder(i_panel, j_strip, l_chunk, i_tile, l_in, i_in, j_in)
    sch.parallel(sch.fuse(i_panel, j_strip))
    sch.unroll(i_in)
    sch.vectorize(j_in)
    sch.decompose_reduction(block, l_chunk)


def _register_tile(sch: Schedule, block, rows: int, cols: int) -> None:
    """acc[rows, cols] in registers, for a block with loops (..., row, column, reduction): ``rows`` of
    the loop before the columns by ``cols`` columns, the reduction outside the tile, tasks over the
    loops before it, row tiles and column strips."""
    *outer, row, col, red = sch.get_loops(block)
    col_o, col_i = sch.split(col, [None, cols])
    row_o, row_i = sch.split(row, [None, rows])
    sch.reorder(row_o, col_o, red, row_i, col_i)
    outer = sch.fuse(*outer, row_o, col_o)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, outer)
    sch.parallel(outer)
    sch.unroll(row_i)
    sch.vectorize(col_i)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(block, red)


def _sum_rows(sch: Schedule, block, rows: int, cols: int, chunk: int, lanes: int) -> None:
    """out[..., c] = sum over all rows m: chunks of ``chunk`` rows summed in parallel into partial sums
    (rfactor), each a register tile, then the partial sums added up. The chunk's rows stay in L2
    while a tile of a few rows of ``out`` (taps k, for dweight) reads them."""
    *_, m = sch.get_loops(block)
    chunks, _ = sch.split(m, [None, chunk])
    partial = sch.rfactor(chunks, 0)
    *spatial, chunks, red = sch.get_loops(partial)
    sch.reorder(chunks, *spatial, red)
    _register_tile(sch, partial, rows, cols)
    parallel_rows(sch, block, lanes)


def _lane_sums(sch: Schedule, block, lanes: int) -> None:
    """out[m, h, k] = sum_r ...: r split into SIMD lanes, each lane summing its own r (rfactor), then
    the lanes summed; parallel over m."""
    *_, r = sch.get_loops(block)
    if int(sch.get(r).extent) % lanes == 0:
        _, lane = sch.split(r, [None, lanes])
        partial = sch.rfactor(lane, factor_axis=3)
        sch.vectorize(sch.get_loops(partial)[-1])
        sch.reverse_compute_at(block, sch.get_loops(partial)[2])
        sch.set_scope(partial, 0, "local")
        block = partial
    sch.parallel(sch.get_loops(block)[0])
