"""Greedy decoding compiled whole: a ``for t`` loop around a decoder step, each step's argmax fed back
as the next step's token. No Python runs per token.

A decoder writes one step as math, ``step(p, token, h, context) -> (h, logits)``
(``seq2seq.GRUDecoder``); the loop adds the greedy choice ``token = argmax(logits)``. Lowering traces
the step as ``halstm.lowering`` traces a cell, with a tracer that decides what each matmul becomes. A
matmul over ``concat(parts)`` splits by its parts: the parts made from the context and parameters
alone are the same at every step, so their share (``context @ W_c^T``) is one GEMM before the loop;
the other parts are one GEMM a step. Their weights, column blocks of the parameters, are packed in
the recipe's layout by ``pack``, a second function of the module that runs once per set of weights.

``main`` is assembled as a cell's sequence is (``halstm.lowering.Skeleton``): 2-D buffers (``tokens``
1-D) with the state after step t in rows (t + 1) * B of its sequence, a ``prologue`` block, and a
``step`` block on row-block views. So the step-loop recipes schedule it as they schedule a cell;
``program.plan.gemms`` names its GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import te

from halstm import targets
from halstm.schedules.decode import recipe_for

from ..cell import Params, upstream
from ..layout import ACCUMULATE, PackedLayout, columns_of, packed_gemm, packed_weights
from ..lowering import Skeleton, indent, prim_func_of, stored_as, view_script
from ..ops import CONCAT_TAG, argmax, concat, tracing
from ..plan import Gemm, Matmul, Plan
from ..frames import as_frame, check_array, check_names, new_array, Pack
from ..runtime import Arg
from ..scratch import lift_module
from ..splice import PART

FLOAT = "float32"


@dataclass
class DecodePlan(Plan):
    """A decoder step's plan (``cell`` is the decoder): ``hoisted`` GEMMs over the context, once before
    the loop, then the step's GEMMs by stage; ``columns[name]`` lists the (start, width) blocks of
    its weight's columns that a GEMM multiplies."""

    columns: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def __str__(self):
        def describe(g: Gemm) -> str:
            blocks = ", ".join(f"{s}:{s + w}" for s, w in self.columns[g.name])
            return f"{g.name} = {g.operand.op.name} @ {g.members[0].weight}[:, {blocks}]^T  (N={g.rows}, K={g.depth})"

        lines = [f"greedy decoding plan for {self.cell!r}", "  before the loop, once:"]
        lines += [f"    {describe(g)}" for g in self.hoisted]
        lines.append("  each step:")
        lines += [f"    stage {s}: {describe(g)}" for s, stage in enumerate(self.stages, 1) for g in stage]
        lines.append("    then token = argmax(logits), the next step's input")
        return "\n".join(lines)


@dataclass
class DecodeProgram:
    """The lowered, unscheduled module (``main`` decodes, ``pack`` packs the weights) and its
    arguments. Recipes read it as they read a cell's ``Program``."""

    decoder: object
    plan: DecodePlan
    steps: int
    batch: int
    layout: PackedLayout
    mod: tvm.IRModule
    args: list[Arg]  # main's
    pack_args: list[Arg]
    dtype = FLOAT
    allow_tf32 = False

    @property
    def nominal_steps(self) -> int:
        """The steps the recipes' choices are made for (``Program.nominal_steps``): its own."""
        return self.steps


class _Splitter:
    """Answers ``matmul(a, weight)``: one GEMM a step over the parts of ``a`` that depend on the
    step's token or state, plus the result of one hoisted GEMM over the others."""

    def __init__(self, decoder, varying: set, layout: PackedLayout):
        self.varying, self.layout = varying, layout
        self.plan = DecodePlan(decoder, [], [], [])
        self.stage_of = {}  # a step GEMM's result op -> its stage
        self.hoisted = {}  # GEMM name -> (its result as the prologue computes it, as the step reads it)
        self.packed = {}  # GEMM name -> (its packed weights as pack computes them, as main reads them)

    def matmul(self, a, weight):
        parts = _parts(a)
        starts = np.cumsum([0] + [int(p.shape[1]) for p in parts])
        each_step, once = [], []
        for part, start in zip(parts, starts):
            (each_step if upstream(part) & self.varying else once).append((part, int(start)))
        name = weight.op.name
        result = None
        if once:
            hoisted = self._gemm(f"{name}_ctx", once, weight, stage=0)
            result = te.placeholder(hoisted.shape, ACCUMULATE, name=hoisted.op.name)
            self.hoisted[hoisted.op.name] = (hoisted, result)
        if each_step:  # a stage after those of the step GEMMs its operand is made from
            reads = set().union(*(upstream(p) for p, _ in each_step))
            stage = 1 + max((s for op, s in self.stage_of.items() if op in reads), default=0)
            gemm = self._gemm(f"{name}_step", each_step, weight, stage)
            self.stage_of[gemm.op] = stage
            result = gemm if result is None else gemm + result
        return result

    def _gemm(self, name: str, parts: list, weight: te.Tensor, stage: int) -> te.Tensor:
        operand = parts[0][0] if len(parts) == 1 else concat(*(p for p, _ in parts))
        blocks = []
        for p, start in parts:  # adjacent parts are one block of columns
            if blocks and sum(blocks[-1]) == start:
                blocks[-1] = (blocks[-1][0], blocks[-1][1] + int(p.shape[1]))
            else:
                blocks.append((start, int(p.shape[1])))
        columns = [columns_of(weight, s, w, f"{weight.op.name}_{s}") for s, w in blocks]
        selected = columns[0] if len(columns) == 1 else concat(*columns)
        rows, depth = int(weight.shape[0]), int(operand.shape[1])
        matmul = Matmul(len(self.plan.matmuls), operand, weight.op.name, rows, depth, None)
        gemm = Gemm(name, stage, operand, [matmul])
        self.plan.matmuls.append(matmul)
        if stage == 0:
            self.plan.hoisted.append(gemm)
        else:
            self.plan.stages += [[] for _ in range(stage - len(self.plan.stages))]
            self.plan.stages[stage - 1].append(gemm)
        self.plan.columns[name] = blocks
        packed = packed_weights(gemm, Params({weight.op.name: selected}), self.layout, f"w_packed_{name}")
        read = te.placeholder(packed.shape, weight.dtype, name=packed.op.name)
        self.packed[name] = (packed, read)
        return packed_gemm(operand, read, self.layout, rows, name)


