"""The backward's reversed time loop, written as a cell of its own.

Backpropagation through time runs a recurrence too: from the adjoints of the states after step t,
D_{t+1}, the step's own math gives those before it, D_t. ``AdjointCell(plan)`` writes that recurrence
as a ``Cell``, derived from the forward cell's expressions by ``halstm.autodiff``, so that whatever
compiles a forward compiles the backward's loop: the planner, the lowering, every recipe (the
persistent kernel, tensor cores, the fused elementwise math), the tuner. Its step k is the forward's
step t = T - 1 - k run backwards::

    dA_g    = [d<g>_0 | d<g>_1 | ...] @ W_g          per first-stage recurrent GEMM g: its operand's
                                                     adjoint at step t + 1 (a GEMM on the states)
    D_{t+1} = d<s>_local + dA through the operand    the states' adjoints after step t
    the forward step t, differentiated from D_{t+1}: the first-stage results' adjoints (the next
    d<g>_j), the states' (plus the loss's gradient g_t: the next d<s>_local). GEMMs of later stages
    are recomputed from the input and pass their adjoints on through GEMMs of their own.

States, each (B, H):
    d<g>_<j>     gate block j of the adjoint of first-stage GEMM g's result at step t
    d<s>_local   the adjoint of state s at step t, all but what flows through those GEMMs' operands
    d<s>         the whole adjoint of s after step t, D_{t+1}, kept for the weights' gradients

The input, one row per batch row and step (``columns``): the hoisted and first-stage GEMMs' results
at step t, the states at t, the states at t + 1 where an operand's adjoint reads them, x_t where the
step reads x outside a matmul, and g_t. ``halstm.backward`` writes it, the steps reversed, with one
step more: its ``d<s>`` are D_0, the initial states' gradients.
"""

from __future__ import annotations

import functools
import itertools
import operator

from tvm import te

from .autodiff import adjoints
from .cell import Cell, Params, placeholders, trace, upstream
from .ops import active_tracer, concat, matmul, plain_matmul
from .plan import Plan


