"""CUDA recipes: every recipe x built-in cell x dtype generates and compiles CUDA (needs nvcc; CPU CI
compiles a representative 6, the rest are marked slow); on a GPU machine (``-m gpu``) each is checked
against the float64 reference."""

import ast
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
import tvm

import halstm
from halstm import schedules
from halstm.layout import PackedLayout
from halstm.schedules import CudaPersistent, CudaStepLoop
from halstm.schedules.cuda_ffma import hoisted_tile, step_tile
from halstm.schedules.cuda_gemm import hoisted_tensor_core_tile, on_wgmma, step_tensor_core_tile
from halstm.schedules.cuda_persistent import prologue_knobs
from halstm.schedules.cuda_tensorcore import TensorCoreTile, tensorize_works
from halstm.targets import CudaTarget

from conftest import (TOLERANCE, assert_nvcc_compiles, gpu_available, outputs_on_gpu, random_inputs, rel_err,
                      representative, upcast)
from cuda_emulator import Buffer, LazyIfThenElse, Memory, Ramp, T, broadcast

CELLS = (halstm.LSTM, halstm.GRU, halstm.PeepholeLSTM, halstm.ResetBeforeGRU)
DTYPES = ("float32", "float16", "bfloat16")
# the CUDA recipes of cells with a recurrent matmul (the scan's, of diagonal cells: test_scan.py)
RECIPES = [r.name for r in schedules.BUILTIN if r.name.startswith("cuda") and r.name != "cuda-scan"]
T_, B_, I_, H_ = 3, 2, 20, 24
H100 = CudaTarget("sm_90", sms=132)
WMMA = {"wgmma": False}  # the tests of WMMA's GEMMs (on an H100 fp16/bf16 GEMMs default to wgmma: test_wgmma.py)


# every cell x dtype x recipe; CI compiles each recipe with each dtype once (6 of 24), the cells spread
# over them (the step loop: LSTM, GRU, PeepholeLSTM; the persistent kernel: GRU, PeepholeLSTM,
# ResetBeforeGRU); the other cases repeat a recipe's dtype path with another cell (slow)
GENERATED = [(cell, dtype, recipe) for recipe in RECIPES for dtype in DTYPES for cell in CELLS]
GENERATED_IN_CI = {"LSTM-float32-cuda-step-loop", "GRU-float16-cuda-step-loop", "PeepholeLSTM-bfloat16-cuda-step-loop",
                   "GRU-bfloat16-cuda-persistent", "PeepholeLSTM-float32-cuda-persistent",
                   "ResetBeforeGRU-float16-cuda-persistent"}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("cell, dtype, recipe", representative(
    GENERATED, [f"{c.__name__}-{d}-{r}" for c, d, r in GENERATED], GENERATED_IN_CI))
def test_generates_cuda(cell, dtype, recipe, tmp_path):
    """TVM without a GPU keeps the module's CUDA source (compiled when it loads): nvcc compiles it
    here for an H100, so a kernel that does not compile fails on the CPU machine."""
    f = halstm.compile(cell(I_, H_), T_, B_, dtype, target=H100, recipe=recipe)
    assert f.recipe.name == recipe
    assert_nvcc_compiles(f.module.mod.imports[0].inspect_source(), tmp_path)


# (T, B, I, H): the tiny shape, and one whose hoisted GEMM has ragged row and column tiles (at T=3
# every check passed while GRU at T=20 came out 85 % wrong); fp16/bf16 on tensor cores at a tile-multiple
# shape, and a ragged one (padded M, N, K)
GPU_SHAPES = [(T_, B_, I_, H_), (20, 4, 32, 48), (8, 16, 64, 64), (7, 17, 20, 40)]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "T{}-B{}-I{}-H{}".format(*s))
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.__name__)
def test_matches_reference_on_gpu(cell, dtype, recipe, shape, rng):
    pytest.importorskip("torch")
    T, B, I, H = shape
    c = cell(I, H)
    f = halstm.compile(c, T, B, dtype, target=CudaTarget.detect(), recipe=recipe)
    for name, got, want in outputs_on_gpu(f, c, T, B, rng, dtype):
        assert rel_err(got, want) < TOLERANCE[dtype], name


def test_each_thread_writes_back_only_its_own_register_tile():
    """The register tile's write-back covers the thread's tm x tn outputs, nothing between them: a
    strided tile once made it span 4 x 49 and store uninitialised registers over other threads'
    results (GRU, T=20: 85 % wrong on an H100)."""
    program = halstm.lower(halstm.GRU(20, 24), steps=20, batch=64)
    knobs = CudaStepLoop().defaults(program, H100)
    lines = CudaStepLoop().apply(program, H100).mod.script().splitlines()
    for gemm, tile in (("x_proj0", hoisted_tile(knobs)), ("gemm0", step_tile(knobs, 64))):
        at = next(i for i, line in enumerate(lines) if f'T.sblock("{gemm}_local")' in line)
        assert f"T.grid({tile.tm}, {tile.tn})" in lines[at - 1], (gemm, tile, lines[at - 1])


def test_next_states_of_a_step_share_one_kernel():
    """LSTM's h and c are written by one elementwise kernel a step, not one each."""
    program = halstm.lower(halstm.LSTM(20, 24), steps=3, batch=2)
    text = CudaStepLoop().apply(program, H100).mod.script()
    step = text[text.index('T.sblock("step")'):]
    kernels = step.count('thread="blockIdx.x"')
    assert 'T.sblock("h_next")' in step and 'T.sblock("c_next")' in step
    assert kernels == 2, f"expected the GEMM kernel and one elementwise kernel, found {kernels}"


