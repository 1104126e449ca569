"""CUDA recipe for the convolutions of ``halstm.models.conv``, by the shape each block's tag names:

    GEMM   the step loop's tiled GEMM (``cuda_ffma.gemm_tiled``: shared-memory tiles, a register
           tile a thread)
    taps   one thread an output (m, c), the K taps in a loop: a warp reads 32 adjacent channels
    rows   chunks of ``chunk`` rows summed by one thread a (chunk, column) into partial sums
           (rfactor), adjacent threads on adjacent columns; then a thread a column adds the chunks
    head   a warp an output (m, h, k), its lanes on adjacent channels of the head, the sum across
           the warp (TVM's cross-thread reduction)
    others (softmaxes over the K taps, per-head sums, copies): one thread an output

Run on an H100 (``docs/results.md#convolution``); ``tests/test_conv.py`` compiles it for sm_90 and checks the
results where a GPU is present (``-m gpu``). The GEMM stages each operand as (row, depth) tiles read along the depth, as
the step loop's operands are stored; the transposed operands of the backward GEMMs (dz^T, x and W
read along their rows) are staged with strided reads.
"""

from __future__ import annotations

from halstm.ops import HEAD_TAG, MATMUL_TAG, ROWS_TAG, TAPS_TAG

from .conv import ConvRecipe
from .cuda_blocks import bind_flat
from .cuda_ffma import GemmTile, gemm_tiled
from .cuda_tensorcore import BYTES, WARP


class CudaConv(ConvRecipe):
    name = "cuda-conv"
    kind = "cuda"
    biased = (TAPS_TAG, ROWS_TAG)  # gemm_tiled stages every operand its block reads, an initial value's too
    # GEMM tiles of 64 x 64: the weight gradient (H * K x C = 496 x 1024 at the realistic size, over
    # 16384 rows) makes 128 blocks, about one per SM of an H100; 128 x 128 tiles would leave 100 idle
    knobs = {"gemm_block": (64, 128), "gemm_thread": (4, 8), "k_chunk": (16, 8), "chunk": (256, 64, 1024),
             "warps": (8, 4), "threads": (256, 128, 512)}

    def runs(self, program, target, knobs) -> bool:
        """The GEMM tile runs as chosen (threads, registers, static shared memory at the widest
        element, fp32) and the other blocks' threads are within the target's."""
        b, t = knobs["gemm_block"], knobs["gemm_thread"]
        return (GemmTile(b, b, t, t, knobs["k_chunk"]).fits(BYTES["float32"], target)
                and knobs["threads"] <= target.max_threads and WARP * knobs["warps"] <= target.max_threads)

    def schedule_block(self, sch, block, tag, target, k) -> None:
        if tag == MATMUL_TAG:
            b, t = k["gemm_block"], k["gemm_thread"]
            gemm_tiled(sch, block, GemmTile(b, b, t, t, k["k_chunk"]))
        elif tag == ROWS_TAG:
            _sum_rows(sch, block, k["chunk"], k["threads"])
        elif tag == HEAD_TAG:
            _warp_sums(sch, block, k["warps"])
        else:  # taps and the rest: a thread an output, any reduction serial inside it
            bind_flat(sch, block, k["threads"])


def _sum_rows(sch, block, chunk: int, threads: int) -> None:
    *_, m = sch.get_loops(block)
    chunks, _ = sch.split(m, [None, chunk])
    partial = sch.rfactor(chunks, 0)
    *spatial, chunks, red = sch.get_loops(partial)
    sch.reorder(chunks, *spatial, red)
    bind_flat(sch, partial, threads)
    bind_flat(sch, block, threads)


def _warp_sums(sch, block, warps: int) -> None:
    *spatial, r = sch.get_loops(block)
    outputs, warp = sch.split(sch.fuse(*spatial), [None, warps])
    _, lane = sch.split(r, [None, 32])
    sch.bind(outputs, "blockIdx.x")
    sch.bind(warp, "threadIdx.y")
    sch.bind(lane, "threadIdx.x")
