"""CPU recipe: the step loop on all cores, GEMMs as register-blocked SIMD micro-kernels.

Prologue: the weight packing runs in parallel over K rows; the hoisted input GEMM and the step's
GEMMs share one micro-kernel schedule (in the backward's functions over all T*B rows, 8-row tiles
where the registers allow):

    for (n_outer, b_outer) in parallel:        # tasks over column strips x row blocks
        acc[rows, cols] = 0                      # a "local" tile LLVM keeps in registers
        for k:                                   # W strip (K x cols) streamed, contiguous
            for r in rows (unrolled): acc[r, :] += a[r, k] * W[k, :]   (cols = 2 vectors, FMA)
        store acc

``rows`` x ``cols`` accumulators must fit the 16 SIMD registers with room for the operands:
4 x 2 vectors = 8 accumulators on AVX2. The elementwise blocks of a stage, fused by inlining,
run in parallel over batch rows and vectorised along the hidden units. The backward's sums down
columns (bias gradients) run down the rows a strip of columns a task, its transposing copies in tiles.
"""

from __future__ import annotations

from tvm.s_tir import Schedule
from tvm.tirx import IntImm

from halstm.layout import PackedLayout

from .recipe import (Recipe, activations, child_blocks, divides, inline_elementwise, is_reduction,
                     merge_next_states, reduces_columns, reduces_rows, transposing_nest)


class CpuStepLoop(Recipe):
    name = "cpu-step-loop"
    keeps_results = True
    knobs = {"rows": (4, 2, 6, 8), "vectors": (2, 1, 3, 4), "panel": (64, 32, 128, 256)}

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cpu"

    def layout(self, program, target, knobs) -> PackedLayout:
        # Strips of one micro-kernel's width: each task streams a contiguous K x cols block. Row-major
        # (K, N) strides N * 4 bytes between k, a multiple of the L1 way size for the usual N, and
        # thrashed a few cache sets: 40 GFLOP/s against 88 with strips (B=64, K=512, N=2048, 1 core).
        return PackedLayout(tile=knobs["vectors"] * target.lanes)

    def valid(self, program, target, knobs) -> bool:
        # The register tile must leave room for the operands: rows * vectors accumulators, the
        # vectors of one W row, one broadcast of a. Tiles past 15 of AVX2's 16 registers spilled and
        # ran 2.3-10x slower than the default (LSTM B=64 H=512: 542-2469 ms against 233 ms, in one
        # tuning run). Rows that do not divide the batch leave predicated-off rows in every tile
        # (rows=6: 530 ms there).
        registers = 32 if target.lanes == 16 else 16
        rows, vectors, batch = knobs["rows"], knobs["vectors"], program.batch
        fits = rows * vectors + vectors + 1 < registers
        return fits and (batch % rows == 0 or rows > batch)

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        sch = Schedule(program.mod)
        for scope in ("prologue", "step"):
            self.schedule_scope(sch, scope, program, target, k)
        return sch

    def schedule_scope(self, sch: Schedule, scope: str, program, target, k: dict, apart=(), keep=()) -> None:
        """The blocks of one scope: elementwise math inlined (but into ``keep``), GEMMs as
        micro-kernels, the rest over rows across cores; those named in ``apart`` left alone."""
        # a function run once over all T*B rows (the backward's) stores the activations its
        # adjoints share: rows, LSTM (100,16,512), 2-core CPU: 17.5 ms against 21.7
        shared = activations(sch, sch.get_sblock(scope)) if program.steps == 1 else set()
        inline_elementwise(sch, sch.get_sblock(scope), {*shared, *apart, *keep})
        gemms, others = child_blocks(sch, scope, program)
        for gemm in gemms:
            rows = _all_rows_tile(sch, gemm, k, target) if program.steps == 1 else k["rows"]
            _micro_kernel(sch, gemm, rows, k["vectors"] * target.lanes, k["panel"])
        others = [b for b in others if sch.get(b).name_hint not in apart]
        for block in merge_next_states(sch, sch.get_sblock(scope), others):
            if reduces_columns(sch, block):
                column_sums(sch, block, target.lanes)
            elif reduces_rows(sch, block, target.lanes):
                row_sums(sch, block, target.lanes)
            elif not tiled_transpose(sch, block):
                parallel_rows(sch, block, target.lanes)


ALL_ROWS_TILE = 8


def _all_rows_tile(sch: Schedule, block, knobs: dict, target) -> int:
    """The register tile's rows for a GEMM of a function run once over all T*B rows (the backward's
    prepare, rows and weights; the rows knob is the step's, whose GEMM has B rows): ``ALL_ROWS_TILE``,
    halving the loads of W per FMA, where it divides the GEMM's rows (T*B; a weight gradient's, the
    H or 4H columns of dG^T) and fits the registers as ``valid`` asks; else the knob's. LSTM
    (100,16,512) on the 2-core CPU (AVX-512), prepare timed alone: 64 ms against 72 with 4 rows.
    Where the rows follow the sequence length (a function for any T: n_steps * B rows), the first
    of these that divides them for every T, down to one row: a tile that leaves some rows out
    predicates the register tile, which TVM's buffer compaction refused ("cannot make uint from
    negative value")."""
    rows, vectors = ALL_ROWS_TILE, knobs["vectors"]
    registers = 32 if target.lanes == 16 else 16
    extent = sch.get(sch.get_loops(block)[0]).extent
    fits = rows * vectors + vectors + 1 < registers
    if isinstance(extent, IntImm):
        return rows if fits and int(extent) % rows == 0 else knobs["rows"]
    candidates = ([rows] if fits else []) + list(range(knobs["rows"], 0, -1))
    return next(r for r in candidates if divides(extent, r))


