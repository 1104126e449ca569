"""Gradients of a sequence: compiled (``compile_backward``) or the float64 reference.

Both take the forward's inputs and the gradient of a loss with respect to every state at every
step, ``grads`` ((T + 1, B, H) by state, the initial state first; a state left out has none), and
return the gradients with respect to x (T, B, I), each parameter and each initial state. For a loss
on the output sequence y and the final states: ``grads[cell.output][1:] = dL/dy`` and
``grads[s][T] += dL/d final s``.
"""

from __future__ import annotations

import functools
import operator

import numpy as np
import tvm
from tvm import te
from tvm.s_tir.schedule import ScheduleError

from halstm import schedules, targets

from .adjoint import AdjointCell
from .autodiff import adjoints
from .backward import BackwardProgram, lower_backward
from .cell import Cell, placeholders, trace
from .compiler import check_problem, serialised
from .compiler import compile as compile_cell
from .frames import Pack, ScratchPools, as_frame, check_array, check_names, on_cpu
from .layout import ACCUMULATE
from .lowering import Problem
from .oracle import _Evaluator
from .plan import make_plan
from .runtime import Arg, steps_of
from .scratch import lift_module


@serialised
def compile_backward(cell: Cell, steps: int | None, batch: int, dtype: str = "float32", target="cpu",
                     knobs: dict | None = None, database=None, allow_tf32: bool = False,
                     loop_recipe=None, given_hoisted: bool = False, given_results: bool = False) -> CompiledBackward:
    """The backward of ``halstm.compile(cell, steps, batch, dtype, target)`` (``halstm.backward``):
    its reversed time loop, the adjoint cell, compiled as ``halstm.compile`` compiles a cell (the
    recipe the tuning ``database``'s records or the defaults choose: ``halstm tune --training``);
    the functions around it over all rows scheduled by the target's step-loop recipe (``knobs``
    overrides its defaults). ``allow_tf32`` as for ``halstm.compile``: float32 GEMMs, the loop's and
    the functions', on TF32 tensor cores. ``steps=None``: one backward for every sequence length, T
    read off each call's x (its reversed loop compiled for any T too, called for T + 1 steps).
    ``loop_recipe``: the reversed loop's recipe (a name or ``Recipe``), as ``halstm.compile``'s
    ``recipe``; None: the database's records or the defaults choose. ``given_hoisted``: the call
    takes the forward's hoisted GEMM results (``hoisted=``, as ``CompiledCell.sequences_keeping``
    keeps them) instead of computing them again: the forward keeps T*B rows of each (float32)
    alive until the backward, and the backward does one GEMM over all rows less a hoisted GEMM.
    ``given_results``: the first stage's GEMM results too, as a forward compiled with
    ``keep_results`` keeps them (``lowering.kept_results``' names, in ``hoisted=``)."""
    check_problem(cell, steps, batch, dtype)
    target = targets.resolve(target)
    steps = None if steps is None else int(steps)
    recipe, knobs, program, exact = _backward_programs(cell, steps, int(batch), dtype, target, knobs, allow_tf32,
                                                       given_hoisted, given_results)
    adjoint = compile_cell(program.adjoint, None if steps is None else steps + 1, int(batch), dtype, target,
                           recipe=loop_recipe, database=database, allow_tf32=allow_tf32)
    from . import cache

    def build(program: BackwardProgram) -> CompiledBackward:
        made = {name: recipe.apply(p, target, **knobs) for name, p in program.functions.items()}
        functions = {name: s.mod["main"].with_attr("global_symbol", name) for name, s in made.items()}
        mod, scratch = lift_module(tvm.IRModule(functions), target)
        module = target.build(mod, **getattr(recipe, "build_options", {}))
        return CompiledBackward(program, target, recipe, knobs, made, module, adjoint, scratch)

    try:  # a cached entry is loaded without scheduling anything
        return cache.backward(program, target, recipe, knobs, adjoint, functools.partial(build, program))
    except ScheduleError:
        if exact is None:
            raise
        program = exact()
        return cache.backward(program, target, recipe, knobs, adjoint, functools.partial(build, program))


