"""Reverse mode over tensor expressions: the adjoint of each tensor, built as new ``te.compute``s.

TVM 0.27 has no ``te.gradient``, so adjoints are derived here from the forward expressions. For a
compute Y[i] = f(..., X[phi(i)], ...), each distinct read of X adds to X's adjoint

    dX[j] += sum over i with phi(i) = j of dY[i] * (df / dX[phi(i)])(i)

In each dimension ``phi`` must be an axis plus a constant or a constant (a ``split`` slice, a bias
read as b[n] in a (B, N) compute, a GEMM operand a[b, k]); the axes it leaves out (the batch axis of
the bias, the n of the GEMM) are summed over. A ``te.sum`` is differentiated through its source, its
reduce axes counted as axes of Y. The scalar derivative df/dX is built node by node, for the node
kinds that the oracle evaluates; anything else raises, naming what and where. A value that it reads
is stored where inlined it would be large (``_Bounded``).
"""

from __future__ import annotations

import functools
import math
import operator

import tvm_ffi
from tvm import te, tirx
from tvm.ir import Call
from tvm.sym import detect_linear_equation
from tvm.sym.analyzer import Analyzer

from .ops import extent, same_extent

_LOAD = "te.tensor_load"
_BINARY = {"Add", "Sub", "Mul", "Div", "Min", "Max", "FloorDiv", "FloorMod",
           "LT", "LE", "GT", "GE", "EQ", "NE", "And", "Or"}
_BOOLEAN = {"LT", "LE", "GT", "GE", "EQ", "NE", "And", "Or", "Not"}

# d f(a) / da from the argument a and the value y = f(a)
_CALLS = {
    "sigmoid": lambda a, y: y * (1.0 - y),
    "tanh": lambda a, y: 1.0 - y * y,
    "exp": lambda a, y: y,
    "log": lambda a, y: 1.0 / a,
    "sqrt": lambda a, y: 0.5 / y,
    "rsqrt": lambda a, y: -0.5 * y / a,
    "fabs": lambda a, y: tirx.Select(a >= 0.0, tirx.const(1.0, str(a.ty)), tirx.const(-1.0, str(a.ty))),
    "erf": lambda a, y: 2.0 / math.sqrt(math.pi) * tirx.exp(-a * a),
}
_FLAT = {"floor", "ceil", "round", "trunc"}  # derivative zero wherever it exists
# The nodes past which a value that the derived expressions read is stored (``_Bounded``): the
# cells of halstm.cells read none past half of it (LayerNormLSTM's largest, 116 nodes)
_INLINE_LIMIT = 256


def adjoints(outputs, seeds, wrt, rules=None, reads=None, known=None) -> list[te.Tensor | None]:
    """The adjoints of the tensors ``wrt`` given those of ``outputs`` (``seeds``, same shapes).

    Every compute between them is differentiated in reverse topological order. ``rules`` maps an op
    to its own rule, ``rule(dY)`` giving (input, contribution) pairs: a planned GEMM's product with
    the transposed weights, say. ``reads`` maps an op to the tensors its value stands for beyond its
    inputs (a GEMM's result read from where it was computed before: its operand), which its rule
    passes adjoints to. ``known`` maps an op to its adjoint where that was computed before (the
    reversed loop's stored ones): taken as it is, not summed from the op's readers. A tensor in
    ``wrt`` that the outputs do not depend on gets None.
    """
    adjoint = derive(outputs, seeds, wrt, rules, reads, known)
    return [adjoint.get(t.op) for t in wrt]


def derive(outputs, seeds, wrt, rules=None, reads=None, known=None) -> dict:
    """The adjoint of every op between ``outputs`` and ``wrt`` by op (``adjoints``' arguments). Ops
    whose adjoints are one tensor (a sum's and each of its terms' read as they are: a copy's
    adjoint is its result's) share it."""
    rules, reads, known = rules or {}, reads or {}, known or {}
    targets = {t.op for t in wrt}
    order = _topological(outputs, reads)
    depends = {}
    for op in order:
        depends[op] = op in targets or any(depends[t.op] for t in [*op.input_tensors, *reads.get(op, ())])
    parts = {op: [] for op in order}
    for out, seed in zip(outputs, seeds):
        parts[out.op].append(seed)
    adjoint, bounded = {}, _Bounded()
    for op in reversed(order):
        if not depends[op] or not (parts[op] or op in known):
            continue
        adjoint[op] = dy = known[op] if op in known else _total(op.output(0), parts[op])
        if op in rules:
            found = rules[op](dy)
        elif isinstance(op, te.ComputeOp):
            found = _reads(op, dy, lambda t: depends[t.op], bounded)
        else:
            continue  # a placeholder: a leaf
        for tensor, contribution in found:
            parts[tensor.op].append(contribution)
    return adjoint