def test_step_gemm_stages_the_state_in_shared_memory():
    """The state a step GEMM reads goes from its row-block view straight into a shared tile (read
    from global memory per multiply-add, the step GEMM ran at 6.6 TFLOP/s on an H100)."""
    program = halstm.lower(halstm.LSTM(20, 24), steps=3, batch=8)
    text = CudaStepLoop().apply(program, H100).mod.script()
    step = text[text.index('T.sblock("step")'):]
    assert 'gemm0_operand_reindex_shared = T.sblock_alloc_buffer((8, 24), scope="shared")' in step
    assert "gemm0_operand_reindex_shared[v0, v1] = h_t[v0, v1]" in step


@pytest.mark.parametrize("batch, hidden", [(1, 256), (3, 48), (64, 1024)])
def test_default_step_tile_is_valid_and_fills_the_gpu(batch, hidden):
    """The defaults pass the recipe's own check on the tile that runs (at B=1 a 64-column tile made
    16-thread blocks), and the step GEMM's grid covers the SMs where the columns allow (64 blocks for
    132 SMs at B=64, H=1024 ran at 5.8 TFLOP/s)."""
    program = halstm.lower(halstm.LSTM(hidden, hidden), steps=2, batch=batch)
    knobs = CudaStepLoop().defaults(program, H100)
    tile = step_tile(knobs, batch)
    assert CudaStepLoop().valid(program, H100, knobs) and tile.threads >= 32
    if 4 * hidden >= 32 * H100.sms:
        assert tile.blocks(batch, 4 * hidden) >= H100.sms


TENSORIZE = "Schedule.tensorize does not work with this apache-tvm-ffi: pin 0.1.14.post0"


@pytest.fixture
def tensorize():
    """A test of tensor-core code fails, rather than skips, where Schedule.tensorize cannot run."""
    assert tensorize_works(), TENSORIZE


tensor_cores = pytest.mark.usefixtures("tensorize")


@tensor_cores
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("shape", [(8, 16, 64, 64), (7, 17, 20, 40)], ids=("aligned", "ragged"))
@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_fp16_and_bf16_gemms_run_on_tensor_cores(dtype, shape, tmp_path):
    """The hoisted and the step GEMM of an LSTM each compile to a tensor-core kernel, also at a
    ragged shape (zero-padded to the tile), and nvcc compiles them (the step's state fetch once
    came out as a make_uint4 of eight halves). On an H100 both are wgmma kernels where K and N are
    whole 64-element tiles (wgmma.py), else WMMA's."""
    T, B, I, H = shape
    program = halstm.lower(halstm.LSTM(I, H), steps=T, batch=B, dtype=dtype)
    source = H100.build(CudaStepLoop().apply(program, H100).mod).mod.imports[0].inspect_source()
    kernels = source.split("__global__")[1:]
    wmma = sum("wmma::mma_sync" in k for k in kernels)
    wgmma = sum("_mma_async_sync_aligned_m64n" in k for k in kernels)
    assert (wmma, wgmma) == ((0, 2) if I % 64 == 0 else (2, 0)), "the hoisted and the step GEMM"
    assert_nvcc_compiles(source, tmp_path)


@tensor_cores
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype, wmma", [("float16", True), ("bfloat16", False)])
def test_tensor_cores_only_where_the_arch_has_them(dtype, wmma, tmp_path):
    """A Turing GPU (sm_75) has fp16 WMMA but no bf16 fragments (Ampere on): bf16 stays on FFMA
    there; nor cp.async: the GEMMs are not pipelined (and refused if asked to be); the module
    compiles for it."""
    turing = CudaTarget("sm_75", sms=40, shared_memory=64 * 1024)
    f = halstm.compile(halstm.LSTM(64, 64), 8, 16, dtype, target=turing, recipe="cuda-step-loop")
    source = f.module.mod.imports[0].inspect_source()
    assert ("wmma::mma_sync" in source) == wmma and f.knobs["tc_stages"] == 1 and "cp_async" not in source
    if wmma:
        with pytest.raises(ValueError, match="cannot run"):
            halstm.compile(halstm.LSTM(64, 64), 8, 16, dtype, target=turing, recipe="cuda-step-loop",
                           knobs={"tc_stages": 2})
    assert_nvcc_compiles(source, tmp_path, "sm_75")


@tensor_cores
@pytest.mark.parametrize("batch, hidden, step_gemms", [(16, 64, 2), (17, 40, 1)], ids=("whole", "ragged"))
def test_computed_operand_gemm_on_tensor_cores_where_unpadded(batch, hidden, step_gemms):
    """ResetBeforeGRU's (r * h) @ W_hn GEMM runs on tensor cores where its operand needs no padding
    (B=16, H=64: both step GEMMs are mma_sync kernels, the hoisted one wgmma's), its r * h stored in
    fp16; where it would (B=17, H=40) it stays on FFMA, the state's GEMM on tensor cores."""
    program = halstm.lower(halstm.ResetBeforeGRU(hidden, hidden), steps=3, batch=batch, dtype="float16")
    sch = CudaStepLoop().apply(program, H100)
    source = H100.build(sch.mod).mod.imports[0].inspect_source()
    kernels = source.split("__global__")[1:]
    assert sum("wmma::mma_sync" in k or "_mma_async_sync_aligned_m64n" in k for k in kernels) == 1 + step_gemms
    if step_gemms == 2:
        assert 'gemm1_operand = T.sblock_alloc_buffer(({}, {}), "float16")'.format(batch, hidden) in sch.mod.script()


