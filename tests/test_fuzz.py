"""Random cells: each seed writes a small cell as Python source, run by halstm and by torch.

The generator builds a step from groups of gates (a sum of matmuls and linears of x, tanh(x), the
states or a value computed in the step from them, ``split`` into 1-4 parts), sigmoid, tanh, exp of a
bounded value, products, sums, divisions by 2 + tanh, per-unit parameter vectors and, in forward
cells with I = H, x itself; 1-3 states, any of them the output; I, H in 1..23, B in 1..5, T in 1..7.
The same source runs twice: with halstm's ops it is a ``halstm.Cell``, with torch's a float64 step.
halstm.reference and torch agree to 1e-12, the compiled fp32 cell within the fp32 tolerance; on the
backward seeds, torch autograd against ``reference_backward`` and ``compile_backward`` the same way.

fp32 is a fair test: every next state is bounded (an activation, a convex mix or an LSTM-style
update) and adds a part of a matmul of x, so that it never decays to zero either; B*H >= 2, since in
a single number a sum that cancels by chance puts fp32's own rounding past 1e-5 (about one draw in
200). Seeds are fixed, inputs fresh (``rng``); a failure prints the cell's source.
``HALSTM_FUZZ_SEEDS=N`` runs forward seeds 0..N-1 and N // 3 backward seeds instead of 12 and 4 (CI
leaves out backward seed 1006, whose paths the other backward seeds take: it is marked slow).
"""

import os
import random
import re
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import TOLERANCE, random_inputs, rel_err, representative, upcast

import halstm
from halstm import ops
from halstm.gradients import compile_backward, reference_backward
from halstm.cell import upstream

torch = pytest.importorskip("torch")