def lower(decoder, steps: int, batch: int, layout: PackedLayout = PackedLayout()) -> DecodeProgram:
    """``main(context, start, h0, params..., packed..., tokens, h_seq, logits)`` decodes ``steps``
    tokens for ``batch`` rows; ``pack(weights..., packed...)`` packs the matmul weights."""
    B, H, V, N = batch, decoder.hidden_size, decoder.vocab_size, steps
    token = te.placeholder((B,), "int32", name="token_t")
    h = te.placeholder((B, H), FLOAT, name="h_t")
    context = te.placeholder((B, H), FLOAT, name="context")
    params = Params({n: te.placeholder(s, FLOAT, name=n) for n, s in decoder.parameters().items()})
    splitter = _Splitter(decoder, {token.op, h.op}, layout)
    with tracing(splitter):
        h_next, logits = decoder.step(params, token, h, context)
    plan = splitter.plan
    h_next = stored_as(h_next, FLOAT, "h_next")
    logits = stored_as(logits, FLOAT, "logits_t")
    token_next = stored_as(argmax(logits), "int32", "token_next")

    # main reads the matmul weights packed (pack makes them once), the other parameters as they are
    weights = {g.members[0].weight for g in plan.gemms}
    read = [p for n, p in params.items() if n not in weights]
    hoisted, hoisted_reads = zip(*splitter.hoisted.values()) if splitter.hoisted else ((), ())
    packed_reads = [splitter.packed[g.name][1] for g in plan.gemms]
    step = _function([token, h, context, *hoisted_reads, *read, *packed_reads], [h_next, logits, token_next])

    start = te.placeholder((B,), "int32", name="start")
    h0 = te.placeholder((B, H), FLOAT, name="h0")
    copies = [stored_as(start, "int32", "token_init"), stored_as(h0, FLOAT, "h_init")]
    prologue = _function([context, start, h0, *read, *packed_reads], [*hoisted, *copies])
    unpacked = [p for n, p in params.items() if n in weights]
    pack = _function(unpacked, [splitter.packed[g.name][0] for g in plan.gemms])

    args = [Arg("context", (B, H), FLOAT, "context"), Arg("start", (B,), "int32", "state"),
            Arg("h0", (B, H), FLOAT, "state")]
    args += [Arg(p.op.name, _shape(p), FLOAT, "param") for p in read]
    args += [Arg(p.op.name, _shape(p), FLOAT, "packed") for p in packed_reads]
    args += [Arg("tokens", ((N + 1) * B,), "int32", "output"), Arg("h_seq", ((N + 1) * B, H), FLOAT, "output"),
             Arg("logits", (N * B, V), FLOAT, "output")]
    allocs = [f'{t.op.name} = T.alloc_buffer({_shape(t)}, "{ACCUMULATE}")' for t in hoisted]
    frame = Skeleton(args, allocs,
                     [_tokens_view("token_init", "0", B), view_script("h_init", "h_seq", "0", B, H, FLOAT)],
                     [_tokens_view("token_t", f"t * {B}", B), view_script("h_t", "h_seq", f"t * {B}", B, H, FLOAT),
                      _tokens_view("token_next", f"t * {B} + {B}", B),
                      view_script("h_next", "h_seq", f"t * {B} + {B}", B, H, FLOAT),
                      view_script("logits_t", "logits", f"t * {B}", B, V, FLOAT)], prologue)
    loop = f"""    for t in range({N}):
        with T.sblock("step"):
{indent([*frame.step_views, PART], 12)}"""
    main = frame.function(loop, parts={"step": step})
    pack_args = [Arg(p.op.name, _shape(p), FLOAT, "param") for p in unpacked]
    pack_args += [Arg(p.op.name, _shape(p), FLOAT, "packed") for p in packed_reads]
    mod = tvm.IRModule({"main": main, "pack": pack.with_attr("global_symbol", "pack")})
    return DecodeProgram(decoder, plan, N, B, layout, mod, args, pack_args)


