"""A lowered function put together as IR: a parsed shell (the signature, the buffers, the views and
the loops, a few lines of TVMScript) whose blocks take the bodies of functions built with
``te.create_prim_func`` (the prologue's and the step's math), as TVMScript's parser would have read
them from the whole function's text. Parsing that text was 44 % of a compile's time on the 2-core
CPU (7.4 of 16.7 s under cProfile: LSTM and LayerNormGRU, I = H = 256, T = 100, B = 16, float32,
forward and backward); LayerNormGRU's forward alone, 0.28-0.53 s to parse the whole text, 0.06 s
the shell and 6-11 ms to splice."""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.s_tir.stmt import SBlock, SBlockRealize

PART = "T.evaluate(0)"  # a shell's placeholder where a block takes a part's body
DETECT_ACCESS = "tirx.script_parsing_detect_access"  # the parser's mark: find the block's reads and writes
_READS_AND_WRITES = 3


def splice(shell: tvm.tirx.PrimFunc, parts: dict) -> tvm.tirx.PrimFunc:
    """``shell`` with each block named in ``parts`` taking that function's body (after the block's
    own views): the function's buffers become the shell's buffers of the same names (its parameters,
    allocations and the views of its blocks), its variables the shell's scalar parameters of the same
    names (``STEPS``), its root block's allocations the block's (a function without a root block,
    nothing to compute, its body as it is); then every such block's reads and writes found from its
    body, as the parser finds them."""
    if not parts:
        return shell
    buffers = _named_buffers(shell)
    scalars = {p.name: p for p in shell.params if isinstance(p.ty, tvm.ir.PrimType)}
    taken = set(buffers)  # buffer names, each once in the function (``_renamed``)

    def take(block: SBlock) -> SBlock:
        part = parts.get(block.name_hint)
        if part is None:
            return block
        body = _renamed(part, buffers, scalars, taken).body
        body, allocs = (body.block.body, body.block.alloc_buffers) if isinstance(body, SBlockRealize) else (body, [])
        return SBlock(block.iter_vars, [], [], block.name_hint, body, block.init,
                      [*block.alloc_buffers, *allocs], block.match_buffers,
                      {**block.annotations, DETECT_ACCESS: tirx.IntImm("int32", _READS_AND_WRITES)}, block.span)

    return complete(shell.with_body(tvm_ffi.structural_map(shell.body, (SBlock, take))))


def complete(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """What TVMScript's parser does last to a function it built: the reads and writes of each block
    marked ``DETECT_ACCESS`` found from its body."""
    return tvm.get_global_func("script.Complete")(func, [], True)


def _named_buffers(func: tvm.tirx.PrimFunc) -> dict:
    """The buffers a function's body may name: its parameters, allocations and blocks' views."""
    out = {p.name: p for p in func.params if isinstance(p.ty, tirx.BufferType)}

    def block(b: SBlock):
        out.update({a.name: a for a in b.alloc_buffers})
        out.update({m.buffer.name: m.buffer for m in b.match_buffers})

    tvm_ffi.structural_walk(func.body, [(SBlock, block), (tirx.AllocBuffer, lambda s: out.update({s.buffer.name: s.buffer}))])
    return out


def _renamed(part: tvm.tirx.PrimFunc, buffers: dict, scalars: dict, taken: set) -> tvm.tirx.PrimFunc:
    """``part`` with its parameters the shell's ``buffers`` of the same names (one the shell does
    not name must be one its body does not touch), its variables the shell's ``scalars`` of the
    same names, and each buffer it allocates declared again where its shape reads one of them or
    its name is ``taken`` (then named as TVMScript's printer names a repeated name: ``compute_1``;
    the functions' buffers are passed by name, ``halstm.scratch``)."""
    given = [(p, buffers[p.name]) for p in part.params if p.name in buffers]
    absent = [p for p in part.params if p.name not in buffers]  # unused by its body, or an error
    remade = []

    def scalar(v):
        return scalars.get(v.name, v)

    for b in _allocated(part.body):
        shape = [tvm_ffi.structural_map(d, (tirx.Var, scalar)) for d in b.shape]
        name = _unused(b.name, taken)
        taken.add(name)
        if name != b.name or not all(new.same_as(old) for new, old in zip(shape, b.shape)):
            remade.append((b, tirx.decl_buffer(shape, b.dtype, name, scope=b.scope(), layout=b.layout)))

    def buffer(b):
        for old, new in given + remade:
            if b.same_as(old):
                return new
        if any(b.same_as(p) for p in absent):
            raise ValueError(f"splice: the body reads or writes '{b.name}', which the shell does not name")
        return b

    def var(v):  # a buffer is a variable of a buffer's type
        return scalar(v) if isinstance(v.ty, tvm.ir.PrimType) else buffer(v)

    def block(b: SBlock) -> SBlock:  # its allocations, which the variables' callback does not reach
        allocs = [buffer(a) for a in b.alloc_buffers]
        if all(new.same_as(old) for new, old in zip(allocs, b.alloc_buffers)):
            return b
        return SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, b.body, b.init, allocs, b.match_buffers,
                      b.annotations, b.span)

    return part.with_body(tvm_ffi.structural_map(part.body, [(SBlock, block), (tirx.Var, var)], order="pre"))


def _unused(name: str, taken: set) -> str:
    """``name``, or where it is taken the first of ``name_1``, ``name_2``, ... that is not."""
    n, out = 0, name
    while out in taken:
        n += 1
        out = f"{name}_{n}"
    return out


def _allocated(stmt) -> list:
    """The buffers ``stmt``'s blocks allocate, in order."""
    out = []
    tvm_ffi.structural_walk(stmt, (SBlock, lambda b: out.extend(b.alloc_buffers)))
    return out