@tensor_cores
def test_step_gemm_ir_on_tensor_cores():
    """The step GEMM's IR: the state's fp16 operand copy (the state itself, not its fp32 view: the
    GEMM widens it) becomes an fp16 shared tile copied as it is (no casts: cp.async can fetch it),
    fragments are loaded with load_matrix_sync and multiplied with mma_sync."""
    program = halstm.lower(halstm.LSTM(64, 64), steps=3, batch=16, dtype="float16")
    before = program.mod.script()
    assert "gemm0_operand[v_b, v_k] = h_t[v_b, v_k]" in before
    assert ('gemm0[v_b, v_n] = gemm0[v_b, v_n] + T.Cast("float32", gemm0_operand[v_b, v_k]) '
            '* T.Cast("float32", w_packed1[v_k, v_n])') in before
    step = CudaStepLoop().apply(program, H100, **WMMA).mod.script()
    step = step[step.index('T.sblock("step")'):]
    assert 'gemm0_operand_shared_dyn = T.sblock_alloc_buffer((16, 64), "float16", scope="shared.dyn")' in step
    assert "gemm0_operand_shared_dyn[v0, v1] = h_t[v0, v1]" in step
    assert "T.tvm_load_matrix_sync(" in step and "T.tvm_mma_sync(" in step