SEEDS = int(os.environ.get("HALSTM_FUZZ_SEEDS", 12))  # forward seeds 0, 1, ...; a third as many backward
BACKWARD_OFFSET = 1005  # backward seeds 1005, ...: a combined GEMM, a three-stage step, a step without matmuls
STATE_NAMES = ("h", "c", "m")
OP_NAMES = ("matmul", "linear", "split", "sigmoid", "tanh", "exp")
TORCH_OPS = {
    "matmul": lambda a, w: a @ w.T,
    "linear": torch.nn.functional.linear,
    "split": lambda t, parts: torch.split(t, t.shape[-1] // parts, -1),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
}


@dataclass
class Fuzzed:
    """A generated cell: its source (a ``halstm.Cell`` subclass named ``name``) and the problem size."""

    source: str
    name: str
    input_size: int
    hidden_size: int
    batch: int
    steps: int

    def _define(self, namespace: dict):
        exec(compile(self.source, f"<{self.name}>", "exec"), namespace)  # noqa: S102 (generated here)
        return namespace[self.name](self.input_size, self.hidden_size)

    def cell(self) -> halstm.Cell:
        """The cell, its step written with halstm's ops."""
        return self._define({"halstm": halstm, **{n: getattr(ops, n) for n in OP_NAMES}})

    def torch_step(self):
        """The same step on torch tensors: ``step(p, x, *states)``."""
        return self._define({"halstm": halstm, **TORCH_OPS}).step


class _Generator:
    """One random cell from ``seed``; ``differentiable``: x only through matmuls (the backward's rule)."""

    def __init__(self, seed: int, differentiable: bool):
        r = self.r = random.Random(seed)
        self.seed = seed
        self.states = STATE_NAMES[:r.randint(1, 3)]
        self.output = r.choice(self.states)
        self.H = r.randint(1, 23)
        self.x_in_step = not differentiable and r.random() < 0.25  # x read outside matmuls (needs I = H)
        self.I = self.H if self.x_in_step else r.randint(1, 23)
        self.B, self.T = r.randint(1 if self.H > 1 else 2, 5), r.randint(1, 7)  # B*H >= 2: see the docstring
        self.lines: list[tuple[list[str], str]] = []  # (names assigned, expression)
        self.params: dict[str, tuple[int, ...]] = {}
        self.blocks: list[list[str]] = []  # the parts (pre-activations) of each group of gates
        self.read: set[str] = set()  # the parts that some expression reads
        self.operands = [("x", self.I)] + [(s, self.H) for s in self.states]
        self.gates: list[str] = []  # sigmoids held in a name, for convex mixes

    def _param(self, prefix: str, shape) -> str:
        name = f"{prefix}{sum(n.startswith(prefix) for n in self.params)}"
        self.params[name] = tuple(shape)
        return f"p.{name}"

    def block(self, first: tuple[str, int]) -> None:
        """One group of gates: a sum of matmuls with k*H rows each, of ``first`` and of random
        operands, split into k parts."""
        r, k = self.r, self.r.randint(1, 4)
        others = [o for o in self.operands if o != first]
        terms = []
        for operand, depth in [first] + r.sample(others, min(len(others), r.choice((0, 1, 1, 2)))):
            if operand == "x" and r.random() < 0.3:
                if ["xt"] not in (names for names, _ in self.lines):
                    self.lines.append((["xt"], "tanh(x)"))
                operand = "xt"
            w, form = self._param("w", (k * self.H, depth)), r.choice(("matmul", "linear", "linear_bias"))
            if form == "linear_bias":
                terms.append(f"linear({operand}, {w}, {self._param('b', (k * self.H,))})")
            else:
                terms.append(f"{form}({operand}, {w})")
        names = [f"g{sum(map(len, self.blocks)) + i}" for i in range(k)]
        self.lines.append((names, " + ".join(terms) if k == 1 else f"split({' + '.join(terms)}, {k})"))
        self.blocks.append(names)

    def derived(self) -> tuple[str, int]:
        """A bounded value of this step's gates and states, an operand of later matmuls (a later stage)."""
        name = f"d{len(self.operands) - 1 - len(self.states)}"
        self.lines.append(([name], self.bounded(2)))
        self.operands.append((name, self.H))
        return self.operands[-1]

    def gate(self) -> str:
        """The name of a sigmoid, new or made before."""
        if not self.gates or self.r.random() < 0.5:
            expr = f"sigmoid({self.pre(2)})"
            self.gates.append(f"z{len(self.gates)}")
            self.lines.append(([self.gates[-1]], expr))
        return self.r.choice(self.gates)

    def leaf(self) -> str:
        """A part of a block no expression reads yet first, then any part, a state or x."""
        r = self.r
        untouched = [parts for parts in self.blocks if not self.read & set(parts)]
        unread = [n for parts in self.blocks for n in parts if n not in self.read]
        if untouched or (unread and r.random() < 0.5):
            name = r.choice(untouched[0] if untouched else unread)
        elif self.x_in_step and r.random() < 0.2:
            return "x"
        else:
            name = r.choice(self.parts if r.random() < 0.6 else self.states)
        self.read.add(name)
        return name

    @property
    def parts(self) -> list[str]:
        return [n for parts in self.blocks for n in parts]

    def pre(self, depth: int) -> str:
        """A pre-activation: a value of moderate size, (B, H)."""
        r = self.r
        kind = r.choice(("leaf", "leaf", "sum", "sum", "scale", "vector", "gated", "bounded")) if depth > 0 else "leaf"
        if kind == "leaf":
            return self.leaf()
        if kind == "sum":
            a, b = self.pre(depth - 1), self.pre(depth - 1)
            return f"({a} {'+' if a == b else r.choice('+-')} {b})"  # never a - a: an exact zero
        if kind == "scale":
            return f"{r.choice((0.5, 1.5, 2.0))} * {self.pre(depth - 1)}"
        if kind == "vector":
            return f"{self._param('v', (self.H,))} * {self.bounded(depth - 1)}"
        if kind == "gated":
            return f"{self.bounded(depth - 1)} * {self.pre(depth - 1)}"
        return self.bounded(depth - 1)

    def bounded(self, depth: int) -> str:
        """A value within [-e, e] whatever the inputs (a state, LSTM-style, within [-T-1, T+1]), (B, H)."""
        r = self.r
        if depth <= 0:
            return r.choice((f"sigmoid({self.leaf()})", f"tanh({self.leaf()})", r.choice(self.states)))
        kind = r.choice(("act", "act", "exp", "product", "mix", "div"))
        if kind == "act":
            return f"{r.choice(('sigmoid', 'tanh'))}({self.pre(depth - 1)})"
        if kind == "exp":
            return f"exp({r.choice(('', '-1.0 * '))}tanh({self.pre(depth - 1)}))"
        if kind == "product":
            return f"{self.bounded(depth - 1)} * {self.bounded(depth - 1)}"
        if kind == "mix":
            z = self.gate()
            return f"({z} * {self.bounded(depth - 1)} + (1.0 - {z}) * {self.bounded(depth - 1)})"
        return f"{self.bounded(depth - 1)} / (2.0 + tanh({self.pre(depth - 1)}))"

    def driven(self) -> str:
        """A pre-activation plus a part of the first block (driven by x: a state never decays to 0)."""
        name = self.r.choice(self.blocks[0])
        self.read.add(name)
        return f"{self.pre(2)} + {name}"

    def next_state(self, s: str) -> str:
        r = self.r
        kind = r.choice(("tanh", "sigmoid", "mix", "lstm", "product"))
        if kind in ("tanh", "sigmoid"):
            return f"{kind}({self.pre(3)} + {self.driven()})"
        if kind == "mix":
            z = self.gate()
            return f"{z} * {s} + (1.0 - {z}) * tanh({self.driven()})"
        if kind == "lstm":
            return f"sigmoid({self.pre(2)}) * {s} + sigmoid({self.pre(2)}) * tanh({self.driven()})"
        return f"sigmoid({self.pre(2)}) * tanh({self.driven()})"

    def source(self) -> Fuzzed:
        """The cell's source: only what its next states read, parameters numbered in order."""
        self.block(("x", self.I))
        for _ in range(self.r.randint(0, 2)):
            self.block(self.derived() if self.r.random() < 0.4 else self.r.choice(self.operands))
        returns = [self.next_state(s) for s in self.states]
        live, kept = set(re.findall(r"\w+", " ".join(returns))), []
        for names, expr in reversed(self.lines):
            if live & set(names):
                kept.insert(0, (names, expr))
                live |= set(re.findall(r"\w+", expr))
        body = [f"{', '.join(names)} = {expr}" for names, expr in kept] + [f"return {', '.join(returns)}"]
        order = dict.fromkeys(re.findall(r"p\.(\w+)", "\n".join(body)))
        rename = {n: f"{n[0]}{sum(m[0] == n[0] for m in list(order)[:i])}" for i, n in enumerate(order)}
        body = [re.sub(r"p\.(\w+)", lambda m: f"p.{rename[m.group(1)]}", line) for line in body]
        params = {rename[n]: self.params[n] for n in order}
        name = f"Fuzz{self.seed}"
        source = "\n".join([
            f"class {name}(halstm.Cell):  # I={self.I}, H={self.H}, B={self.B}, T={self.T}",
            f"    states = {self.states!r}",
            f"    output = {self.output!r}",
            "",
            "    def parameters(self):",
            f"        return {params!r}",
            "",
            f"    def step(self, p, x, {', '.join(self.states)}):",
            *(f"        {line}" for line in body),
        ])
        return Fuzzed(source + "\n", name, self.I, self.H, self.B, self.T)


def generate(seed: int, differentiable: bool = False) -> Fuzzed:
    """The cell of ``seed`` (``differentiable``: one whose backward halstm derives)."""
    return _Generator(seed, differentiable).source()


def torch_run(cell, step, x, params, states, requires_grad=False):
    """``step`` over the sequence in torch float64: (the leaves by name, y (T, B, H), final states)."""
    leaves = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=requires_grad)
              for k, v in {"x": x, **params, **states}.items()}
    p = halstm.Params({n: leaves[n] for n in params})
    current, ys = [leaves[s] for s in cell.states], []
    for t in range(x.shape[0]):
        out = step(p, leaves["x"][t], *current)
        current = [out] if isinstance(out, torch.Tensor) else list(out)
        ys.append(current[cell.states.index(cell.output)])
    return leaves, torch.stack(ys), dict(zip(cell.states, current))


