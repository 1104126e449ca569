"""The Hopper wgmma GEMM (schedules/wgmma.py): the IR before and after, where it applies, and (GPU)
its results against NumPy in float64 for every tile the recipes choose."""

import itertools
import shutil

import numpy as np
import pytest
from tvm import te, tirx
from tvm.runtime import from_dlpack
from tvm.s_tir import Schedule

import halstm
from conftest import TF32_TOLERANCE, TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err, upcast
from halstm.gradients import reference_backward
from halstm.layout import PackedLayout
from halstm.schedules import CudaPersistent, CudaStepLoop
from halstm.schedules.cuda_gemm import on_wgmma
from halstm.schedules.cuda_persistent import prologue_knobs
from halstm.schedules.cuda_tensorcore import tensorize_works
from halstm.schedules.wgmma import WgmmaTile, gemm_wgmma, wgmma_available, wgmma_tile
from halstm.targets import CudaTarget

H100 = CudaTarget("sm_90", sms=132)
TENSORIZE = "Schedule.tensorize does not work with this apache-tvm-ffi: pin 0.1.14.post0"


@pytest.fixture
def tensorize():
    """A test of wgmma code fails, rather than skips, where Schedule.tensorize cannot run."""
    assert tensorize_works(), TENSORIZE


needs_tensorize = pytest.mark.usefixtures("tensorize")


def gemm(m: int, n: int, k, dtype: str, packed_here: bool = True) -> Schedule:
    """C = A @ W with W packed (K, N) from stacked weights (N, K), as the hoisted GEMM reads them; or
    (not ``packed_here``) W given (K, N), as a step GEMM reads the weights the prologue packed. ``k``
    "any": K a multiple of 64 that each call's arrays give (as the weight gradients' T*B rows)."""
    tiles = tirx.Var("k_tiles", "int32") if k == "any" else None  # a scalar argument, as the steps are
    k = k if tiles is None else tiles * 64
    a = te.placeholder((m, k), dtype, name="A")
    if packed_here:
        weights = te.placeholder((n, k), dtype, name="weights")
        packed = te.compute((k, n), lambda i, j: weights[j, i], name="w_packed")
    else:
        weights = packed = te.placeholder((k, n), dtype, name="weights")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") * packed[r, j].astype("float32"), axis=r),
                   name="C")
    return Schedule(te.create_prim_func([a, weights, c] if tiles is None else [tiles, a, weights, c]))


@needs_tensorize
def test_gemm_becomes_one_wgmma_kernel_over_k_major_weights():
    sch = gemm(300, 256, 128, "float16")
    before = sch.mod.script()
    assert "w_packed[v_i, v_j] = weights[v_j, v_i]" in before  # the packing transposes
    assert "C[v_i, v_j] = T.float32(0.0)" in before  # the GEMM's zero-fill
    assert gemm_wgmma(sch, sch.get_sblock("C"), WgmmaTile(2, 128, 4, True), "float16")
    after = sch.mod.script()
    assert "w_packed[v_j, v_i] = weights[v_j, v_i]" in after  # now a copy: W is (N, K),
    packing = sch.get_loops(sch.get_sblock("w_packed"))
    assert [sch.get(loop).extent for loop in packing] == [256, 128]  # and k innermost (coalesced)
    assert 'T.launch_thread("blockIdx.x", 6)' in after  # 3 row tiles (ragged) x 2 column tiles
    assert '"mma_async", "sync", "aligned", "m64n128k16", "f32", "f16", "f16"' in after
    assert after.count("C[v_i, v_j] = T.float32(0.0)") == 0  # the zero-fill emits nothing


@needs_tensorize
def test_left_alone_where_the_operands_are_not_the_storage_type():
    sch = gemm(64, 128, 64, "float32")
    assert not gemm_wgmma(sch, sch.get_sblock("C"), WgmmaTile(1, 128, 4, False), "float16")
    assert "wgmma" not in sch.mod.script()


