"""The CUDA target: the GPU's properties, and a build that can launch kernels cooperatively."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import tvm
import tvm_ffi
from tvm.runtime import Executable
from tvm.target import Target
from tvm.tirx.build import split_host_device_mods, tir_to_runtime  # the module: tvm.tirx.build is its function

COOPERATIVE = "tirx.use_cooperative_launch"


@dataclass(frozen=True)
class CudaTarget:
    """A CUDA GPU as recipes see it. ``detect()`` reads the device; the constructor lets a machine
    without a GPU compile for one (``CudaTarget("sm_90", sms=132)`` for an H100 SXM or an H200)."""

    arch: str
    sms: int
    shared_memory: int = 227 * 1024  # per block, opt-in maximum (Hopper)
    max_threads: int = 1024
    name: str = ""

    kind = "cuda"
    # global buffers between kernels are passed in by the caller (torch's allocator), not taken
    # from TVM's workspace pool, whose destructor may free them after the CUDA runtime began
    # unloading at exit (``halstm.scratch``)
    lifts_scratch = True
    static_shared_memory = 48 * 1024  # per block, for "shared" scope (static) allocations

    @functools.cached_property
    def compute_capability(self) -> int:
        """The architecture as a number: 90 for sm_90 (and sm_90a)."""
        return int("".join(c for c in self.arch if c.isdigit()))

    @classmethod
    def detect(cls, index: int = 0) -> CudaTarget:
        dev = tvm.cuda(index)
        if not dev.exist:
            raise RuntimeError(
                "no CUDA device is visible: pass CudaTarget(arch=..., sms=...) to compile for one"
            )
        major, minor = dev.compute_version.split(".")
        return cls(
            arch=f"sm_{major}{minor}",
            sms=dev.multi_processor_count,
            shared_memory=_opt_in_shared_memory(dev),
            max_threads=dev.max_threads_per_block,
            name=dev.device_name,
        )

    @property
    def isa(self) -> str:
        """The instruction set kernels are compiled for: sm_90 as sm_90a, the Hopper-only set that
        has wgmma (schedules/wgmma.py)."""
        return self.arch + ("a" if self.arch == "sm_90" else "")

    @property
    def tvm_target(self) -> Target:
        """TVM's target, for ``isa``."""
        return Target(
            {"kind": "cuda", "arch": self.isa,
             "max_threads_per_block": self.max_threads, "max_shared_memory_per_block": self.shared_memory},
            host="llvm",
        )

    @property
    def key(self) -> str:
        return f"cuda-{self.arch}-{self.sms}sm" + (f"-{self.name.replace(' ', '_')}" if self.name else "")

    def device(self):
        return tvm.cuda(0)

    def build(self, mod: tvm.IRModule, cooperative: bool = False):
        """Compile ``mod``; with ``cooperative``, every kernel that calls ``T.cuda.grid_sync()`` is
        launched with cudaLaunchCooperativeKernel, which the grid sync needs.

        This is ``tvm.tirx.build`` (which ``tvm.compile`` runs, and wraps in an Executable), with one
        step between the host/device split and the device finalisation: the cooperative flag, which
        must sit on the device function after the split (an attribute on the PrimFunc does not reach
        the kernel).
        """
        rewrite_generated_source()
        with self._context():
            host_mod, device_mods = self.split(mod)
            _, finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(self.tvm_target)
            if cooperative:
                device_mods = {t: mark_cooperative(m) for t, m in device_mods.items()}
            device_mods = {t: finalize_device()(m) for t, m in device_mods.items()}
            return Executable(tir_to_runtime(finalize_host()(host_mod), device_mods, Target(self.tvm_target.host)))

    def split(self, mod: tvm.IRModule) -> tuple[tvm.IRModule, dict]:
        """``mod`` through TVM's default TIR pipeline for this target, as ``build`` lowers it, split
        into the host module and the device modules (the kernels, before code generation)."""
        with self._context():
            target = self.tvm_target
            pipeline, _, _ = tvm.tirx.get_default_tir_pipeline(target)
            return split_host_device_mods(pipeline(tvm.tirx.transform.BindTarget(target)(mod)))

    @staticmethod
    def _context() -> tvm.transform.PassContext:
        """The caller's pass context (opt level, instruments, other config) without TIR CSE: TVM's
        common-subexpression pass hands a step's row offset (t * B * H) to the kernel as an opaque
        argument; the code generator then cannot prove a 16-byte load through a state's row view
        aligned and gathers instead (for fp16, a make_uint4 of eight halves that nvcc rejects).
        nvcc eliminates common subexpressions itself. With asynchronous copies on: the global to
        shared copies of a software pipeline's asynchronous stages become cp.async (the tensor-core
        GEMM's tc_stages); copies outside such stages stay as they are. And without TVM's storage
        rewrite: it gave the tensor-core GEMM's fp32 C tile the fp16 A tile's memory (in three or
        more stages), and lowering then failed on the fp32 pointer into it (access_ptr element
        type); the merge of the dynamic shared allocations, which lays them out by byte offsets,
        still shares that memory."""
        outer = tvm.transform.PassContext.current()
        config = {**outer.config, "tirx.disable_cse_tir": True, "tirx.use_async_copy": True,
                  "tirx.disable_storage_rewrite": True}
        return tvm.transform.PassContext(outer.opt_level, list(outer.required_pass), list(outer.disabled_pass),
                                         list(outer.instruments), config)