def lower_backward_for(cell: Cell, steps: int | None, batch: int, dtype: str, target,
                       knobs: dict | None = None, allow_tf32: bool = False):
    """(recipe, knobs, BackwardProgram, schedules made on the way by name), as ``compile_backward``
    builds them (``_backward_programs``): the program on tensor cores where TVM schedules its
    functions so (scheduled here to find out), else the exact one."""
    recipe, knobs, program, exact = _backward_programs(cell, steps, batch, dtype, target, knobs, allow_tf32)
    if exact is None:
        return recipe, knobs, program, {}
    try:
        return recipe, knobs, program, {name: recipe.apply(p, target, **knobs) for name, p in program.functions.items()}
    except ScheduleError:
        return recipe, knobs, exact(), {}


def _backward_programs(cell: Cell, steps: int | None, batch: int, dtype: str, target, knobs: dict | None,
                       allow_tf32: bool, given_hoisted: bool = False, given_results: bool = False):
    """(recipe, knobs, BackwardProgram, the exact program's lowering or None) for ``compile_backward``:
    the target's step-loop recipe and its knobs, the backward lowered in its layout, its reversed
    loop's operand GEMMs one a gate where the persistent kernel runs it in fp16/bf16 (each polling a
    gate's adjoint as stored), one gathered GEMM otherwise (H100, T=100, reversed loop ms, gathered / one a gate: LSTM fp16
    (100,16,512) 0.766 / 0.670, (100,64,1024) 2.374 (step loop) / 1.599; GRU fp16 0.641 / 0.525,
    1.887 / 1.020; LSTM fp32 (100,16,512) 0.679 / 0.857); the weight gradients' fp16/bf16 GEMMs on
    tensor cores (with ``allow_tf32`` their float32 GEMMs on TF32 tensor cores). Where TVM fails
    to schedule those (WMMA's schedule of a GEMM padded to its tiles can leave the next one without
    a stage pipeline: sizes that are not whole tiles, as LSTM T=5, B=16, H=32), the last item lowers
    the backward with them on float32 operands, exact; it is None where nothing runs on tensor
    cores (exact float32 and the CPU, whose step-loop schedules always apply)."""
    recipe = next(r for r in schedules.BUILTIN if r.name == f"{target.kind}-step-loop")
    plan = make_plan(cell)
    forward = Problem(cell, plan, steps, batch, dtype, allow_tf32=allow_tf32)
    knobs = recipe.resolve(forward, target, knobs)
    layout = recipe.layout(forward, target, knobs)
    on_tensor_cores = target.kind == "cuda" and (dtype != "float32" or allow_tf32)
    gathered = reversed_loop(cell, steps, batch, dtype, target, plan, allow_tf32).gathered
    program = lower_backward(cell, steps, batch, dtype, plan, layout, gathered, allow_tf32=allow_tf32,
                             given_hoisted=given_hoisted, given_results=given_results)
    if not on_tensor_cores:
        return recipe, knobs, program, None
    exact_options = dict(allow_tf32=False) if dtype == "float32" else dict(exact_weights=True)
    return recipe, knobs, program, lambda: lower_backward(cell, steps, batch, dtype, plan, layout, gathered,
                                                          given_hoisted=given_hoisted, given_results=given_results,
                                                          **exact_options)


def reversed_loop(cell: Cell, steps: int | None, batch: int, dtype: str, target, plan=None,
                  allow_tf32: bool = False) -> AdjointCell:
    """The adjoint cell ``compile_backward`` compiles for T + 1 steps (any, where ``steps`` is None),
    in the form ``lower_backward_for`` chooses (``halstm tune --training`` tunes it)."""
    plan = plan or make_plan(cell)
    target = targets.resolve(target)
    if target.kind == "cuda" and (dtype != "float32" or allow_tf32):
        from . import cache

        split = AdjointCell(plan, gathered=False)
        loop = Problem(split, make_plan(split), None if steps is None else steps + 1, batch, dtype,
                       allow_tf32=allow_tf32)
        first = cache.decided(loop, target, {"first recipe": True},
                              lambda: {"recipe": schedules.recipes_for(loop, target)[0].name})
        if first["recipe"] == "cuda-persistent":
            return split
    return AdjointCell(plan, gathered=True)