@tensor_cores
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("cell, fused, kernels, gates_in_global",
                         [(halstm.LSTM, True, 1, False), (halstm.PeepholeLSTM, True, 1, False),
                          (halstm.GRU, False, 2, True), (halstm.ResetBeforeGRU, True, 3, True)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_step_epilogue_runs_in_the_tensor_core_gemms_kernel(cell, fused, kernels, gates_in_global, tmp_path):
    """tc_epilogue: the step's elementwise math in its GEMM's kernel, reading the C tile, the gates
    never in global memory (no gemm0 buffer). LSTM's 4H columns are stored 4 gates x units a tile
    (PackedLayout.units); GRU's 3 gates do not divide its 16-column fragments' tile and stay two
    kernels; ResetBeforeGRU's second GEMM (one gate) fuses with h_next, the first (r and z, z read
    after the second) does not. Off, every cell keeps one kernel more."""
    def step_kernels(epilogue):
        f = halstm.compile(cell(64, 64), 3, 16, "float16", target=H100, recipe="cuda-step-loop",
                           knobs={"tc_epilogue": epilogue, **WMMA})
        text = f.schedule.mod.script()
        step = text[text.index('T.sblock("step")'):]
        return f, step.count('thread="blockIdx.x"'), "gemm0 = T.sblock_alloc_buffer" in step

    f, on, gemm0_buffer = step_kernels(True)
    assert (on, gemm0_buffer) == (kernels, gates_in_global)
    assert (f.program.layout.units is not None) == fused
    assert step_kernels(False)[1] == kernels + fused
    assert_nvcc_compiles(f.module.mod.imports[0].inspect_source(), tmp_path)


def test_tensor_core_knobs_pruned_where_they_do_not_apply():
    """fp32 never varies the WMMA knobs (on an H100 its GEMMs run on wgmma as three TF32 products,
    or on FFMA cores with tensor cores off); with tensor cores on, the FFMA knobs of the GEMMs on
    tensor cores stay at their first value (B=16: both GEMMs)."""
    assert tensorize_works(), TENSORIZE
    recipe = CudaStepLoop()
    fp32 = halstm.lower(halstm.LSTM(64, 64), steps=2, batch=16)
    space = recipe.space(fp32, H100)
    assert all(k["tc_frags"] == 2 and k["tc_k"] == 32 for k in space)
    assert {k["tensor_cores"] for k in space} == {True, False}
    fp16 = halstm.lower(halstm.LSTM(64, 64), steps=2, batch=16, dtype="float16")
    on = [k for k in recipe.space(fp16, H100) if k["tensor_cores"]]
    assert on and all(k["block_rows"] == 64 and k["hoisted_block"] == 128 for k in on)


def test_importing_the_recipes_skips_tvms_intrinsic_library():
    """TVM's tensor_intrin package took 37-66 s to import on a 2-core machine (every tuner worker
    paid it, and CI's tuner tests timed out): the recipes bring their own WMMA intrinsics."""
    probe = "import sys, halstm.schedules; sys.exit('tvm.s_tir.tensor_intrin' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], cwd=tempfile.gettempdir()).returncode == 0


def test_cuda_build_keeps_the_callers_pass_context():
    """The build's own setting (no TIR CSE) joins the caller's pass context instead of replacing it:
    a pass instrument set around halstm.compile sees the lowering passes."""
    seen = []

    @tvm.ir.instrument.pass_instrument
    class Names:
        def run_before_pass(self, mod, info):
            seen.append(info.name)

    with tvm.transform.PassContext(instruments=[Names()]):
        halstm.compile(halstm.LSTM(8, 8), 2, 2, target=H100, recipe="cuda-step-loop")
    assert any("FlattenBuffer" in name for name in seen), seen[:10]


def test_step_gemm_tensor_core_tile_fills_the_sms():
    """With tc_fill the step GEMM's tensor-core tile narrows (fragments, then warps) while half the
    SMs would sit idle (B=64, N=4096: 64 blocks of 64 x 64 for 132 SMs), and keeps its size where
    the grid already fills them."""
    tile = TensorCoreTile(warps_m=2, warps_n=2, fm=2, fn=2, bk=32)
    narrowed = tile.for_rows(64).filling(64, 4096, sms=132)
    assert (narrowed.bm, narrowed.bn) == (64, 32) and narrowed.threads == tile.threads
    assert narrowed.blocks(64, 4096) == 128
    assert tile.for_rows(256).filling(256, 4096, sms=132) == tile
    # B=16, N=2048: 16 x 64 tiles, 32 blocks -> 16 x 16, 128 blocks of one warp
    assert tile.for_rows(16).filling(16, 2048, sms=132).blocks(16, 2048) == 128


@pytest.mark.parametrize("batch, hidden, pipelined_k, tf32_k, bk, bn, warps_m",
                         [(64, 1024, 32, 32, 128, 32, 2), (256, 1024, 64, 32, 128, 64, 4),
                          (16, 512, 32, 16, 128, 16, 2), (64, 2048, 64, 64, 128, 64, 4)])
def test_step_tensor_core_defaults_cut_the_round_trips(batch, hidden, pipelined_k, tf32_k, bk, bn, warps_m):
    """fp16 on an H100: the step GEMM's defaults pipeline four K tiles of 32 (64 bytes a row), at
    most 32 of them, with the narrowed column tile, not prefetched; where the tile stays 64 columns
    wide (B=256, H=1024; B=64, H=2048) 8 warps a block and K tiles of 64 (128 bytes); in one stage
    they stage K in the fewest tiles that fit (B=64, H=1024: 8 tiles of K=128 where the first knob
    values made 32 of K=32, in 64 blocks); both pass valid(); fp32 leaves the knobs alone; TF32's
    tiles of 16 (on WMMA: on wgmma by default) stay at most 32 too (H=1024: 32 of 32), with 4 warps."""
    assert tensorize_works(), TENSORIZE
    recipe = CudaStepLoop()
    program = halstm.lower(halstm.LSTM(hidden, hidden), steps=2, batch=batch, dtype="float16")
    knobs = recipe.defaults(program, H100, WMMA)
    one_stage = {**knobs, "tc_stages": 1, **recipe._step_tensor_core_defaults(program, H100, {**knobs, "tc_stages": 1})}
    for k, want in ((knobs, (4, pipelined_k)), (one_stage, (1, bk))):
        tile = step_tensor_core_tile(k, batch, 4 * hidden, H100)
        assert (k["tc_stages"], k["tc_step_k"], k["tc_prefetch"], k["tc_fill"], tile.bn) == (*want, False, True, bn)
        assert k["tc_warps_m"] == warps_m
        assert recipe.valid(program, H100, k) and tile.fits(2, H100)
        assert 2 * tile.blocks(batch, 4 * hidden) > H100.sms
    fp32 = halstm.lower(halstm.LSTM(hidden, hidden), steps=2, batch=batch)
    assert all(recipe.defaults(fp32, H100)[n] == recipe.knobs[n][0] for n in ("tc_step_k", "tc_prefetch", "tc_fill"))
    tf32 = halstm.lower(halstm.LSTM(hidden, hidden), steps=2, batch=batch, allow_tf32=True)
    tf32_knobs = recipe.defaults(tf32, H100, WMMA)
    assert (tf32_knobs["tc_step_k"], tf32_knobs["tc_warps_m"]) == (tf32_k, 2)  # 16 fp32 (64 bytes) a tile


def test_step_gemm_keeps_four_warps_on_narrow_tiles():
    """ResetBeforeGRU at B=256, H=1024: its second GEMM (1024 columns) narrows to 32 columns to fill
    the SMs, where 8 warps measured slower (3.52 ms against 3.14): 4 warps, K tiles of 32."""
    assert tensorize_works(), TENSORIZE
    program = halstm.lower(halstm.ResetBeforeGRU(1024, 1024), steps=2, batch=256, dtype="float16")
    knobs = CudaStepLoop().defaults(program, H100, WMMA)
    assert (knobs["tc_warps_m"], knobs["tc_step_k"]) == (2, 32)
    assert min(step_tensor_core_tile(knobs, 256, g.rows, H100).bn for g in program.plan.step_gemms) < 64


def test_step_tensor_core_knobs_pruned_where_they_do_not_fit():
    """valid() checks the step tile that runs: on a GPU with 64 KiB of shared memory a block at B=256,
    H=1024, a 64 x 64 tile with K=128 in two stages needs 70 KiB (in one, 35 KiB); one warp (B=16,
    filled to 16 x 16) prefetching K=128 holds 64 registers a thread, at the limit, and passes. (On
    wgmma, the default on an H100, these knobs change nothing and stay at their first value.)"""
    assert tensorize_works(), TENSORIZE
    recipe = CudaStepLoop()
    small = CudaTarget("sm_90", sms=132, shared_memory=64 * 1024)
    wide = halstm.lower(halstm.LSTM(1024, 1024), steps=2, batch=256, dtype="float16")
    narrow = halstm.lower(halstm.LSTM(512, 512), steps=2, batch=16, dtype="float16")
    assert not recipe.valid(wide, small, recipe.resolve(wide, small, {"tc_step_k": 128, "tc_stages": 2, **WMMA}))
    assert recipe.valid(wide, small, recipe.resolve(wide, small, {"tc_step_k": 128, "tc_stages": 1, **WMMA}))
    assert recipe.valid(wide, H100, recipe.resolve(wide, H100, {"tc_step_k": 128, "tc_stages": 2, **WMMA}))
    assert recipe.valid(narrow, H100, recipe.resolve(narrow, H100, {"tc_step_k": 128, "tc_prefetch": True, **WMMA}))
    assert any(k["tc_prefetch"] and k["tc_step_k"] == 128 for k in recipe.space(narrow, H100))


def test_tensor_core_tiles_fit_as_the_runtime_launches_them():
    """All of a tensor-core GEMM's shared memory is dynamic, which TVM's CUDA runtime opts a kernel in
    to past 48 KiB, up to the block's maximum: the 64 x 128 step tile with K=64 that failed to launch
    on an H100 as 26 KiB of static operand tiles beside a 32 KiB dynamic C tile fits now, as do
    four stages of 128 x 128 with K=32. A GPU with 64 KiB a block takes that tile in two stages
    (its C tile, 64 KiB, over 37 KiB of operand tiles), not in four (74 KiB of operand tiles)."""
    assert TensorCoreTile(2, 4, 2, 2, 64).fits(2, H100)
    assert TensorCoreTile(2, 2, 4, 4, 32, stages=4).fits(2, H100)
    small = CudaTarget("sm_90", sms=132, shared_memory=64 * 1024)
    assert TensorCoreTile(2, 2, 4, 4, 32, stages=2).fits(2, small)
    assert not TensorCoreTile(2, 2, 4, 4, 32, stages=4).fits(2, small)


def test_hoisted_gemm_has_its_own_fragments():
    """tc_hoisted_frags sizes the hoisted GEMM's WMMA tile alone (on wgmma it changes nothing): at B=256, H=1024 4 x 4 fragments
    make a 128 x 128 hoisted tile (valid: 74 KiB of dynamic shared memory in four stages) while the
    step GEMM keeps its 128 x 64 tile of 8 warps and its pipelined K tile (64, four stages); the
    step GEMM's warps (2 x 4: 64 x 128) leave the hoisted tile's 2 x 2 warps alone. It is the default
    where the 128 x 128 grid has a block for every SM: at T=2 (512 x 4096: 128 blocks for 132 SMs)
    it stays 2 x 2 (64 x 64)."""
    assert tensorize_works(), TENSORIZE
    recipe = CudaStepLoop()
    program = halstm.lower(halstm.LSTM(1024, 1024), steps=2, batch=256, dtype="float16")
    ampere = CudaTarget("sm_80", sms=132)  # WMMA's hoisted GEMM (on an H100 it runs on wgmma)
    assert recipe.defaults(program, ampere)["tc_hoisted_frags"] == 2
    longer = halstm.lower(halstm.LSTM(1024, 1024), steps=3, batch=256, dtype="float16")
    assert recipe.defaults(longer, ampere)["tc_hoisted_frags"] == 4
    assert CudaPersistent().defaults(longer, ampere)["tc_hoisted_frags"] == 4
    assert recipe.defaults(longer, H100)["tc_hoisted_frags"] == 2  # moot on wgmma: its first value
    assert not recipe.valid(program, H100, recipe.resolve(program, H100, {"tc_hoisted_frags": 4}))  # on wgmma
    knobs = recipe.resolve(program, H100, {"tc_hoisted_frags": 4, "wgmma": False})
    assert recipe.valid(program, H100, knobs)
    assert (hoisted_tensor_core_tile(knobs).bm, hoisted_tensor_core_tile(knobs).bn) == (128, 128)
    step = step_tensor_core_tile(knobs, 256, 4096, H100)
    assert (step.bm, step.bn, step.bk, step.stages, step.threads) == (128, 64, 64, 4, 256)
    wide = recipe.resolve(program, H100, {"tc_hoisted_frags": 4, "tc_warps_m": 2, "tc_warps_n": 4, "wgmma": False})
    assert (hoisted_tensor_core_tile(wide).bm, hoisted_tensor_core_tile(wide).bn) == (128, 128)
    assert (step_tensor_core_tile(wide, 256, 4096, H100).bn, hoisted_tensor_core_tile(wide).threads) == (128, 128)
    assert any(k["tc_hoisted_frags"] == 4 for k in recipe.space(program, H100))


def _step_gemm_kernel(source: str) -> str:
    """The step's GEMM kernel: the wmma kernel that reads the state sequence (h_seq)."""
    kernels = [k for k in source.split("__global__")[1:] if k.find("{") < k.find(";")]  # definitions
    return next(k for k in kernels if "mma_sync" in k and "h_seq" in k.split("{")[0])


@tensor_cores
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("prefetch", (True, False))
def test_step_gemm_prefetches_the_next_k_tile(prefetch, tmp_path):
    """tc_prefetch: the step GEMM loads K tile k+1 into registers (uint4 ..._local arrays) before
    the mma of tile k, its main loop runs K / bk - 1 times after a prologue that loads tile 0, and
    there is one shared tile each for A and W (64 x (128 + 8) and 128 x (32 + 8) halves: TVM's
    pipeline pass needs no second buffer, the stores follow the reads); without
    it, the loop runs K / bk times and nothing is staged in registers."""
    program = halstm.lower(halstm.LSTM(1024, 1024), steps=3, batch=64, dtype="float16")
    knobs = {"tc_step_k": 128, "tc_prefetch": prefetch, "tc_fill": True, "tc_stages": 1, **WMMA}
    mod = CudaStepLoop().apply(program, H100, **knobs).mod
    source = H100.build(mod).mod.imports[0].inspect_source()
    kernel = _step_gemm_kernel(source)
    assert ("w_packed1_shared_dyn_local_ptr" in kernel) == prefetch
    assert f"k_0_0 < {1024 // 128 - 1 if prefetch else 1024 // 128};" in kernel
    assert (64 * 136 + 128 * 40) * 2 in _dynamic_shared_bytes(mod).values()
    assert kernel.count("mma_sync(") == (2 if prefetch else 1)  # the last tile's mma after the loop
    assert_nvcc_compiles(source, tmp_path)


# cells x dtypes x shapes x step-GEMM settings, nvcc compiles each: a Latin square (each cell meets
# each shape and each setting; fp16 and bf16 alternate), defaults (narrowed, K tile from the
# target, not prefetched) and explicit ones; ragged B and H included
STEP_SETTINGS = [{}, {"tc_step_k": 64, "tc_prefetch": True}, {"tc_step_k": 16, "tc_prefetch": True, "tc_fill": False},
                 {"tc_step_k": 32, "tc_prefetch": False, "tc_fill": False, "tc_hoisted_frags": 4}]
STEP_SHAPES = [(64, 1024), (20, 48), (16, 512), (17, 40)]
STEP_CASES = [(CELLS[(i + j) % 4], ("float16", "bfloat16")[(i + j) % 2], STEP_SHAPES[i], STEP_SETTINGS[j])
              for i in range(4) for j in range(4)]
# CI: each shape and each setting once, both dtypes (shape, setting: 0 0, 1 2, 2 1, 3 3)
STEP_CASES_IN_CI = {"LSTM-float16-B64H1024-0", "ResetBeforeGRU-bfloat16-B20H48-2", "ResetBeforeGRU-bfloat16-B16H512-1",
                    "PeepholeLSTM-float16-B17H40-3"}


@tensor_cores
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("cell, dtype, shape, knobs", representative(
    STEP_CASES, [f"{c.__name__}-{d}-B{s[0]}H{s[1]}-{i % 4}" for i, (c, d, s, _) in enumerate(STEP_CASES)],
    STEP_CASES_IN_CI))
def test_step_gemm_settings_compile(cell, dtype, shape, knobs, tmp_path):
    """Each step-GEMM setting the recipe accepts generates CUDA that nvcc compiles, with the step
    GEMM on WMMA tensor cores."""
    B, H = shape
    knobs = {**knobs, **WMMA}
    program = halstm.lower(cell(H, H), steps=3, batch=B, dtype=dtype)
    recipe = CudaStepLoop()
    assert recipe.valid(program, H100, recipe.resolve(program, H100, knobs))
    source = H100.build(recipe.apply(program, H100, **knobs).mod).mod.imports[0].inspect_source()
    assert _step_gemm_kernel(source)
    assert_nvcc_compiles(source, tmp_path)


# --- the packed weights: a tiled transpose through shared memory ---------------------------------------

class _KernelT(T):
    float16 = bfloat16 = float
    Ramp = staticmethod(Ramp.of)
    Broadcast = staticmethod(broadcast)


def _device_kernels(mod) -> dict:
    """The kernels (device PrimFuncs, by name) TVM's CUDA pipeline makes of ``mod``, as H100.build
    lowers them before code generation."""
    _, device = H100.split(mod)
    return {gv.name_hint: f for m in device.values() for gv, f in m.functions.items()}


def _run_kernel(func, arrays: dict) -> None:
    """Run a lowered kernel in Python as test_cuda_persistent's emulator runs the step text: block by
    block, and in a block every thread one phase (up to a __syncthreads) at a time, on the flat
    ``arrays`` by parameter name. Races (between threads or blocks) and accesses out of bounds raise."""
    text, memory = func.script(), Memory()
    env = {"T": _KernelT}
    for name, param in re.findall(r"(\w+) = T.decl_buffer\(.*data=(\w+)\)", text):
        env[name] = Buffer(name, arrays[param], memory)
    blocks, bx = re.search(r'with T.launch_thread\("blockIdx.x", (\d+)\) as (\w+):', text).groups()
    shared = re.findall(r"(\w+) = T.alloc_shared\(\((\d+),\)", text)
    # "with T.launch_thread(...) as tx:" or, without TVM's storage rewrite, "tx = T.launch_thread(...)"
    launch = re.search(r'(?:with T.launch_thread\("threadIdx.x", (\d+)\) as (\w+):|(\w+) = T.launch_thread\("threadIdx.x", (\d+)\))\n', text)
    threads, tx = (launch.group(1), launch.group(2)) if launch.group(1) else (launch.group(4), launch.group(3))
    body = LazyIfThenElse().visit(ast.parse(textwrap.dedent(text[launch.end():])))
    phases = [[]]
    for statement in body.body:
        if "T.alloc_shared(" in ast.unparse(statement):
            continue  # the shared tiles, made per block below
        if ast.unparse(statement) == "T.tvm_storage_sync('shared')":
            phases.append([])
        else:
            phases[-1].append(statement)
    phases = [compile(ast.fix_missing_locations(ast.Module(p, [])), "<kernel>", "exec") for p in phases]
    for b in range(int(blocks)):
        tiles = {name: Buffer(name, np.full(int(size), np.nan), memory, shared=True) for name, size in shared}
        for code in phases:
            memory.phase += 1
            for t in range(int(threads)):
                memory.who = (b, t)
                exec(code, {**env, **tiles, bx: b, tx: t})  # noqa: S102


# every cell x dtype x size x recipe; CI runs each recipe at each size, with each cell and both dtypes, and
# ResetBeforeGRU's stacked weights below a tile with both recipes (7 of 36)
HIDDEN = {"aligned": 64, "ragged": 50, "below-a-tile": 24}
PACKED = [(cell, dtype, size, recipe) for recipe in RECIPES for size in HIDDEN for dtype in ("float32", "float16")
          for cell in (halstm.LSTM, halstm.GRU, halstm.ResetBeforeGRU)]
PACKED_IN_CI = {"LSTM-float32-aligned-cuda-step-loop", "GRU-float16-ragged-cuda-step-loop",
                "ResetBeforeGRU-float32-below-a-tile-cuda-step-loop", "GRU-float32-aligned-cuda-persistent",
                "ResetBeforeGRU-float16-ragged-cuda-persistent", "LSTM-float32-below-a-tile-cuda-persistent",
                "ResetBeforeGRU-float16-below-a-tile-cuda-persistent"}


@pytest.mark.parametrize("cell, dtype, size, recipe", representative(
    PACKED, [f"{c.__name__}-{d}-{h}-{r}" for c, d, h, r in PACKED], PACKED_IN_CI))
def test_packed_weights_are_the_transpose(cell, dtype, size, recipe, rng):
    """Each packing kernel, lowered by TVM's CUDA pipeline and run in Python thread by thread, writes
    exactly the transpose of its weights through a shared tile: at H=50 neither K nor N is whole
    32 x 32 tiles; at H=24 a tile is more than the weight (bound to the block's threads as 8 x 24,
    its copy once read past the tile: compute-sanitizer on an H100, ResetBeforeGRU's 24 x 24
    weight); ResetBeforeGRU stacks weight_hr and weight_hz in one GEMM (an if_then_else over the
    two)."""
    c = cell(HIDDEN[size], HIDDEN[size])
    _check_packing_kernels(halstm.lower(c, steps=2, batch=4, dtype=dtype), recipe, rng)


@pytest.mark.parametrize("cell", (halstm.LSTM, halstm.ResetBeforeGRU), ids=lambda c: c.__name__)
def test_packing_kernels_group_the_gates_of_each_units_tile(cell, rng):
    """With PackedLayout.units (a fused step epilogue) the packing kernels store column n of the
    stacked weights' transpose at ``layout.column(n)``: 4 units of each gate, then the next 4."""
    layout = PackedLayout(units=4, width=64)
    program = halstm.lower(cell(64, 64), steps=2, batch=16, dtype="float16", layout=layout)
    _check_packing_kernels(program, "cuda-step-loop", rng)


@tensor_cores
def test_packing_kernels_copy_where_every_gemm_runs_on_wgmma(rng):
    """Where the hoisted and the step GEMMs run on wgmma (TF32 here, which reads no (K, N) operand)
    the recipe packs every weight (N, K) (PackedLayout.k_major): each packing kernel is a copy,
    no shared tile."""
    cell = halstm.LSTM(64, 64)
    program = halstm.lower(cell, steps=2, batch=64, dtype="float32", allow_tf32=True)
    recipe = next(r for r in schedules.BUILTIN if r.name == "cuda-step-loop")
    layout = recipe.layout(program, H100, recipe.resolve(program, H100, {}))
    assert layout == PackedLayout(k_major=True)
    _check_packing_kernels(halstm.lower(cell, 2, 64, "float32", layout=layout, allow_tf32=True), recipe.name, rng)


def _check_packing_kernels(program, recipe, rng):
    """Each GEMM's packing kernel run in Python writes its weights' transpose through a shared tile,
    columns where ``program.layout`` stores them; a hoisted GEMM on wgmma's packs them (N, K), a copy.
    The persistent kernel reads the step's weights where they are: only the hoisted GEMMs pack theirs."""
    params = {n: rng.standard_normal(s) for n, s in program.cell.parameters().items()}
    recipe = next(r for r in schedules.BUILTIN if r.name == recipe)
    sch = recipe.apply(program, H100)
    wgmma = on_wgmma(prologue_knobs(program, H100, recipe.resolve(program, H100, {}))
                             if recipe.name == "cuda-persistent" else recipe.resolve(program, H100, {}), program, H100)
    kernels = _device_kernels(sch.mod)
    weights = {m.weight for m in program.plan.matmuls}
    for g in program.plan.hoisted if recipe.name == "cuda-persistent" else program.plan.gemms:
        members = [m.weight for m in g.members]
        name, func = next((n, f) for n, f in kernels.items()
                          if {p.name[:-4] for p in f.params} & weights == set(members))
        packed = next(p.name for p in func.params if p.name[:-4] not in weights)
        assert len(func.params) == len(members) + 1, (name, func.params)
        k_major = program.layout.k_major or (wgmma and g.stage == 0)
        assert ("T.alloc_shared(" in func.script()) != k_major, f"{name}: a shared tile only to transpose"
        out = np.full(g.depth * g.rows, np.nan)
        _run_kernel(func, {**{f"{w}_ptr": params[w].ravel() for w in members}, packed: out})
        want = np.empty((g.depth, g.rows))
        want[:, [program.layout.column(n, g.rows) for n in range(g.rows)]] = np.concatenate([params[w] for w in members]).T
        assert np.array_equal(out.reshape(g.rows, g.depth).T if k_major else out.reshape(g.depth, g.rows), want), name


# CI: the step loop's packing in fp32, the persistent kernel's in fp16; the other two repeat a recipe's
# packing kernels with the other element type (slow)
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype, recipe", representative(
    [(d, r) for d in ("float32", "float16") for r in RECIPES], [f"{d}-{r}" for d in ("float32", "float16") for r in RECIPES],
    ["float32-cuda-step-loop", "float16-cuda-persistent"]))