def _parts(a: te.Tensor) -> list[te.Tensor]:
    """The parts of a concatenation, in order; [a] for anything else (or parts that repeat)."""
    if a.op.tag != CONCAT_TAG:
        return [a]
    parts = list(a.op.input_tensors)
    return parts if sum(int(p.shape[1]) for p in parts) == int(a.shape[1]) else [a]


def _function(inputs, outputs) -> tvm.tirx.PrimFunc:
    return prim_func_of(inputs, outputs, [t.op.name for t in [*inputs, *outputs]])


def _shape(t) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


def _tokens_view(name: str, row: str, rows: int) -> str:
    return f'{name} = T.match_buffer(tokens[{row}:{row} + {rows}], ({rows},), "int32", offset_factor=1)'


def compile(decoder, steps: int, batch: int, target="cpu", knobs: dict | None = None) -> GreedyDecoder:  # noqa: A001
    """Compile greedy decoding of ``steps`` tokens for ``batch`` rows with the target's decode recipe
    (``halstm.schedules.decode``); ``knobs`` overrides its defaults."""
    for name, value in (("steps", steps), ("batch", batch)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    target = targets.resolve(target)
    recipe = recipe_for(target)
    program = lower(decoder, int(steps), int(batch))
    knobs = recipe.resolve(program, target, knobs)
    layout = recipe.layout(program, target, knobs)
    if layout != program.layout:
        program = lower(decoder, int(steps), int(batch), layout)
    schedule = recipe.apply(program, target, **knobs)
    mod, scratch = lift_module(schedule.mod, target)
    return GreedyDecoder(program, target, recipe, knobs, schedule, target.build(mod), scratch)


class GreedyDecoder:
    """Compiled greedy decoding. ``weights = f.pack(params)`` once per set of parameters (by name, as
    ``decoder.parameters()``), then ``tokens, hidden, logits = f(weights, context, h0, start)``:
    context and h0 (B, H), start tokens (B,) int32; tokens (N, B) int32, hidden (N + 1, B, H) with h0
    first, logits (N, B, V). NumPy arrays in, NumPy out; torch tensors in, torch out (shared through
    DLPack, on torch's current stream)."""

    def __init__(self, program: DecodeProgram, target, recipe, knobs, schedule, module, scratch: dict):
        self.program, self.target, self.recipe, self.knobs = program, target, recipe, knobs
        self.schedule, self.module, self.scratch = schedule, module, scratch  # scratch: ``halstm.scratch``
        self._packs = {name: Pack(args) for name, args in scratch.items()}  # allocated together, a call each
        self._device = target.device()

    def pack(self, params: dict) -> dict:
        p = self.program
        unpacked = [a for a in p.pack_args if a.role == "param"] + [a for a in p.args if a.role == "param"]
        check_names(params, "params", {a.name for a in unpacked}, required=True)
        frame = as_frame(next(iter(params.values())), self._device)
        weights = {}
        for arg in unpacked:
            check_array(params[arg.name], f"params['{arg.name}']", arg.shape, arg.dtype)
            weights[arg.name] = frame.share(params[arg.name])
        weights |= {a.name: new_array(a, self._device, zeros=False) for a in p.pack_args if a.role == "packed"}
        scratch = frame.new_all(self._packs["pack"]) if "pack" in self._packs else []
        self.module["pack"](*(weights[a.name] for a in p.pack_args), *scratch)
        return {a.name: weights[a.name] for a in p.args if a.role in ("param", "packed")}

    def __call__(self, weights: dict, context, h0, start):
        p = self.program
        N, B, H, V = p.steps, p.batch, p.decoder.hidden_size, p.decoder.vocab_size
        frame = as_frame(context, self._device)
        inputs = {"context": context, "h0": h0, "start": start}
        tensors, outputs = [], {}
        for arg in p.args:
            if arg.name in inputs:
                check_array(inputs[arg.name], arg.name, arg.shape, arg.dtype)
                tensors.append(frame.share(inputs[arg.name]))
            elif arg.role == "output":
                tensors.append(outputs.setdefault(arg.name, frame.new(arg, zeros=False)))
            else:
                tensors.append(weights[arg.name])
        tensors += frame.new_all(self._packs["main"]) if "main" in self._packs else []
        self.module["main"](*tensors)
        tokens, hidden, logits = (frame.result(outputs[n]) for n in ("tokens", "h_seq", "logits"))
        return tokens.reshape(N + 1, B)[1:], hidden.reshape(N + 1, B, H), logits.reshape(N, B, V)

    def __repr__(self):
        p = self.program
        return (f"<compiled greedy decoding of {p.decoder!r} N={p.steps} B={p.batch} on {self.target.key} "
                f"with {self.recipe.name} {self.knobs}>")