def _micro_kernel(sch: Schedule, block, rows: int, cols: int, panel: int) -> None:
    """Panels of ``panel`` rows (kept in L2) x strips of ``cols`` columns x tiles of ``rows`` rows.

    Within a panel a strip stays in L1 across the panel's row tiles. Without panels, the hoisted
    GEMM (6400 x 512 x 2048) streamed all of x once per strip and ran at 129 GFLOP/s. The panel is
    at most the GEMM's rows: at B=32 a 64-row panel left half of the step GEMM's tasks empty. Where
    the rows are symbolic (a function for any T), the panel is the largest whole number of tiles up to
    ``panel`` that divides them for every T: nothing then predicates the register tile.
    """
    b, n, k = sch.get_loops(block)
    extent = sch.get(b).extent
    if isinstance(extent, IntImm):  # a panel past the rows is tasks with nothing to do
        panel = min(panel, int(extent))
    elif divides(extent, rows):
        panel = next(m * rows for m in range(max(1, panel // rows), 0, -1) if divides(extent, m * rows))
    b_panel, b_outer, b_inner = sch.split(b, [None, max(1, panel // rows), rows])
    n_outer, n_inner = sch.split(n, [None, cols])
    sch.reorder(b_panel, n_outer, b_outer, k, b_inner, n_inner)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, b_outer)
    sch.parallel(sch.fuse(b_panel, n_outer, b_outer))
    sch.unroll(b_inner)
    sch.vectorize(n_inner)
    sch.vectorize(sch.get_loops(acc)[-1])
    sch.decompose_reduction(block, k)


def parallel_rows(sch: Schedule, block, lanes: int) -> None:
    """Rows across cores; the hidden units of a row in SIMD lanes (not for a cell's own
    reductions, which keep their inner loop serial)."""
    loops = sch.get_loops(block)
    sch.parallel(loops[0])
    inner = loops[-1]
    if len(loops) > 1 and not is_reduction(sch, block) and sch.get(inner).extent.value % lanes == 0:
        sch.vectorize(sch.split(inner, [None, lanes])[1])


def row_sums(sch: Schedule, block, lanes: int) -> None:
    """A sum along each row (a layer norm's mean and variance over a row's columns, sum over k of
    f(r, k)): each row's columns in SIMD lanes, lane l summing columns l, l + lanes, ... (rfactor,
    in registers), then the lanes added; rows across cores. A serial sum is a chain of dependent
    adds: on the 2-core CPU (both ways compiled in one process and called in turn, medians),
    LayerNormGRU (100,1,256), four sums over 768 columns a step, 2.28 ms serial, 1.79 in lanes,
    LayerNormLSTM 3.20 / 2.46; (100,16,512) 64.9 / 57.9 and 90.4 / 79.9."""
    row, column = sch.get_loops(block)
    _, lane = sch.split(column, [None, lanes])
    partial = sch.rfactor(lane, factor_axis=1)
    sch.vectorize(sch.get_loops(partial)[-1])
    sch.reverse_compute_at(block, sch.get_loops(partial)[0])
    sch.set_scope(partial, 0, "local")
    sch.parallel(sch.get_loops(partial)[0])


COLUMN_VECTORS = 4  # SIMD vectors of columns a column-sum task keeps in registers
TRANSPOSE_TILE = 32


def column_sums(sch: Schedule, block, lanes: int) -> None:
    """A sum down columns (a bias gradient over all T*B rows, d_bias[j] = sum over r of d[r, j]):
    tasks over strips of ``COLUMN_VECTORS`` vectors of columns, each running down the rows with the
    strip's sums in registers, so that a row's part of the strip is read as whole vectors. One task
    a column, serial down the rows, read each element alone: the rows function of LSTM (100,16,512),
    timed alone on the 2-core CPU, 16.3 ms against 44.8."""
    column, row = sch.get_loops(block)
    strip = COLUMN_VECTORS * lanes
    if sch.get(column).extent.value % strip:
        strip = lanes
    task, lane = sch.split(column, [None, strip])
    sch.reorder(task, row, lane)
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, task)
    sch.parallel(task)
    sch.vectorize(lane)
    init = sch.decompose_reduction(block, row)
    sch.vectorize(sch.get_loops(init)[-1])
    sch.vectorize(sch.get_loops(acc)[-1])


def tiled_transpose(sch: Schedule, block) -> bool:
    """A transposing copy (out[n, r] = d[r, n]: the backward's ``d<gemm>_transposed``, the adjoint
    cell's transposed weights; blocks merged into one nest by merge_next_states each transpose) in
    ``TRANSPOSE_TILE``-square tiles, tasks over tiles, each tile's source rows in L1 while it is
    written a row at a time (LSTM (100,16,512), 2-core CPU, the weights function timed alone: 86 ms
    against 140 untiled, which read each source column down all T*B rows). Returns False, leaving the
    block alone, where the nest has other than two loops or a block of it does not transpose."""
    if not transposing_nest(sch, block):
        return False
    rows, columns = sch.get_loops(block)
    row_tile, row = sch.split(rows, [None, TRANSPOSE_TILE])
    column_tile, column = sch.split(columns, [None, TRANSPOSE_TILE])
    sch.reorder(row_tile, column_tile, row, column)
    sch.parallel(sch.fuse(row_tile, column_tile))
    return True