def test_packing_kernels_transpose_through_a_shared_tile(dtype, recipe, tmp_path):
    """In the CUDA source, each kernel that packs an LSTM weight (reads weight_ih or weight_hh, not the
    persistent kernel, which reads weight_hh where it is) holds a 32 x 33 shared tile that its threads
    fill, sync on, and copy out; one element a thread (bind_flat) read the weights strided by K (ncu,
    H100, fp16 H=1024: 32 us a weight)."""
    f = halstm.compile(halstm.LSTM(64, 64), 3, 4, dtype, target=H100, recipe=recipe,
                       knobs={"wgmma": False})  # on wgmma the hoisted GEMM's weights are packed (N, K): a copy
    source = f.module.mod.imports[0].inspect_source()
    heads = [(k.split("{")[0], k) for k in source.split("__global__")[1:]]
    packing = [k for head, k in heads if ";" not in head and re.search(r"weight_(ih|hh)_ptr", head)  # definitions
               and "_seq_ptr" not in head]
    assert len(packing) == (1 if recipe == "cuda-persistent" else 2)
    element = {"float32": "float", "float16": "half"}[dtype]
    for kernel in packing:
        assert re.search(rf"__shared__ alignas\(\d+\) {element} w_packed\d_shared_ptr\[1056\];", kernel), kernel
        assert "__syncthreads();" in kernel, kernel
    assert_nvcc_compiles(source, tmp_path)


