"""The planner: reads a traced cell and decides how its matmuls run.

From the expressions alone it finds
  - matmuls whose operand depends only on x and parameters: hoisted out of the time loop, computed
    as one GEMM over all T*B rows before it;
  - recurrent matmuls that share an operand: combined into one GEMM over their weights packed
    contiguously;
  - the order they must wait for each other: a matmul whose operand needs another recurrent
    matmul's result runs in a later stage of the step.
Between stages, and after the last, the elementwise math fuses into one block. ``print(plan)``
shows what was decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import te

from .cell import Cell, placeholders, trace, upstream
from .diagonal import Diagonal, classify
from .ops import plain_matmul


@dataclass
class Matmul:
    """One ``matmul(operand, weight)`` call of the cell, by call order."""

    index: int
    operand: te.Tensor
    weight: str
    rows: int  # N: rows of the weight, columns of the result
    depth: int  # K
    result: te.Tensor


@dataclass
class Gemm:
    """Matmuls sharing an operand, run as one GEMM over their weights stacked in call order."""

    name: str
    stage: int  # 0: hoisted out of the time loop; s >= 1: stage s of each step
    operand: te.Tensor
    members: list[Matmul] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return sum(m.rows for m in self.members)

    @property
    def depth(self) -> int:
        return self.members[0].depth

    def offset(self, m: Matmul) -> int:
        """Where matmul m's columns start in the GEMM's result."""
        start = 0
        for member in self.members:
            if member.index == m.index:
                return start
            start += member.rows
        raise KeyError(m.index)


@dataclass
class Plan:
    cell: Cell
    matmuls: list[Matmul]
    hoisted: list[Gemm]
    stages: list[list[Gemm]]
    x_in_step: bool = False  # the step's math reads x itself, not only through the hoisted matmuls
    diagonal: Diagonal = Diagonal(reason="not classified")  # which states recur as a(x) * s + b(x)

    @property
    def step_gemms(self) -> list[Gemm]:
        """The GEMMs of the steps, stage by stage (the hoisted ones not among them)."""
        return [g for stage in self.stages for g in stage]

    @property
    def gemms(self) -> list[Gemm]:
        return self.hoisted + self.step_gemms

    def gemm_of(self, index: int) -> Gemm:
        return next(g for g in self.gemms if any(m.index == index for m in g.members))

    def __str__(self):
        # the backward's plans (halstm.backward) also hold its GradGemms, which print themselves
        def describe(g) -> str:
            if not isinstance(g, Gemm):
                return str(g)
            weights = " | ".join(m.weight for m in g.members)
            return f"{g.name} = {g.operand.op.name} @ [{weights}]^T  (N={g.rows}, K={g.depth})"

        def operand(g) -> str:
            return g.operand.op.name if isinstance(g, Gemm) else g.left

        lines = [f"plan for {self.cell!r}"]
        if self.hoisted:
            lines.append("  before the time loop, one GEMM over all T*B rows each:")
            lines += [f"    {describe(g)}" for g in self.hoisted]
        lines.append("  each step:")
        for s, stage in enumerate(self.stages, 1):
            lines += [f"    stage {s}: {describe(g)}" for g in stage]
            later = [operand(g) for g in self.stages[s]] if s < len(self.stages) else []
            made = ", ".join(later) if later else "next " + ", ".join(self.cell.states)
            lines.append(f"             then one fused elementwise block -> {made}")
        if not self.stages:
            lines.append("    one fused elementwise block -> next " + ", ".join(self.cell.states))
        if self.x_in_step:
            lines.append("  the elementwise math reads the step's rows of x too")
        lines.append(str(self.diagonal))
        return "\n".join(lines)


class _RecordingTracer:
    """Makes plain matmuls and records each call for the planner."""

    def __init__(self):
        self.calls: list[Matmul] = []

    def matmul(self, a, weight):
        result = plain_matmul(a, weight)
        rows, depth = (int(d) for d in weight.shape)
        self.calls.append(Matmul(len(self.calls), a, weight.op.name, rows, depth, result))
        return result


def make_plan(cell: Cell) -> Plan:
    """Trace ``cell`` and plan its matmuls."""
    tracer = _RecordingTracer()
    traced = trace(cell, *placeholders(cell, batch=1), tracer=tracer)
    calls = tracer.calls
    state_ops = {s.op for s in traced.states}
    result_op = {m.result.op: m for m in calls}

    stage: dict[int, int] = {}
    for m in calls:  # call order is a topological order: an operand is built before it is used
        up = upstream(m.operand)
        if up & state_ops:
            stage[m.index] = 1 + max((stage[result_op[op].index] for op in up if op in result_op), default=0)
        else:
            stage[m.index] = 0

    gemms: list[Gemm] = []
    count = {"x_proj": 0, "gemm": 0}
    for m in calls:
        s = stage[m.index]
        group = next((g for g in gemms if g.stage == s and g.operand.same_as(m.operand)), None)
        if group is None:
            kind = "x_proj" if s == 0 else "gemm"
            group = Gemm(f"{kind}{count[kind]}", s, m.operand)
            count[kind] += 1
            gemms.append(group)
        group.members.append(m)

    depth = max((g.stage for g in gemms), default=0)
    hoisted_results = frozenset(m.result.op for m in calls if stage[m.index] == 0)
    plan = Plan(
        cell,
        calls,
        hoisted=[g for g in gemms if g.stage == 0],
        stages=[[g for g in gemms if g.stage == s] for s in range(1, depth + 1)],
        x_in_step=any(traced.x.op in upstream(t, hoisted_results) for t in traced.next_states),
    )
    plan.diagonal = classify(traced, plan)
    return plan
