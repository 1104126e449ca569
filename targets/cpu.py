"""The multi-core CPU target (LLVM)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import tvm
from tvm.target import codegen

# TVM's thread pool assumes two hardware threads a core and uses half of the CPUs it sees: on a
# 2-CPU machine, one. Parallel loops then ran on one core (91 GFLOP/s against 184 with two, for the
# step GEMM of LSTM B=64 H=512). The pool reads this variable when it starts, at the first parallel
# call; a value the user set wins.
os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))


@dataclass(frozen=True)
class CpuTarget:
    """An x86/ARM CPU: LLVM's name for it, the cores used, and its float32 SIMD lanes."""

    mcpu: str
    cores: int
    lanes: int

    kind = "cpu"
    # global buffers between a function's loops stay in TVM's workspace pool, which keeps them
    # between calls: a caller's allocation of the hoisted GEMM's T x B x 4H output would fault its
    # pages in on every call (``halstm.scratch``)
    lifts_scratch = False

    @classmethod
    def host(cls) -> CpuTarget:
        mcpu = codegen.llvm_get_system_cpu()
        probe = tvm.target.Target({"kind": "llvm", "mcpu": mcpu})
        if codegen.llvm_cpu_has_features("avx512f", probe):
            lanes = 16
        elif codegen.llvm_cpu_has_features("avx2", probe) or codegen.llvm_cpu_has_features("avx", probe):
            lanes = 8
        else:
            lanes = 4
        return cls(mcpu, len(os.sched_getaffinity(0)), lanes)

    @property
    def tvm_target(self) -> tvm.target.Target:
        return tvm.target.Target({"kind": "llvm", "mcpu": self.mcpu, "num-cores": self.cores})

    @property
    def key(self) -> str:
        """What identifies this target in a tuning record."""
        return f"llvm-{self.mcpu}-{self.cores}c"

    def device(self):
        return tvm.cpu(0)

    def build(self, mod: tvm.IRModule):
        return tvm.compile(mod, target=self.tvm_target)