def test_only_hopper_fp16_bf16_and_tf32():
    assert tensorize_works(), TENSORIZE
    assert wgmma_available("float16", H100)
    assert not wgmma_available("float32", H100)
    assert wgmma_available("float32", H100, allow_tf32=True)
    assert not wgmma_available("float16", CudaTarget("sm_80", sms=108))
    assert not wgmma_available("bfloat16", CudaTarget("sm_100", sms=148))


def test_tiles_follow_the_measured_shapes():
    assert wgmma_tile(25600, 4096, H100) == WgmmaTile(2, 256, 4, True)  # the hoisted GEMM
    assert wgmma_tile(25600, 4224, H100) == WgmmaTile(2, 128, 5, True)  # columns not whole 256s
    assert wgmma_tile(256, 4096, H100) == WgmmaTile(1, 128, 6, True)  # a step's rows
    assert wgmma_tile(64, 8192, H100) == WgmmaTile(1, 64, 4, False)  # 128 columns: 64 blocks
    # the backward's over all rows: a long K takes the wide tile from one wave of blocks
    assert wgmma_tile(4096, 1024, H100, depth=6400) == WgmmaTile(2, 256, 4, True)  # a weight gradient
    assert wgmma_tile(4096, 1024, H100, depth=1024) == WgmmaTile(1, 128, 6, True)  # K short: 128 blocks
    assert wgmma_tile(4096, 1024, H100) == WgmmaTile(1, 128, 6, True)  # K not known
    rows = tirx.Var("n_steps", "int32") * 64  # a function's rows for any T
    assert wgmma_tile(4096, 1024, H100, depth=rows) == WgmmaTile(2, 256, 4, True)
    assert wgmma_tile(2048, 512, H100, depth=1600) == WgmmaTile(1, 128, 6, True)  # 32 wide blocks
    # a long K: the fewer waves, a narrow block's weighed as NARROW_BLOCK_TIME of a wide one's
    assert wgmma_tile(3072, 1024, H100, depth=6400) == WgmmaTile(2, 256, 4, True)  # 1 wave against 3
    assert wgmma_tile(1536, 1024, H100, depth=6400) == WgmmaTile(1, 128, 6, True)  # 1 wave against 2
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
    assert ("= *(float2*)(acc_ptr + " in source) == wgmma  # C stored 8 bytes a thread (H100: 573 -> 387 us)
    assert CudaStepLoop().defaults(program, H100)["wgmma"]
    assert_nvcc_compiles(source, tmp_path)


TILES = [WgmmaTile(2, 256, 4, True), WgmmaTile(2, 128, 5, True), WgmmaTile(1, 128, 6, True),
         WgmmaTile(1, 64, 4, False)]


@needs_tensorize
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_a_symbolic_k_is_read_by_the_kernel_from_the_function(tmp_path):
    """K an expression of the function's own variable (the weight gradients' sums over T*B rows of a
    backward for any T): one kernel whose K loop and prologue read that expression, built with
    nothing left undefined (tensorize leaves the kernel's own K variable in its operands' regions:
    ``_bind_depth``)."""
    sch = gemm(256, 256, "any", "float16", packed_here=False)
    tile = WgmmaTile(1, 128, 6, True)  # four K tiles fetched ahead: more than a call may have
    assert tile.fits(256, sch.get(sch.get_loops(sch.get_sblock("C"))[-1]).extent, "float16", H100)
    assert gemm_wgmma(sch, sch.get_sblock("C"), tile, "float16")
    after = sch.mod.script()
    assert "for kt in range(k_tiles * 64 // 64):" in after and "if s < k_tiles * 64 // 64:" in after
    assert "k = T.int32()" not in after
    assert_nvcc_compiles(H100.build(sch.mod).mod.imports[0].inspect_source(), tmp_path)
    assert not WgmmaTile(1, 128, 6, True).fits(256, tirx.Var("t", "int32") * 32, "float16", H100)


