"""The backward's plan: the forward's GEMMs and those the backward adds (``GradGemm``), which of
them each of its functions computes, and the adjoint cell of its reversed loop."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from tvm import te

from ..adjoint import AdjointCell
from ..cell import Cell, upstream
from ..layout import PackedLayout
from ..lowering import trace_step
from ..plan import Gemm, Plan, make_plan


@dataclass(frozen=True)
class GradGemm:
    """A GEMM of the backward: ``name = left @ right``, giving ``gives``; ``rows`` is its result's
    width and ``depth`` its K, as for a forward ``Gemm``: an operand's adjoint sums over the forward
    GEMM's N; a weight's adjoint over the sequence's T * B rows, which the plan does not know (0)."""

    name: str
    left: str
    right: str
    gives: str
    rows: int
    depth: int

    def __str__(self):
        return f"{self.name} = {self.left} @ {self.right} -> {self.gives}"


@dataclass
class BackwardPlan:
    """The forward's plan and the GEMMs the backward adds to it; ``gathered``: the form of the
    adjoint cell's operand GEMMs (``AdjointCell``); ``exact_weights``: see ``between_dtype``."""

    forward: Plan
    gathered: bool = True
    exact_weights: bool = False  # the weight gradients' GEMM operands in float32 whatever the dtype
    tf32: bool = False  # those operands rounded to TF32 (``weight_operand``)
    given_hoisted: bool = False  # the hoisted GEMMs' results are arguments: the forward's, kept
    given_results: bool = False  # so are the first stage's (``lowering.kept_results``)

    @property
    def cell(self) -> Cell:
        return self.forward.cell

    @property
    def recurrent(self) -> list[Gemm]:
        return [g for g in self.forward.gemms if g.stage > 0]

    @functools.cached_property
    def state_operands(self) -> dict[str, str]:
        """Recurrent GEMMs whose operand is a state as it is (LSTM's and GRU's h), by name: that
        state. weights reads its sequence; rows stores the other recurrent GEMMs' operands
        (``a_<gemm>_seq``)."""
        step = trace_step(self.forward, 1, "float32", PackedLayout(), autodiff=True)
        names = {t.op: s for s, t in zip(self.cell.states, step.states)}
        return {g.name: names[step.operands[g.name].op] for g in self.recurrent if step.operands[g.name].op in names}

    @property
    def stored_operands(self) -> list[Gemm]:
        """The recurrent GEMMs whose operands rows stores for weights (``state_operands``' aside)."""
        return [g for g in self.recurrent if g.name not in self.state_operands]

    @property
    def rows_operands(self) -> list[Gemm]:
        """The recurrent GEMMs whose operands' adjoints the rows function computes: the later stages'
        (they pass adjoints on to earlier results), and the first stage's where the operand reads x
        or a parameter (its adjoint into the states is the reversed loop's)."""
        return [g for g in self.recurrent
                if g.stage > 1 or any(isinstance(op, te.PlaceholderOp) and op.name not in self.cell.states
                                      for op in upstream(g.operand))]

    @property
    def each_step(self) -> list[GradGemm]:
        return [_operand_adjoint(g) for g in self.rows_operands]

    @property
    def after_loop(self) -> list[GradGemm]:
        return [_weight_adjoint(g) for g in self.forward.gemms] + [_operand_adjoint(g) for g in self.forward.hoisted]

    @functools.cached_property
    def adjoint(self) -> AdjointCell:
        return AdjointCell(self.forward, self.gathered)

    def prepare_plan(self) -> Plan:
        """The prepare function's GEMMs: the hoisted ones in its prologue (unless given), the first
        stage's in its step."""
        hoisted = [] if self.given_hoisted else self.forward.hoisted
        return Plan(self.cell, self.forward.matmuls, hoisted, [] if self.given_results else self.forward.stages[:1])

    def rows_plan(self) -> Plan:
        """The rows function's GEMMs as recipes read a plan: the forward's later stages and the
        operands' adjoints in its step (the hoisted and first-stage GEMMs' results it reads from the
        reversed loop's input)."""
        return Plan(self.cell, self.forward.matmuls, [], [*self.forward.stages[1:], self.each_step],
                    self.forward.x_in_step)

    def weights_plan(self) -> Plan:
        """The weights function's GEMMs, all in its step."""
        return Plan(self.cell, [], [], [self.after_loop])

    def __str__(self):
        given = [g for g in self.forward.gemms
                 if g.stage == 0 and self.given_hoisted or g.stage == 1 and self.given_results]
        recomputed = ", ".join(g.name for g in self.forward.gemms if g.stage <= 1 and g not in given)
        given = ", ".join(g.name for g in given)
        read = ", ".join(g.name for g in self.forward.gemms if g.stage <= 1 and g.name not in self.adjoint.summed)
        lines = [f"backward plan for {self.cell!r}",
                 "  prepare, over all T*B rows: " + (f"{given} given (the forward's); " if given else "")
                 + (f"{recomputed} recomputed; " if recomputed else "") + "the adjoint cell's input, steps reversed"
                 + "".join(f" ({h} + {g} as one sum)" for h, g in self.adjoint.summed.items()),
                 "  the reversed time loop (T + 1 steps), compiled as a cell: "
                 + str(make_plan(self.adjoint)).replace("\n", "\n  "),
                 f"  rows, over all T*B rows: {read} read from the adjoint cell's input"
                 + (", the later stages' GEMMs recomputed" if len(self.forward.stages) > 1 else "")
                 + "; the step's adjoints from D_{t+1}"
                 + (", with" if self.each_step else "")]
        lines += [f"    {g}" for g in self.each_step]
        if self.forward.x_in_step:
            lines.append("    d x_t, the adjoint of the step's own read of x -> dx_seq")
        lines.append("  weights, over all T*B rows:")
        lines += [f"    {g}" for g in self.after_loop]
        if self.forward.x_in_step:
            lines.append("    d x += dx_seq (the steps' own reads of x)")
        return "\n".join(lines)


def _weights_of(g: Gemm) -> str:
    return "[" + " | ".join(m.weight for m in g.members) + "]"


def _operand_adjoint(g: Gemm) -> GradGemm:
    return GradGemm(f"grad_a_{g.name}", f"d{g.name}", _weights_of(g), f"d {g.operand.op.name}", g.depth, g.rows)


def _weight_adjoint(g: Gemm) -> GradGemm:
    return GradGemm(f"grad_w_{g.name}", f"d{g.name}^T", g.operand.op.name, f"d {_weights_of(g)}", g.depth, 0)