def visible_gpus() -> list[CudaTarget]:
    """Each CUDA device this process sees, in order (``CudaTarget.detect`` of each index)."""
    count = 0
    while tvm.cuda(count).exist:
        count += 1
    return [CudaTarget.detect(i) for i in range(count)]


_TF32_OPERAND = re.compile(r"(nvcuda::wmma::fragment<nvcuda::wmma::matrix_[ab], 16, 16, 8, )half(, [\w:]+> )(\w+)\[")
_LOAD = re.compile(r"nvcuda::wmma::load_matrix_sync\((\w+)(\[[^\]]*\]), [^;]*\);")


def tf32_fragments(source: str) -> str:
    """``source`` with its TF32 operand fragments declared as ``precision::tf32``. A rewrite of the
    generated CUDA because no IR declares a TF32 WMMA fragment: TVM 0.27 has no TF32 dtype and prints
    a fragment's type from its buffer's, refusing fp32 operands. So recipes type them fp16
    (schedules/wmma.py), which prints a 16x16x8 half fragment, a shape WMMA has for TF32 only. Each
    load_matrix_sync into one reads fp32 and is followed by the rounding to TF32 (10 mantissa bits,
    to nearest) that cuBLAS and cuDNN apply; the tensor cores alone would truncate."""
    names = {name for *_, name in _TF32_OPERAND.findall(source)}
    if not names:
        return source
    source = _TF32_OPERAND.sub(r"\1nvcuda::wmma::precision::tf32\2\3[", source)

    def rounded(load: re.Match) -> str:
        if load.group(1) not in names:
            return load.group(0)
        frag = load.group(1) + load.group(2)
        return (f"{load.group(0)} for (int t = 0; t < {frag}.num_elements; ++t) "
                f"{{ {frag}.x[t] = nvcuda::wmma::__float_to_tf32({frag}.x[t]); }}")

    return _LOAD.sub(rounded, source)