class CompiledBackward:
    """``dx, dparams, dstates = f(x, params, seqs, grads)``, where ``seqs`` are the forward's state
    sequences (``CompiledCell.sequences``). NumPy arrays in, NumPy out; torch tensors in, torch out
    (shared through DLPack, as the forward). ``schedules`` holds each function's schedule by name
    ("prepare", "rows", "weights"), ``adjoint`` the compiled reversed loop (a ``CompiledCell``);
    ``scratch`` each function's scratch buffers by name (``halstm.scratch``); ``cached``: the
    compiled-module cache's entry, None where it was built)."""

    cached = None
    PLANS_KEPT = 64  # call plans kept for a backward of any T, one a sequence length

    def __init__(self, program: BackwardProgram, target, recipe, knobs, schedules: dict, module, adjoint,
                 scratch: dict):
        self.program, self.target, self.recipe, self.knobs = program, target, recipe, knobs
        self.schedules, self.module, self.adjoint, self.scratch = schedules, module, adjoint, scratch

    @functools.cached_property
    def _plans(self) -> dict[int, _CallPlan]:
        return {}

    def _plan_for(self, T: int) -> _CallPlan:
        """The call plan of a call over T steps, made once a T (the most recent ``PLANS_KEPT`` kept)."""
        plan = self._plans.get(T)
        if plan is None:
            if len(self._plans) >= self.PLANS_KEPT:
                self._plans.pop(next(iter(list(self._plans))), None)
            plan = self._plans[T] = _CallPlan(self, T)
        return plan

    @functools.cached_property
    def longest(self) -> int | None:
        """The longest sequence a backward for any T takes (None for one T): its functions' and its
        reversed loop's, which runs T + 1 steps."""
        p = self.program
        return None if p.steps is not None else min(p.longest, self.adjoint.signature.longest - 1)

    def steps_of(self, x) -> int:
        """T of a call: the backward's, or where it serves any, x's first dimension, checked."""
        p = self.program
        if p.steps is not None:
            return p.steps
        return steps_of(x, p.batch, p.plan.cell.input_size, p.dtype, self.longest)

    def __call__(self, x, params: dict, seqs: dict, grads: dict | None = None, hoisted: dict | None = None):
        buffers, finish, plan, frame = self._bind(x, params, seqs, grads, hoisted, reuse=True)

        def run():
            for function, args in plan.calls:
                function(*args(buffers))

        frame.on_device(run)()
        done = finish()
        frame.release()  # the pack's buffers, done with (the results have their own)
        return done

    def prepare(self, x, params: dict, seqs: dict, grads: dict | None = None, hoisted: dict | None = None):
        """Check the arguments and allocate the buffers once; returns a function that runs the four
        compiled functions and waits for the device, as benchmarks time the kernels alone."""
        buffers, _, plan, frame = self._bind(x, params, seqs, grads, hoisted)
        calls = [(function, args(buffers)) for function, args in plan.calls]

        def run():
            for function, args in calls:
                function(*args)

        run = frame.on_device(run)

        def timed():
            run()
            frame.sync()

        return timed

    @functools.cached_property
    def _scratch_pools(self) -> ScratchPools:
        return ScratchPools()

    def _bind(self, x, params: dict, seqs: dict, grads: dict | None, hoisted: dict | None, reuse: bool = False):
        """A call's buffers by slot (``_CallPlan``), the caller's arrays checked and shared, the rest
        allocated; the function that returns (dx, dparams, dstates) after the call; the call plan;
        the frame. A call's host time beyond its kernels, torch tensors, LSTM T=5 B=2 H=16 float32 on the 2-core
        CPU machine (``python benchmarks/call_overhead.py LSTM 5,2,16 --backward --reps 3000``): 105-120 us;
        210-220 us before the call plan (functions looked up each call, a dict of every argument,
        each buffer allocated on its own), 365-375 us where the module was built in the process
        (each lookup then goes through the module's import tree). With ``reuse``, the pack's buffers
        are one of ``_scratch_pools``' allocations (torch tensors: the host's, or the CUDA stream's),
        which the call gives back."""
        T = self.steps_of(x)
        plan, dtype, B = self._plan_for(T), self.program.dtype, self.program.batch
        frame = as_frame(x, plan.device, plan.cpu)
        params = check_names(params, "params", plan.param_names, required=True)
        seqs = check_names(seqs, "seqs", plan.state_names, required=True)
        grads = check_names(grads or {}, "grads", plan.state_names, required=False)
        if plan.hoisted_names:
            hoisted = check_names(hoisted or {}, "hoisted", plan.hoisted_names, required=True)
        elif hoisted:
            raise ValueError("hoisted: this backward computes the hoisted GEMMs' results itself "
                             "(compile_backward(..., given_hoisted=True) takes them)")
        buffers = [None] * plan.count
        for slot, value in plan.numbers:  # T, T + 1: the sequence lengths of a backward for any T
            buffers[slot] = value
        missing = len(grads) < len(plan.state_names)  # then the pack's second buffer is zeroed too
        pool = self._scratch_pools.of(frame) if reuse else None
        for slot, value in zip(plan.scratch_slots, frame.new_all(plan.scratch, 2 if missing else 1, pool)):
            buffers[slot] = value
        for slot, arg in plan.results:
            buffers[slot] = frame.new(arg, zeros=False)
        sources = {"x": {"x": x}, "params": params, "seqs": seqs, "grads": grads, "hoisted": hoisted}
        share = frame.share
        for slot, where, key, what, shape, view in plan.given:
            source = sources[where]
            if key in source:
                value = source[key]
                check_array(value, what, shape, ACCUMULATE if where == "hoisted" else dtype)
                buffers[slot] = share(value if view is None else value.reshape(view))
            else:
                buffers[slot] = buffers[plan.no_gradient]
        for slot, s in plan.final_grads:  # the adjoint's initial states: each final state's gradient, else zeros
            buffers[slot] = share(grads[s][T]) if s in grads else buffers[plan.zeros]

        def finish():
            result, first = frame.result, (T + 1) * B  # the adjoint's last step: D_0
            return (result(buffers[plan.dx]).reshape(T, B, plan.input_size),
                    {n: result(buffers[i]) for n, i in plan.dparams},
                    {s: result(buffers[i])[first:first + B] for s, i in plan.dstates})

        return buffers, finish, plan, frame

    def __repr__(self):
        p = self.program
        return (f"<compiled backward of {p.plan.cell!r} T={p.steps or 'any'} B={p.batch} {p.dtype} "
                f"on {self.target.key} with {self.recipe.name} {self.knobs}, "
                f"its reversed loop with {self.adjoint.recipe.name}>")