def sequence_grads(cell, gy, finals):
    """The loss's gradients with respect to every state at every step (halstm's interface)."""
    T, B, H = gy.shape
    grads = {s: np.zeros((T + 1, B, H)) for s in cell.states}
    grads[cell.output][1:] += gy
    for s, g in finals.items():
        grads[s][T] += g
    return grads


def assert_close(got: dict, want: dict, tolerance: float, source: str, what: str):
    """Each array within ``tolerance`` relative norm error (exactly zero where ``want`` is)."""
    for name, value in want.items():
        error = np.linalg.norm(np.asarray(got[name], np.float64) - value)
        assert error <= tolerance * np.linalg.norm(value), (
            f"{what} '{name}': relative error {rel_err(got[name], value):.3g} > {tolerance:g} for\n{source}")


def check_forward(fuzzed: Fuzzed, rng):
    """torch float64 against halstm.reference to ~1e-12, the compiled fp32 cell within the fp32 tolerance."""
    print(fuzzed.source)  # shown with any failure, one that raises included
    cell = fuzzed.cell()
    x, params, states = random_inputs(cell, fuzzed.steps, fuzzed.batch, rng)
    y_ref, final_ref = halstm.reference(cell, x, upcast(params), upcast(states))
    want = {"y": y_ref, **final_ref}
    _, y, final = torch_run(cell, fuzzed.torch_step(), x, params, states)
    assert_close({"y": y.numpy(), **{s: v.numpy() for s, v in final.items()}}, want, 1e-12, fuzzed.source,
                 "torch float64 against halstm.reference")
    y, final = halstm.compile(cell, fuzzed.steps, fuzzed.batch)(x, params, states)
    assert_close({"y": y, **final}, want, TOLERANCE["float32"], fuzzed.source, "compiled fp32")


