"""What a cell is: its parameters, the states that recur, and the math of one step.

A cell subclasses ``Cell`` and writes ``step`` with tensor expressions (``halstm.ops`` or raw
``te.compute``); it says nothing about loops, threads or memory. ``trace`` runs ``step`` on
placeholders and returns the expression graph that the planner, the lowering and the reference read.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
from tvm import te

from .ops import same_extent, tracing

# Tracing a cell (``ops.tracing``'s tracer stack, TVM's te tag scope), the recipes' per-program
# caches and building go through process-wide state: ``trace`` holds this lock, and so do
# ``halstm.compile`` and ``compile_backward`` throughout. Re-entrant: they trace while holding it,
# and ``halstm.nn``'s cache holds it across its lookup and the compile that fills it.
BUILD_LOCK = threading.RLock()


class Params(dict):
    """Parameters by name, also reachable as attributes: ``p.weight_ih``."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the cell has no parameter '{name}'") from None


class Cell:
    """A recurrent cell. Subclasses set ``states`` and write ``parameters`` and ``step``.

    ``states`` names the tensors that recur, each of shape (B, hidden_size); ``output`` names the
    one whose sequence is the cell's output. ``step(p, x, *states)`` returns the next states in the
    order of ``states``. ``biases`` names the parameters that are bias terms, those that
    ``halstm.nn.RNN(..., bias=False)`` leaves out (``()``: none); see ``bias_parameters``.
    """

    states: tuple[str, ...] = ("h",)
    output: str = "h"
    biases: tuple[str, ...] | None = None  # None: not declared

    def __init__(self, input_size: int, hidden_size: int):
        if input_size < 1 or hidden_size < 1:
            raise ValueError(f"input_size and hidden_size must be >= 1, got {input_size}, {hidden_size}")
        self.input_size = int(input_size)
        self.hidden_size = int(hidden_size)

    def parameters(self) -> dict[str, tuple[int, ...]]:
        """Parameter shapes by name."""
        raise NotImplementedError

    def step(self, p: Params, x: te.Tensor, *states: te.Tensor):
        """The next states, from the input x (B, input_size) and the current states."""
        raise NotImplementedError

    def bias_parameters(self) -> tuple[str, ...]:
        """The parameters that are bias terms: ``biases`` as declared. A cell that does not declare
        them has none if it has no 1-D parameter; with 1-D parameters, which may be biases or not
        (gains, peepholes), it must say."""
        params = self.parameters()
        if self.biases is None:
            vectors = [n for n, shape in params.items() if len(shape) == 1]
            if vectors:
                raise ValueError(
                    f"{self.name} does not declare which parameters are biases, and its 1-D parameters "
                    f"{vectors} may be: set `biases = (...)` on the class to the names of its bias terms "
                    f"(`biases = ()` if none is one)"
                )
            return ()
        unknown = [n for n in self.biases if n not in params]
        if unknown:
            raise ValueError(f"{self.name}.biases names {unknown}, which are not among its parameters {list(params)}")
        return tuple(self.biases)

    @property
    def name(self) -> str:
        return type(self).__name__

    def init_parameters(self, seed: int | None = None, dtype="float32") -> dict[str, np.ndarray]:
        """Random parameters as PyTorch initialises RNNs: uniform in +-1/sqrt(hidden_size)."""
        rng = np.random.default_rng(seed)
        bound = 1.0 / np.sqrt(self.hidden_size)
        return {
            name: rng.uniform(-bound, bound, shape).astype(dtype)
            for name, shape in self.parameters().items()
        }

    def __repr__(self):
        return f"{self.name}(input_size={self.input_size}, hidden_size={self.hidden_size})"


@dataclass
class Trace:
    """One traced step: its placeholders and the expressions of the next states."""

    x: te.Tensor
    states: list[te.Tensor]
    params: Params
    next_states: list[te.Tensor]


def placeholders(cell: Cell, batch: int, dtype="float32"):
    """Fresh placeholders for x, the states and the parameters of one step."""
    x = te.placeholder((batch, cell.input_size), dtype, name="x")
    states = [te.placeholder((batch, cell.hidden_size), dtype, name=s) for s in cell.states]
    params = Params(
        {n: te.placeholder(tuple(shape), dtype, name=n) for n, shape in cell.parameters().items()}
    )
    return x, states, params


def trace(cell: Cell, x, states, params, tracer=None) -> Trace:
    """Run ``cell.step`` on the given tensors; ``tracer`` decides what each matmul becomes. One
    thread at a time traces (``BUILD_LOCK``)."""
    with BUILD_LOCK:
        if tracer is None:
            out = cell.step(params, x, *states)
        else:
            with tracing(tracer):
                out = cell.step(params, x, *states)
    out = [out] if isinstance(out, te.Tensor) else list(out)
    if len(out) != len(cell.states):
        raise ValueError(
            f"{cell.name}.step returned {len(out)} tensors, expected one per state {cell.states}"
        )
    batch = x.shape[0]
    for name, t in zip(cell.states, out):
        if not isinstance(t, te.Tensor) or len(t.shape) != 2 or not same_extent(t.shape[0], batch) \
                or not same_extent(t.shape[1], cell.hidden_size):
            got = tuple(t.shape) if isinstance(t, te.Tensor) else type(t).__name__
            raise ValueError(
                f"{cell.name}.step: next state '{name}' must be a tensor of shape "
                f"({batch}, {cell.hidden_size}), got {got}"
            )
    return Trace(x, list(states), params, out)


def upstream(t: te.Tensor, stops: frozenset = frozenset()) -> set:
    """Every op that t is computed from, t's own included, not looking past the ops in ``stops``."""
    seen, todo = set(), [t.op]
    while todo:
        op = todo.pop()
        if op not in seen:
            seen.add(op)
            if op not in stops:
                todo += [i.op for i in op.input_tensors]
    return seen


def check_cell(cell: Cell) -> None:
    """Reject cells whose declarations cannot be compiled, naming what is wrong."""
    if not isinstance(cell, Cell):
        raise TypeError(f"expected a halstm.Cell, got {type(cell).__name__}")
    if not cell.states or len(set(cell.states)) != len(cell.states):
        raise ValueError(f"{cell.name}.states must be distinct names, got {cell.states}")
    if cell.output not in cell.states:
        raise ValueError(f"{cell.name}.output '{cell.output}' is not one of its states {cell.states}")
    params = cell.parameters()
    clash = set(params) & ({"x"} | set(cell.states))
    if clash:
        raise ValueError(f"{cell.name}: parameter names {sorted(clash)} clash with x or a state")
    for name in list(params) + list(cell.states):
        if not name.isidentifier():
            raise ValueError(f"{cell.name}: '{name}' is not a valid name")