# --- the tensor-core GEMMs pipelined over K tiles (tc_stages) ----------------------------------------

@tensor_cores
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
@pytest.mark.parametrize("dtype, knobs", [("float16", {"tc_stages": 2, "tc_step_k": 32}),
                                          ("float16", {"tc_stages": 3, "tc_step_k": 32, "tc_hoisted_frags": 2}),
                                          ("tf32", {"tc_stages": 2, "tc_step_k": 16, "tc_k": 16})])
def test_pipelined_gemms_fetch_with_cp_async(dtype, knobs, tmp_path):
    """tc_stages > 1: both GEMMs fetch their A and W tiles with cp.async (the step's operand a copy
    of the state in its own dtype, not a cast of its fp32 view back: that was a plain load), commit a
    group per K tile, stages - 1 of them before the loop, and wait for all but stages - 1 pending
    groups; nvcc compiles them. A ragged shape (operands
    fetched an element at a time, which cp.async cannot) is not pipelined."""
    storage, tf32 = ("float32", True) if dtype == "tf32" else (dtype, False)
    knobs = {**knobs, "wgmma": False}  # WMMA's pipeline (wgmma.py pipelines its own)
    f = halstm.compile(halstm.LSTM(256, 256), 3, 64, storage, target=H100, recipe="cuda-step-loop", knobs=knobs,
                       allow_tf32=tf32)
    source = f.module.mod.imports[0].inspect_source()
    gemms = [k for k in source.split("__global__")[1:] if "mma_sync" in k]
    assert len(gemms) == 2
    stages = knobs["tc_stages"]
    assert [k.count("ptx_cp_async_legacy_cg_16") for k in gemms] == [2 * stages, 2 * stages]
    assert all("commit_group" in k and f"wait_group_{stages - 1}(" in k for k in gemms)
    assert_nvcc_compiles(source, tmp_path)
    ragged = halstm.compile(halstm.LSTM(40, 40), 3, 17, storage, target=H100, recipe="cuda-step-loop", knobs=knobs,
                            allow_tf32=tf32)
    assert "cp.async" not in ragged.module.mod.imports[0].inspect_source()


