"""Gradients of a sequence: compiled (``compile_backward``) or the float64 reference.

Both take the forward's inputs and the gradient of a loss with respect to every state at every
step, ``grads`` ((T + 1, B, H) by state, the initial state first; a state left out has none), and
return the gradients with respect to x (T, B, I), each parameter and each initial state. For a loss
on the output sequence y and the final states: ``grads[cell.output][1:] = dL/dy`` and
``grads[s][T] += dL/d final s``.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import te

from halstm import schedules, targets

from .autodiff import adjoints
from .backward import BackwardProgram, lower_backward
from .cell import Cell, placeholders, trace
from .compiler import check_problem, serialised
from .compiler import compile as compile_cell
from .lowering import lower
from .oracle import _Evaluator
from .plan import make_plan
from .runtime import Arg, check_array, check_names, as_frame


@serialised
def compile_backward(cell: Cell, steps: int, batch: int, dtype: str = "float32", target="cpu",
                     knobs: dict | None = None) -> CompiledBackward:
    """The backward of ``halstm.compile(cell, steps, batch, dtype, target)`` (``halstm.backward``):
    its reversed time loop, the adjoint cell, compiled as ``halstm.compile`` compiles a cell (the
    recipe its records or the defaults choose); the functions around it over all rows scheduled by
    the target's step-loop recipe (``knobs`` overrides its defaults)."""
    check_problem(cell, steps, batch, dtype)
    target = targets.resolve(target)
    recipe = next(r for r in schedules.BUILTIN if r.name == f"{target.kind}-step-loop")
    plan = make_plan(cell)
    forward = lower(cell, int(steps), int(batch), dtype, plan)
    knobs = recipe.resolve(forward, target, knobs)
    program = lower_backward(cell, int(steps), int(batch), dtype, plan, recipe.layout(forward, target, knobs))
    adjoint = compile_cell(program.adjoint, int(steps) + 1, int(batch), dtype, target)
    from . import cache

    def build():
        scheduled = {name: recipe.apply(p, target, **knobs) for name, p in program.functions.items()}
        functions = {name: s.mod["main"].with_attr("global_symbol", name) for name, s in scheduled.items()}
        module = target.build(tvm.IRModule(functions), **getattr(recipe, "build_options", {}))
        return CompiledBackward(program, target, recipe, knobs, scheduled, module, adjoint)

    return cache.backward(program, target, recipe, knobs, adjoint, build)


