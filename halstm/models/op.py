"""A fixed-shape tensor function outside the cell machinery (a convolution, its gradient): TE math
made one TensorIR function, scheduled by a recipe, built for a target, called with torch tensors."""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import te

from halstm import targets
from halstm.frames import check_array, TorchFrame
from halstm.runtime import Arg
from halstm.scratch import lift_module


@dataclass
class OpProgram:
    """The unscheduled function ``main`` and what calling it needs.

    ``args`` are in call order, with role "input", "output" or "scratch": an intermediate result the
    caller allocates and drops after the call, so that torch's allocator counts the large ones (what
    a recipe adds, a packed copy of an operand, is the function's own). ``tags`` maps a block to the
    TE tag of the computation that made it.
    """

    name: str
    func: tvm.tirx.PrimFunc
    args: list[Arg]
    tags: dict[str, str]

    @property
    def mod(self) -> tvm.IRModule:
        return tvm.IRModule({"main": self.func})


def make_program(name: str, inputs: dict, outputs: dict, scratch: dict | None = None) -> OpProgram:
    """The function of ``outputs`` (and ``scratch``) from ``inputs``: dicts of TE tensors by name."""
    groups = (("input", inputs), ("output", outputs), ("scratch", scratch or {}))
    args = [Arg(n, tuple(int(d) for d in t.shape), str(t.dtype), role) for role, ts in groups for n, t in ts.items()]
    func = te.create_prim_func([t for _, ts in groups for t in ts.values()])
    tags, seen, stack = {}, set(), [t.op for t in [*outputs.values(), *(scratch or {}).values()]]
    while stack:
        op = stack.pop()
        if op in seen or isinstance(op, te.PlaceholderOp):
            continue
        seen.add(op)
        tags[op.name] = op.tag
        stack.extend(t.op for t in op.input_tensors)
    return OpProgram(name, func, args, {n: t for n, t in tags.items() if t})


class CompiledOp:
    """``f(*inputs)`` -> the outputs by name, torch tensors on the inputs' device. ``schedule.trace``
    lists the recipe's rewrites."""

    def __init__(self, program: OpProgram, target, recipe, knobs: dict):
        self.program, self.target, self.recipe, self.knobs = program, target, recipe, knobs
        self.schedule = recipe.apply(program, target, **knobs)
        if self.schedule is None:
            raise ValueError(f"recipe '{recipe.name}' does not apply to {program.name} on {target}")
        mod, scratch = lift_module(self.schedule.mod, target)
        self.module = target.build(mod)
        self._main = self.module["main"]
        self._args = [*program.args, *scratch.get("main", ())]  # then the schedule's scratch buffers
        self._inputs = [a.name for a in program.args if a.role == "input"]  # once, not per call

    def __call__(self, *values):
        import torch

        if len(values) != len(self._inputs):
            raise TypeError(f"{self.program.name} takes {self._inputs}, got {len(values)} tensors")
        frame = TorchFrame(values[0], self.target.device(), cpu=self.target.kind == "cpu")
        given = dict(zip(self._inputs, values))
        for name, value in given.items():
            if value.device != values[0].device:
                raise ValueError(f"{name} is on {value.device}, {self._inputs[0]} on {values[0].device}")
        tensors, outputs = [], {}
        for arg in self._args:
            if arg.role == "input":
                check_array(given[arg.name], arg.name, arg.shape, arg.dtype)
                tensors.append(frame.share(given[arg.name]))
            else:
                new = torch.empty(arg.shape, dtype=getattr(torch, arg.dtype), device=values[0].device)
                tensors.append(new)
                if arg.role == "output":
                    outputs[arg.name] = new
        self._main(*tensors)
        return outputs

    def __repr__(self):
        return f"<compiled {self.program.name} on {self.target.key} with {self.recipe.name} {self.knobs}>"


def compile_op(program: OpProgram, target, recipes, knobs: dict | None = None) -> CompiledOp:
    """Build ``program`` with the first of ``recipes`` that applies on ``target`` ("cpu", "cuda" or a
    ``halstm.targets`` object); ``knobs`` override its defaults."""
    target = targets.resolve(target)
    recipe = next((r for r in recipes if r.is_applicable(program, target)), None)
    if recipe is None:
        raise ValueError(f"none of {[r.name for r in recipes]} applies to {program.name} on {target}")
    return CompiledOp(program, target, recipe, recipe.resolve(program, target, knobs))