class AdjointCell(Cell):
    """The reversed loop of ``plan.cell``'s backward (module docstring). ``columns``: (name, width) of
    its input's column groups in order, ``where``: each one's (first column, width)."""

    output = None  # set per instance: the first state

    def __init__(self, plan: Plan, gathered: bool = True):
        cell, H = plan.cell, plan.cell.hidden_size
        self.forward, self.gathered = plan, gathered
        self.first = [g for g in plan.step_gemms if g.stage == 1]
        for g in self.first:
            if g.rows % H:
                raise NotImplementedError(
                    f"{cell.name}: the backward needs a recurrent matmul's columns to be whole multiples of "
                    f"hidden_size ({H}); {g.name} has {g.rows}")
        self.later = [g for g in plan.step_gemms if g.stage > 1]
        weights = {m.weight for m in plan.matmuls}
        later_weights = {m.weight for g in self.later for m in g.members}
        self.elementwise = [n for n in cell.parameters() if n not in weights or n in later_weights]
        self.states = (tuple(f"d{g.name}_{j}" for g in self.first for j in range(g.rows // H))
                       + tuple(f"d{s}_local" for s in cell.states) + tuple(f"d{s}" for s in cell.states))
        self.output = self.states[0]
        self.biases = ()
        self.reads_next = self._reads_next_states()
        self.summed = self._summed_results()
        self.columns = self._columns()
        starts = itertools.accumulate((w for _, w in self.columns), initial=0)
        self.where = {name: (start, width) for (name, width), start in zip(self.columns, starts)}
        super().__init__(sum(w for _, w in self.columns), H)

    @property
    def name(self) -> str:
        return f"{self.forward.cell.name}Adjoint"

    def _columns(self) -> list[tuple[str, int]]:
        """(name, width) of the input's columns, in order."""
        cell, H = self.forward.cell, self.forward.cell.hidden_size
        out = [(g.name, g.rows) for g in self.forward.gemms if g.stage <= 1 and g.name not in self.summed]
        out += [(s, H) for s in cell.states]
        if self.reads_next:
            out += [(f"{s}_next", H) for s in cell.states]
        if self.forward.x_in_step:
            out.append(("x", cell.input_size))
        return out + [(f"g{s}", H) for s in cell.states]

    def parameters(self):
        shapes = self.forward.cell.parameters()
        out = {n: shapes[n] for n in self.elementwise}
        out |= {name: (g.depth, width) for name, (g, _, width) in self.transposed().items()}
        out |= {f"{m.weight}_t": (m.depth, m.rows) for g in self.later for m in g.members}
        return out

    def transposed(self) -> dict:
        """The weights of the operands' adjoints by parameter name: (first-stage GEMM, its first
        column, columns), its stacked weights transposed; with ``gathered`` one a GEMM (its
        operand the gate blocks side by side), else one a gate block (a GEMM each, its operand a
        state as stored)."""
        H = self.forward.cell.hidden_size
        if self.gathered:
            return {f"{g.name}_t": (g, 0, g.rows) for g in self.first}
        return {f"{g.name}_t{j}": (g, j * H, H) for g in self.first for j in range(g.rows // H)}

    def step(self, p, x, *states):
        cell, H = self.forward.cell, self.forward.cell.hidden_size
        n_first = sum(g.rows // H for g in self.first)
        d_gemm, local = states[:n_first], states[n_first:n_first + len(cell.states)]

        def column(name):
            start, width = self.where[name]
            return te.compute((x.shape[0], width), lambda b, n: x[b, start + n], name=f"in_{name}")

        # the first-stage GEMMs' operands' adjoints, from the last step's result adjoints
        d_operand, start = {}, 0
        for g in self.first:
            blocks = d_gemm[start:start + g.rows // H]
            start += g.rows // H
            if self.gathered:
                d_operand[g.name] = matmul(concat(*blocks) if len(blocks) > 1 else blocks[0], p[f"{g.name}_t"])
            else:
                d_operand[g.name] = functools.reduce(operator.add, (matmul(b, p[f"{g.name}_t{j}"])
                                                                    for j, b in enumerate(blocks)))
        nexts = [column(f"{s}_next") if self.reads_next else s_local for s, s_local in zip(cell.states, local)]
        d_next = _add(local, self._through_operands(nexts, d_operand, p))

        # the forward step t from its input row, differentiated from D_{t+1}
        given = {g.name: zeros(x.shape[0], g.rows, g.name) if g.name in self.summed else column(g.name)
                 for g in self.forward.gemms if g.stage <= 1}
        now = [column(s) for s in cell.states]
        x_t = column("x") if self.forward.x_in_step else _unread_x(cell, x.shape[0])
        tracer = _Recompute(self.forward, given, p)
        traced = trace(cell, x_t, now, self._forward_params(p), tracer)
        results = [given[g.name] for g in self.first]
        found = adjoints(traced.next_states, d_next, [*results, *now], tracer.rules, tracer.reads)
        d_results, d_states = found[:len(results)], found[len(results):]
        out = []
        for g, d in zip(self.first, d_results):
            out += [_zero_or_columns(d, x.shape[0], j * H, H, f"d{g.name}_{j}") for j in range(g.rows // H)]
        gradients = [column(f"g{s}") for s in cell.states]
        out += _add(gradients, d_states)
        return out + d_next

    def _through_operands(self, states, d_operand: dict, p) -> list:
        """The first-stage GEMMs' operands, traced on ``states``, differentiated from ``d_operand``:
        each state's share (None where it has none)."""
        tracer = _Operands(self.forward)
        trace(self.forward.cell, _unread_x(self.forward.cell, states[0].shape[0]), list(states),
              self._forward_params(p), tracer)
        gemms = [g for g in self.first if g.name in tracer.operands]
        return adjoints([tracer.operands[g.name] for g in gemms], [d_operand[g.name] for g in gemms], list(states))

    def _forward_params(self, p) -> Params:
        """The forward cell's parameters for a trace in the step: the adjoint's where it has them,
        placeholders for the matmul weights whose results come from the input."""
        return Params({n: p[n] if n in p else te.placeholder(tuple(shape), "float32", name=n)
                       for n, shape in self.forward.cell.parameters().items()})

    def _summed_results(self) -> dict[str, str]:
        """Hoisted GEMM results that the step reads only added to a first-stage GEMM's result (LSTM's
        input and recurrent gates), by name: that first-stage GEMM's name. Their adjoints are then
        one tensor, and every value the step computes depends on their sum alone: the input holds
        the sum in the first-stage result's columns (``summed_into``), and the hoisted result reads as
        zeros (LSTM: 8 columns of H a row, not 12)."""
        cell, H = self.forward.cell, self.forward.cell.hidden_size
        gemms = [g for g in self.forward.gemms if g.stage <= 1]
        given = {g.name: te.placeholder((1, g.rows), "float32", name=g.name) for g in gemms}
        x, states, params = placeholders(cell, 1)
        params = Params(params | {f"{m.weight}_t": te.placeholder((m.depth, m.rows), "float32", name=f"{m.weight}_t")
                                  for g in self.later for m in g.members})
        tracer = _Recompute(self.forward, given, params)
        traced = trace(cell, x, states, params, tracer)
        seeds = [te.placeholder((1, H), "float32", name=f"d{s}") for s in cell.states]
        found = dict(zip(given, adjoints(traced.next_states, seeds, list(given.values()), tracer.rules, tracer.reads)))
        summed = {}
        for h in (g for g in gemms if g.stage == 0 and found[g.name] is not None):
            partner = next((g for g in self.first if g.rows == h.rows and g.name not in summed.values()
                            and found[g.name] is not None and found[g.name].same_as(found[h.name])), None)
            if partner is not None:
                summed[h.name] = partner.name
        return summed

    def summed_into(self, name: str) -> list[str]:
        """The GEMM results whose sum the input's columns of first-stage GEMM ``name`` hold."""
        return [name, *(h for h, g in self.summed.items() if g == name)]

    def _reads_next_states(self) -> bool:
        """Whether an operand's adjoint reads the states' values (it is not linear in them)."""
        cell = self.forward.cell
        x, states, params = placeholders(cell, 1)
        tracer = _Operands(self.forward)
        trace(cell, x, states, params, tracer)
        gemms = [g for g in self.first if g.name in tracer.operands]
        seeds = [te.placeholder((1, g.depth), "float32", name=f"d{g.name}") for g in gemms]
        found = adjoints([tracer.operands[g.name] for g in gemms], seeds, states)
        reads = set().union(*(upstream(d) for d in found if d is not None))
        if x.op in reads:
            raise NotImplementedError(f"{cell.name}: a recurrent matmul's operand multiplies x with a state; "
                                      "its backward is not derived")
        return any(s.op in reads for s in states)


class _Recompute:
    """Answers the forward's matmuls in the adjoint's step: first-stage and hoisted GEMMs with their
    results' columns from the input (``given``), later stages recomputed as matmuls of the adjoint's
    own, each with a ``rule`` passing its result's adjoint to its operand through the transposed
    weights (``reads``: the operand each such result stands for)."""

    def __init__(self, plan: Plan, given: dict, p):
        self.plan, self.given, self.p, self.calls, self.rules, self.reads = plan, given, p, 0, {}, {}
        self.outer = active_tracer()

    def matmul(self, a, weight):
        m = self.plan.matmuls[self.calls]
        self.calls += 1
        g = self.plan.gemm_of(m.index)
        if g.stage <= 1:
            start = g.offset(m)
            return te.compute((a.shape[0], m.rows), lambda b, n: self.given[g.name][b, start + n],
                              name=f"{g.name}_{m.weight}")
        result = self.outer.matmul(a, weight) if self.outer else plain_matmul(a, weight)
        transposed = self.p[f"{m.weight}_t"]
        self.rules[result.op] = lambda d, a=a, w=transposed: [(a, matmul(d, w))]
        self.reads[result.op] = [a]  # hoisted by the adjoint's planner: its result may be read, not computed
        return result


class _Operands:
    """Records the first-stage GEMMs' operands of a trace (by GEMM name), answering every matmul with
    zeros."""

    def __init__(self, plan: Plan):
        self.plan, self.calls, self.operands = plan, 0, {}

    def matmul(self, a, weight):
        m = self.plan.matmuls[self.calls]
        self.calls += 1
        g = self.plan.gemm_of(m.index)
        if g.stage == 1:
            self.operands.setdefault(g.name, a)
        return te.compute((a.shape[0], m.rows), lambda *i: te.const(0.0, "float32"), name=f"unused_{m.weight}")


def _unread_x(cell: Cell, batch) -> te.Tensor:
    """Zeros in x's place for a trace whose math does not read x (its matmuls of x are answered
    otherwise)."""
    return te.compute((batch, cell.input_size), lambda *i: te.const(0.0, "float32"), name="x_unread")


def _add(tensors, terms) -> list:
    """Each tensor plus its term (None: none)."""
    def total(t, d):
        return te.compute(t.shape, lambda *i: t(*i) + d(*i), name=f"{t.op.name}_total")

    return [t if d is None else total(t, d) for t, d in zip(tensors, terms)]


def zeros(batch, width: int, name: str) -> te.Tensor:
    return te.compute((batch, width), lambda *i: te.const(0.0, "float32"), name=name)


def _zero_or_columns(t, batch, start: int, width: int, name: str) -> te.Tensor:
    if t is None:
        return zeros(batch, width, name)
    return te.compute((t.shape[0], width), lambda b, n: t[b, start + n], name=name)
