"""The float64 oracle: runs any cell definition on NumPy, step by step in Python.

It interprets the same tensor expressions that the compiler lowers (``halstm.cell.trace``), not a
second copy of the math: each ``te.compute`` is evaluated over index grids, matmuls with
``np.matmul``. Slow and plain on purpose; every test compares against it.
"""

from __future__ import annotations

import math

import numpy as np
from tvm import te

from .cell import Cell, placeholders, trace
from .ops import MATMUL_TAG

_BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Div": np.divide,
    "Min": np.minimum,
    "Max": np.maximum,
    "FloorDiv": np.floor_divide,
    "FloorMod": np.mod,
    "LT": np.less,
    "LE": np.less_equal,
    "GT": np.greater,
    "GE": np.greater_equal,
    "EQ": np.equal,
    "NE": np.not_equal,
    "And": np.logical_and,
    "Or": np.logical_or,
}

_CALLS = {
    "sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
    "tanh": np.tanh,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "rsqrt": lambda v: 1.0 / np.sqrt(v),
    "fabs": np.abs,
    "erf": np.vectorize(math.erf),
    "pow": np.power,
    "floor": np.floor,
    "ceil": np.ceil,
    "round": np.round,
}

_REDUCERS = {"Add": np.sum, "Max": np.max, "Min": np.min, "Mul": np.prod}


class _Evaluator:
    """Evaluates tensors of one traced step given the values of its placeholders."""

    def __init__(self, bound: dict):
        self.values = dict(bound)  # op -> ndarray
        self.guarded = 0  # inside a branch of if_then_else: reads past a tensor's end are discarded values

    def tensor(self, t: te.Tensor) -> np.ndarray:
        if t.op not in self.values:
            self.values[t.op] = self._compute(t.op)
        return self.values[t.op]

    def _compute(self, op) -> np.ndarray:
        if isinstance(op, te.PlaceholderOp):
            raise KeyError(f"no value bound for placeholder '{op.name}'")
        if op.tag == MATMUL_TAG:
            a, w = op.input_tensors
            return self.tensor(a) @ self.tensor(w).T
        if not isinstance(op, te.ComputeOp) or op.num_outputs != 1:
            raise NotImplementedError(f"the reference cannot evaluate op '{op.name}' ({type(op).__name__})")
        shape = tuple(int(iv.dom.extent) for iv in op.axis)
        env = {}
        for d, iv in enumerate(op.axis):
            grid = np.arange(int(iv.dom.extent)).reshape([-1 if i == d else 1 for i in range(len(shape))])
            env[iv.var] = grid
        value = self._expr(op.body[0], env, len(shape))
        return np.broadcast_to(np.asarray(value, dtype=np.float64), shape).copy()

    def _expr(self, e, env, ndim):
        kind = type(e).__name__
        if kind == "Var":
            return env[e]
        if kind in ("IntImm", "FloatImm"):
            return e.value
        if kind == "Cast":  # float64 all through: casts between float types are no-ops here
            v = self._expr(e.value, env, ndim)
            return np.trunc(v).astype(np.int64) if str(e.ty).startswith("int") else v
        if kind in _BINARY:
            return _BINARY[kind](self._expr(e.a, env, ndim), self._expr(e.b, env, ndim))
        if kind == "Not":
            return np.logical_not(self._expr(e.a, env, ndim))
        if kind == "Select":
            return np.where(*(self._expr(v, env, ndim) for v in (e.condition, e.true_value, e.false_value)))
        if kind == "Call":
            name = e.op.name.split(".")[-1]
            if name == "tensor_load":
                tensor, *index = e.args
                value = self.tensor(tensor)
                index = [np.asarray(self._expr(i, env, ndim)) for i in index]
                if self.guarded:  # TVM evaluates only the branch taken; both are evaluated here
                    index = [np.clip(i, 0, n - 1) for i, n in zip(index, value.shape)]
                return value[tuple(index)]
            if name == "if_then_else":
                condition = self._expr(e.args[0], env, ndim)
                self.guarded += 1
                try:
                    return np.where(condition, *(self._expr(a, env, ndim) for a in e.args[1:]))
                finally:
                    self.guarded -= 1
            if name in _CALLS:
                return _CALLS[name](*(self._expr(a, env, ndim) for a in e.args))
            raise NotImplementedError(f"the reference has no rule for '{e.op.name}'")
        if kind == "Reduce":
            return self._reduce(e, env, ndim)
        raise NotImplementedError(f"the reference has no rule for {kind}: {e}")

    def _reduce(self, e, env, ndim):
        reducer = _REDUCERS.get(type(e.combiner.result[0]).__name__)
        if reducer is None or len(e.source) != 1:
            raise NotImplementedError(f"the reference has no rule for the reduction {e.combiner}")
        axes = list(e.axis)
        total = ndim + len(axes)
        inner = {k: (np.expand_dims(v, tuple(range(ndim, total))) if np.ndim(v) else v) for k, v in env.items()}
        for d, iv in enumerate(axes):
            inner[iv.var] = np.arange(int(iv.dom.extent)).reshape(
                [-1 if i == ndim + d else 1 for i in range(total)]
            )
        value = self._expr(e.source[0], inner, total)
        full = tuple(np.broadcast_shapes(*(np.shape(v) for v in inner.values())))
        value = np.broadcast_to(value, full)
        if e.condition is not None and not (type(e.condition).__name__ == "IntImm" and e.condition.value):
            identity = np.float64(e.combiner.identity_element[0].value)
            value = np.where(np.broadcast_to(self._expr(e.condition, inner, total), full), value, identity)
        return reducer(value, axis=tuple(range(ndim, total)))


def reference(cell: Cell, x, params: dict, states: dict | None = None):
    """Run ``cell`` over x (T, B, I) in float64.

    Returns (output sequence (T, B, H), final states by name), as ``halstm.compile`` does.
    """
    x = np.asarray(x, dtype=np.float64)
    steps, batch, _ = x.shape
    ph_x, ph_states, ph_params = placeholders(cell, batch)
    traced = trace(cell, ph_x, ph_states, ph_params)
    fixed = {ph_params[n].op: np.asarray(params[n], dtype=np.float64) for n in ph_params}
    current = [
        np.asarray(states[s], dtype=np.float64) if states and s in states else np.zeros((batch, cell.hidden_size))
        for s in cell.states
    ]
    out = np.empty((steps, batch, cell.hidden_size))
    k = cell.states.index(cell.output)
    for t in range(steps):
        bound = {**fixed, ph_x.op: x[t], **{p.op: v for p, v in zip(ph_states, current)}}
        ev = _Evaluator(bound)
        current = [ev.tensor(n) for n in traced.next_states]
        out[t] = current[k]
    return out, dict(zip(cell.states, current))
