"""The WMMA intrinsics the tensor-core GEMM tensorizes with: operands in row-major tiles of dynamic
shared memory, the accumulator fp32, stored to another such tile. fp16/bf16 operands make 16x16x16 fragments;
fp32 operands (with TF32 allowed) 16x16x8 ones of ``precision::tf32``, the shape TF32 WMMA has.

Each is a pair (what the loop computes, what replaces it) written as TVMScript and registered on
first use. TVM ships equivalents in ``tvm.s_tir.tensor_intrin.cuda``, but importing that package
builds some 500 intrinsics for every target through a decorator that walks the Python stack, which
took 37-66 s on a 2-core machine: longer than compiling a cell. TVM 0.27 has none for TF32, and its
CUDA code generator refuses fp32 operand fragments; so TF32 operand fragments are typed fp16 in the
IR (``TF32_STAND_IN``: the load intrinsic "casts" to it, the mma widens it back), which prints a
16x16x8 half fragment, a shape WMMA has only for TF32; the CUDA target declares those as
``precision::tf32`` in the generated source (``targets/cuda.py``, ``tf32_fragments``).
"""

from __future__ import annotations

import functools
import textwrap

import tvm
from tvm.s_tir._tensor_intrin import TensorIntrin

FRAG = 16  # a fragment's rows (M) and columns (N)
_ACC = "float32"
TF32_STAND_IN = "float16"  # the IR type of a TF32 operand fragment
TILE_SCOPE = "shared.dyn"  # the shared tiles the operand fragments load from and the accumulator stores to


def fragment_dtype(dtype: str) -> str:
    """The IR type of an operand fragment for ``dtype`` operands."""
    return TF32_STAND_IN if dtype == "float32" else dtype


def frag_k(dtype: str) -> int:
    """A fragment's depth (K) for ``dtype`` operands: 8 for fp32 (as TF32), else 16."""
    return 8 if dtype == "float32" else 16


def _index(buffer: str, stride: str, cols: int) -> str:
    """The fragment index of a 16 x ``cols`` tile whose first element is at ``elem_offset`` in a
    buffer of row stride ``stride``: fragments are numbered row by row."""
    return f"{buffer}.elem_offset // {stride} // 16 * ({stride} // {cols}) + {buffer}.elem_offset % {stride} // {cols}"


def _match(name: str, dtype: str, scope: str, shape: tuple, strides: str = "") -> str:
    extra = f", strides=[{strides}]" if strides else ""
    return (f"    {name} = T.match_buffer({name.lower()}, {shape}, \"{dtype}\", align=64, offset_factor={min(shape)}, "
            f"scope=\"{scope}\"{extra})\n")


def _func(name: str, params: str, buffers: list[tuple], reads: str, writes: str, body: str) -> str:
    """``buffers``: (name, dtype, scope, shape, stride variable prefix or "")."""
    strides = "".join(f"    {s}1 = T.int32()\n    {s}0 = T.int32()\n" for *_, s in buffers if s)
    matches = "".join(_match(b, d, sc, shape, f"{s}1, {s}0" if s else "") for b, d, sc, shape, s in buffers)
    return (f"@T.prim_func(s_tir=True)\ndef {name}({params}):\n{strides}{matches}"
            f"    with T.sblock(\"root\"):\n        T.reads({reads})\n        T.writes({writes})\n"
            + textwrap.indent(body.strip("\n") + "\n", " " * 8))


_COPY = """
for i, j in T.grid({rows}, {cols}):
    with T.sblock("copy"):
        vi, vj = T.axis.remap("SS", [i, j])
        C[vi, vj] = {value}
"""


