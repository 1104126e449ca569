"""Small helpers for building TensorIR with TVM's IR builder, the calls TVMScript's parser makes:
loops and conditions as context managers, named values, syncs, and the last step of a parsed
function (``complete``)."""

from __future__ import annotations

from contextlib import contextmanager

import tvm
import tvm_ffi
from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder


def named_buffers(func: tvm.tirx.PrimFunc) -> dict:
    """The function's parameters and allocated buffers, by name."""
    out = {p.name: p for p in func.params}

    def allocated(node):
        out[node.buffer.name] = node.buffer

    tvm_ffi.structural_walk(func.body, (tirx.AllocBuffer, allocated))
    return out


def complete(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """What TVMScript's parser does last to a function it built (``s_tir``): each block's reads and
    writes found from its body, where not given."""
    return tvm.get_global_func("script.Complete")(func, [], True)


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
