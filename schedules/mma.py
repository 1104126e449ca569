"""The ``mma.sync`` intrinsics the tensor-core GEMM can tensorize with instead of WMMA (``TensorCoreTile.mma``):
fp16/bf16 operands loaded from shared memory by ``ldmatrix`` into a warp's registers, two
``mma.sync.m16n8k16`` a 16x16x16 tile, the fp32 accumulator kept in registers and stored to a shared
tile. WMMA's ``load_matrix_sync`` leaves the load instructions to nvcc; ``ldmatrix`` loads a warp's four
8x8 matrices with one instruction.

A 16x16 tile in registers is TVM's ``warp`` scope: a (32, 8) buffer, thread by element, laid out as
the mma operand and accumulator fragments are (``fragment_layout``); the schedule transforms each
warp buffer to (row tile, column tile, thread, element) so that a 16x16 tile is what these intrinsics
match. After TVM's own in ``tvm.s_tir.tensor_intrin.cuda`` (``get_ldmatrix_intrin``, ``get_mma_intrin``,
``get_mma_fill_intrin``, ``get_mma_store_intrin``), which are fp16 only and whose import registers some
500 intrinsics (wmma.py says what that costs).
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm.s_tir._tensor_intrin import TensorIntrin
from tvm.script import tirx as T

from .wmma import FRAG, TILE_SCOPE

WARP = 32
ELEMENTS = FRAG * FRAG // WARP  # a thread's elements of a 16x16 tile
PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16"}


def fragment_layout(i, j):
    """(thread, element) holding element (i, j) of a 16x16 mma operand or accumulator: rows i and
    i + 8 of a thread's column pair (j, j + 1), columns j and j + 8 (PTX ISA, "mma.m16n8k16")."""
    return 4 * (i % 8) + (j % 8) // 2, 4 * (j // 8) + (i // 8) * 2 + j % 2


def tiled_layout(i, j):
    """The warp buffers' layout: a 16x16 tile per (row tile, column tile), fragment-laid out."""
    return (i // FRAG, j // FRAG, *fragment_layout(i % FRAG, j % FRAG))


def _load(dtype: str, transpose: bool):
    """A 16x16 tile of ``TILE_SCOPE`` into a warp's fragment registers: one ldmatrix.x4 (with
    ``transpose``, .trans: the B operand of row-major (K, N) weights). Thread t gives the address of
    row t % 16, columns 8 * (t // 16) ... + 7."""

    @T.prim_func(s_tir=True)
    def desc(warp_handle: T.handle, shared_handle: T.handle) -> None:
        shared = T.match_buffer(shared_handle, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG, scope=TILE_SCOPE)
        warp = T.match_buffer(warp_handle, (WARP, ELEMENTS), dtype, align=64, offset_factor=FRAG, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:FRAG, 0:FRAG])
            T.writes(warp[0:WARP, 0:ELEMENTS])
            for ax0, ax1 in T.grid(FRAG, FRAG):
                with T.sblock("shared_warp"):
                    v0, v1 = T.axis.remap("SS", [ax0, ax1])
                    thread, element = T.meta_var(fragment_layout(v0, v1))
                    T.reads(shared[v0, v1])
                    T.writes(warp[thread, element])
                    warp[thread, element] = shared[v0, v1]

    @T.prim_func(s_tir=True)
    def impl(warp_handle: T.handle, shared_handle: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        shared = T.match_buffer(shared_handle, (FRAG, FRAG), dtype, align=64, offset_factor=FRAG, scope=TILE_SCOPE,
                                strides=[s0, s1])
        warp = T.match_buffer(warp_handle, (WARP, ELEMENTS), dtype, align=64, offset_factor=FRAG, scope="warp")
        with T.sblock("root"):
            T.reads(shared[0:FRAG, 0:FRAG])
            T.writes(warp[0:WARP, 0:ELEMENTS])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.ptx_legacy.ldmatrix(transpose, 4, ".b16", warp.data, warp.elem_offset + ELEMENTS * tx,
                                                 shared.access_ptr("r"), s0 * (tx % 16) + 8 * (tx // 16),
                                                 dtype=dtype))

    return desc, impl


def _mma(dtype: str):
    """C += A @ B over a 16x16x16 tile in fragments, as two m16n8k16 (B's and C's column halves)."""
    ptx = PTX_TYPE[dtype]

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, ELEMENTS), dtype, align=64, offset_factor=FRAG, scope="warp")
        B = T.match_buffer(b, (WARP, ELEMENTS), dtype, align=64, offset_factor=FRAG, scope="warp")
        C = T.match_buffer(c, (WARP, ELEMENTS), "float32", align=64, offset_factor=FRAG, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:ELEMENTS], A[0:WARP, 0:ELEMENTS], B[0:WARP, 0:ELEMENTS])
            T.writes(C[0:WARP, 0:ELEMENTS])
            for i, j, k in T.grid(FRAG, FRAG, FRAG):
                with T.sblock("C"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    tc, ec = T.meta_var(fragment_layout(vi, vj))
                    ta, ea = T.meta_var(fragment_layout(vi, vk))
                    tb, eb = T.meta_var(fragment_layout(vk, vj))
                    T.reads(C[tc, ec], A[ta, ea], B[tb, eb])
                    T.writes(C[tc, ec])
                    C[tc, ec] = C[tc, ec] + T.Cast("float32", A[ta, ea]) * T.Cast("float32", B[tb, eb])

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, b: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, ELEMENTS), dtype, align=64, offset_factor=FRAG, scope="warp")
        B = T.match_buffer(b, (WARP, ELEMENTS), dtype, align=64, offset_factor=FRAG, scope="warp")
        C = T.match_buffer(c, (WARP, ELEMENTS), "float32", align=64, offset_factor=FRAG, scope="warp")
        with T.sblock("root"):
            T.reads(C[0:WARP, 0:ELEMENTS], A[0:WARP, 0:ELEMENTS], B[0:WARP, 0:ELEMENTS])
            T.writes(C[0:WARP, 0:ELEMENTS])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                for half in T.unroll(2):
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", ptx, ptx, "fp32",
                        A.data, A.elem_offset + tx * ELEMENTS,
                        B.data, B.elem_offset + tx * ELEMENTS + half * (ELEMENTS // 2),
                        C.data, C.elem_offset + tx * ELEMENTS + half * (ELEMENTS // 2),
                        False, dtype="float32"))

    return desc, impl