# Device functions that recipes call by name (T.call_extern), defined in a kernel's source where it
# calls them. The persistent kernel's step synchronised through the states' values
# (schedules/persistent_kernel.py, PersistentKernel.polled): the not-yet-written values hold a sentinel, a NaN
# with every bit set, that no stored value may have; its reductions' partial sums through values tagged
# with their step (schedules/persistent_reductions.py, GridReductions.store_part).
DEVICE_HELPERS = r"""
template <int N> __device__ __forceinline__ void halstm_load_relaxed(unsigned int* w, const void* p) {
  // N bytes (2, 4, 8 or 16) at p in global memory as 32-bit words, read past L1 (other SMs write them)
  if (N == 16) asm volatile("ld.relaxed.gpu.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                            : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p) : "memory");
  else if (N == 8) asm volatile("ld.relaxed.gpu.global.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p) : "memory");
  else if (N == 4) asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(w[0]) : "l"(p) : "memory");
  else { unsigned short h; asm volatile("ld.relaxed.gpu.global.u16 %0, [%1];" : "=h"(h) : "l"(p) : "memory"); w[0] = h; }
}

template <int N, int W> __device__ __forceinline__ bool halstm_has_sentinel(const unsigned int* w) {
  // whether any of the W-byte values in the N bytes is the sentinel
  bool any = false;
  for (int i = 0; i < (N + 3) / 4; ++i)
    any |= W == 4 ? w[i] == 0xFFFFFFFFu : ((w[i] & 0xFFFFu) == 0xFFFFu || (N > 2 && (w[i] >> 16) == 0xFFFFu));
  return any;
}

template <int N> __device__ __forceinline__ void halstm_store(void* p, const unsigned int* w) {
  if (N == 16) *(uint4*)p = make_uint4(w[0], w[1], w[2], w[3]);
  else if (N == 8) *(uint2*)p = make_uint2(w[0], w[1]);
  else if (N == 4) *(unsigned int*)p = w[0];
  else *(unsigned short*)p = (unsigned short)w[0];
}

template <int N, int W, typename... P> __device__ __forceinline__ void halstm_poll_stage(bool poll, P... pointers) {
  // pointers: (destination, source) pairs of N bytes; the sources are all loaded at once, and with
  // poll those holding a sentinel again (together) until none does; then stored
  constexpr int n = sizeof...(P) / 2;
  void* p[] = {(void*)pointers...};
  unsigned int v[n][4];
#pragma unroll
  for (int i = 0; i < n; ++i) halstm_load_relaxed<N>(v[i], p[2 * i + 1]);
  for (bool missing = poll; missing;) {
    missing = false;
#pragma unroll
    for (int i = 0; i < n; ++i)
      if (halstm_has_sentinel<N, W>(v[i])) { missing = true; halstm_load_relaxed<N>(v[i], p[2 * i + 1]); }
  }
#pragma unroll
  for (int i = 0; i < n; ++i) halstm_store<N>(p[2 * i], v[i]);
}

template <int W> __device__ __forceinline__ void halstm_wait_value(bool poll, const void* p) {
  // with poll, until the W-byte value at p is not the sentinel
  unsigned int w[4];
  if (poll) do { halstm_load_relaxed<W>(w, p); } while (halstm_has_sentinel<W, W>(w));
}

__device__ __forceinline__ void halstm_store_part(void* p, unsigned int tag, float v) {
  // a partial sum and the step it belongs to (tag), in one 8-byte store
  unsigned long long w = (unsigned long long)tag << 32 | __float_as_uint(v);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(w) : "memory");
}

template <typename... P> __device__ __forceinline__ void halstm_poll_parts(unsigned int tag, P... pointers) {
  // pointers: (destination, source) pairs of partial sums stored by halstm_store_part; the sources
  // all loaded at once, read past L1, those of another tag again (together) until none is; then
  // the values stored
  constexpr int n = sizeof...(P) / 2;
  void* p[] = {(void*)pointers...};
  unsigned long long w[n];
#pragma unroll
  for (int i = 0; i < n; ++i) asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w[i]) : "l"(p[2 * i + 1]) : "memory");
  for (bool missing = true; missing;) {
    missing = false;
#pragma unroll
    for (int i = 0; i < n; ++i)
      if ((unsigned int)(w[i] >> 32) != tag) {
        missing = true;
        asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w[i]) : "l"(p[2 * i + 1]) : "memory");
      }
  }
#pragma unroll
  for (int i = 0; i < n; ++i) *(float*)p[2 * i] = __uint_as_float((unsigned int)w[i]);
}

__device__ __forceinline__ float halstm_lane_sum(float v, int lanes) {
  // the sum of v over the aligned group of `lanes` lanes (a power of two up to 32) that holds this
  // thread, in each lane of the group (a butterfly: every lane adds the same pairs); every lane of
  // the warp calls it
  unsigned int mask = __activemask();
  for (int m = lanes >> 1; m > 0; m >>= 1) v += __shfl_xor_sync(mask, v, m);
  return v;
}

template <int N> struct halstm_bits;
template <> struct halstm_bits<2> { typedef unsigned short type; static constexpr type sentinel = 0xFFFFu, nan = 0x7FFFu; };
template <> struct halstm_bits<4> { typedef unsigned int type; static constexpr type sentinel = 0xFFFFFFFFu, nan = 0x7FFFFFFFu; };

template <typename V> __device__ __forceinline__ V halstm_not_sentinel(V v) {
  // v, or a canonical NaN where its bits are the sentinel's
  typedef halstm_bits<sizeof(V)> B;
  typename B::type b = *reinterpret_cast<typename B::type*>(&v);
  if (b == B::sentinel) { b = B::nan; v = *reinterpret_cast<V*>(&b); }
  return v;
}
"""