class CompiledBackward:
    """``dx, dparams, dstates = f(x, params, seqs, grads)``, where ``seqs`` are the forward's state
    sequences (``CompiledCell.sequences``). NumPy arrays in, NumPy out; torch tensors in, torch out
    (shared through DLPack, as the forward). ``schedules`` holds each function's schedule by name
    ("prepare", "rows", "weights"), ``adjoint`` the compiled reversed loop (a ``CompiledCell``);
    ``cached``: the compiled-module cache's entry, None where it was built)."""

    cached = None

    def __init__(self, program: BackwardProgram, target, recipe, knobs, schedules: dict, module, adjoint):
        self.program, self.target, self.recipe, self.knobs = program, target, recipe, knobs
        self.schedules, self.module, self.adjoint = schedules, module, adjoint

    def __call__(self, x, params: dict, seqs: dict, grads: dict | None = None):
        p = self.program
        cell, T, B, dtype = p.plan.cell, p.steps, p.batch, p.dtype
        device = self.target.device()
        frame = as_frame(x, device)
        params = check_names(params, "params", set(cell.parameters()), required=True)
        seqs = check_names(seqs, "seqs", set(cell.states), required=True)
        grads = check_names(grads or {}, "grads", set(cell.states), required=False)
        sequence = (T + 1, B, cell.hidden_size)
        given = {  # argument name -> (what the caller passed, its name for errors, the shape expected)
            "x": (x, "x", (T, B, cell.input_size)),
            **{n: (v, f"params['{n}']", tuple(cell.parameters()[n])) for n, v in params.items()},
            **{f"{s}_seq": (v, f"seqs['{s}']", sequence) for s, v in seqs.items()},
            **{f"g{s}_seq": (v, f"grads['{s}']", sequence) for s, v in grads.items()},
        }
        adjoint, buffers = p.adjoint, {}
        from_adjoint = {f"{q}_seq" for q in adjoint.states}
        for arg in p.args:
            if arg.name in given:
                value, what, shape = given[arg.name]
                check_array(value, what, shape, dtype)
                buffers[arg.name] = frame.share(value.reshape(arg.shape))
            elif arg.name not in from_adjoint:  # a state without a gradient, the buffers between, the results
                buffers[arg.name] = frame.new(arg, zeros=arg.role == "grad")
        self.module["prepare"](*(buffers[a.name] for a in p.prepare.args))
        # the adjoint's initial states: each final state's gradient (d<s>_local), zeros
        zeros = frame.new(Arg("zeros", (B, cell.hidden_size), dtype, "buffer"), zeros=True)
        initial = {q: zeros for q in adjoint.states}
        initial |= {f"d{s}_local": frame.share(grads[s][T]) for s in grads}
        buffers |= self.adjoint.run_on(buffers["adjoint_x"], {n: buffers[n] for n in adjoint.parameters()},
                                       initial, lambda a: frame.new(a, False))
        for name in ("rows", "weights"):
            self.module[name](*(buffers[a.name] for a in p.functions[name].args))
        dx = frame.result(buffers["dx"]).reshape(T, B, cell.input_size)
        first = (T + 1) * B  # the adjoint's last step: D_0
        return (dx, {n: frame.result(buffers[f"d{n}"]) for n in cell.parameters()},
                {s: frame.result(buffers[f"d{s}_seq"])[first:first + B] for s in cell.states})

    def __repr__(self):
        p = self.program
        return (f"<compiled backward of {p.plan.cell!r} T={p.steps} B={p.batch} {p.dtype} on {self.target.key} "
                f"with {self.recipe.name} {self.knobs}, its reversed loop with {self.adjoint.recipe.name}>")


def reference_backward(cell: Cell, x, params: dict, states: dict | None, grads: dict):
    """The gradients in float64: the adjoints that ``halstm.autodiff`` derives from the cell's
    expressions, evaluated step by step in reverse by the oracle (``halstm.reference``'s
    interpreter). Returns (dx, dparams, dstates) as NumPy arrays."""
    x = np.asarray(x, dtype=np.float64)
    T, B, _ = x.shape
    H = cell.hidden_size
    ph_x, ph_states, ph_params = placeholders(cell, B)
    traced = trace(cell, ph_x, ph_states, ph_params)
    d_next = [te.placeholder((B, H), "float32", name=f"d{s}_next") for s in cell.states]
    found = adjoints(traced.next_states, d_next, [ph_x, *ph_states, *ph_params.values()])
    fixed = {ph_params[n].op: np.asarray(params[n], dtype=np.float64) for n in ph_params}

    def evaluator(t, current, bound=()):
        return _Evaluator({**fixed, ph_x.op: x[t], **{p.op: v for p, v in zip(ph_states, current)}, **dict(bound)})

    seq = [[np.asarray((states or {}).get(s, np.zeros((B, H))), dtype=np.float64) for s in cell.states]]
    for t in range(T):
        seq.append([evaluator(t, seq[-1]).tensor(n) for n in traced.next_states])
    zero = np.zeros((T + 1, B, H))
    d = [np.asarray(grads.get(s, zero)[T], dtype=np.float64) for s in cell.states]
    dx, dparams = np.zeros_like(x), {n: np.zeros(np.shape(params[n])) for n in ph_params}
    for t in reversed(range(T)):
        ev = evaluator(t, seq[t], ((p.op, v) for p, v in zip(d_next, d)))
        values = [0.0 if a is None else ev.tensor(a) for a in found]  # None: no dependence
        dx[t] = values[0]
        d = [np.asarray(grads.get(s, zero)[t], dtype=np.float64) + v
             for s, v in zip(cell.states, values[1:1 + len(cell.states)])]
        for n, v in zip(ph_params, values[1 + len(cell.states):]):
            dparams[n] += v
    return dx, dparams, dict(zip(cell.states, d))
