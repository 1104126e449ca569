"""The WMMA 16x16x16 intrinsics the tensor-core GEMM tensorizes with: operands fp16 or bf16 in
row-major shared-memory tiles, the accumulator fp32, stored to ``shared.dyn``.

Each is a pair (what the loop computes, what replaces it) written as TVMScript and registered on
first use. TVM ships equivalents in ``tvm.s_tir.tensor_intrin.cuda``, but importing that package
builds some 500 intrinsics for every target through a decorator that walks the Python stack, which
took 37-66 s on a 2-core machine: longer than compiling a cell.
"""

from __future__ import annotations

import functools
import textwrap

import tvm
from tvm.s_tir._tensor_intrin import TensorIntrin

FRAG = 16
_ACC = "float32"

# the fragment index of a 16x16 tile whose first element is at ``buf.elem_offset`` in a buffer of
# row stride ``stride``: fragments are numbered row by row
_INDEX = "{b}.elem_offset // {s} // 16 * ({s} // 16) + {b}.elem_offset % {s} // 16"


def _match(name: str, dtype: str, scope: str, strides: str = "") -> str:
    extra = f", strides=[{strides}]" if strides else ""
    return (f"    {name} = T.match_buffer({name.lower()}, (16, 16), \"{dtype}\", align=64, offset_factor=16, "
            f"scope=\"{scope}\"{extra})\n")


def _func(name: str, params: str, buffers: list[tuple], reads: str, writes: str, body: str) -> str:
    strides = "".join(f"    {s}1 = T.int32()\n    {s}0 = T.int32()\n" for *_, s in buffers if s)
    matches = "".join(_match(b, d, sc, f"{s}1, {s}0" if s else "") for b, d, sc, s in buffers)
    return (f"@T.prim_func(s_tir=True)\ndef {name}({params}):\n{strides}{matches}"
            f"    with T.sblock(\"root\"):\n        T.reads({reads})\n        T.writes({writes})\n"
            + textwrap.indent(body.strip("\n") + "\n", " " * 8))


_COPY = """
for i, j in T.grid(16, 16):
    with T.sblock("copy"):
        vi, vj = T.axis.remap("SS", [i, j])
        C[vi, vj] = A[vi, vj]
"""


def _copy(dtype: str, source: str, target: str) -> tuple[str, str]:
    """A 16x16 tile from scope ``source`` to ``target``, one of them a WMMA fragment: a
    load_matrix_sync from memory into a fragment, or a store_matrix_sync out of the accumulator."""
    load = target.startswith("wmma.")
    fragment, memory = ("C", "A") if load else ("A", "C")
    strides = {fragment: "d", memory: "s"}
    args = "a: T.handle, c: T.handle"
    io = ("A[0:16, 0:16]", "C[0:16, 0:16]")
    desc = _func("desc", args, [("A", dtype, source, ""), ("C", dtype, target, "")], *io, _COPY)
    call = (f"T.evaluate(T.tvm_{'load' if load else 'store'}_matrix_sync({fragment}.data, 16, 16, 16, "
            f"{_INDEX.format(b=fragment, s='d1')}, {memory}.access_ptr(\"{'r' if load else 'w'}\", "
            f"ptr_type=\"{dtype}\"), s1, \"row_major\", dtype=\"void\"))")
    impl = _func("impl", args, [("A", dtype, source, strides["A"]), ("C", dtype, target, strides["C"])], *io, call)
    return desc, impl


def _fill() -> tuple[str, str]:
    """0 -> ``wmma.accumulator``."""
    zero = """
for i, j in T.grid(16, 16):
    with T.sblock("init"):
        vi, vj = T.axis.remap("SS", [i, j])
        C[vi, vj] = T.float32(0)
"""
    call = (f"T.evaluate(T.tvm_fill_fragment(C.data, 16, 16, 16, {_INDEX.format(b='C', s='d1')}, "
            "T.float32(0), dtype=\"void\"))")
    desc = _func("desc", "c: T.handle", [("C", _ACC, "wmma.accumulator", "")], "", "C[0:16, 0:16]", zero)
    impl = _func("impl", "c: T.handle", [("C", _ACC, "wmma.accumulator", "d")], "", "C[0:16, 0:16]", call)
    return desc, impl


def _mma(dtype: str) -> tuple[str, str]:
    """C += A @ B over one 16x16x16 fragment triple, operands widened to fp32."""
    args = "a: T.handle, b: T.handle, c: T.handle"
    io = ("C[0:16, 0:16], A[0:16, 0:16], B[0:16, 0:16]", "C[0:16, 0:16]")
    loop = f"""
for i, j, k in T.grid(16, 16, 16):
    with T.sblock("update"):
        vi, vj, vk = T.axis.remap("SSR", [i, j, k])
        C[vi, vj] = C[vi, vj] + T.Cast("{_ACC}", A[vi, vk]) * T.Cast("{_ACC}", B[vk, vj])
"""
    index = {b: _INDEX.format(b=b, s=f"{b.lower()}1") for b in "ABC"}
    call = (f"T.evaluate(T.tvm_mma_sync(C.data, {index['C']}, A.data, {index['A']}, B.data, {index['B']}, "
            f"C.data, {index['C']}, dtype=\"void\"))")
    frags = [("A", dtype, "wmma.matrix_a"), ("B", dtype, "wmma.matrix_b"), ("C", _ACC, "wmma.accumulator")]
    desc = _func("desc", args, [(*f, "") for f in frags], *io, loop)
    impl = _func("impl", args, [(*f, f[0].lower()) for f in frags], *io, call)
    return desc, impl


@functools.cache
def intrinsics(dtype: str) -> dict[str, str]:
    """Register (once) and name the intrinsics for ``dtype`` operands: roles load_a, load_b,
    init, compute, store."""
    pairs = {"load_a": _copy(dtype, "shared", "wmma.matrix_a"), "load_b": _copy(dtype, "shared", "wmma.matrix_b"),
             "init": _fill(), "compute": _mma(dtype), "store": _copy(_ACC, "wmma.accumulator", "shared.dyn")}
    names = {role: f"halstm_wmma_{role}_{dtype}" for role in pairs}
    for role, (desc, impl) in pairs.items():
        TensorIntrin.register(names[role], tvm.script.from_source(desc), tvm.script.from_source(impl), override=True)
    return names