@needs_tensorize
def test_weights_packed_elsewhere_are_read_mn_major():
    """W (K, N) not packed in the GEMM's scope (the step's weights, packed by the prologue) stays
    (K, N): the kernel stages it MN-major (transposed wgmma operand, ``trans-b`` 1)."""
    sch = gemm(128, 256, 128, "float16", packed_here=False)
    assert gemm_wgmma(sch, sch.get_sblock("C"), WgmmaTile(1, 128, 6, True), "float16")
    after = sch.mod.script()
    assert 'weights: T.Buffer((128, 256), "float16")' in after  # (K, N), as given
    # each k16 step 4096 bytes into the W tile (two K groups of 8 rows x 128 columns); scale-a, -b 1,
    # A not transposed, W transposed
    assert '+ kk * 4096) // 16), kt > 0 or kk > 0, 1, 1, 0, 1, "mma_async"' in after


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("symbolic", [False, True], ids=["fixed-k", "any-k"])
@pytest.mark.parametrize("packed_here", [True, False], ids=["k-major", "mn-major"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.groups}x{t.bn}-{t.stages}{'f' if t.in_flight else ''}")
def test_gemm_matches_float64_on_gpu(tile, dtype, packed_here, symbolic, rng):
    """Ragged M (every row tile but the last whole), several K tiles, fresh inputs; W staged K-major
    (packed here, into (N, K)) and MN-major (given (K, N), fp16/bf16); float32 as TF32 (its operands'
    low mantissa bits dropped: TF32_TOLERANCE). K fixed, or any multiple of 64 (one function called
    with K = 384, then 64: fewer K tiles than some tiles fetch ahead)."""
    torch = pytest.importorskip("torch")
    target = CudaTarget.detect()
    if not wgmma_available(dtype, target, allow_tf32=True):
        pytest.skip("not a Hopper GPU")
    if dtype == "float32" and not packed_here:
        pytest.skip("TF32 wgmma has no MN-major operand")
    m, n, k = 333, 512, 384
    sch = gemm(m, n, "any" if symbolic else k, dtype, packed_here)
    assert gemm_wgmma(sch, sch.get_sblock("C"), tile, dtype)
    if packed_here:
        fused = sch.fuse(*sch.get_loops(sch.get_sblock("w_packed")))
        bx, tx = sch.split(fused, [None, 256])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    f = target.build(sch.mod)["main"]
    for depth in (k, 64) if symbolic else (k,):
        a = rng.standard_normal((m, depth))
        w = rng.standard_normal((n, depth)) / depth**0.5
        args = [torch.tensor(v, dtype=getattr(torch, dtype), device="cuda") for v in (a, w if packed_here else w.T)]
        c = torch.full((m, n), float("nan"), device="cuda")
        f(*[depth // 64] * symbolic, *[from_dlpack(t.contiguous()) for t in (*args, c)])
        w64 = args[1].double().cpu().numpy()
        want = args[0].double().cpu().numpy() @ (w64.T if packed_here else w64)
        tolerance = TF32_TOLERANCE if dtype == "float32" else 1e-5
        assert np.linalg.norm(c.cpu().numpy() - want) / np.linalg.norm(want) < tolerance, depth


@needs_tensorize
@pytest.mark.parametrize("recipe", [CudaStepLoop(), CudaPersistent()], ids=lambda r: r.name)
@pytest.mark.parametrize("cell, batch, hidden", [(halstm.LSTM, 256, 1024), (halstm.GRU, 64, 1024), (halstm.LSTM, 16, 512)])
def test_defaults_put_the_hoisted_gemm_on_wgmma(recipe, cell, batch, hidden):
    """The recipes' defaults are valid with the hoisted GEMM on wgmma: its WMMA fragments (moot) stay
    at their first value (sweeps found them rejected when they did not)."""
    program = halstm.lower(cell(hidden, hidden), steps=100, batch=batch, dtype="float16")
    knobs = recipe.defaults(program, H100)
    assert recipe.valid(program, H100, knobs)
    step_loop = knobs if recipe.name == "cuda-step-loop" else prologue_knobs(program, H100, knobs)
    assert on_wgmma(step_loop, program, H100) and on_wgmma(step_loop, program, H100, step=True)  # B >= 16
    assert knobs["tc_hoisted_frags"] == recipe.knobs["tc_hoisted_frags"][0]


@needs_tensorize
def test_wmma_knobs_of_gemms_on_wgmma_are_not_searched():
    """Where both GEMMs run on wgmma their WMMA knobs change nothing: the defaults hold them at their
    first value, and on tensor cores the space varies only the wgmma tiles, the step GEMMs' K slices
    and the elementwise kernels' threads. With wgmma off (a switch: ``resolve``) the defaults tune them as before, in
    both recipes. ResetBeforeGRU's r * h GEMM runs on wgmma too (r * h stored by a kernel of its
    own); exact float32 as three TF32 products (split_tf32) the same, its FFMA knobs searched with
    tensor cores off."""
    recipe = CudaStepLoop()
    lstm = halstm.lower(halstm.LSTM(1024, 1024), steps=100, batch=256, dtype="float16")
    on, off = recipe.defaults(lstm, H100), recipe.resolve(lstm, H100, {"wgmma": False})
    assert all(on[n] == recipe.knobs[n][0] for n in recipe._TENSOR_CORE + recipe._TENSOR_CORE_STEP)
    assert (off["tc_warps_m"], off["tc_stages"], off["tc_step_k"], off["tc_fill"]) == (4, 4, 64, True)  # WMMA's own defaults
    assert recipe.valid(lstm, H100, on) and recipe.valid(lstm, H100, off)
    wgmma = [k for k in recipe.space(lstm, H100) if k["tensor_cores"] and k["wgmma"]]
    assert sorted((k["threads"], k["wgmma_hoisted"], k["wgmma_step"]) for k in wgmma if k["wgmma_step_split"] == "auto") == sorted(
        itertools.product(recipe.knobs["threads"], ("auto", "2x128x5f", "1x128x6f", "1x64x4"), ("auto", "1x64x4", "2x128x5f")))
    # K = 1024: two slices of eight K tiles at most, each named where "auto" (one slice where the
    # step tile's grid fills the SMs: not 2x128x5f's 64 blocks) chooses otherwise
    assert {(k["wgmma_step"], k["wgmma_step_split"]) for k in wgmma if k["wgmma_step_split"] != "auto"} == {
        ("auto", 2), ("1x64x4", 2), ("2x128x5f", 1)}
    reset = halstm.lower(halstm.ResetBeforeGRU(1024, 1024), steps=100, batch=256, dtype="float16")
    assert on_wgmma(recipe.defaults(reset, H100), reset, H100, step=True)
    assert len({k["tc_step_k"] for k in recipe.space(reset, H100) if k["tensor_cores"] and k["wgmma"]}) == 1
    exact = halstm.lower(halstm.LSTM(1024, 1024), steps=100, batch=256)
    space = recipe.space(exact, H100)
    assert {(k["tensor_cores"], k["wgmma"]) for k in space} == {(True, True), (False, True)}
    assert sorted((k["threads"], k["wgmma_hoisted"], k["wgmma_step"]) for k in space
                  if k["tensor_cores"] and k["wgmma_step_split"] == "auto") == sorted(
        itertools.product(recipe.knobs["threads"], ("auto", "2x128x5f", "1x128x6f", "1x64x4"), ("auto", "1x64x4", "2x128x5f")))
    assert len({k["block_cols"] for k in space if not k["tensor_cores"]}) > 1
    persistent = halstm.lower(halstm.LSTM(1024, 1024), steps=100, batch=64, dtype="float16")
    assert CudaPersistent().defaults(persistent, H100)["tc_hoisted_frags"] == 2  # moot on wgmma
    assert CudaPersistent().resolve(persistent, H100, {"wgmma": False})["tc_hoisted_frags"] == 4  # 128 x 128 tiles


@needs_tensorize
def test_the_wgmma_tiles_are_knobs():
    """wgmma_hoisted and wgmma_step name a tile (WgmmaTile.name) or leave it to wgmma_tile ("auto"):
    the tile named is the kernel built; one that "auto" picks anyway, or that does not fit, is not a
    valid setting (a repeat, or a GEMM off wgmma)."""
    assert WgmmaTile.parse("2x128x5f") == WgmmaTile(2, 128, 5, True) and WgmmaTile(1, 64, 4, False).name == "1x64x4"
    recipe = CudaStepLoop()
    program = halstm.lower(halstm.GRU(256, 256), steps=4, batch=64, dtype="float16")
    auto = recipe.defaults(program, H100)
    assert (auto["wgmma_hoisted"], auto["wgmma_step"]) == ("auto", "auto")
    step = recipe.resolve(program, H100, {"wgmma_step": "1x128x6f"})  # auto's: 1 x 64 (128 columns: 6 blocks)
    assert recipe.valid(program, H100, step) and on_wgmma(step, program, H100, step=True)
    script = recipe.apply(program, H100, **step).mod.script()
    assert '"m64n128k16"' in script and '"m64n64k16"' in script  # the step's tile, the hoisted GEMM's
    assert not recipe.valid(program, H100, recipe.resolve(program, H100, {"wgmma_step": "1x64x4"}))  # auto's
    assert not recipe.valid(program, H100, recipe.resolve(program, H100, {"wgmma_step": "2x128x5f", "wgmma": False}))
    ragged = halstm.lower(halstm.GRU(320, 320), steps=4, batch=64, dtype="float16")
    wide = recipe.resolve(ragged, H100, {"wgmma_hoisted": "2x256x4f"})  # 960 columns: not whole 256s
    assert on_wgmma(recipe.defaults(ragged, H100), ragged, H100)  # auto's tile fits (1 x 64)
    assert not on_wgmma(wide, ragged, H100) and not recipe.valid(ragged, H100, wide)


@needs_tensorize
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_tf32_runs_both_gemms_on_wgmma(tmp_path):
    """float32 with allow_tf32: the hoisted and the step GEMM on wgmma's k8 TF32 instruction, 32
    fp32 a 128-byte K tile, every weight packed (N, K) by the lowering (PackedLayout.k_major: TF32
    wgmma reads no (K, N) operand); nvcc compiles it. A step of 4 rows (FFMA) leaves the weights
    (K, N), the hoisted GEMM on wgmma laying its own out (N, K)."""
    cell = halstm.LSTM(256, 256)
    f = halstm.compile(cell, 4, 64, "float32", target=H100, recipe="cuda-step-loop", allow_tf32=True)
    source = f.module.mod.imports[0].inspect_source()
    assert "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32" in source and "wmma::mma_sync" not in source
    assert on_wgmma(f.knobs, f.program, H100) and on_wgmma(f.knobs, f.program, H100, step=True)
    assert f.program.layout == PackedLayout(k_major=True)
    assert_nvcc_compiles(source, tmp_path)
    narrow = halstm.compile(cell, 4, 4, "float32", target=H100, recipe="cuda-step-loop", allow_tf32=True)
    assert narrow.program.layout == PackedLayout() and on_wgmma(narrow.knobs, narrow.program, H100)
    assert "tf32.tf32" in narrow.module.mod.imports[0].inspect_source()
    sch = gemm(64, 128, 96, "float32", packed_here=False)  # W (K, N): no TF32 wgmma
    assert not gemm_wgmma(sch, sch.get_sblock("C"), WgmmaTile(1, 64, 4, False), "float32")


@needs_tensorize
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_exact_fp32_runs_as_three_tf32_products(tmp_path):
    """float32 without allow_tf32: both GEMMs on TF32 wgmma over K three times over (PackedLayout.
    tf32x3: the operand split [a_s, a_b, a_b] by a kernel of its own, the weights [w_b; w_s; w_b]),
    no other tensor-core GEMM, the step's K in two slices of 12 K tiles (its 16 blocks leave most
    SMs idle); nvcc compiles it. With tensor cores off, or a step too narrow for
    tensor cores (B=4), FFMA alone, the layout plain."""
    cell = halstm.LSTM(256, 256)
    f = halstm.compile(cell, 4, 64, "float32", target=H100, recipe="cuda-step-loop")
    source = f.module.mod.imports[0].inspect_source()
    assert f.program.layout == PackedLayout(k_major=True, tf32x3=True, split_k=2) and not f.program.allow_tf32
    assert "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32" in source and "wmma::" not in source
    assert "tvm_builtin_ptx_wgmma_tf32_ss_mma_async_sync_aligned_m64n64k8_f32_tf32_tf32" in source
    assert "(uint)4096" in source and "(uint)4294959104" in source  # tf32_big: TF32_HALF, TF32_BITS
    assert f.program.mod.script().count("T.reinterpret") >= 4
    assert_nvcc_compiles(source, tmp_path)
    for off in (halstm.compile(cell, 4, 64, "float32", target=H100, recipe="cuda-step-loop",
                               knobs={"tensor_cores": False}),
                halstm.compile(cell, 4, 4, "float32", target=H100, recipe="cuda-step-loop")):
        assert off.program.layout == PackedLayout() and "wgmma" not in off.module.mod.imports[0].inspect_source()


@needs_tensorize
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_persistent_exact_fp32_hoists_three_tf32_products(tmp_path):
    """The persistent kernel in exact float32: the hoisted GEMM as three TF32 products on wgmma (its
    weights (N, K), the operand split: PackedLayout.hoisted_only), the cooperative kernel's step on
    FFMA over (K, N) weights; nvcc compiles it. With wgmma off, FFMA alone, the layout plain."""
    cell = halstm.LSTM(256, 256)
    f = halstm.compile(cell, 4, 16, "float32", target=H100, recipe="cuda-persistent")
    source = f.module.mod.imports[0].inspect_source()
    assert f.program.layout == PackedLayout(k_major=True, tf32x3=True, hoisted_only=True)
    assert "wgmma.mma_async.sync.aligned.m64n" in source and ".f32.tf32.tf32" in source
    kernels = [k for k in source.split('extern "C" __global__')[1:] if k.split("\n")[0].endswith("{")]
    (cooperative,) = [k for k in kernels if "grid_sync" in k]
    assert "wgmma" not in cooperative and "wmma" not in cooperative
    assert_nvcc_compiles(source, tmp_path)
    off = halstm.compile(cell, 4, 16, "float32", target=H100, recipe="cuda-persistent", knobs={"wgmma": False})
    assert off.program.layout == PackedLayout() and "wgmma" not in off.module.mod.imports[0].inspect_source()


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
def test_exact_fp32_as_accurate_as_ffma_on_gpu(rng):
    """LSTM T=50, B=64, H=1024 (K=1024: the small products' low bits matter) in exact float32:
    three TF32 products within float32's tolerance of float64 and within 2x FFMA's own error."""
    torch = pytest.importorskip("torch")
    target = CudaTarget.detect()
    if not wgmma_available("float32", target, allow_tf32=True):
        pytest.skip("not a Hopper GPU")
    cell = halstm.LSTM(1024, 1024)
    x, params, states = random_inputs(cell, 50, 64, rng)
    want, _ = halstm.reference(cell, np.asarray(x, np.float64), upcast(params), upcast(states))
    to_gpu = lambda a: torch.from_numpy(np.asarray(a, np.float32)).cuda()
    args = to_gpu(x), {k: to_gpu(v) for k, v in params.items()}, {k: to_gpu(v) for k, v in states.items()}
    errors = {}
    for on in (True, False):
        f = halstm.compile(cell, 50, 64, "float32", target=target, recipe="cuda-step-loop",
                           knobs={"tensor_cores": on}, database=False)
        assert f.program.layout.tf32x3 == on
        errors[on] = rel_err(f(*args)[0].cpu().numpy(), want)
    assert errors[True] < TOLERANCE["float32"] and errors[True] < 2 * errors[False], errors


# --- the step GEMMs' K in slices (PackedLayout.split_k) ---------------------------------------------

def _reversed_loop(cell, steps: int, batch: int, dtype: str):
    """The reversed loop's program as the step loop runs it: one GEMM over the gates' adjoints."""
    tf32 = dtype == "tf32"
    adjoint = halstm.AdjointCell(halstm.make_plan(cell), gathered=True)
    return halstm.lower(adjoint, steps + 1, batch, "float32" if tf32 else dtype, allow_tf32=tf32)


@needs_tensorize
def test_step_gemms_are_cut_into_k_slices_where_their_grid_leaves_sms_idle():
    """split_k "auto": the reversed loop's GEMM (N = H) of LSTM (100,256,1024) fp16 makes 64 blocks
    of 1x64x4: two slices; TF32 at B=64, 16 blocks: eight (the most); the forward's (N = 4H, 128
    blocks) stays whole, as does a step without a GEMM (RG-LRU). A number named is the layout's
    where it cuts K into slices of eight K tiles or more, else not a valid setting."""
    recipe = CudaStepLoop()

    def split(program, knobs=None):
        return recipe.layout(program, H100, recipe.resolve(program, H100, knobs)).split_k

    lstm = halstm.LSTM(1024, 1024)
    assert split(_reversed_loop(lstm, 100, 256, "float16")) == 2
    assert split(_reversed_loop(lstm, 100, 64, "tf32")) == 8
    assert split(halstm.lower(lstm, 100, 256, "float16")) == 1
    assert split(halstm.lower(halstm.RGLRU(256, 256), 100, 256, "float16")) == 1
    reversed_fp16 = _reversed_loop(lstm, 100, 256, "float16")  # K = 4096: 64 K tiles
    assert split(reversed_fp16, {"wgmma_step_split": 8}) == 8
    assert recipe.valid(reversed_fp16, H100, recipe.resolve(reversed_fp16, H100, {"wgmma_step_split": 8}))
    narrow = _reversed_loop(halstm.LSTM(256, 256), 100, 64, "float16")  # K = 1024: 16 K tiles
    assert split(narrow) == 2
    assert not recipe.valid(narrow, H100, {**recipe.defaults(narrow, H100), "wgmma_step_split": 4})
    assert not recipe.valid(narrow, H100, {**recipe.defaults(narrow, H100), "wgmma_step_split": 2})  # "auto"'s


@needs_tensorize
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_a_step_gemm_in_k_slices_is_one_wgmma_kernel_whose_grid_rows_are_the_slices(tmp_path):
    """The reversed loop of LSTM (6, 64, 256) fp16 in two slices: the step's GEMM is (2, B, N) summed
    by an elementwise gemm0_sum, which the math reading it takes in; one wgmma kernel computes both
    slices (blockIdx.z), each reading its half of K through strided operands; nvcc compiles it."""
    program = _reversed_loop(halstm.LSTM(256, 256), 6, 64, "float16")
    f = halstm.compile(program.cell, 7, 64, "float16", target=H100, recipe="cuda-step-loop")
    assert f.program.layout.split_k == 2
    script = f.program.mod.script()
    assert "gemm0 = T.sblock_alloc_buffer((2, 64, 256))" in script
    assert "gemm0_sum[v_b, v_n] = gemm0[0, v_b, v_n] + gemm0[1, v_b, v_n]" in script
    source = f.module.mod.imports[0].inspect_source()
    kernels = [k for k in source.split('extern "C" __global__')[1:] if "{" in k]  # definitions
    gemm = [k for k in kernels if "wgmma" in k]
    assert len(gemm) == 1 and "blockIdx.z) * 512)" in gemm[0]  # a slice's K offset: 512 columns
    assert "(((int)blockIdx.z) * 16384)" in gemm[0]  # its result: slice z of (2, 64, 256)
    reading = [k for k in kernels if "gemm0_ptr" in k.split("{")[0] and k not in gemm]
    # both slices read, four columns a thread: slice 1 at 64 * 256 elements
    assert len(reading) == 1 and "(float4*)(gemm0_ptr" in reading[0] and "* 4)) + 16384))" in reading[0]
    assert_nvcc_compiles(source, tmp_path)


def test_a_step_gemm_in_k_slices_off_wgmma_sums_a_slice_a_thread(monkeypatch, rng):
    """Where wgmma declines a sliced GEMM (an operand it does not read), each thread sums one output
    of one slice, the state's copy read in place: the kernel, run in Python as TVM lowers it (the
    CUDA emulator), against NumPy."""
    from cuda_emulator import run_kernel
    from halstm.schedules import gemm_rules

    monkeypatch.setattr(gemm_rules, "gemm_wgmma", lambda *args: False)
    T, B, I, H = 2, 4, 8, 16
    program = halstm.lower(halstm.LSTM(I, H), T, B, "float32", layout=PackedLayout(k_major=True, split_k=2))
    sch = CudaStepLoop().apply(program, H100, tensor_cores=False)
    _, device = H100.split(sch.mod)
    kernel = next(f for m in device.values() for f in m.functions.values()
                  if {p.name for p in f.params} == {"gemm0_ptr", "h_seq_ptr", "w_packed1_ptr", "t"})
    h_seq, packed = rng.standard_normal(((T + 1) * B, H)), rng.standard_normal((4 * H, H))  # (N, K)
    arrays = {"h_seq_ptr": h_seq.ravel().copy(), "w_packed1_ptr": packed.ravel().copy(),
              "gemm0_ptr": np.full(2 * B * 4 * H, np.nan)}
    run_kernel(kernel.specialize({kernel.params[-1]: 1}), arrays)  # t = 1
    h = h_seq[B:2 * B]
    want = np.stack([h[:, :H // 2] @ packed[:, :H // 2].T, h[:, H // 2:] @ packed[:, H // 2:].T])
    assert rel_err(arrays["gemm0_ptr"].reshape(2, B, 4 * H), want) < 1e-12


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype, batch", [("float16", 256), ("tf32", 64), ("float32", 64)])
@pytest.mark.parametrize("cell_type", [halstm.LSTM, halstm.GRU], ids=lambda c: c.__name__)
def test_step_gemms_in_k_slices_match_float64_on_gpu(cell_type, dtype, batch, rng):
    """Forward and backward in the step loop at H=1024, T=4: the reversed loop's GEMM in K slices
    (fp16 B=256 two, TF32 and exact float32 B=64 eight), the forward's too where "auto" cuts it
    (float32 at B=64: two); results against the float64 derivation."""
    torch = pytest.importorskip("torch")
    from test_backward import as_dict, sequence_grads

    target = CudaTarget.detect()
    if not wgmma_available("float32", target, allow_tf32=True):
        pytest.skip("not a Hopper GPU")
    T, B, hidden = 4, batch, 1024
    cell = cell_type(hidden, hidden)
    tf32, tolerance = dtype == "tf32", TF32_TOLERANCE if dtype == "tf32" else TOLERANCE[dtype]
    dtype = "float32" if tf32 else dtype
    forward = halstm.compile(cell, T, B, dtype, target=target, recipe="cuda-step-loop", allow_tf32=tf32,
                             database=False)
    backward = halstm.compile_backward(cell, T, B, dtype, target=target, allow_tf32=tf32,
                                       loop_recipe="cuda-step-loop")
    assert backward.adjoint.program.layout.split_k > 1
    x, params, states = random_inputs(cell, T, B, rng, dtype)
    gy, finals = rng.standard_normal((T, B, hidden)), {s: rng.standard_normal((B, hidden)) for s in cell.states}
    to_gpu = lambda d: {k: torch.from_numpy(np.asarray(v)).cuda() for k, v in d.items()}
    x_gpu = torch.from_numpy(x).cuda()
    seqs = forward.sequences(x_gpu, to_gpu(params), to_gpu(states))
    want_y, _ = halstm.reference(cell, np.asarray(x, np.float64), upcast(params), upcast(states))
    assert rel_err(seqs[cell.output][1:].float().cpu().numpy(), want_y) < tolerance
    got = as_dict(*backward(x_gpu, to_gpu(params), seqs, to_gpu(sequence_grads(cell, gy, finals, x.dtype))))
    want = as_dict(*reference_backward(cell, x, upcast(params), upcast(states), sequence_grads(cell, gy, finals)))
    for name, value in want.items():
        assert rel_err(got[name].float().cpu().numpy(), value) < tolerance, name
