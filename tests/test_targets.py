"""The CPU target's vectorisable exp: accurate, IEEE at the extremes (inf, 0, NaN as torch), and really
vectorised; the CUDA target's cooperative launch of the kernels that grid-sync."""

import numpy as np
import tvm
from tvm import te
from tvm.s_tir import Schedule
from tvm.script import tirx as T

from halstm.targets import CudaTarget, resolve
from halstm.targets.cuda import COOPERATIVE, mark_cooperative


def build_exp(n):
    target = resolve("cpu")
    x = te.placeholder((n,), name="x")
    y = te.compute((n,), lambda i: te.exp(x[i]), name="y")
    sch = Schedule(te.create_prim_func([x, y]))
    sch.vectorize(sch.split(sch.get_loops(sch.get_sblock("y"))[0], [None, 8])[1])
    return target.build(sch.mod)


def test_exp_is_accurate_and_keeps_nan():
    values = np.concatenate([np.linspace(-86, 86, 8000), [np.nan] * 8, [-1e4] * 8, [1e4] * 8]).astype(np.float32)
    f = build_exp(values.size)
    out = tvm.runtime.empty(values.shape, "float32", tvm.cpu())
    f(tvm.runtime.tensor(values, tvm.cpu()), out)
    got = out.numpy()
    finite = slice(0, 8000)
    want = np.exp(values[finite].astype(np.float64))
    assert np.max(np.abs(got[finite] - want) / want) < 5e-7
    assert np.isnan(got[8000:8008]).all()
    assert (got[8008:8016] == 0).all() and (got[8016:] == np.inf).all()  # as torch: underflow to 0, overflow to inf


def test_exp_makes_no_libm_calls():
    asm = build_exp(64).mod.inspect_source("asm")
    assert "expf" not in asm


@T.prim_func
def grid_sync_then_wide(a: T.Buffer((64,), "float32")):
    for bx in T.thread_binding(2, thread="blockIdx.x"):
        for tx in T.thread_binding(32, thread="threadIdx.x"):
            a[bx * 32 + tx] = a[bx * 32 + tx] + T.float32(1)
            T.cuda.grid_sync()
            a[bx * 32 + tx] = a[bx * 32 + tx] * T.float32(2)
    for bx in T.thread_binding(64, thread="blockIdx.x"):
        a[bx] = a[bx] + T.float32(1)


def test_only_the_kernel_that_grid_syncs_launches_cooperatively():
    """After the lowering and host/device split that ``CudaTarget.build`` runs, the kernel calling
    ``T.cuda.grid_sync()`` is flagged for the cooperative launch (last but a dynamic shared memory
    tag) and the other keeps the ordinary one: fails where TVM's lowering stops keeping grid_sync's op."""
    _, device = CudaTarget("sm_90", sms=132).split(tvm.IRModule({"main": grid_sync_then_wide}))
    (kernels,) = device.values()
    params = {gvar.name_hint: list(f.attrs["tirx.kernel_launch_params"])
              for gvar, f in mark_cooperative(kernels).functions.items()}
    assert params == {"grid_sync_then_wide_kernel": ["blockIdx.x", "threadIdx.x", COOPERATIVE],
                      "grid_sync_then_wide_kernel_1": ["blockIdx.x"]}