def _fill():
    """0 -> a 16x16 fp32 accumulator tile."""

    @T.prim_func(s_tir=True)
    def desc(c: T.handle) -> None:
        C = T.match_buffer(c, (WARP, ELEMENTS), "float32", scope="warp")
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:ELEMENTS])
            for i0, i1 in T.grid(FRAG, FRAG):
                with T.sblock("init"):
                    i, j = T.axis.remap("SS", [i0, i1])
                    thread, element = T.meta_var(fragment_layout(i, j))
                    T.reads()
                    T.writes(C[thread, element])
                    C[thread, element] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle) -> None:
        C = T.match_buffer(c, (WARP, ELEMENTS), "float32", scope="warp", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:WARP, 0:ELEMENTS])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.cuda.mma_fill_legacy(ELEMENTS, C.data, C.elem_offset, dtype="float32"))

    return desc, impl


def _store(scope: str):
    """A 16x16 fp32 accumulator tile -> ``scope`` (a thread's two adjacent columns of a row at a time)."""

    @T.prim_func(s_tir=True)
    def desc(a: T.handle, c: T.handle) -> None:
        A = T.match_buffer(a, (WARP, ELEMENTS), "float32", scope="warp")
        C = T.match_buffer(c, (FRAG, FRAG), "float32", scope=scope)
        with T.sblock("root"):
            T.reads(A[0:WARP, 0:ELEMENTS])
            T.writes(C[0:FRAG, 0:FRAG])
            for i0, i1 in T.grid(FRAG, FRAG):
                with T.sblock("store"):
                    v0, v1 = T.axis.remap("SS", [i0, i1])
                    thread, element = T.meta_var(fragment_layout(v0, v1))
                    T.reads(A[thread, element])
                    T.writes(C[v0, v1])
                    C[v0, v1] = A[thread, element]

    @T.prim_func(s_tir=True)
    def impl(a: T.handle, c: T.handle) -> None:
        s0 = T.int32()
        s1 = T.int32()
        A = T.match_buffer(a, (WARP, ELEMENTS), "float32", scope="warp", offset_factor=1)
        C = T.match_buffer(c, (FRAG, FRAG), "float32", scope=scope, offset_factor=1, strides=[s0, s1])
        with T.sblock("root"):
            T.reads(A[0:WARP, 0:ELEMENTS])
            T.writes(C[0:FRAG, 0:FRAG])
            for tx in T.thread_binding(0, WARP, "threadIdx.x"):
                T.evaluate(T.cuda.mma_store_legacy(FRAG, FRAG, C.access_ptr("w"), A.data, A.elem_offset, s0,
                                                   dtype="float32"))

    return desc, impl


@functools.cache
def intrinsics(dtype: str) -> dict[str, str]:
    """Register (once) and name the intrinsics for ``dtype`` operands (fp16, bf16): roles load_a,
    load_b, init, compute, store (to the shared C tile), as wmma.intrinsics, and store_global."""
    pairs = {"load_a": _load(dtype, False), "load_b": _load(dtype, True), "init": _fill(),
             "compute": _mma(dtype), "store": _store(TILE_SCOPE), "store_global": _store("global")}
    names = {role: f"halstm_mma_{role}_{dtype}" for role in pairs}
    # TVM's lowering of mma_store_legacy looks the fragment layout up by this name
    tvm_ffi.register_global_func("tirx.index_map.shared_16x16_to_ldmatrix_32x8_layout",
                                 lambda ij: tvm.runtime.convert(list(fragment_layout(*ij))), override=True)
    for role, (desc, impl) in pairs.items():
        TensorIntrin.register(names[role], desc, impl, override=True)
    return names