def _topological(outputs, reads: dict) -> list:
    """The ops the outputs are computed from, each after its inputs (and ``reads``)."""
    order, seen = [], set()

    def visit(op):
        if op not in seen:
            seen.add(op)
            for t in [*op.input_tensors, *reads.get(op, ())]:
                visit(t.op)
            order.append(op)

    for t in outputs:
        visit(t.op)
    return order


def _total(tensor: te.Tensor, parts: list):
    """The sum of a tensor's adjoint contributions (tensors, or functions of the indices)."""
    if len(parts) == 1 and isinstance(parts[0], te.Tensor):
        return parts[0]
    return te.compute(tensor.shape, lambda *j: functools.reduce(operator.add, (p(*j) for p in parts)),
                      name=f"d_{tensor.op.name}")


class _Bounded:
    """A value as the derivatives read it: the tensor itself or, where its expression with the
    elementwise computes that it reads inlined passes ``_INLINE_LIMIT`` nodes, a sum of it over one
    element. The schedules inline an elementwise compute into its readers unless one is a
    reduction: so such a value is computed once and stored, not inlined into every adjoint whose
    derivative reads it, and again into every adjoint that one's is inlined into (a clamped state
    with a layer norm and a gate inlined into it, in the tests' GatedNormRNN, left TVM's
    simplifier minutes of work)."""

    def __init__(self):
        self.sizes, self.copies = {}, {}

    def __call__(self, t: te.Tensor) -> te.Tensor:
        if t.op not in self.copies:
            if self._size(t.op) <= _INLINE_LIMIT:
                return t
            one = te.reduce_axis((0, 1), name="one")
            self.copies[t.op] = te.compute(t.shape, lambda *i: te.sum(t(*i), axis=one), name=f"{t.op.name}_stored")
        return self.copies[t.op]

    def _size(self, op) -> int:
        if op not in self.sizes:
            body = op.body[0] if isinstance(op, te.ComputeOp) else None
            self.sizes[op] = 1 if body is None or type(body).__name__ == "Reduce" else self._nodes(body)
        return self.sizes[op]

    def _nodes(self, e) -> int:
        if is_load(e):
            return self._size(e.args[0].op)
        return 1 + sum(self._nodes(c) for c in children(e))


def _reads(op, dy, needed, bounded: _Bounded):
    """(tensor, contribution to its adjoint) for each distinct read in op of a tensor in ``needed``."""
    if op.num_outputs != 1:
        raise NotImplementedError(f"backward: compute '{op.name}' has {op.num_outputs} outputs; one is supported")
    body, axes, condition = op.body[0], list(op.axis), None
    if type(body).__name__ == "Reduce":
        if type(body.combiner.result[0]).__name__ != "Add" or len(body.source) != 1:
            raise NotImplementedError(f"backward: reduction '{op.name}' is not a sum ({body.combiner}); only te.sum is supported")
        axes += list(body.axis)
        condition = None if _is_true(body.condition) else body.condition
        body = body.source[0]
    domain = {iv.var: extent(iv.dom.extent) for iv in axes}
    for read in _distinct_reads(body):
        tensor = read.args[0]
        partial = _Derivative(read, op.name).of(body) if needed(tensor) else None
        if partial is not None:
            yield tensor, _scatter(op, dy, read, partial, condition, domain, bounded)


