"""Hopper's warpgroup GEMM (wgmma, sm_90a): C[M, N] = A[M, K] @ W[K, N] in fp32 from fp16/bf16
operands (fp32 ones as TF32), one kernel that a schedule tensorizes a whole GEMM block with
(``gemm_wgmma``):

    W's buffer laid out (N, K) where it is packed in the GEMM's scope (transform_layout) or
    packed so (PackedLayout.k_major)
    for block (bm = 64 x groups rows, bn columns; columns fastest)     blockIdx.x
      for warpgroup (64 rows each, 128 threads)                         threadIdx.x
        for kt in K / bk (bk: 128 bytes, 64 fp16 or 32 fp32), stages K tiles in flight (cp.async):
          A_s[bm, bk], W_s[bn, bk]                    "shared.dyn", rows of 128 bytes, 16-byte
                                                      chunks XOR-swizzled by row (wgmma's 128B mode);
                                                      W given (K, N), fp16/bf16 only: W_s[64, bn] in
                                                      atoms of 8 K rows by 64 columns (wgmma's
                                                      MN-major operand, which TF32 lacks)
          4 x wgmma.mma_async m64n{bn}k16 (k8 TF32; A_s, W_s through matrix descriptors)
          acc += ...                                  registers, bn / 2 floats a thread; the first
                                                      K step overwrites it (scale-d 0)
        C = acc                                       rows past M not stored

WMMA (cuda_tensorcore.py) reaches the tensor cores through warp-level mma.sync, whose operands every
warp first loads from shared memory into registers; wgmma reads both from shared memory itself, a
warpgroup at a time, and runs asynchronously to the issuing threads. H100, the kernels alone
(``benchmarks/gemm_tiles.py``, docs/results.md#where-the-time-goes), us, fp16:

    GEMM (M x N x K)        WMMA (recipe default)   wgmma (wgmma_tile)   wgmma, C 8 bytes a store   cuBLAS
    25600 x 4096 x 1024     697                     573                  387                        300-307
    6400 x 8192 x 2048      723                     501                                             297
    256 x 4096 x 1024       14.7                    10.5                 7.3                        5.8-6.7
    64 x 8192 x 2048        17.2                    11.1                                            9.7

Storing each thread's two adjacent accumulators with one 8-byte store instead of two 4-byte ones
took a third off: the fp32 C of the hoisted GEMM is 420 MB. bf16 the same for wgmma and
cuBLAS; WMMA's bf16 took 988-1012 us on the large GEMMs. cuBLAS keeps a lead: its kernels also load
tiles by TMA, in thread-block clusters, with warps that only load (warp specialisation), and write
C in fp16; TVM 0.27 offers those as raw PTX too, not done here.

The kernel is written in TVMScript with TVM's ``T.ptx`` instructions (wgmma.mma_async, cp.async) and
registered as a tensor intrinsic per shape and tile. It replaces the GEMM's update; the GEMM's
zero-fill (``decompose_reduction``) becomes an intrinsic that emits nothing, since the update
overwrites C at its first K step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import tvm_ffi
from tvm import tirx
from tvm.s_tir import Schedule
from tvm.s_tir._tensor_intrin import TensorIntrin
from tvm.tirx import IntImm
from tvm.script import tirx as T

from .cuda_tensorcore import BYTES, store_operand_in, tensorize_works
from .recipe import divides, in_k_slices, is_pure_copy

ROW_BYTES = 128  # a K tile: one 128-byte swizzled row (64 fp16/bf16 elements, 32 fp32)
K_STEPS = 4  # wgmma instructions a K tile: each takes 32 bytes of K (k16 fp16/bf16, k8 tf32)
WARPGROUP = 128  # threads
ROWS = 64  # a warpgroup's rows (wgmma's M)
SWIZZLE_128B = 3  # T.cuda.wgmma.encode_matrix_descriptor's code for the 128-byte swizzle
ARCH = 90  # wgmma exists on sm_90a only (Hopper; Blackwell has tcgen05 instead)
_PTX_TYPE = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}  # float32 only as TF32


@dataclass(frozen=True)
class WgmmaTile:
    """A block of ``groups`` warpgroups (64 rows each) by ``bn`` columns, ``stages`` K tiles of 64 in
    shared memory; with ``in_flight`` one wgmma group stays in flight while the next K tile is
    fetched (then stages - 2 tiles are fetched ahead, else stages - 1)."""

    groups: int
    bn: int
    stages: int
    in_flight: bool

    @classmethod
    def parse(cls, name: str) -> WgmmaTile:
        """The tile ``name`` names: "2x256x4f" is 2 warpgroups by 256 columns, 4 stages, a group in flight."""
        groups, bn, stages = name.rstrip("f").split("x")
        return cls(int(groups), int(bn), int(stages), name.endswith("f"))

    @property
    def name(self) -> str:
        return f"{self.groups}x{self.bn}x{self.stages}{'f' if self.in_flight else ''}"

    @property
    def bm(self) -> int:
        return ROWS * self.groups

    @property
    def threads(self) -> int:
        return WARPGROUP * self.groups

    @property
    def ahead(self) -> int:
        return self.stages - 2 if self.in_flight else self.stages - 1

    @property
    def shared_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * ROW_BYTES

    def fits(self, cols: int, depth, dtype: str, target) -> bool:
        """Whether the tile serves N = ``cols`` and K = ``depth`` (a number, or an expression in a
        function's sequence length that its K tile provably divides) in shared memory."""
        return (cols % self.bn == 0 and divides(depth, ROW_BYTES // BYTES[dtype]) and self.bn <= 256
                and self.ahead >= 1 and self.shared_bytes <= target.shared_memory)

    def blocks(self, rows: int, cols: int) -> int:
        return -(-rows // self.bm) * (cols // self.bn)


def wgmma_available(dtype: str, target, allow_tf32: bool = False) -> bool:
    """fp16/bf16 GEMMs (float32 ones as TF32 where allowed) on a Hopper GPU."""
    return (target.kind == "cuda" and dtype in _PTX_TYPE and (dtype != "float32" or allow_tf32)
            and target.compute_capability == ARCH and tensorize_works())


LONG_K = 2048  # a GEMM's K from which two warpgroups by 256 columns pay off at one wave of blocks
# Where K is long, a block of one warpgroup by 128 columns does a quarter of a wide block's work in
# this fraction of its time (H200, fp16, 3072 x 1024 x 25600: 384 such blocks in 317 us, 96 wide in 270)
NARROW_BLOCK_TIME = 0.39


def wgmma_tile(rows: int, cols: int, target, depth=None) -> WgmmaTile:
    """The fastest tile measured for the shape's kind (H100). Where two warpgroups by 256
    columns make four waves of blocks or more (the hoisted GEMM over all T*B rows), or, where K
    (``depth``: a number, or an expression in a function's sequence length, whose rows it sums) is
    long (the backward's GEMMs over all rows), fewer waves than the narrow tile's weighed by
    NARROW_BLOCK_TIME: that tile, four stages, one wgmma group in flight (573 us at 25600 x 4096 x 1024; 128 columns in five stages 577, without the group in
    flight 626-638). A step's few rows: one warpgroup, 128 columns in six stages (10.5 us at 256 x
    4096 x 1024, 128 blocks) or, where that leaves half the SMs idle, 64 columns in four (11.1 us at
    64 x 8192 x 2048 against 11.7). With 8-byte stores: 387 against 422 us hoisted, a step's 7.3
    against 7.7 and 9.0; TF32 the same choice (681 against 809 us hoisted, a step's 12.4 against
    13.7); the recipe's knobs wgmma_hoisted and wgmma_step choose others. The backward's, H200,
    fp16, us, two warpgroups by 256 against one by 128 (``benchmarks/gemm_tiles.py``; cuBLAS):
    4096 x 1024 x 6400 (a weight gradient, B = 64) 78 against 109 (69), 6400 x 1024 x 4096 (its
    operand's) 99 against 122 (78), 4096 x 1024 x 25600 296 against 431 (265); TF32 143 against 213
    (131); at 2048 x 512 x 1600 (32 blocks) 20.3 against 8.3; GRU's, 3072 x 1024 x 6400 (96 wide
    blocks) 73 against 82, TF32 138 against 160, 1536 x 1024 x 6400 (48) 70 against 52."""
    wide = WgmmaTile(2, 256, 4, True) if cols % 256 == 0 else WgmmaTile(2, 128, 5, True)
    step = WgmmaTile(1, 128, 6, True)
    narrow = step if cols % 128 == 0 and 2 * step.blocks(rows, cols) > target.sms else WgmmaTile(1, 64, 4, False)
    if cols % wide.bn:
        return narrow
    if _long(depth):  # the fewer waves of blocks, each narrow one NARROW_BLOCK_TIME of a wide one's
        waves = lambda tile: -(-tile.blocks(rows, cols) // target.sms)
        return wide if waves(wide) <= NARROW_BLOCK_TIME * waves(narrow) else narrow
    return wide if wide.blocks(rows, cols) >= 4 * target.sms else narrow


def _long(depth) -> bool:
    """Whether K is at least LONG_K: a number (0 or None: not known), or an expression in a function's
    sequence length (the rows of a sequence, long at the sequence lengths that matter)."""
    if depth is None or isinstance(depth, (int, IntImm)):
        return depth is not None and int(depth) >= LONG_K
    return True


def gemm_wgmma(sch: Schedule, block, tile: WgmmaTile, dtype: str) -> bool:
    """``block`` (C[b, n] += A[b, k] * W[k, n], fp32, loops b, n, k) as the wgmma kernel, a copy
    feeding A inlined (A is read where the copy reads it). W packed in this scope is laid out (N, K)
    (transform_layout; its packing becomes a copy): wgmma's K-major operand, the layout the module's
    figures were measured in. Weights packed elsewhere (the step's, packed by the prologue: transform_layout refuses a
    buffer of the whole function) are read as stored: (N, K) where the lowering packed them so
    (``PackedLayout.k_major``), else (K, N), wgmma's MN-major operand: fp16/bf16 only (TF32 wgmma has
    no transposed operand). A computed A (r * h; the split of PackedLayout.tf32x3) stays its own
    kernel, stored in ``dtype`` (rounded, as WMMA's fetch rounds it). Returns False, leaving the
    block alone, where an operand is not in ``dtype`` nor computed for this GEMM alone, or the layout
    is not one wgmma reads (float32: as TF32). A GEMM in K slices (s, b, n, k: PackedLayout.split_k)
    is one kernel whose grid's z is the slice, each reading its slice of A's and W's K (strided)."""
    a_buffer, w_buffer = (r.source for r in sch.get(block).reads[:2])
    producers = [p for p in sch.get_producers(block) if sch.get(p).writes[0].source.same_as(a_buffer)]
    copies = [is_pure_copy(sch, p) for p in producers]
    a_source = sch.get(producers[0]).reads[0].source if producers and all(copies) else a_buffer
    k_by_n = sch.get(block).reads[1].region[0].min.same_as(sch.get(block).iter_vars[-1].var)  # W[k, n]
    packings = [p for p in sch.get_producers(block) if sch.get(p).writes[0].source.same_as(w_buffer)]
    if (w_buffer.dtype != dtype or (a_source.dtype != dtype and all(copies))
            or (dtype == "float32" and k_by_n and not packings)
            or any(len(sch.get_consumers(p)) > 1 for p in producers)):
        return False
    for producer, copy in zip(producers, copies):
        if copy:
            sch.compute_inline(producer)
    store_operand_in(sch, block, dtype)
    _row_tiles_in_grid(sch, block, tile)
    sliced = in_k_slices(sch, block)
    if sliced:
        sch.bind(sch.get_loops(block)[-4], "blockIdx.z")
    rows, cols, depth = (sch.get(loop).extent for loop in sch.get_loops(block)[-3:])
    rows, cols = int(rows), int(cols)
    depth = int(depth) if isinstance(depth, IntImm) else depth  # symbolic: the weight gradients' T*B rows
    if k_by_n and packings:
        sch.transform_layout(block, ("read", 1), lambda k, n: (n, k))
        for packing in packings:  # now a copy: k innermost
            if len(sch.get_loops(packing)) == 2:
                sch.reorder(*reversed(sch.get_loops(packing)))
        k_by_n = False
    init = sch.decompose_reduction(block, sch.get_loops(block)[-3])
    sch.tensorize(sch.get_loops(init)[-2], _register_fill(rows, cols))
    loop = sch.get_loops(block)[-3]
    if isinstance(depth, int):
        sch.tensorize(loop, _register_gemm(rows, cols, depth, dtype, tile, k_by_n, sliced))
    else:
        name = sch.get(block).name_hint
        sch.tensorize(loop, _register_gemm_of_any_depth(rows, cols, depth, dtype, tile, k_by_n))
        _bind_depth(sch, sch.get_sblock(name + "_o"), depth)  # the block tensorize makes of the loop
    return True


def _bind_depth(sch: Schedule, kernel, depth) -> None:
    """The tensorized ``kernel``'s own K variable replaced by the GEMM's K (an expression of the
    function's sequence length): tensorize set the operands' regions to the kernel's buffer shapes,
    which read that variable, and nothing else defines it."""
    stmt = sch.get(kernel)
    k = stmt.match_buffers[0].buffer.shape[1]  # A (M, k)
    bound = tvm_ffi.structural_map(stmt, (tirx.Var, lambda v: depth if v.same_as(k) else v))
    sch.state.replace(sch.get_sref(kernel), bound, {stmt: bound})


def _row_tiles_in_grid(sch: Schedule, block, tile: WgmmaTile) -> None:
    """Rows of symbolic extent (a function for any T, its hoisted GEMM's rows padded to a multiple
    of the tile's, ``lowering.hoisted_rows``): the kernel for one row tile of ``tile.bm`` rows,
    the row tiles along the grid's y. A kernel's rows are fixed where it is registered."""
    rows = sch.get_loops(block)[-3]
    if isinstance(sch.get(rows).extent, IntImm):
        return
    row_tile, _ = sch.split(rows, [None, tile.bm])
    sch.bind(row_tile, "blockIdx.y")


@functools.cache  # once a process: a registration (parsing the kernel) took 0.10-0.16 s on the 2-core CPU
def _register_fill(rows: int, cols: int) -> str:
    name = f"halstm_wgmma_fill_{rows}x{cols}"

    @T.prim_func(s_tir=True)
    def desc(c: T.handle):
        C = T.match_buffer(c, (rows, cols), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:rows, 0:cols])
            for i, j in T.grid(rows, cols):
                with T.sblock("fill"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    C[vi, vj] = T.float32(0)

    @T.prim_func(s_tir=True)
    def impl(c: T.handle):
        C = T.match_buffer(c, (rows, cols), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads()
            T.writes(C[0:rows, 0:cols])
            T.evaluate(0)  # the GEMM's first K step overwrites C

    TensorIntrin.register(name, desc, impl, override=True)
    return name


@functools.cache
def _register_gemm(M: int, N: int, K: int, dtype: str, tile: WgmmaTile, k_by_n: bool, strided: bool = False) -> str:
    """The kernel for K = ``K``; ``strided``: A's and W's K columns part of their rows (a K slice)."""
    suffix = ("_kn" if k_by_n else "") + ("_s" if strided else "")
    return _register(f"halstm_wgmma_{M}x{N}x{K}_{dtype}_{tile.name}{suffix}", M, N, K, dtype, tile, k_by_n, strided)


def _register_gemm_of_any_depth(M: int, N: int, K, dtype: str, tile: WgmmaTile, k_by_n: bool) -> str:
    """The kernel for K an expression in a function's sequence length (its weight gradients' sums
    over T*B rows): its description reads that expression, which tensorize matches in the GEMM it
    replaces; its kernel a K variable of its own, which ``_bind_depth`` replaces by the expression.
    Registered again for each GEMM (one name: tensorize reads it at once), with a description of
    its expression and the kernel parsed once a process."""
    return _register(f"halstm_wgmma_{M}x{N}xT_{dtype}_{tile.name}{'_kn' if k_by_n else ''}",
                     M, N, K, dtype, tile, k_by_n)


def _register(name: str, M: int, N: int, K, dtype: str, tile: WgmmaTile, k_by_n: bool, strided: bool = False) -> str:
    w_shape = (K, N) if k_by_n else (N, K)
    a_strides, w_strides = _strides(strided), _strides(strided and not k_by_n)

    @T.prim_func(s_tir=True, check_well_formed=False)  # a symbolic K reads the function's sequence length
    def desc(a: T.handle, w: T.handle, c: T.handle):
        A = T.match_buffer(a, (M, K), dtype, strides=a_strides, offset_factor=1)
        W = T.match_buffer(w, w_shape, dtype, strides=w_strides, offset_factor=1)
        C = T.match_buffer(c, (M, N), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:M, 0:N], A[0:M, 0:K], W[0:w_shape[0], 0:w_shape[1]])
            T.writes(C[0:M, 0:N])
            for i, j, k in T.grid(M, N, K):
                with T.sblock("gemm"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    C[vi, vj] = C[vi, vj] + T.Cast("float32", A[vi, vk]) * T.Cast(
                        "float32", W[vk, vj] if k_by_n else W[vj, vk])

    impl = _kernel(M, N, K if isinstance(K, int) else None, dtype, tile, k_by_n, strided)
    TensorIntrin.register(name, desc, impl, override=True)
    return name


def _strides(strided: bool) -> list:
    """A match_buffer's strides: a row stride of its own where the region is part of its rows."""
    return [tirx.Var("row_stride", "int32"), 1] if strided else []


@functools.cache  # once a process for a K of any length (a fixed K's registration is cached whole)
def _kernel(M: int, N: int, K: int | None, dtype: str, tile: WgmmaTile, k_by_n: bool, strided: bool = False):
    """The kernel as the intrinsic's implementation (same buffers as its description); K a number,
    or None for any (then its prologue fetches only the K tiles that exist); ``strided``: A and
    W (N, K) rows of a stride of their own. W (N, K) is staged K-major: a W tile is bn rows of 128 bytes, as A's. W (K, N) is
    staged MN-major: 8 K rows of 64 columns (1024 bytes, swizzled as A's rows) an atom, the atoms
    of a K group side by side along N, the K groups after one another; its descriptor's leading
    offset is the atoms' distance along N, its stride offset the K groups' (the other order
    computes garbage)."""
    bm, bn, stages, ahead, threads = tile.bm, tile.bn, tile.stages, tile.ahead, tile.threads
    size = BYTES[dtype]
    bk, chunk = ROW_BYTES // size, 16 // size  # elements of a K tile, of a 16-byte copy
    atoms = bn // 64  # MN-major W: atoms along N
    w_ldo, w_sdo = 1024 // 16, atoms * 1024 // 16  # 16-byte units
    k_step_bytes = 2 * atoms * 1024 if k_by_n else 32  # an instruction's K through the W tile
    col_tiles = N // bn
    a_tile = bm * bk
    stage = (bm + bn) * bk  # elements of shared memory a stage: the A tile, then the W tile
    acc_n = bn // 2
    ptx = _PTX_TYPE[dtype]
    mma = f"wgmma.mma_async.sync.aligned.m64n{bn}k{32 // size}.f32.{ptx}.{ptx}"
    transposes = () if dtype == "float32" else (0, 1 if k_by_n else 0)  # TF32 takes no transpose immediates
    guarded = K is None or K // bk < ahead  # the K tiles fetched ahead may not all exist
    # any K: a variable of the kernel's own (the description's expression reaches tensorize as a copy,
    # whose variable nothing would define), replaced by the GEMM's K afterwards (``_bind_depth``)
    K = tirx.Var("k", "int32") if K is None else K
    w_shape = (K, N) if k_by_n else (N, K)
    a_strides, w_strides = _strides(strided), _strides(strided and not k_by_n)

    @T.macro
    def fetch(smem, A, W, tx, m0, n0, slot, kt):
        # 16-byte chunks, 8 to a 128-byte row: chunk c of row r at chunk c ^ (r % 8) (the swizzle);
        # rows past M are zero-filled (source size 0) from a clamped, valid address
        for i in T.unroll(a_tile // chunk // threads):
            c = T.meta_var(tx + i * threads)
            r = T.meta_var(c // 8)
            T.ptx["cp.async.cg.shared.global"](
                T.address_of(smem[slot * stage + r * bk + T.bitwise_xor(c % 8, r % 8) * chunk]),
                T.address_of(A[T.min(m0 + r, M - 1), kt * bk + c % 8 * chunk]), 16,
                T.if_then_else(m0 + r < M, T.uint32(16), T.uint32(0)))
        for i in T.unroll(bn * bk // chunk // threads):
            c = T.meta_var(tx + i * threads)
            if k_by_n:  # (fp16/bf16) chunk c: K row c // (bn / 8), its 16 bytes c % (bn / 8) along N
                k = T.meta_var(c // (bn // 8))
                n = T.meta_var(c % (bn // 8))
                T.ptx["cp.async.cg.shared.global"](
                    T.address_of(smem[slot * stage + a_tile + ((k // 8 * atoms + n // 8) * 8 + k % 8) * 64
                                      + T.bitwise_xor(n % 8, k % 8) * 8]),
                    T.address_of(W[kt * bk + k, n0 + n * 8]), 16, T.uint32(16))
            else:
                r = T.meta_var(c // 8)
                T.ptx["cp.async.cg.shared.global"](
                    T.address_of(smem[slot * stage + a_tile + r * bk + T.bitwise_xor(c % 8, r % 8) * chunk]),
                    T.address_of(W[n0 + r, kt * bk + c % 8 * chunk]), 16, T.uint32(16))

    @T.prim_func(s_tir=True, check_well_formed=False)  # as the description
    def impl(a: T.handle, w: T.handle, c: T.handle):
        A = T.match_buffer(a, (M, K), dtype, strides=a_strides, offset_factor=1)
        W = T.match_buffer(w, w_shape, dtype, strides=w_strides, offset_factor=1)
        C = T.match_buffer(c, (M, N), "float32", offset_factor=1)
        with T.sblock("root"):
            T.reads(C[0:M, 0:N], A[0:M, 0:K], W[0:w_shape[0], 0:w_shape[1]])
            T.writes(C[0:M, 0:N])
            bx = T.launch_thread("blockIdx.x", -(-M // bm) * col_tiles)
            tx = T.launch_thread("threadIdx.x", threads)
            smem = T.alloc_buffer((stages * stage,), dtype, scope="shared.dyn")
            acc = T.alloc_buffer((acc_n,), "float32", scope="local")
            a_desc = T.alloc_buffer((1,), "uint64", scope="local")
            w_desc = T.alloc_buffer((1,), "uint64", scope="local")
            m0 = T.meta_var(bx // col_tiles * bm)
            n0 = T.meta_var(bx % col_tiles * bn)
            group = T.meta_var(tx // WARPGROUP)
            for s in T.unroll(ahead):
                if guarded:
                    if s < K // bk:
                        fetch(smem, A, W, tx, m0, n0, s, s)
                else:
                    fetch(smem, A, W, tx, m0, n0, s, s)
                T.ptx["cp.async.commit_group"]()
            for i in T.unroll(acc_n):
                acc[i] = T.float32(0)
            # K-major, 128-byte swizzle: 8-row groups 1024 bytes apart (16-byte units: 64)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(a_desc[0]), T.address_of(smem[group * ROWS * bk]),
                                                  1, 64, SWIZZLE_128B)
            T.cuda.wgmma.encode_matrix_descriptor(T.address_of(w_desc[0]), T.address_of(smem[a_tile]),
                                                  w_ldo if k_by_n else 1, w_sdo if k_by_n else 64, SWIZZLE_128B)
            for kt in range(K // bk):
                T.ptx["cp.async.wait_group"](ahead - 1)
                T.ptx.fence.proxy.async_.shared__cta()  # the copies' writes, seen by wgmma's reads
                T.tvm_storage_sync("shared")
                if kt + ahead < K // bk:
                    fetch(smem, A, W, tx, m0, n0, (kt + ahead) % stages, kt + ahead)
                T.ptx["cp.async.commit_group"]()
                T.ptx.wgmma.fence.sync.aligned()
                for kk in T.unroll(K_STEPS):
                    # the descriptors' start address (16-byte units) moved to the stage and K step
                    T.ptx[mma](*[acc[i] for i in range(acc_n)],
                               a_desc[0] + T.Cast("uint64", (kt % stages * stage * size + kk * 32) // 16),
                               w_desc[0] + T.Cast("uint64", (kt % stages * stage * size + kk * k_step_bytes) // 16),
                               T.ptx.pred(T.Or(kt > 0, kk > 0)), 1, 1, *transposes)
                T.ptx.wgmma.commit_group.sync.aligned()
                T.ptx.wgmma.wait_group.sync.aligned(1 if tile.in_flight else 0)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            # the accumulator fragment: warp w of the group, lane l, register i
            warp = T.meta_var(tx % WARPGROUP // 32)
            lane = T.meta_var(tx % 32)
            for j in T.unroll(acc_n // 2):  # registers 2j, 2j + 1: two adjacent columns, one 8-byte store
                row = T.meta_var(m0 + group * ROWS + warp * 16 + lane // 4 + j % 2 * 8)
                if row < M:
                    C[row, T.Ramp(n0 + j // 2 * 8 + lane % 4 * 2, 1, 2)] = acc[T.Ramp(2 * j, 1, 2)]

    return impl
