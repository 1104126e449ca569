"""Diagonal recurrences: which states of a step recur as s' = a(x) * s + b(x).

Such a state's whole sequence is a linear recurrence with coefficients known before the time loop,
so it can run as a parallel scan over T (``schedules.scan``) instead of T dependent steps. Found
from the step's expressions alone:

  first     s' reads no state: computed from x for all T*B rows before the scan (the adjoint of
            an SRU's h, which its step never reads);
  scanned   s' is affine in s, elementwise (element (r, j) of s' reads element (r, j) of s), and
            neither coefficient reads a state but the first ones;
  derived   s' reads no state but the scanned and first ones (an SRU's h from its c'); computed
            for all T*B rows at once after the scan.

``split_affine(t, s)`` takes an expression t apart into a and b; ``classify(trace, plan)`` says which
states scan, or why the step is not a scan (``Diagonal.reason``), which ``print(plan)`` shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import te, tirx

from .autodiff import children, is_load, rebuild
from .cell import upstream
from .ops import same_extent

_ADDITIVE = {"Add", "Sub"}


class NotAffine(Exception):
    """Why an expression is not a(x) * s + b(x) in a state s."""


@dataclass(frozen=True)
class Diagonal:
    """The states that scan and those computed after them; ``reason`` why the step does not scan
    (None where it does)."""

    first: tuple[str, ...] = ()
    scanned: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()
    reason: str | None = None

    @property
    def scans(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        if not self.scans:
            return f"  no parallel scan over T: {self.reason}"
        lines = ["  the states recur diagonally, a parallel scan over T:"]
        if self.first:
            lines.append(f"    first {', '.join(self.first)} from x alone, over all T*B rows")
        lines.append(f"    {', '.join(self.scanned)} = a * itself + b, elementwise, a and b from x")
        if self.derived:
            lines.append(f"    then {', '.join(self.derived)} from x and the scanned states, over all T*B rows")
        return "\n".join(lines)


def classify(trace, plan) -> Diagonal:
    """Which states of ``trace`` (``cell.trace`` of plan.cell) scan and which follow from them."""
    if plan.stages:
        g = plan.step_gemms[0]
        return Diagonal(reason=f"a state feeds a matmul ({g.name} = {g.operand.op.name} @ ...), "
                               f"which mixes its elements")
    names = list(plan.cell.states)
    ops = {s.op: n for n, s in zip(names, trace.states)}
    reads = {n: {ops[op] for op in upstream(t) if op in ops} for n, t in zip(names, trace.next_states)}
    first = [n for n in names if not reads[n]]
    scanned, why = [], {}
    for n, s, t in zip(names, trace.states, trace.next_states):
        if n not in reads[n]:
            continue
        try:
            a, b = split_affine(t, s)
        except NotAffine as e:
            why[n] = str(e)
            continue
        stray = sorted({ops[op] for c in (a, b) if c is not None for op in upstream(c) if op in ops} - set(first))
        if stray:
            why[n] = f"{n}' = a * {n} + b with a or b reading state(s) {', '.join(stray)}"
        else:
            scanned.append(n)
    derived = [n for n in names if n not in scanned and n not in first]
    for n in derived:
        if n in why:
            return Diagonal(reason=why[n])
        others = sorted(reads[n] - set(scanned) - set(first))
        if others:
            return Diagonal(reason=f"{n}' reads {', '.join(others)}, which is not a(x) * itself + b(x)")
    if not scanned:
        return Diagonal(reason="no state reads itself")
    return Diagonal(tuple(first), tuple(scanned), tuple(derived))


def split_affine(t: te.Tensor, s: te.Tensor) -> tuple[te.Tensor | None, te.Tensor | None]:
    """(a, b) with t = a * s + b elementwise, each a tensor of t's shape or None (zero); raises
    ``NotAffine`` naming the compute that is not. a and b may read other tensors, states among them:
    the caller checks what they read."""
    depends = _depending(t, s.op)
    made = {}

    def parts(u: te.Tensor):
        if u.op.same_as(s.op):
            return te.compute(u.shape, lambda *i: tirx.const(1.0, u.dtype), name=f"{s.op.name}_one"), None
        if u.op not in made:
            made[u.op] = _split_compute(u, s, depends, parts)
        return made[u.op]

    return parts(t)


def _split_compute(u: te.Tensor, s: te.Tensor, depends: set, parts):
    op = u.op
    name = op.name
    if not isinstance(op, te.ComputeOp) or op.num_outputs != 1 or type(op.body[0]).__name__ == "Reduce":
        raise NotAffine(f"'{name}' is not elementwise in {s.op.name} (a reduction or another op)")
    if len(op.axis) != len(s.shape) or not all(map(same_extent, u.shape, s.shape)):
        raise NotAffine(f"'{name}' has shape {tuple(u.shape)}, not {s.op.name}'s: it mixes its elements")
    axes = [iv.var for iv in op.axis]

    def linear(e):
        """(a, b) expressions of e = a * s + b in the op's axes; None for zero."""
        if not _reads_any(e, depends):
            return None, e
        kind = type(e).__name__
        if is_load(e):
            tensor, index = e.args[0], e.args[1:]
            if len(index) != len(axes) or not all(i.same_as(v) for i, v in zip(index, axes)):
                raise NotAffine(f"'{name}' reads {tensor.op.name} at other than its own element")
            if tensor.op.same_as(s.op):
                return tirx.const(1.0, s.dtype), None
            a, b = parts(tensor)
            return (None if a is None else a(*axes)), (None if b is None else b(*axes))
        if kind in _ADDITIVE:
            (a1, b1), (a2, b2) = linear(e.a), linear(e.b)
            if kind == "Sub":
                a2, b2 = _negate(a2), _negate(b2)
            return _plus(a1, a2), _plus(b1, b2)
        if kind == "Mul":
            (a1, b1), (a2, b2) = linear(e.a), linear(e.b)
            if a1 is not None and a2 is not None:
                raise NotAffine(f"'{name}' multiplies two values that depend on {s.op.name}")
            a, k, b = (a1, b2, b1) if a1 is not None else (a2, b1, b2)
            return a * k, (None if b is None else b * k)
        if kind == "Div":
            if _reads_any(e.b, depends):
                raise NotAffine(f"'{name}' divides by a value that depends on {s.op.name}")
            a, b = linear(e.a)
            return a / e.b, (None if b is None else b / e.b)
        if kind == "Cast":
            a, b = linear(e.value)
            return tuple(None if c is None else tirx.Cast(str(e.ty), c) for c in (a, b))
        what = e.op.name if kind == "Call" else kind
        raise NotAffine(f"'{name}' applies {what} to a value that depends on {s.op.name}")

    a, b = linear(op.body[0])

    def tensor(expr, suffix):
        if expr is None:
            return None
        return te.compute(u.shape, lambda *i: rebuild(expr, dict(zip(axes, i)), lambda t: t), name=f"{name}_{suffix}")

    return tensor(a, "a"), tensor(b, "b")


def _plus(x, y):
    return y if x is None else x if y is None else x + y


def _negate(x):
    return None if x is None else tirx.const(0, str(x.ty)) - x


def _reads_any(e, ops: set) -> bool:
    todo = [e]
    while todo:
        node = todo.pop()
        if is_load(node) and node.args[0].op in ops:
            return True
        todo += children(node)
    return False


def _depending(t: te.Tensor, target) -> set:
    """The ops between ``target`` and t (both included) that t reads ``target`` through."""
    memo = {}

    def visit(op) -> bool:
        if op not in memo:
            memo[op] = op.same_as(target) or any(visit(i.op) for i in op.input_tensors)
        return memo[op]

    visit(t.op)
    return {op for op, d in memo.items() if d}


