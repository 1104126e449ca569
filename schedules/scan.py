"""Scan recipes: a diagonal cell's sequence as a parallel scan over T (``halstm.scan``).

They apply where the planner found the step diagonal (``Plan.diagonal``: every state that recurs is
a(x) * s + b(x), elementwise) and build the scan's function instead of the lowering's time loop::

    prologue        the hoisted GEMMs, as the target's step loop (CPU) or persistent kernel (CUDA) runs them
    first, derived  the states computed from x and the scanned states: elementwise over all T*B rows
    scan            the coefficients' math inlined into the scan passes, which run
                      CPU   tasks over rows x vectors of units (x chunks), SIMD along the units
                      CUDA  a thread an element (and chunk), consecutive threads consecutive units

Knob ``chunk``: the steps a pass runs serially (0: all T, one pass). On a GPU the chunks are the
parallelism: B*H elements alone are too few threads to keep the memory system busy.
"""

from __future__ import annotations

import tvm
from tvm.s_tir import Schedule

from halstm.layout import PackedLayout
from halstm.scan import fuses, scan_source

from .cpu import CpuStepLoop
from .cuda_blocks import bind_flat
from .cuda_persistent import CudaPersistent, hoisted_knobs_matter, schedule_prologue, step_loop_defaults
from .recipe import Recipe, inline_elementwise, merge_next_states


def scans(program) -> bool:
    return program.plan.diagonal.scans


def _scan_function(program, chunk: int, lanes: int = 1, group: int | None = None) -> Schedule:
    return Schedule(tvm.IRModule({"main": tvm.script.from_source(scan_source(program, chunk, lanes, group))}))


def _passes(sch: Schedule) -> list:
    """The scan passes' blocks, in order: those of the scan's scope whose body runs a loop (the
    coefficients' blocks each store one value). Each keeps its running value in a local buffer of
    its own, which TVM 0.27 counts among the block's reads and writes once a producer is inlined into
    it: a block reading what it writes is not "complete", and parallel, vectorize and bind then refuse
    its loops. They are scheduled first."""
    return [b for b in sch.get_child_blocks(sch.get_sblock("scan"))
            if not isinstance(sch.get(b).body, tvm.tirx.BufferStore)]


def _elementwise_scopes(program, chunk: int) -> list[str]:
    """The scopes of elementwise math over all rows, besides the scan's."""
    d = program.plan.diagonal
    return ((["initial"] if d.first or d.derived else []) + (["first"] if d.first else [])
            + ([] if fuses(program, chunk) else ["coefficients"]) + (["derived"] if d.derived else []))


class CpuScan(CpuStepLoop):
    """The scan on the CPU. Knobs: ``chunk``; ``units`` a task runs (each step it reads that many
    consecutive units of a row; ``defaults`` has the figures); the step loop's for the hoisted GEMM."""

    name = "cpu-scan"
    knobs = {"chunk": (0, 64, 256), "units": (1024, 256, 64), **CpuStepLoop.knobs}

    def defaults(self, program, target, switches: dict | None = None) -> dict:
        """The most units a task that still give every core one. MinGRU (4096,8,1024) with I=64 (its
        GEMM small), 2-core CPU, ms in two rounds: 1024 units 67, 90; 256 108, 138; 16 132, 174; the
        step loop 89, 94."""
        k = super().defaults(program, target, switches)
        H, cores = program.cell.hidden_size, getattr(target, "cores", 1)
        k["units"] = next((u for u in self.knobs["units"] if program.batch * -(-H // u) >= cores),
                          min(self.knobs["units"]))
        return k

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cpu" and scans(program)

    def valid(self, program, target, knobs) -> bool:
        return (super().valid(program, target, knobs) and (knobs["chunk"] == 0 or program.longest > knobs["chunk"])
                and _group(program, target, knobs) == min(knobs["units"], program.cell.hidden_size))

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        H = program.cell.hidden_size
        lanes = target.lanes if H % target.lanes == 0 else 1
        sch = _scan_function(program, k["chunk"], lanes, _group(program, target, k))
        self.schedule_scope(sch, "prologue", program, target, k)
        for scope in _elementwise_scopes(program, k["chunk"]):
            self.schedule_scope(sch, scope, program, target, k)
        passes = {sch.get(b).name_hint for b in _passes(sch)}
        for block in _passes(sch):  # before the coefficients inline into them (see _passes)
            _tasks(sch, block)
        self.schedule_scope(sch, "scan", program, target, k, apart=passes)
        return sch


def _group(program, target, knobs) -> int:
    """The units of a task: the knob's where they are whole vectors dividing H, else the most
    vectors up to it that divide H, else one unit (H not whole vectors)."""
    H, lanes = program.cell.hidden_size, target.lanes
    if H % lanes:
        return 1
    return max(g for g in range(lanes, min(knobs["units"], H) + 1, lanes) if H % g == 0)


def _tasks(sch: Schedule, block) -> None:
    """A scan pass's blocks (an element or a vector of units each) as tasks across cores."""
    sch.parallel(sch.fuse(*sch.get_loops(block)))


class CudaScan(Recipe):
    """The scan on CUDA. Knobs: ``chunk``; ``threads`` a block of the scan's passes and elementwise
    blocks; ``tc_hoisted_frags``, ``wgmma`` for the hoisted GEMM, as the persistent kernel's."""

    name = "cuda-scan"
    # chunk, MinGRU (4096,8,1024) on an H200, prepared ms fp32 / bf16: 16 1.72 / 0.49, 64 1.69 / 0.45,
    # 256 1.62 / 0.44, 0 (serial) 1.81 / 0.89; 64 the default, whole chunks from T = 64 on
    knobs = {"chunk": (64, 32, 128, 256, 0), "threads": (256, 128, 512),
             "tc_hoisted_frags": CudaPersistent.knobs["tc_hoisted_frags"], "wgmma": CudaPersistent.knobs["wgmma"]}
    switches = ("wgmma",)

    def is_applicable(self, program, target) -> bool:
        return target.kind == "cuda" and scans(program)

    def defaults(self, program, target, switches: dict | None = None) -> dict:
        k = super().defaults(program, target, switches)
        k["tc_hoisted_frags"] = step_loop_defaults(program, target, k["wgmma"])["tc_hoisted_frags"]
        return k

    def layout(self, program, target, knobs) -> PackedLayout:
        return CudaPersistent().layout(program, target, knobs)

    def valid(self, program, target, knobs) -> bool:
        return (knobs["chunk"] == 0 or program.longest > knobs["chunk"]) and hoisted_knobs_matter(self, program, target,
                                                                                                  knobs)

    def apply(self, program, target, **knobs) -> Schedule:
        k = self.resolve(program, target, knobs)
        sch = _scan_function(program, k["chunk"])
        schedule_prologue(sch, program, target, k)
        passes = {sch.get(b).name_hint for b in _passes(sch)}
        for block in _passes(sch):  # before the coefficients inline into them (see _passes)
            bind_flat(sch, block, k["threads"])
        for scope in [*_elementwise_scopes(program, k["chunk"]), "scan"]:
            inline_elementwise(sch, sch.get_sblock(scope), passes)
            blocks = [b for b in sch.get_child_blocks(sch.get_sblock(scope)) if sch.get(b).name_hint not in passes]
            for block in merge_next_states(sch, sch.get_sblock(scope), blocks):
                bind_flat(sch, block, k["threads"])
        return sch