def check_backward(fuzzed: Fuzzed, rng):
    """Gradients of L = <gy, y> + sum over states of <g_s, final s> with respect to x, the parameters
    and the initial states: torch autograd in float64 against reference_backward to ~1e-12 and
    against compile_backward (fp32) within the fp32 tolerance."""
    print(fuzzed.source)
    cell, T, B, H = fuzzed.cell(), fuzzed.steps, fuzzed.batch, fuzzed.hidden_size
    x, params, states = random_inputs(cell, T, B, rng)
    gy, finals = rng.standard_normal((T, B, H)), {s: rng.standard_normal((B, H)) for s in cell.states}
    leaves, y, final = torch_run(cell, fuzzed.torch_step(), x, params, states, requires_grad=True)
    loss = (y * torch.from_numpy(gy)).sum() + sum((final[s] * torch.from_numpy(g)).sum() for s, g in finals.items())
    loss.backward()
    want = {k: np.zeros(v.shape) if v.grad is None else v.grad.numpy() for k, v in leaves.items()}
    grads = sequence_grads(cell, gy, finals)
    dx, dparams, dstates = reference_backward(cell, x, upcast(params), upcast(states), grads)
    assert_close({"x": dx, **dparams, **dstates}, want, 1e-12, fuzzed.source, "halstm.reference_backward")
    seqs = halstm.compile(cell, T, B).sequences(x, params, states)
    backward = compile_backward(cell, T, B)
    dx, dparams, dstates = backward(x, params, seqs, {s: g.astype(np.float32) for s, g in grads.items()})
    assert_close({"x": dx, **dparams, **dstates}, want, TOLERANCE["float32"], fuzzed.source, "compile_backward")


HOISTED_CHAIN_BUG = pytest.mark.xfail(
    strict=True, raises=NotImplementedError,
    reason="compile_backward: a hoisted matmul whose operand reads another hoisted matmul's result; the weights "
           "function differentiates through that GEMM as traced on its packed weights (reads w_packed0 at index "
           "n // 32), where reference_backward derives it")


def reads_a_hoisted_matmul(cell) -> bool:
    """Whether a hoisted matmul's operand reads another hoisted matmul's result (``HOISTED_CHAIN_BUG``)."""
    plan = halstm.make_plan(cell)
    results = {m.result.op for g in plan.hoisted for m in g.members}
    return any(upstream(g.operand) & results for g in plan.hoisted)


@pytest.mark.parametrize("seed", range(SEEDS), ids=lambda s: f"seed{s}")
def test_random_cell_matches_float64(seed, rng):
    check_forward(generate(seed), rng)


BACKWARD_SEEDS = range(BACKWARD_OFFSET, BACKWARD_OFFSET + SEEDS // 3)
# CI: every backward seed but 1006 (two hoisted GEMMs, one of them of tanh(x), and two step GEMMs), which
# repeats the paths of 1005 (a combined step GEMM over a state that is not the output) and 1007 (three
# stages, a hoisted GEMM of tanh(x)) (slow); 1008 is the step without a GEMM (three states)
BACKWARD_IN_CI = {f"seed{s}" for s in BACKWARD_SEEDS} - {"seed1006"}


@pytest.mark.parametrize("seed", representative([(s,) for s in BACKWARD_SEEDS], [f"seed{s}" for s in BACKWARD_SEEDS],
                                                BACKWARD_IN_CI))
def test_random_cell_backward_matches_torch_autograd(seed, rng, request):
    fuzzed = generate(seed, differentiable=True)
    if reads_a_hoisted_matmul(fuzzed.cell()):
        request.applymarker(HOISTED_CHAIN_BUG)
    check_backward(fuzzed, rng)


HOISTED_CHAIN = Fuzzed('''class HoistedChain(halstm.Cell):  # I=1, H=2, B=2, T=2
    def parameters(self):
        return {'w0': (2, 1), 'w1': (2, 2)}

    def step(self, p, x, h):
        return tanh(matmul(tanh(matmul(x, p.w0)), p.w1) + h)
''', "HoistedChain", 1, 2, 2, 2)


def test_a_matmul_of_a_hoisted_matmul_matches_float64(rng):
    """Both matmuls hoisted, the second over the first's result: the forward is right, its backward
    is not compiled (below)."""
    check_forward(HOISTED_CHAIN, rng)


@HOISTED_CHAIN_BUG
def test_backward_of_a_matmul_of_a_hoisted_matmul(rng):
    check_backward(HOISTED_CHAIN, rng)
