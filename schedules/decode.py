"""Recipes for compiled greedy decoding (``halstm.models.decoding``).

Its ``main`` has the shape of a cell's sequence function (a ``prologue`` block, a ``step`` block on
row-block views, GEMMs named by the plan), so it is scheduled as the step-loop recipes schedule a cell,
plus what decoding adds: ``pack``, which lays the weights out once; the logits' epilogue (the hoisted
context share and the bias) computed as the vocabulary GEMM writes its tile back, not in a pass of its
own over (B, V); and on CUDA the argmax over the vocabulary, a reduction shared by the threads of a
block (one thread a row would take V serial steps).
"""

from __future__ import annotations

from tvm.s_tir import Schedule

from .cpu import CpuStepLoop, parallel_rows
from .cuda import CudaStepLoop
from .cuda_blocks import bind_flat, bind_reduction
from .cuda_ffma import gemm_tiled, step_tile
from .recipe import child_blocks, inline_elementwise, is_pure_copy, is_reduction, merge_next_states


class CpuGreedyDecode(CpuStepLoop):
    """``cpu-step-loop`` on ``main``; ``pack`` in parallel over its column strips."""

    name = "cpu-greedy-decode"

    def defaults(self, program, target, switches: dict | None = None) -> dict:
        # Panels no taller than the batch: the micro-kernel makes panel // rows row tiles a panel
        # whatever the batch, and at B=32 a 64-row panel left half of its tasks predicated off
        # (31 against 16 ms a token, V=32000).
        knobs = super().defaults(program, target, switches)
        rows = knobs["rows"]
        return {**knobs, "panel": min(knobs["panel"], -(-program.batch // rows) * rows)}

    def apply(self, program, target, **knobs) -> Schedule:
        sch = super().apply(program, target, **knobs)
        for gemm in program.plan.gemms:  # after the micro-kernel: the write-back has cache_write's name
            epilogue = _epilogue(sch, sch.get_sblock(f"{gemm.name}_local"))
            if epilogue is not None:
                sch.reverse_compute_inline(epilogue)
        for block in _packing(sch):
            parallel_rows(sch, block, target.lanes)
        return sch


class CudaGreedyDecode(CudaStepLoop):
    """``cuda-step-loop``'s tiled GEMMs, all with the step's tile (the hoisted ones have B rows too, not
    T * B), and flat elementwise kernels; the argmax one block a row. The embedding lookup is kept out of
    the GEMM until its tile is staged, then read into the tile: inlined into the GEMM, its row index
    ``token[b]`` left the reindexed tile without a row axis at B=1, which the cooperative fetch needs."""

    name = "cuda-greedy-decode"

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        sch = Schedule(program.mod)
        for scope in ("prologue", "step"):
            inline_elementwise(sch, sch.get_sblock(scope), keep={"embedding"})
            gemms, others = child_blocks(sch, scope, program)
            views = {m.buffer.name for m in sch.get(sch.get_sblock(scope)).match_buffers}
            epilogues = [_epilogue(sch, gemm) for gemm in gemms]
            # kept as handles, less those tiling inlines: the lookup (read into the GEMM's tile) and
            # the epilogues (block names repeat across scopes, so they are not found again by name)
            gone = {sch.get_sref(b) for b in epilogues if b is not None}
            others = [b for b in others
                      if sch.get_sref(b) not in gone and not _feeds_tile(sch, b, gemms)]
            for gemm, epilogue in zip(gemms, epilogues):
                gemm_tiled(sch, gemm, step_tile(k, program.batch), views)
                if epilogue is not None:
                    sch.reverse_compute_inline(epilogue)
            for block in merge_next_states(sch, sch.get_sblock(scope), others):
                (bind_reduction if is_reduction(sch, block) else bind_flat)(sch, block, k["threads"])
        for block in _packing(sch):
            bind_flat(sch, block, k["threads"])
        return sch


def _epilogue(sch: Schedule, block):
    """The elementwise block that alone reads ``block``'s result (the logits), or None."""
    consumers = sch.get_consumers(block)
    return consumers[0] if len(consumers) == 1 and not is_reduction(sch, consumers[0]) else None


def _feeds_tile(sch: Schedule, block, gemms) -> bool:
    """A copy read by a GEMM: ``gemm_tiled`` inlines it into the GEMM's staged tile."""
    targets = {sch.get_sref(g) for g in gemms}
    return (any(sch.get_sref(c) in targets for c in sch.get_consumers(block))
            and not is_reduction(sch, block) and is_pure_copy(sch, block))


def _packing(sch: Schedule) -> list:
    """The blocks of ``pack`` with its column selections inlined; the schedule works on it after."""
    sch.work_on("pack")
    root = sch.get_sblock("root")
    inline_elementwise(sch, root)
    return sch.get_child_blocks(root)


def recipe_for(target):
    return CpuGreedyDecode() if target.kind == "cpu" else CudaGreedyDecode()