class _CallPlan:
    """A CompiledBackward's calls worked out once: each buffer of its four functions by slot (an
    index into a call's list of buffers), where each comes from (the caller's arrays, checked and
    shared; one allocation for the buffers between the functions, zeros first: read in place of a
    missing gradient and as the reversed loop's initial states; one each for the results, which
    outlive the call), and the compiled functions bound with their arguments' slots in order; for a
    call over T steps (a backward for any T has one a T, its functions' ``STEPS`` T, its reversed
    loop's T + 1, each in a slot of its own: ``numbers``)."""

    def __init__(self, backward: CompiledBackward, T: int):
        p, adjoint = backward.program, backward.adjoint
        cell, B, dtype, H = p.plan.cell, p.batch, p.dtype, p.plan.cell.hidden_size
        self.device = backward.target.device()
        self.cpu = on_cpu(self.device)
        self.param_names, self.state_names, self.input_size = set(cell.parameters()), set(cell.states), cell.input_size
        slots: dict[str, int] = {}

        def slot(name: str) -> int:
            return slots.setdefault(name, len(slots))

        sequence = (T + 1, B, H)
        callers = {"x": ("x", "x", "x", (T, B, cell.input_size)),  # buffer -> (where, key, name in errors, shape)
                   **{n: ("params", n, f"params['{n}']", tuple(shape)) for n, shape in cell.parameters().items()},
                   **{f"{s}_seq": ("seqs", s, f"seqs['{s}']", sequence) for s in cell.states},
                   **{f"g{s}_seq": ("grads", s, f"grads['{s}']", sequence) for s in cell.states},
                   **{a.name: ("hoisted", a.name, f"hoisted['{a.name}']", a.at(T).shape)
                      for a in p.args if a.role == "hoisted"}}
        self.hoisted_names = {a.name for a in p.args if a.role == "hoisted"}
        results = {"dx", *(f"d{n}" for n in cell.parameters()), *(f"d{s}_seq" for s in cell.states)}
        from_adjoint = {a.name for a in adjoint.signature.args if a.role == "output"}
        # (slot, where, key, name in errors, shape expected, shape passed or None where the same)
        self.given: list[tuple] = []
        self.results: list[tuple[int, Arg]] = []
        self.numbers: list[tuple[int, int]] = []  # (slot, value): the sequence lengths a call passes
        grad_shape = next(a.at(T).shape for a in p.args if a.role == "grad")
        scratch = [Arg("zeros", (B, H), dtype, "buffer"), Arg("no gradient", grad_shape, dtype, "buffer")]
        phases: list[str | None] = [None, None]  # the pack's buffers' phases (``Pack``)
        self.zeros, self.no_gradient = slot("zeros"), slot("no gradient")
        self.scratch_slots = [self.zeros, self.no_gradient]

        def allocated(arg: Arg, key: str | None = None, phase: str | None = None) -> int:
            """The slot of a buffer the call allocates: a result, or one of the pack's (``key``:
            its slot's name where not the buffer's; ``phase``: the function whose own scratch it is,
            sharing bytes with the other functions' own)."""
            if arg.name in results:
                self.results.append((slot(arg.name), arg))
                return slots[arg.name]
            scratch.append(arg)
            phases.append(phase)
            self.scratch_slots.append(slot(key or arg.name))
            return self.scratch_slots[-1]

        for arg in p.args:
            arg = arg.at(T)
            if arg.role == "steps":
                self.numbers.append((slot(arg.name), T))
            elif arg.name in callers:
                where, key, what, shape = callers[arg.name]
                self.given.append((slot(arg.name), where, key, what, shape, None if arg.shape == shape else arg.shape))
            elif arg.name not in from_adjoint:
                allocated(arg)
        # the adjoint's initial states: zeros, but each final state's gradient ((slot, state) where given)
        self.final_grads: list[tuple[int, str]] = []
        adjoint_args = []
        for arg, where, key in adjoint.slots:
            arg = arg.at(T + 1)
            if arg.role == "steps":
                adjoint_args.append(slot("adjoint steps"))
                self.numbers.append((adjoint_args[-1], T + 1))
            elif arg.role == "x":
                adjoint_args.append(slots["adjoint_x"])
            elif where == "params":
                adjoint_args.append(slots[key])
            elif where == "states":
                final = next((s for s in cell.states if key == f"d{s}_local"), None)
                adjoint_args.append(self.zeros if final is None else slot(f"initial {key}"))
                if final is not None:
                    self.final_grads.append((adjoint_args[-1], final))
            else:
                adjoint_args.append(allocated(arg))
        # each function's own scratch buffers (``halstm.scratch``), a slot each; the functions run one
        # after another, so their own buffers share bytes: LSTM fp16 (100,256,1024) on CUDA, the pack
        # 2.45 GB against 3.78 GB unshared
        adjoint_args += [allocated(a.at(T + 1), f"adjoint {a.name}", "adjoint") for a in adjoint.scratch]
        indices = {name: [slots[a.name] for a in f.args] + [allocated(a.at(T), f"{name} {a.name}", name)
                                                           for a in backward.scratch.get(name, ())]
                   for name, f in p.functions.items()}
        self.count, self.scratch = len(slots), Pack(scratch, phases)
        self.dx = slots["dx"]
        self.dparams = [(n, slots[f"d{n}"]) for n in cell.parameters()]
        self.dstates = [(s, slots[f"d{s}_seq"]) for s in cell.states]
        self.calls = [(backward.module["prepare"], _getter(indices["prepare"])),
                      (adjoint.function, _getter(adjoint_args)),
                      (backward.module["rows"], _getter(indices["rows"])),
                      (backward.module["weights"], _getter(indices["weights"]))]


def _getter(indices: list[int]):
    """A list's items at ``indices``, as a tuple."""
    if len(indices) == 1:
        return lambda values: (values[indices[0]],)
    return operator.itemgetter(*indices)


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