def _scatter(op, dy, read, partial, condition, domain, bounded: _Bounded):
    """The contribution of one read X[phi(i)] in op: dY[i] * partial, gathered onto X's indices."""
    tensor = read.args[0]
    shape = [extent(d) for d in tensor.shape]
    maps = _index_map(read, domain, op)
    bound = [v for v, _ in maps if v is not None]
    free = [v for v in domain if not any(v.same_as(b) for b in bound)]
    out = [extent(d) for d in op.output(0).shape]
    identity = (
        len(shape) == len(out) and all(map(same_extent, shape, out)) and not free and condition is None
        and all(v is not None and v.same_as(iv.var) and c == 0 for (v, c), iv in zip(maps, op.axis))
        and type(partial).__name__ == "FloatImm" and partial.value == 1.0
    )
    if identity:  # a copy's adjoint is the adjoint of its result
        return dy

    def term(j, env):
        inside = []
        for d, (v, c) in enumerate(maps):
            if v is None:
                inside.append(j[d] == c)
                continue
            env[v] = j[d] - c
            if c > 0 or not _at_least(c + domain[v], shape[d]):  # X[j] is read by part of Y only
                # 0 <= j - c < extent, written so that where a slice is whole vectors TVM's
                # simplifier makes it a condition on the outer loop: the if_then_else stays vectorised
                inside.append(tirx.floordiv(env[v], domain[v]) == 0)
                env[v] = tirx.max(tirx.min(env[v], domain[v] - 1), 0)
        value = dy(*(env[iv.var] for iv in op.axis)) * _cast(rebuild(partial, env, bounded), dy.dtype)
        if condition is not None:
            inside.append(rebuild(condition, env, bounded))
        # if_then_else, not Select: Select evaluates both sides, and the simplifier drops the clamp
        # inside the masked side (the condition implies it), which then reads out of bounds
        return tirx.if_then_else(tirx.all(*inside), value, tirx.const(0, dy.dtype)) if inside else value

    if not free:
        return lambda *j: term(j, {})

    def summed(*j):
        axes = [te.reduce_axis((0, domain[v]), name=v.name) for v in free]
        return te.sum(term(j, {v: a.var for v, a in zip(free, axes)}), axis=axes)

    return te.compute(shape, summed, name=f"d_{tensor.op.name}_{op.name}")


def _at_least(a, b) -> bool:
    """Whether extent a is provably at least b."""
    if isinstance(a, int) and isinstance(b, int):
        return a >= b
    return Analyzer().can_prove(a >= b)


def _index_map(read, domain: dict, op) -> list:
    """Per dimension of the read, (v, c) with index = v + c for an axis v of the compute, or
    (None, c) for a constant index c; each axis in one dimension at most."""
    tensor, *index = read.args
    variables = list(domain)
    maps = []
    for e in index:
        coefficients = detect_linear_equation(e, variables)
        if len(coefficients) == len(variables) + 1 and all(type(c).__name__ == "IntImm" for c in coefficients):
            *scales, constant = (int(c) for c in coefficients)
            used = [v for v, scale in zip(variables, scales) if scale]
            if len(used) <= 1 and set(scales) <= {0, 1}:
                maps.append((used[0] if used else None, constant))
                continue
        raise NotImplementedError(f"backward: compute '{op.name}' reads {tensor.op.name} at index {e}; only "
                                  "an axis plus a constant, or a constant, can be differentiated")
    axes = [v for v, _ in maps if v is not None]
    if any(a.same_as(b) for i, a in enumerate(axes) for b in axes[:i]):
        raise NotImplementedError(f"backward: compute '{op.name}' reads {tensor.op.name} with one axis in two "
                                  f"dimensions ({', '.join(map(str, index))}); a diagonal cannot be differentiated")
    return maps


def _is_true(e) -> bool:
    return e is None or (type(e).__name__ == "IntImm" and bool(e.value))


def is_load(e) -> bool:
    return type(e).__name__ == "Call" and e.op.name == _LOAD


def children(e) -> list:
    kind = type(e).__name__
    if kind in _BINARY:
        return [e.a, e.b]
    if kind in ("Cast", "Not"):
        return [e.value if kind == "Cast" else e.a]
    if kind == "Select":
        return [e.condition, e.true_value, e.false_value]
    if kind == "Call":
        return list(e.args[1:] if is_load(e) else e.args)
    return []


def _same_read(a, b) -> bool:
    return a.args[0].same_as(b.args[0]) and all(
        tvm_ffi.structural_equal(x, y) for x, y in zip(a.args[1:], b.args[1:]))


def _distinct_reads(e) -> list:
    found, todo = [], [e]
    while todo:
        node = todo.pop()
        if is_load(node) and not any(_same_read(node, f) for f in found):
            found.append(node)
        todo += children(node)
    return found


