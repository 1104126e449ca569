"""Epilogue fusion in the CUDA step loop: a step GEMM on WMMA tensor cores and the elementwise math
that reads it in one kernel (knob tc_epilogue), the math reading the GEMM's C tile from shared
memory, where the packed layout groups a column tile's gates by units (``epilogue_units``,
``PackedLayout.units``; ``fuse_epilogue``).
"""

from __future__ import annotations

from tvm.s_tir import Schedule

from .cuda_gemm import on_wgmma, step_tensor_core_tile, use_tensor_cores
from .cuda_tensorcore import WARP, TensorCoreTile, fetches_its_operand, gemm_tensorcore
from .recipe import is_reduction


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
