"""The schedule of one GEMM block on CUDA, as rules tried in order, the first that takes the block
winning (as TVM dlight's ``ScheduleRule``s): ``choose`` answers with the rule's configuration (its
tile) or None where the block is not its own, ``apply`` schedules the block with it or, where a
check on the schedule declines, leaves it alone and returns False.

    GEMM_RULES = (WgmmaGemm(), WmmaGemm(), SlicedFfmaGemm(), FfmaGemm())

wgmma (Hopper, ``wgmma.py``) where its tile fits; WMMA (``cuda_tensorcore.py``) where its tile
fetches the operand; a GEMM in K slices off tensor cores a thread an output; else the FFMA register
tile (``cuda_ffma.py``). The knobs that size each are the recipe's (``cuda.py``'s ``knobs``).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace

from tvm.error import InternalError
from tvm.s_tir import Schedule
from tvm.s_tir.schedule import ScheduleError
from tvm.tirx import IntImm

from .cuda_ffma import GemmTile, gemm_tiled, hoisted_tile, step_tile
from .cuda_gemm import (gemm_wgmma_tile, hoisted_tensor_core_tile, rows_and_gemms, step_tensor_core_tile,
                        tf32_gemms, use_tensor_cores)
from .cuda_tensorcore import fetches_its_operand, gemm_tensorcore
from .recipe import divides, in_k_slices, is_pure_copy
from .wgmma import gemm_wgmma


@dataclass(frozen=True)
class GemmBlock:
    """A GEMM block as the rules read it: the schedule and the block, the recipe's knobs, the
    program and target, whether it is the step's GEMM (B rows) or a hoisted one (T*B rows, ``rows``
    at the program's nominal T), its loops' extents ``m``, ``n``, ``k`` (symbolic where they follow
    the sequence length), whether it sums K in slices, and the step's views (the FFMA tile's)."""

    sch: Schedule
    block: object
    knobs: dict
    program: object
    target: object
    step: bool
    views: tuple
    rows: int
    m: object
    n: object
    k: object
    sliced: bool

    @classmethod
    def of(cls, sch: Schedule, block, knobs: dict, program, target, step: bool, views=()) -> GemmBlock:
        m, n, k = (sch.get(loop).extent for loop in sch.get_loops(block)[-3:])
        return cls(sch, block, knobs, program, target, step, tuple(views), rows_and_gemms(program, step)[0], m, n, k,
                   in_k_slices(sch, block))

    @functools.cached_property
    def on_tensor_cores(self) -> bool:
        """Whether the knobs, the target and the dtype put this GEMM on tensor cores (asked by both
        tensor-core rules, answered once)."""
        return use_tensor_cores(self.knobs, self.program, self.target, self.rows if self.step else None)


class WgmmaGemm:
    """wgmma where the knob, the target and the dtype allow it and its tile fits the GEMM and
    divides its rows."""

    def choose(self, g: GemmBlock):
        if not g.on_tensor_cores:
            return None
        m_rows = int(g.m) if isinstance(g.m, IntImm) else g.rows  # a GEMM's own M (a weight gradient's)
        tile = gemm_wgmma_tile(g.knobs, g.program, g.target, m_rows, int(g.n), g.k, g.step, tf32_gemms(g.program, g.step))
        return tile if tile is not None and _divides_rows(g.m, tile.bm) else None

    def apply(self, g: GemmBlock, tile) -> bool:
        return gemm_wgmma(g.sch, g.block, tile, g.program.dtype)


class WmmaGemm:
    """WMMA where its tile divides the rows and K, fetches the operand, and schedules (tried on a
    copy first: ``_schedules``); not a GEMM in K slices."""

    def choose(self, g: GemmBlock):
        if g.sliced or not g.on_tensor_cores:
            return None
        if g.step:
            tile = step_tensor_core_tile(g.knobs, g.rows, int(g.n), g.target)
        else:
            tile = hoisted_tensor_core_tile(g.knobs).for_rows(g.rows)
        if (_divides_rows(g.m, tile.bm) and _divides_rows(g.k, tile.bk)
                and fetches_its_operand(g.sch, g.block, tile, g.program.dtype)
                and _schedules(gemm_tensorcore, g.sch, g.block, tile, g.program.dtype)):
            return tile
        return None

    def apply(self, g: GemmBlock, tile) -> bool:
        gemm_tensorcore(g.sch, g.block, tile, g.program.dtype)
        return True


class SlicedFfmaGemm:
    """A GEMM in K slices (s, b, n, k) off tensor cores (an operand wgmma does not read, which
    ``step_split_k`` cannot foresee): a thread an output of a slice, its sum in a register, a
    state's copy read where it is."""

    def choose(self, g: GemmBlock):
        return g.knobs["threads"] if g.sliced else None

    def apply(self, g: GemmBlock, threads: int) -> bool:
        sch = g.sch
        for producer in sch.get_producers(g.block):
            if is_pure_copy(sch, producer):
                sch.compute_inline(producer)
        s, b, n, _ = sch.get_loops(g.block)[-4:]
        outer, inner = sch.split(sch.fuse(s, b, n), [None, threads])
        sch.bind(outer, "blockIdx.x")
        sch.bind(inner, "threadIdx.x")
        sch.reverse_compute_at(sch.cache_write(g.block, 0, "local"), inner)
        return True


