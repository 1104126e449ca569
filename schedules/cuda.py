"""CUDA step-loop recipe: the hoisted GEMM once, then per step one GEMM kernel and one fused
elementwise kernel per stage, launched from the compiled host loop over t (no Python per step).

GEMMs: one thread per output element, accumulating in a register, K walked in unrolled chunks;
consecutive threads take consecutive columns, so reads of the packed (K, N) weights coalesce.
"""

from __future__ import annotations

from tvm.s_tir import Schedule

from .recipe import Recipe, child_blocks, inline_elementwise


class CudaStepLoop(Recipe):
    name = "cuda-step-loop"
    knobs = {"threads": (128, 256, 64), "k_chunk": (16, 32, 8)}

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cuda"

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        sch = Schedule(program.mod)
        for scope in ("prologue", "step"):
            inline_elementwise(sch, sch.get_sblock(scope))
            gemms, elementwise = child_blocks(sch, scope)
            for gemm in gemms:
                _gemm_tiles(sch, gemm, k["threads"], k["k_chunk"])
            for block in elementwise:
                _bind_flat(sch, block, k["threads"])
        return sch


def _gemm_tiles(sch: Schedule, block, threads: int, k_chunk: int) -> None:
    """One thread per output element, columns across threads."""
    b, n, k = sch.get_loops(block)
    n_block, n_thread = sch.split(n, [None, threads])
    k_outer, k_inner = sch.split(k, [None, k_chunk])
    sch.reorder(b, n_block, n_thread, k_outer, k_inner)
    sch.bind(sch.fuse(b, n_block), "blockIdx.x")
    sch.bind(n_thread, "threadIdx.x")
    acc = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(acc, n_thread)
    sch.unroll(k_inner)
    sch.decompose_reduction(block, k_outer)


def _bind_flat(sch: Schedule, block, threads: int) -> None:
    fused = sch.fuse(*sch.get_loops(block))
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