def _copy(dtype: str, source: str, target: str, shape: tuple, k: int) -> tuple[str, str]:
    """A ``shape`` tile of ``dtype`` from scope ``source`` to ``target``, one of them a WMMA
    fragment of depth ``k``: a load_matrix_sync from memory into an operand fragment (of
    ``fragment_dtype``), or a store_matrix_sync out of the accumulator."""
    load = target.startswith("wmma.")
    into = fragment_dtype(dtype) if load else dtype
    value = "A[vi, vj]" if into == dtype else f'T.Cast("{into}", A[vi, vj])'
    fragment, memory = ("C", "A") if load else ("A", "C")
    strides = {fragment: "d", memory: "s"}
    args = "a: T.handle, c: T.handle"
    region = f"0:{shape[0]}, 0:{shape[1]}"
    io = (f"A[{region}]", f"C[{region}]")
    body = _COPY.format(rows=shape[0], cols=shape[1], value=value)
    desc = _func("desc", args, [("A", dtype, source, shape, ""), ("C", into, target, shape, "")], *io, body)
    call = (f"T.evaluate(T.tvm_{'load' if load else 'store'}_matrix_sync({fragment}.data, 16, 16, {k}, "
            f"{_index(fragment, 'd1', shape[1])}, {memory}.access_ptr(\"{'r' if load else 'w'}\", "
            f"ptr_type=\"{dtype}\"), s1, \"row_major\", dtype=\"void\"))")
    buffers = [("A", dtype, source, shape, strides["A"]), ("C", into, target, shape, strides["C"])]
    impl = _func("impl", args, buffers, *io, call)
    return desc, impl


def _fill(k: int) -> tuple[str, str]:
    """0 -> ``wmma.accumulator``."""
    zero = """
for i, j in T.grid(16, 16):
    with T.sblock("init"):
        vi, vj = T.axis.remap("SS", [i, j])
        C[vi, vj] = T.float32(0)
"""
    call = (f"T.evaluate(T.tvm_fill_fragment(C.data, 16, 16, {k}, {_index('C', 'd1', 16)}, "
            "T.float32(0), dtype=\"void\"))")
    desc = _func("desc", "c: T.handle", [("C", _ACC, "wmma.accumulator", (16, 16), "")], "", "C[0:16, 0:16]", zero)
    impl = _func("impl", "c: T.handle", [("C", _ACC, "wmma.accumulator", (16, 16), "d")], "", "C[0:16, 0:16]", call)
    return desc, impl


def _mma(dtype: str, k: int) -> tuple[str, str]:
    """C += A @ B over one 16 x 16 x ``k`` fragment triple, operands widened to fp32."""
    args = "a: T.handle, b: T.handle, c: T.handle"
    io = (f"C[0:16, 0:16], A[0:16, 0:{k}], B[0:{k}, 0:16]", "C[0:16, 0:16]")
    loop = f"""
for i, j, k in T.grid(16, 16, {k}):
    with T.sblock("update"):
        vi, vj, vk = T.axis.remap("SSR", [i, j, k])
        C[vi, vj] = C[vi, vj] + T.Cast("{_ACC}", A[vi, vk]) * T.Cast("{_ACC}", B[vk, vj])
"""
    shapes = {"A": (16, k), "B": (k, 16), "C": (16, 16)}
    index = {b: _index(b, f"{b.lower()}1", shapes[b][1]) for b in "ABC"}
    call = (f"T.evaluate(T.tvm_mma_sync(C.data, {index['C']}, A.data, {index['A']}, B.data, {index['B']}, "
            f"C.data, {index['C']}, dtype=\"void\"))")
    operand = fragment_dtype(dtype)
    frags = [("A", operand, "wmma.matrix_a"), ("B", operand, "wmma.matrix_b"), ("C", _ACC, "wmma.accumulator")]
    desc = _func("desc", args, [(*f, shapes[f[0]], "") for f in frags], *io, loop)
    impl = _func("impl", args, [(*f, shapes[f[0]], f[0].lower()) for f in frags], *io, call)
    return desc, impl


@functools.cache
def intrinsics(dtype: str) -> dict[str, str]:
    """Register (once) and name the intrinsics for ``dtype`` operands: roles load_a, load_b,
    init, compute, store."""
    k = frag_k(dtype)
    pairs = {"load_a": _copy(dtype, TILE_SCOPE, "wmma.matrix_a", (16, k), k),
             "load_b": _copy(dtype, TILE_SCOPE, "wmma.matrix_b", (k, 16), k),
             "init": _fill(k), "compute": _mma(dtype, k),
             "store": _copy(_ACC, "wmma.accumulator", TILE_SCOPE, (16, 16), k)}
    names = {role: f"halstm_wmma_{role}_{dtype}" for role in pairs}
    for role, (desc, impl) in pairs.items():
        TensorIntrin.register(names[role], tvm.script.from_source(desc), tvm.script.from_source(impl), override=True)
    return names