def with_device_helpers(source: str) -> str:
    """``source`` with DEVICE_HELPERS before its first kernel where it calls them. A rewrite of the
    generated CUDA because the kernels call the helpers by name (``T.call_extern``), which TIR does not
    define; TVM 0.27's ``T.ptx.ld.relaxed.gpu`` could now express their loads in the IR instead."""
    at = source.find('extern "C" __global__')
    return source if "halstm_" not in source or at < 0 else source[:at] + DEVICE_HELPERS + "\n" + source[at:]


@functools.cache
def rewrite_generated_source() -> None:
    """Hook ``tf32_fragments`` and ``with_device_helpers`` into TVM's CUDA code generation (its
    ``tvm_callback_cuda_postproc``, which sees every kernel's source before nvcc), after any hook
    already there. They rewrite only fragment declarations that nvcc would reject and add only
    functions halstm's kernels call, so other CUDA code built in the process is unchanged."""
    name = "tvm_callback_cuda_postproc"
    before = tvm.get_global_func(name, allow_missing=True)

    def postproc(source, target):
        return with_device_helpers(tf32_fragments(before(source, target) if before is not None else source))

    tvm.register_global_func(name, postproc, override=True)


def calls_grid_sync(func: tvm.tirx.PrimFunc) -> bool:
    """Whether device function ``func`` calls ``T.cuda.grid_sync()``, which stays a call of the op
    ``tirx.cuda.grid_sync`` through TVM 0.27's lowering up to the host/device split."""
    grid_sync = tvm.ir.Op.get("tirx.cuda.grid_sync")
    found = tvm_ffi.structural_walk(
        func.body, (tvm.ir.Call, lambda call: tvm_ffi.VisitInterrupt() if call.op.same_as(grid_sync) else None))
    return found is not None


def mark_cooperative(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod``'s device functions, those that call grid_sync flagged for the cooperative launch; the
    others (a prologue's GEMM, with more blocks than can be co-resident) keep the ordinary launch,
    which a cooperative one would refuse."""
    out = tvm.IRModule({}, attrs=mod.attrs)
    for gvar, func in mod.functions.items():
        params = list(func.attrs.get("tirx.kernel_launch_params", []) if func.attrs else [])
        if COOPERATIVE not in params and calls_grid_sync(func):
            # the runtime wants the dynamic-shared-memory tag last
            dyn = [t for t in params if "dyn_shared" in t]
            func = func.with_attr("tirx.kernel_launch_params", [t for t in params if t not in dyn] + [COOPERATIVE] + dyn)
        out[gvar] = func
    return out


def _opt_in_shared_memory(dev) -> int:
    """Shared memory a block may opt into: the driver's figure when torch can read it, else the
    static 48 KiB limit TVM reports."""
    try:
        import torch

        props = torch.cuda.get_device_properties(dev.index)
        return int(getattr(props, "shared_memory_per_block_optin", dev.max_shared_memory_per_block))
    except Exception:  # torch absent or without CUDA: the runtime's figure is the safe one
        return dev.max_shared_memory_per_block