def rebuild(e, env: dict, read):
    """e with its variables replaced as ``env`` says (TVM 0.27's Python has no substitute), each
    tensor ``t`` read as ``read(t)``."""
    kind = type(e).__name__
    if kind == "Var":
        return env.get(e, e)
    if kind in ("IntImm", "FloatImm"):
        return e
    if kind in _BINARY:
        return type(e)(rebuild(e.a, env, read), rebuild(e.b, env, read))
    if kind == "Cast":
        return tirx.Cast(str(e.ty), rebuild(e.value, env, read))
    if kind == "Not":
        return tirx.Not(rebuild(e.a, env, read))
    if kind == "Select":
        return tirx.Select(*(rebuild(v, env, read) for v in children(e)))
    if kind == "Call":
        if is_load(e):
            return read(e.args[0])(*(rebuild(i, env, read) for i in e.args[1:]))
        return Call(e.op, [rebuild(a, env, read) for a in e.args], ret_ty=e.ty)
    raise NotImplementedError(f"backward: cannot rebuild {kind} ({e})")


def _cast(e, dtype: str):
    return e if str(e.ty) == dtype else tirx.Cast(dtype, e)


def _plus(*terms):
    terms = [t for t in terms if t is not None]
    return functools.reduce(operator.add, terms) if terms else None


def _or_zero(e, like):
    return tirx.const(0, str(like.ty)) if e is None else e


class _Derivative:
    """d e / d read for one read of a tensor, in terms of e's own variables; None where zero."""

    def __init__(self, read, where: str):
        self.read, self.where = read, where

    def of(self, e):
        kind = type(e).__name__
        if kind in ("Var", "IntImm", "FloatImm") or kind in _BOOLEAN:
            return None
        if kind in ("Add", "Sub"):
            da, db = self.of(e.a), self.of(e.b)
            return _plus(da, db if kind == "Add" or db is None else -db)
        if kind == "Mul":
            da, db = self.of(e.a), self.of(e.b)
            return _plus(None if da is None else da * e.b, None if db is None else e.a * db)
        if kind == "Div":
            da, db = self.of(e.a), self.of(e.b)
            # tirx.Div, not "/": the operator folds constants in the expression's dtype (1.0 / 48.0 in
            # float32 is off by 1e-8), and the float64 oracle evaluates the derivative exactly
            return _plus(None if da is None else tirx.Div(da, e.b), None if db is None else -tirx.Div(e, e.b) * db)
        if kind in ("Min", "Max"):
            da, db = self.of(e.a), self.of(e.b)
            if da is None and db is None:
                return None
            first = e.a <= e.b if kind == "Min" else e.a >= e.b
            return tirx.Select(first, _or_zero(da, e), _or_zero(db, e))
        if kind == "Select":
            dt, df = self.of(e.true_value), self.of(e.false_value)
            if dt is None and df is None:
                return None
            return tirx.Select(e.condition, _or_zero(dt, e), _or_zero(df, e))
        if kind == "Cast":
            dv = self.of(e.value)
            return None if dv is None or not str(e.ty).startswith(("float", "bfloat")) else tirx.Cast(str(e.ty), dv)
        if kind in ("FloorDiv", "FloorMod") and str(e.ty).startswith("int"):
            return None
        if kind == "Call":
            return self._call(e)
        raise NotImplementedError(f"backward: cannot differentiate {kind} in compute '{self.where}' ({e})")

    def _call(self, e):
        name = e.op.name.split(".")[-1]
        if is_load(e):
            return tirx.const(1.0, str(e.ty)) if _same_read(e, self.read) else None
        if name in _FLAT:
            return None
        if name == "if_then_else":
            cond, t, f = e.args
            dt, df = self.of(t), self.of(f)
            if dt is None and df is None:
                return None
            return tirx.if_then_else(cond, _or_zero(dt, e), _or_zero(df, e))
        if name == "pow":
            a, b = e.args
            da, db = self.of(a), self.of(b)
            return _plus(None if da is None else b * tirx.pow(a, b - 1.0) * da,
                         None if db is None else e * tirx.log(a) * db)
        if name in _CALLS:
            da = self.of(e.args[0])
            return None if da is None else _CALLS[name](e.args[0], e) * da
        raise NotImplementedError(f"backward: no derivative for '{e.op.name}' in compute '{self.where}'")
