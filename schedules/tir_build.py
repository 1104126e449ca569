"""Small helpers for building TensorIR with TVM's IR builder, the calls TVMScript's parser makes:
loops and conditions as context managers, named values, syncs, and the last step of a parsed
function (``complete``)."""

from __future__ import annotations

from contextlib import contextmanager

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir import TensorLoad
from tvm.s_tir.stmt import SBlock
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder

from halstm.splice import DETECT_ACCESS
from halstm.splice import complete as parser_complete  # this module's ``complete`` adds ``whole``


def named_buffers(func: tvm.tirx.PrimFunc) -> dict:
    """The function's parameters and allocated buffers, by name."""
    out = {p.name: p for p in func.params}

    def allocated(node):
        out[node.buffer.name] = node.buffer

    tvm_ffi.structural_walk(func.body, (tirx.AllocBuffer, allocated))
    return out


_BUFFER_DATA = tvm.ir.Op.get("tirx.buffer_data")  # a buffer's pointer (``buffer.data``)


def complete(func: tvm.tirx.PrimFunc, whole: tuple = ()) -> tvm.tirx.PrimFunc:
    """What TVMScript's parser does last to a function it built (``s_tir``): each block's reads and
    writes found from its body, where not given. The blocks named in ``whole`` read and write every
    buffer they touch whole instead: a persistent kernel's blocks, whose regions TVM would infer from
    hundreds of accesses symbolic in the thread indices (LayerNormLSTM fp16 (T, 16, 512), its layer
    norms' sums unrolled: 18 s on the 2-core CPU machine, the rest of its compile 2 s)."""
    if whole:
        func = func.with_body(tvm_ffi.structural_map(
            func.body, (SBlock, lambda b: _touching_whole(b) if b.name_hint in whole else b)))
    return parser_complete(func)


def _touching_whole(block: SBlock) -> SBlock:
    """``block`` declaring whole every buffer from outside it that its body loads or stores or passes
    by pointer (a view's, ``match_buffer``'s, its source)."""
    loads, stores, pointers, inner, views = [], [], [], list(block.alloc_buffers), {}

    def nested(b):
        inner.extend(b.alloc_buffers)
        views.update({m.buffer: m.source.source for m in b.match_buffers})

    def pointer(call):
        if call.op.same_as(_BUFFER_DATA):
            pointers.append(call.args[0])

    tvm_ffi.structural_walk(block.body, [
        (TensorLoad, lambda e: loads.append(e.source)), (tirx.BufferStore, lambda s: stores.append(s.buffer)),
        (tirx.AllocBuffer, lambda s: inner.append(s.buffer)), (SBlock, nested), (tvm.ir.Call, pointer)])
    views.update({m.buffer: m.source.source for m in block.match_buffers})

    def outside(buffers):
        seen = {}
        for b in buffers:
            while b in views:
                b = views[b]
            if not any(b.same_as(i) for i in inner):
                seen.setdefault(b.name, b)
        return [tirx.BufferRegion(b, [tvm.ir.Range(0, n) for n in b.shape]) for b in seen.values()]

    annotations = {k: v for k, v in block.annotations.items() if k != DETECT_ACCESS}
    return SBlock(block.iter_vars, outside(loads + pointers), outside(stores + pointers), block.name_hint, block.body,
                  block.init, block.alloc_buffers, block.match_buffers, annotations, block.span)


def named(name: str, value):
    IRBuilder.name(name, value)
    return value


@contextmanager
def loop(kind, extent: int, name: str, **kwargs):
    with kind(extent, **kwargs) as var:
        yield named(name, var)


@contextmanager
def when(condition):
    with T.If(condition), T.Then():
        yield


def zero(dtype: str):
    return T.Cast(dtype, T.float32(0))


def sync_threads() -> None:
    T.evaluate(T.tvm_storage_sync("shared"))


def sync_grid() -> None:
    T.evaluate(T.cuda.grid_sync())


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m
