"""The Hopper wgmma GEMM (schedules/wgmma.py): the IR before and after, where it applies, and (GPU)
its results against NumPy in float64 for every tile the recipes choose."""

import shutil

import numpy as np
import pytest
from tvm import te
from tvm.runtime import from_dlpack
from tvm.s_tir import Schedule

import halstm
from conftest import assert_nvcc_compiles, gpu_available
from halstm.schedules import CudaStepLoop
from halstm.schedules.cuda_tensorcore import tensorize_works
from halstm.schedules.wgmma import WgmmaTile, gemm_wgmma, wgmma_available, wgmma_tile
from halstm.targets import CudaTarget

H100 = CudaTarget("sm_90", sms=132)
needs_tensorize = pytest.mark.skipif(not tensorize_works(), reason="Schedule.tensorize crashes with this apache-tvm-ffi")


def gemm(m: int, n: int, k: int, dtype: str) -> Schedule:
    """C = A @ W with W packed (K, N) from stacked weights (N, K), as the hoisted GEMM reads them."""
    a = te.placeholder((m, k), dtype, name="A")
    weights = te.placeholder((n, k), dtype, name="weights")
    packed = te.compute((k, n), lambda i, j: weights[j, i], name="w_packed")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * packed[r, j].astype("float32"), axis=r),
                   name="C")
    return Schedule(te.create_prim_func([a, weights, c]))


@needs_tensorize
def test_gemm_becomes_one_wgmma_kernel_over_k_major_weights():
    sch = gemm(300, 256, 128, "float16")
    before = sch.mod.script()
    assert "w_packed[v_i, v_j] = weights[v_j, v_i]" in before  # the packing transposes
    assert gemm_wgmma(sch, sch.get_sblock("C"), WgmmaTile(2, 128, 4, True), "float16")
    after = sch.mod.script()
    assert "w_packed[v_j, v_i] = weights[v_j, v_i]" in after  # now a copy: W is (N, K),
    packing = sch.get_loops(sch.get_sblock("w_packed"))
    assert [sch.get(loop).extent for loop in packing] == [256, 128]  # and k innermost (coalesced)
    assert 'T.launch_thread("blockIdx.x", 6)' in after  # 3 row tiles (ragged) x 2 column tiles
    assert "wgmma.mma_async" in after or "T.ptx.wgmma" in after
    assert after.count("C[v_i, v_j] = T.float32(0.0)") == 0  # the zero-fill emits nothing


@needs_tensorize
def test_left_alone_where_the_operands_are_not_the_storage_type():
    sch = gemm(64, 128, 64, "float32")
    assert not gemm_wgmma(sch, sch.get_sblock("C"), WgmmaTile(1, 128, 4, False), "float16")
    assert "wgmma" not in sch.mod.script()


def test_only_hopper_fp16_and_bf16():
    assert wgmma_available("float16", H100) == tensorize_works()
    assert not wgmma_available("float32", H100)
    assert not wgmma_available("float16", CudaTarget("sm_80", sms=108))
    assert not wgmma_available("bfloat16", CudaTarget("sm_100", sms=148))


def test_tiles_follow_the_measured_shapes():
    assert wgmma_tile(25600, 4096, H100) == WgmmaTile(2, 256, 4, True)  # the hoisted GEMM
    assert wgmma_tile(25600, 4224, H100) == WgmmaTile(2, 128, 5, True)  # columns not whole 256s
    assert wgmma_tile(256, 4096, H100) == WgmmaTile(1, 128, 6, True)  # a step's rows
    assert wgmma_tile(64, 8192, H100) == WgmmaTile(1, 64, 4, False)  # 128 columns: 64 blocks
    assert not WgmmaTile(1, 128, 6, True).fits(4096, 1000, "float16", H100)  # K not whole tiles
    assert not WgmmaTile(2, 256, 6, True).fits(4096, 1024, "float16", H100)  # 288 KiB of shared memory


@needs_tensorize
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("wgmma", [True, False])
def test_hoisted_gemm_on_wgmma_is_a_knob(wgmma, tmp_path):
    program = halstm.lower(halstm.GRU(64, 64), steps=8, batch=16, dtype="bfloat16")
    f = halstm.compile(halstm.GRU(64, 64), 8, 16, "bfloat16", target=H100, recipe="cuda-step-loop",
                       knobs={"wgmma": wgmma})
    source = f.module.mod.imports[0].inspect_source()
    assert ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16" in source) == wgmma
    assert CudaStepLoop().defaults(program, H100)["wgmma"]
    assert_nvcc_compiles(source, tmp_path)


TILES = [WgmmaTile(2, 256, 4, True), WgmmaTile(2, 128, 5, True), WgmmaTile(1, 128, 6, True),
         WgmmaTile(1, 64, 4, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.groups}x{t.bn}-{t.stages}{'f' if t.in_flight else ''}")
def test_gemm_matches_float64_on_gpu(tile, dtype, rng):
    """Ragged M (every row tile but the last whole), several K tiles, fresh inputs."""
    torch = pytest.importorskip("torch")
    target = CudaTarget.detect()
    if not wgmma_available(dtype, target):
        pytest.skip("not a Hopper GPU")
    m, n, k = 333, 512, 384
    sch = gemm(m, n, k, dtype)
    assert gemm_wgmma(sch, sch.get_sblock("C"), tile, dtype)
    c_block = sch.get_sblock("w_packed")
    fused = sch.fuse(*sch.get_loops(c_block))
    bx, tx = sch.split(fused, [None, 256])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    f = target.build(sch.mod)["main"]
    a = rng.standard_normal((m, k))
    w = rng.standard_normal((n, k)) / k**0.5
    args = [torch.tensor(v, dtype=getattr(torch, dtype), device="cuda") for v in (a, w)]
    c = torch.full((m, n), float("nan"), device="cuda")
    f(*[from_dlpack(t) for t in (*args, c)])
    want = args[0].double().cpu().numpy() @ args[1].double().cpu().numpy().T
    assert np.linalg.norm(c.cpu().numpy() - want) / np.linalg.norm(want) < 1e-5
