"""The CUDA target: the GPU's properties, and a build that can launch kernels cooperatively."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import tvm
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
    static_shared_memory = 48 * 1024  # per block, for "shared" scope (static) allocations

    @property
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
    def tvm_target(self) -> Target:
        return Target(
            {"kind": "cuda", "arch": self.arch, "max_threads_per_block": self.max_threads,
             "max_shared_memory_per_block": self.shared_memory},
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

        The flag must sit on the device function after the host/device split (an attribute on the
        PrimFunc does not reach the kernel), so this is ``tvm.tirx.build`` with one step between
        the split and the device finalisation.
        """
        _rewrite_generated_source()
        with self._context():
            if not cooperative:
                return tvm.compile(mod, target=self.tvm_target)
            host_mod, device_mods = self.split(mod)
            _, finalize_host, finalize_device = tvm.tirx.get_default_tir_pipeline(self.tvm_target)
            device_mods = {t: finalize_device()(_mark_cooperative(m)) for t, m in device_mods.items()}
            return tir_to_runtime(finalize_host()(host_mod), device_mods, Target(self.tvm_target.host))

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


_TF32_OPERAND = re.compile(r"(nvcuda::wmma::fragment<nvcuda::wmma::matrix_[ab], 16, 16, 8, )half(, [\w:]+> )(\w+)\[")
_LOAD = re.compile(r"nvcuda::wmma::load_matrix_sync\((\w+)(\[[^\]]*\]), [^;]*\);")


def tf32_fragments(source: str) -> str:
    """``source`` with its TF32 operand fragments declared as ``precision::tf32``: TVM 0.27 refuses
    fp32 operand fragments, so recipes type them fp16 (schedules/wmma.py), which prints a 16x16x8
    half fragment, a shape WMMA has for TF32 only. Each load_matrix_sync into one reads fp32 and is
    followed by the rounding to TF32 (10 mantissa bits, to nearest) that cuBLAS and cuDNN apply; the
    tensor cores alone would truncate."""
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


@functools.cache
def _rewrite_generated_source() -> None:
    """Hook ``tf32_fragments`` into TVM's CUDA code generation (its ``tvm_callback_cuda_postproc``,
    which sees every kernel's source before nvcc), after any hook already there. It rewrites only
    fragment declarations that nvcc would reject, so other CUDA code built in the process is unchanged."""
    name = "tvm_callback_cuda_postproc"
    before = tvm.get_global_func(name, allow_missing=True)

    def postproc(source, target):
        return tf32_fragments(before(source, target) if before is not None else source)

    tvm.register_global_func(name, postproc, override=True)


def _mark_cooperative(mod: tvm.IRModule) -> tvm.IRModule:
    """Flag the kernels that call grid_sync; the others (a prologue's GEMM, with more blocks than
    can be co-resident) keep the ordinary launch, which a cooperative one would refuse."""
    out = tvm.IRModule({}, attrs=mod.attrs)
    for gvar, func in mod.functions.items():
        params = list(func.attrs.get("tirx.kernel_launch_params", []) if func.attrs else [])
        if COOPERATIVE not in params and "grid_sync" in func.script():
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