class FfmaGemm:
    """The FFMA register tile, its rows the most that divide the GEMM's (``_row_tile_dividing``)."""

    def choose(self, g: GemmBlock):
        tile = step_tile(g.knobs, g.program.batch) if g.step else hoisted_tile(g.knobs)
        return tile if _divides_rows(g.m, tile.bm) else _row_tile_dividing(tile, g.m)

    def apply(self, g: GemmBlock, tile) -> bool:
        gemm_tiled(g.sch, g.block, tile, g.views)
        return True


GEMM_RULES = (WgmmaGemm(), WmmaGemm(), SlicedFfmaGemm(), FfmaGemm())


def schedule_gemm(sch: Schedule, block, knobs: dict, program, target, step: bool, views=()):
    """The hoisted GEMM (T x B rows) or the step's (B rows) scheduled by the first of GEMM_RULES that
    takes it; returns that rule. Symbolic extents (the backward's functions for any T): rows go to
    tensor cores where the tile's rows divide them for every T (``_divides_rows``); a symbolic K
    (the weight gradients' over T*B rows, padded) where the K tile divides it, else to FFMA."""
    g = GemmBlock.of(sch, block, knobs, program, target, step, views)
    for rule in GEMM_RULES:
        config = rule.choose(g)
        if config is not None and rule.apply(g, config):
            return rule
    raise AssertionError(f"no GEMM rule took {sch.get(block).name_hint}: FfmaGemm takes every block")


def _divides_rows(rows, bm: int) -> bool:
    """Whether a tile of ``bm`` rows serves a GEMM of ``rows`` rows (or K): any number of them, or where they are
    symbolic (n_steps * B, any T), a multiple of ``bm`` for every T (a predicated tile fails in TVM 0.27)."""
    return isinstance(rows, IntImm) or divides(rows, bm)


def _row_tile_dividing(tile: GemmTile, rows) -> GemmTile:
    """``tile`` with the most rows, a power of two, that divide symbolic ``rows`` for every T (the
    backward's GEMMs over n_steps * B rows: B's largest power-of-two factor, up to the tile's)."""
    bm = tile.bm
    while bm > 1 and not divides(rows, bm):
        bm //= 2
    return replace(tile, bm=bm, tm=min(tile.tm, bm))


def _schedules(schedule, sch: Schedule, block, *args) -> bool:
    """Whether ``schedule(sch, block, *args)`` succeeds, tried on a schedule of ``sch``'s module as it
    stands (``Schedule.copy`` failed inside TVM on some states): WMMA's padding of a GEMM can leave
    its scope no stage pipeline, and the shared fetch's ``compute_at`` then fails (the reversed loop
    of a cell with a layer norm and clamps, fp16, B=16, H=32), and ``tensorize`` can fail a check
    inside TVM where K is symbolic (the weight gradients' GEMM of GRU's hoisted gates for any T,
    fp16, B=4, H=32): FFMA serves those."""
    trial = Schedule(copy.deepcopy(sch.mod))  # a schedule may rewrite the module it is given in place
    try:
        schedule(trial, trial.get_sblock(sch.get(block).name_hint), *args)
    except (ScheduleError, InternalError):
        return False
    return True