def _dynamic_shared_bytes(mod) -> dict:
    """Each kernel's dynamic shared memory as TVM's CUDA pipeline allocates it (merged), by name."""
    sizes = {}
    for name, func in _device_kernels(mod).items():
        found = re.search(r'buf_dyn_shmem = T.alloc_buffer\(\((\d+),\)', func.script())
        if found:
            sizes[name] = int(found.group(1))
    return sizes


@tensor_cores
@pytest.mark.parametrize("dtype, knobs", [("float16", {}), ("float16", {"tc_stages": 4}), ("float16", {"tc_stages": 1}),
                                          ("float32", {"tc_stages": 3, "tc_hoisted_frags": 4})])
def test_shared_memory_model_matches_tvms_allocation(dtype, knobs):
    """TensorCoreTile.shared_bytes as TVM allocates the GEMM kernels' merged dynamic shared memory:
    the larger of the operand tiles (rows padded to 8 more than a multiple of 32: a K tile of 16
    takes rows of 40) and the fp32 C tile laid over them. LSTM B=256, H=1024 (T=3): the hoisted
    and the step GEMM."""
    program = halstm.lower(halstm.LSTM(1024, 1024), steps=3, batch=256, dtype=dtype, allow_tf32=dtype == "float32")
    recipe = CudaStepLoop()
    knobs = {**knobs, "wgmma": False}  # WMMA's tiles
    k = recipe.resolve(program, H100, knobs)
    size = 4 if dtype == "float32" else 2
    tiles = (hoisted_tensor_core_tile(k).for_rows(3 * 256), step_tensor_core_tile(k, 256, 4096, H100))
    assert sorted(_dynamic_shared_bytes(recipe.apply(program, H100, **knobs).mod).values()) == sorted(
        t.shared_bytes(size) for t in tiles)
    assert TensorCoreTile(2, 2, 4, 4, 16, stages=2).operand_bytes(4) == 0xE400  # ptxas, when static


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype, knobs", [("float16", {"tc_stages": 2, "tc_step_k": 32}),
                                          ("bfloat16", {"tc_stages": 3, "tc_step_k": 32, "tc_hoisted_frags": 2}),
                                          ("tf32", {"tc_stages": 2, "tc_step_k": 16, "tc_k": 16})])
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.__name__)
def test_pipelined_gemms_match_reference_on_gpu(cell, dtype, knobs, rng):
    torch = pytest.importorskip("torch")
    from conftest import TF32_TOLERANCE

    storage, tf32 = ("float32", True) if dtype == "tf32" else (dtype, False)
    T, B, H = 20, 64, 256
    c = cell(H, H)
    f = halstm.compile(c, T, B, storage, target=CudaTarget.detect(), recipe="cuda-step-loop", knobs=knobs,
                       allow_tf32=tf32)
    x, params, states = random_inputs(c, T, B, rng, storage)
    to_gpu = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(getattr(torch, storage)).cuda()
    y, _ = f(to_gpu(x), {k: to_gpu(v) for k, v in params.items()}, {k: to_gpu(v) for k, v in states.items()})
    want_y, _ = halstm.reference(c, np.asarray(x, np.float64), upcast(params), upcast(states))
    assert rel_err(y.float().cpu().numpy(), want_y) < (TF32_TOLERANCE if tf32 else TOLERANCE[dtype])
