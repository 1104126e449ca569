"""The persistent kernel's plan: operand staging, knob pruning, co-residency, code generation, and its
kernel's IR executed thread by thread in Python (index math, races); on a GPU (``-m gpu``) results
against the float64 reference."""

import dataclasses
import re
import shutil
import subprocess

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te
from tvm.s_tir.stmt import SBlock
from conftest import TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err, representative, upcast
from cuda_emulator import Buffer, Fragment, Memory, Race, T, compile_text, lockstep, python_expr, python_lines
from test_custom_cell import X_IN_STEP
from halstm.schedules import CudaPersistent
from halstm.schedules.cuda_persistent import POLLING_MAX_BATCH
from halstm.schedules.block_gemm import _warp_frags
from halstm.schedules.persistent_kernel import PersistentKernel
from halstm.schedules.step_program import Reduction, mean_of
from halstm.targets import CudaTarget

import halstm
from halstm.adjoint import AdjointCell
from halstm.cell import upstream
from halstm.oracle import _Evaluator
from halstm.plan import make_plan

CELLS = (halstm.LSTM, halstm.GRU, halstm.PeepholeLSTM, halstm.ResetBeforeGRU)
DTYPES = ("float32", "float16", "bfloat16")
H100 = CudaTarget("sm_90", sms=132)
NVCC = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


def _program(cell=halstm.LSTM, batch=16, hidden=512, dtype="float32", steps=2, inputs=None):
    return halstm.lower(cell(inputs or hidden, hidden), steps=steps, batch=batch, dtype=dtype)


def _step_text(program, target=H100, **knobs) -> str:
    sch = CudaPersistent().apply(program, target, **knobs)
    text = sch.mod.script()
    return text[text.index("for p_bx in"):]


def test_step_operand_is_staged_in_shared_memory():
    """h (B x K, written by every block before the grid sync) goes into shared memory once a step, four
    elements a thread at a time; the GEMM reads it and the weights only from there, and its result
    stays in shared memory (no global gemm buffer)."""
    text = _step_text(_program(), poll_states=False)
    assert re.search(r'a_s1 = T.sblock_alloc_buffer\(\(\d+,\), scope="shared.dyn"\)', text)
    staging = re.search(r"for p_v in T.vectorized\(4\):\n\s+a_s1\[.*\] = h_seq\[t \* 16 \+ ", text)
    assert staging, "the operand is not staged from h's sequence, vectorised"
    gemm = text[text.index("for p_c in range"):]
    gemm = gemm[:gemm.index("T.tvm_storage_sync")]
    assert "h_seq" not in gemm and "h_t" not in gemm and "w_packed" not in gemm
    assert "gemm0[" not in text


def test_the_kernels_blocks_declare_whole_buffers():
    """The persistent and step blocks read and write every buffer they touch whole, so that TVM does
    not infer their regions from every access (LayerNormLSTM's forward compiled in 11.0 s on the
    2-core CPU machine, now in 1.1 s, its CUDA source the same byte for byte): the state
    sequences polled through views by pointer, the shared buffers of the persistent block from the
    step's, those it allocates itself not at all."""
    sch = CudaPersistent().apply(_program(batch=2, hidden=16, steps=3), H100)
    blocks = {}
    tvm_ffi.structural_walk(sch.mod["main"].body, (SBlock, lambda b: blocks.update({b.name_hint: b})))

    def declared(regions):
        assert all(int(r.min) == 0 and int(r.extent) == int(n) for x in regions
                   for r, n in zip(x.region, x.source.shape)), "a region that is not its whole buffer"
        return {x.source.name for x in regions}

    persistent, step = blocks["persistent"], blocks["step"]
    assert {"h_seq", "c_seq", "h0", "c0", "x_proj0", "weight_hh"} <= declared(persistent.reads)
    assert declared(persistent.writes) == {"h_seq", "c_seq"}
    assert "h_seq" in declared(step.reads) and "a_s1" in declared(step.writes)  # a view polled by pointer
    assert not {b.name for b in persistent.alloc_buffers} & (declared(persistent.reads) | declared(persistent.writes))
    assert not any("detect_access" in k for b in (persistent, step) for k in b.annotations)


def test_input_projection_is_prefetched_with_the_operand():
    """The hoisted GEMM's columns of the block's units for the step go into shared memory before the
    step's GEMM; the elementwise math reads them there (its global loads waited after the GEMM)."""
    text = _step_text(_program())
    step = text[text.index('T.sblock("step")'):]
    assert step.index("x_s0[") < step.index("for p_c in range")
    elementwise = step[step.index("h_next["):]
    assert "x_s0[" in elementwise and "x_proj0_t[" not in elementwise


@pytest.mark.parametrize("cell, batch, hidden", [(halstm.ResetBeforeGRU, 3, 50), (halstm.LSTM, 16, 512)],
                         ids=["ResetBeforeGRU", "LSTM"])
def test_shared_buffers_are_never_placed_over_each_other(cell, batch, hidden):
    """TVM merges the shared allocations and reuses the space of one whose last use has passed (it put
    ResetBeforeGRU's second partial buffer over the first); the weights and the operand's zero padding
    must survive every step. All buffers are written before the time loop, so the merged allocation is
    at least their sum: what ``shared_bytes`` counts against the limit."""
    program = _program(cell, batch=batch, hidden=hidden)
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().defaults(program, H100))
    assert kernel.shared_bytes() <= _allocated_shared_bytes(program) <= H100.shared_memory


def _allocated_shared_bytes(program, **knobs) -> int:
    """The persistent kernel's (the one that grid-syncs: not the prologue's GEMM) dynamic shared
    memory on an H100 (defaults but ``knobs``), as TVM's lowering merges it."""
    from tvm.tirx.build import split_host_device_mods

    target = H100.tvm_target
    mod = tvm.tirx.transform.BindTarget(target)(CudaPersistent().apply(program, H100, **knobs).mod)
    _, devices = split_host_device_mods(tvm.tirx.get_default_tir_pipeline(target)[0](mod))
    (text,) = [t for t in (f.script() for m in devices.values() for f in m.functions.values()) if "grid_sync" in t]
    (size,) = re.findall(r'buf_dyn_shmem = T.alloc_buffer\(\((\d+),\), "uint8", scope="shared.dyn"\)', text)
    return int(size)


def test_reset_before_gru_stages_one_operand_for_both_gemms():
    """ResetBeforeGRU at B=64, H=1024 fp16: its two step GEMMs (h, then r * h after a grid sync) stage
    their 129 KiB operands one after the other in one buffer; with two they took 352.5 KiB, beyond
    the 227 KiB, and the GEMMs fell back to FFMA with the operand in global memory. Now on tensor
    cores, in the 215.5 KiB that TVM allocates (8 units, one row block: the defaults before row blocks;
    the elementwise math adds the split-K partials, no buffer of their sum)."""
    program = _program(halstm.ResetBeforeGRU, batch=64, hidden=1024, dtype="float16", inputs=32)
    old = {"units": 8, "row_blocks": 1}
    knobs = CudaPersistent().resolve(program, H100, old)
    kernel = PersistentKernel.plan(program, H100, knobs)
    assert knobs["tensor_cores"] and kernel.staged
    assert [name for name, *_ in kernel.buffers() if name.startswith("a_s")] == ["a_s1"]
    sch = CudaPersistent().apply(program, H100, **old)
    allocated = sch.get(sch.get_sblock("persistent")).alloc_buffers
    assert ({b.name: (int(b.shape[0]), str(b.dtype)) for b in allocated if b.scope() == "shared.dyn"}
            == {name: (size, dtype) for name, size, dtype, scope in kernel.buffers() if scope == "shared.dyn"})
    assert kernel.shared_bytes() == _allocated_shared_bytes(program, **old) <= H100.shared_memory
    _, source = _generate(halstm.ResetBeforeGRU(32, 1024), 2, 64, "float16", {"resident_weights": False})
    assert source.count("wmma::mma_sync(") == 2  # one loop of mma per GEMM: both on tensor cores


def test_fp16_weights_and_operand_stay_fp16_in_shared_memory():
    text = _step_text(_program(dtype="float16"))
    assert re.search(r'w_s1 = T.sblock_alloc_buffer\(\(\d+,\), "float16", scope="shared.dyn"\)', text)
    assert re.search(r'a_s1 = T.sblock_alloc_buffer\(\(\d+,\), "float16", scope="shared.dyn"\)', text)


def test_operand_falls_back_to_global_memory_when_it_does_not_fit():
    """B=64, H=1024 fp32: the weights (32 columns x 1024) fit, the 64 x 1024 operand beside them not."""
    program = _program(batch=64, hidden=1024)
    knobs = CudaPersistent().defaults(program, H100)
    kernel = PersistentKernel.plan(program, H100, knobs)
    assert not kernel.staged and kernel.shared_bytes() <= H100.shared_memory
    assert "a_s1" not in _step_text(program)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_step_gemm_runs_on_tensor_cores(dtype):
    """B=16, H=512 fp16/bf16 by default: the block's 16 x 16 outputs on tensor cores, K=512 in 32
    fragments split over the 8 warps; no FFMA tile. fp32 stays on FFMA. A computed operand
    (ResetBeforeGRU's r * h) goes on tensor cores too, staged rounded to the weights' dtype."""
    program = _program(dtype=dtype)
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().defaults(program, H100))
    (g,) = kernel.gemms
    assert (g.tensor_cores, g.tiles, g.split, g.chunks, g.stride % 8) == (True, 1, 8, 4, 0)
    text = _step_text(program)
    assert text.count("T.tvm_mma_sync(") == 1 and "a_r[" not in text
    assert 'scope="wmma.matrix_b"' in text and '"col_major"' in text
    assert "T.tvm_mma_sync(" not in _step_text(_program())
    text = _step_text(_program(halstm.ResetBeforeGRU, dtype=dtype))
    assert text.count("T.tvm_mma_sync(") == 2 and "a_r[" not in text
    assert re.search(rf'a_s\d+\[[^\n]*\] = T.Cast\("{dtype}", gemm\d+_operand\[', text)


def test_resident_weight_fragments_load_once_before_the_time_loop():
    """LSTM fp16 B=16 H=512: each warp's 4 weight fragments (4 chunks of K, 1 column fragment) are
    loaded from shared memory into wf before the time loop, unrolled (constant indices keep them in
    registers); the step's mma use them and load no weights. Without the knob, the step loads b_f."""
    program = _program(dtype="float16")
    text = _step_text(program)
    setup, step = text[:text.index("for t in range(")], text[text.index("for t in range("):]
    assert 'wf1 = T.sblock_alloc_buffer((1024,), "float16", scope="wmma.matrix_b")' in setup
    assert "for p_c in T.unroll(4):" in setup and "T.tvm_load_matrix_sync(wf1.data, 16, 16, 16, p_c + p_f" in setup
    assert "wf1.data, p_c + p_f" in step and "T.tvm_load_matrix_sync(b_f" not in step and "for p_c in T.unroll(4)" in step
    step = _step_text(program, resident_weights=False)
    assert "wf1" not in step and "T.tvm_load_matrix_sync(b_f" in step


@pytest.mark.parametrize("wgmma", [True, False])
def test_hoisted_gemm_runs_on_tensor_cores(wgmma):
    """The prologue's input GEMM over all T x B rows, as the step loop runs it: on tensor cores for
    fp16 (H100, LSTM fp16 T=100 B=64 H=1024: its FFMA tile took 1.71 ms of the 2.65, ncu), wgmma's
    or WMMA's (knob wgmma)."""
    program = _program(batch=3, hidden=64, dtype="float16")  # B=3: the step's GEMM stays FFMA
    text = CudaPersistent().apply(program, H100, wgmma=wgmma).mod.script()
    prologue, kernel = text[:text.index("for p_bx in")], text[text.index("for p_bx in"):]
    assert ("T.tvm_mma_sync(" in prologue) != wgmma and ("wgmma" in prologue) == wgmma
    assert "T.tvm_mma_sync(" not in kernel and "wgmma" not in kernel


def test_hoisted_gemm_fragments_are_a_knob():
    """tc_hoisted_frags sizes the prologue's tensor-core GEMM (4: 4 x 4 fragments a warp, 128 x 128
    a block of 2 x 2 warps: T x B = 128 rows by 4H = 256 columns in 2 blocks instead of 8); without
    tensor cores (fp32) it would change nothing, and valid() keeps it at its first value."""
    recipe = CudaPersistent()
    program = _program(batch=16, hidden=64, dtype="float16", steps=8)
    for frags, blocks in ((2, 8), (4, 2)):
        knobs = recipe.resolve(program, H100, {"tc_hoisted_frags": frags, "wgmma": False})
        assert recipe.valid(program, H100, knobs)
        text = recipe.apply(program, H100, **knobs).mod.script()
        prologue = text[:text.index("for p_bx in")]
        assert f'T.thread_binding({blocks}, thread="blockIdx.x")' in prologue
        assert f"T.grid({frags}, {frags})" in prologue
    fp32 = _program(batch=16, hidden=64)
    assert not recipe.valid(fp32, H100, recipe.resolve(fp32, H100, {"tc_hoisted_frags": 4}))
    assert all(k["tc_hoisted_frags"] == 2 for k in recipe.space(fp32, H100))
    # on wgmma (the default on an H100) the fragments change nothing either
    assert not recipe.valid(program, H100, recipe.resolve(program, H100, {"tc_hoisted_frags": 4}))
    # exact fp32: wgmma runs the hoisted GEMM as three TF32 products (CudaPersistent.layout), off it
    # FFMA; where that GEMM's tile does not fit wgmma (K=20, N=160) the knob changes nothing
    assert recipe.layout(fp32, H100, recipe.resolve(fp32, H100, None)).hoisted_only
    assert recipe.valid(fp32, H100, recipe.resolve(fp32, H100, {"wgmma": False}))
    narrow = _program(batch=17, hidden=40, inputs=20, steps=7)
    assert not recipe.valid(narrow, H100, recipe.resolve(narrow, H100, {"wgmma": False}))


def test_tensor_cores_pruned_where_they_cannot_run():
    recipe = CudaPersistent()
    for program, target in ((_program(), H100), (_program(dtype="bfloat16"), CudaTarget("sm_75", sms=40))):
        assert not recipe.defaults(program, target)["tensor_cores"]
        assert all(not k["tensor_cores"] for k in recipe.space(program, target))
    # B=64, H=1024 fp16: 32 columns x 1024 weights and the 64 x 1024 operand fit (214 KB); at B=256
    # the operand does not: its fragments are loaded from global memory
    wide = _program(batch=64, hidden=1024, dtype="float16")
    assert recipe.defaults(wide, H100)["tensor_cores"] and PersistentKernel.plan(wide, H100, recipe.defaults(wide, H100)).staged
    wider = _program(batch=256, hidden=1024, dtype="float16")
    assert recipe.defaults(wider, H100)["tensor_cores"]
    assert not PersistentKernel.plan(wider, H100, recipe.defaults(wider, H100)).staged
    # ... which a computed operand (ResetBeforeGRU's r * h, rounded to fp16) cannot be
    gru = _program(halstm.ResetBeforeGRU, batch=256, hidden=1024, dtype="float16")
    assert not recipe.valid(gru, H100, {**recipe.defaults(gru, H100), "tensor_cores": True})
    assert not recipe.defaults(gru, H100)["tensor_cores"] and recipe.is_applicable(gru, H100)
    # so there stage_operand=False on tensor cores would stage all the same: not a candidate of its own
    gru64 = _program(halstm.ResetBeforeGRU, batch=64, hidden=1024, dtype="float16")
    assert not any(k["tensor_cores"] and not k["stage_operand"] for k in recipe.space(gru64, H100))
    # on tensor cores the register tile changes nothing, on FFMA warp_frags: one candidate each
    space = recipe.space(_program(dtype="float16"), H100)  # once: 10 s of the CPU machine's time a call
    for tensor_cores, moot in ((True, ("tile_rows", "tile_cols")), (False, ("warp_frags",))):
        settings = [tuple(v for n, v in k.items() if n not in moot)
                    for k in space if k["tensor_cores"] == tensor_cores]
        assert settings and len(settings) == len(set(settings))


@pytest.mark.parametrize("batch, hidden, units, row_blocks, staged, frags", [
    (256, 1024, 16, 2, False, 4), (128, 1024, 16, 2, False, 2), (64, 1024, 16, 2, True, 1),
    (64, 512, 8, 2, True, 1), (32, 512, 4, 1, True, 1), (16, 512, 4, 1, True, 1)])
def test_defaults_split_the_batch_over_row_blocks(batch, hidden, units, row_blocks, staged, frags):
    """LSTM on tensor cores: the largest grid, in it the fewest unit groups, at least 32 rows a block
    (at B=64, H=512 16 units in 4 row blocks would give 16); the operand streams where it does not fit."""
    recipe, program = CudaPersistent(), _program(batch=batch, hidden=hidden, dtype="float16")
    k = recipe.defaults(program, H100)
    assert (k["units"], k["row_blocks"]) == (units, row_blocks)
    kernel = PersistentKernel.plan(program, H100, k)
    assert kernel.staged == staged and k["tensor_cores"] and recipe.runs(program, H100, k)  # else streamed
    assert [g.frags for g in kernel.gemms] == [frags]


@pytest.mark.parametrize("cell, batch, hidden, units, row_blocks, threads", [
    (halstm.LayerNormGRU, 16, 512, 16, 1, 256), (halstm.LayerNormLSTM, 64, 512, 16, 4, 256),
    (halstm.LayerNormLSTM, 32, 512, 16, 2, 256),  # blocks of 16 rows (REDUCING_ROW_FRAGMENTS)
    (halstm.LayerNormGRU, 3, 333, 37, 1, 256),  # FFMA: 9 groups of 37 units
    # in blocks of 16 rows 32 groups would stream the operand, in blocks of 32 none runs: the largest grid
    (halstm.LayerNormGRU, 64, 1024, 16, 2, 512),
    (halstm.LSTM, 16, 512, 4, 1, 256), (halstm.LSTM, 64, 512, 8, 2, 256)])  # no sums: the largest grid
def test_defaults_give_a_step_with_sums_few_unit_groups(cell, batch, hidden, units, row_blocks, threads):
    """Every block reads each unit group's partial sums of its rows a round: at most
    REDUCING_GRID_GROUPS groups where a setting runs, the batch in blocks of REDUCING_ROW_FRAGMENTS
    fragments of rows, and REDUCING_THREADS_A_ROW threads a row of the block's batch to share its
    rows' sums."""
    recipe, program = CudaPersistent(), _program(cell, batch=batch, hidden=hidden, dtype="float16")
    k = recipe.defaults(program, H100)
    assert (k["units"], k["row_blocks"], k["threads"]) == (units, row_blocks, threads)
    assert recipe.runs(program, H100, k)


@pytest.mark.parametrize("row_tiles, frags, most, chosen", [
    (2, 3, 4, 3),  # GRU (100,64,1024), 16 units: 1 fragment leaves 2 of 8 warps idle
    (2, 4, 4, 1),  # LSTM there: 8 tiles for 8 warps
    (8, 4, 4, 4), (8, 3, 4, 3), (4, 4, 4, 2),  # B=256 and 128 (128 and 64 rows a block)
    (2, 3, 1, 1),  # the knob caps it
    (3, 4, 4, 4),  # no even share: the most
])
def test_warp_fragments_share_the_tiles_evenly(row_tiles, frags, most, chosen):
    assert _warp_frags(row_tiles, frags, 8, most) == chosen


def test_shared_buffers_start_32_byte_aligned():
    """Merged back to back, every buffer starts where WMMA's loads and stores may point (32 bytes)."""
    from halstm.schedules.cuda_tensorcore import BYTES

    for cell in CELLS:
        program = _program(cell, batch=3, hidden=50, dtype="float16")
        knobs = {**CudaPersistent().defaults(program, H100), "tensor_cores": True}
        for name, size, dtype, scope in PersistentKernel.plan(program, H100, knobs).buffers():
            assert scope != "shared.dyn" or size * BYTES[dtype] % 32 == 0, name


GRIDS = [(batch, hidden, sms) for sms in (132, 114, 46, 8) for batch, hidden in ((1, 256), (16, 512), (16, 768), (3, 50))]


# CI: each size and each SM count once (4 of 16)
@pytest.mark.parametrize("batch, hidden, sms", representative(
    GRIDS, ["{}-{}-{}".format(*g) for g in GRIDS], {"1-256-8", "16-512-46", "16-768-114", "3-50-132"}))
def test_grid_never_exceeds_the_sms(batch, hidden, sms):
    """One block an SM is what makes the cooperative launch legal: the defaults and every setting the
    tuner may try keep the grid within the SMs."""
    target = CudaTarget("sm_90", sms=sms)
    program = _program(batch=batch, hidden=hidden, steps=1)
    recipe = CudaPersistent()
    if not recipe.is_applicable(program, target):  # only when the weights do not fit on chip
        assert PersistentKernel.plan(program, target, recipe.defaults(program, target)) is None
        return
    settings = [recipe.defaults(program, target)] + recipe.space(program, target)
    for knobs in settings:
        assert hidden // knobs["units"] <= sms
    text = _step_text(program, target)
    grid = int(re.search(r'T.thread_binding\((\d+), thread="blockIdx.x"\)', text).group(1))
    assert grid <= sms and grid == hidden // recipe.defaults(program, target)["units"]


@pytest.mark.parametrize("cell, merged", [(halstm.GRU, {True}), (halstm.LayerNormGRU, {True, False})],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_space_searches_the_sums_knobs_only_where_the_step_has_sums(cell, merged):
    """merge_variances only where the step has sums of its own; poll_sums nowhere (it stays on)."""
    program = _program(cell, batch=1, hidden=4, inputs=4, steps=3)
    space = CudaPersistent().space(program, H100)
    assert {k["merge_variances"] for k in space} == merged and {k["poll_sums"] for k in space} == {True}


def test_valid_prunes_what_cannot_run():
    recipe, program = CudaPersistent(), _program(batch=3, hidden=512)
    ok = recipe.defaults(program, H100)
    assert recipe.valid(program, H100, ok)
    assert not recipe.valid(program, H100, {**ok, "units": 2})  # 256 blocks for 132 SMs
    assert not recipe.valid(program, H100, {**ok, "units": 3})  # not a divisor of H
    assert not recipe.valid(program, H100, {**ok, "tile_rows": 4})  # more rows than the batch
    assert not recipe.valid(program, H100, {**ok, "units": 4, "tile_cols": 8, "tile_rows": 8})  # registers
    wide = _program(batch=1, hidden=2048)  # 32 units a block: 128 columns x 2048 fp32 weights
    assert not recipe.valid(wide, H100, {**recipe.defaults(wide, H100), "units": 32})
    space = recipe.space(program, H100)
    assert ok in space and all(recipe.valid(program, H100, k) for k in space)


def test_defaults_split_k_over_the_threads():
    """B=16, H=512, 256 threads: 16 tiles of 4 x 4 outputs, 16 split-K parts of 8 chunks of 4 k."""
    program = _program()
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().defaults(program, H100))
    (g,) = kernel.gemms
    assert (g.C, g.tm, g.tn, g.tiles, g.split, g.chunks) == (16, 4, 4, 16, 16, 8)
    assert g.tiles * g.split == kernel.threads and kernel.grid == 128


@pytest.mark.parametrize("batch, hidden", [(4, 512), (8, 1024)])
def test_defaults_leave_out_waiters_where_several_gemms_poll(batch, hidden):
    """The backward's reversed loop of LSTM, one GEMM a gate (fp16 on Hopper): four polled states
    (16 KiB and 64 KiB staged a step), no waiters (POLL_WAITERS_ABOVE_BYTES)."""
    from halstm.gradients import reversed_loop

    adjoint = reversed_loop(halstm.LSTM(hidden, hidden), 100, batch, "float16", H100)
    program = halstm.lower(adjoint, steps=101, batch=batch, dtype="float16")
    knobs = CudaPersistent().defaults(program, H100)
    kernel = PersistentKernel.plan(program, H100, knobs)
    assert len(kernel.gemms) == 4 and len(kernel.polled) == 4 and kernel.polled_bytes >= 16 * 1024
    assert not knobs["poll_waiters"]


@pytest.mark.parametrize("cell, batch, hidden, units, row_blocks", [
    (halstm.LSTM, 16, 512, 8, 1), (halstm.GRU, 1, 256, 4, 1), (halstm.LSTM, 16, 1024, 16, 1),
    (halstm.LSTM, 64, 1024, 16, 2), (halstm.GRU, 8, 512, 8, 1)])  # 64 groups of 16 units already
def test_defaults_give_a_step_polling_several_states_few_unit_groups(cell, batch, hidden, units, row_blocks):
    """The backward's reversed loop stages every gate's adjoint a step: at most POLLING_GRID_GROUPS
    unit groups, where the forward of the same shape takes the largest grid within the SMs; it polls
    them up to POLLING_MAX_BATCH rows, from more it ends a step in a grid sync."""
    from halstm.gradients import reversed_loop

    recipe = CudaPersistent()
    adjoint = reversed_loop(cell(hidden, hidden), 100, batch, "float16", H100)
    program = halstm.lower(adjoint, steps=101, batch=batch, dtype="float16")
    k = recipe.defaults(program, H100)
    assert (k["units"], k["row_blocks"]) == (units, row_blocks) and recipe.runs(program, H100, k)
    assert len(PersistentKernel.plan(program, H100, {**k, "poll_states": True}).polled) > 1
    assert k["poll_states"] == (batch <= POLLING_MAX_BATCH)
    forward = recipe.defaults(_program(cell, batch=batch, hidden=hidden, dtype="float16"), H100)
    assert hidden // forward["units"] * forward["row_blocks"] == 128


def test_math_adds_the_split_k_partials():
    """B=16, H=512 (16 split-K parts): no pass of all threads sums the partial tiles into a buffer;
    the elementwise math reads each gate's 16 partials and adds them."""
    program = _program()
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().defaults(program, H100))
    (g,) = kernel.gemms
    assert g.split == 16 and not any(name.startswith("g_s") for name, *_ in kernel.buffers())
    h_next = next(line for line in _step_text(program).splitlines() if "h_next[" in line and " = " in line)
    assert h_next.count(f"part{g.index}[{15 * g.partial_stride} + ") == 4  # the four gates' last partials


@pytest.mark.parametrize("cell, batch, hidden, waiters", [
    (halstm.LSTM, 16, 512, False),  # 16 KiB staged a step
    (halstm.LSTM, 64, 512, False),  # 2 row blocks: 32 KiB
    (halstm.GRU, 64, 1024, True),  # 2 row blocks: 64 KiB
], ids=lambda v: getattr(v, "__name__", str(v)))
def test_defaults_put_waiters_before_the_polled_staging_above_32_kib(cell, batch, hidden, waiters):
    """fp16: one waiter a producer before the polled staging only where a block stages more than
    POLL_WAITERS_ABOVE_BYTES a step; without, a barrier still precedes it (after the prefetch)."""
    program = _program(cell, batch=batch, hidden=hidden, dtype="float16")
    knobs = CudaPersistent().defaults(program, H100)
    kernel = PersistentKernel.plan(program, H100, knobs)
    assert kernel.polled and knobs["poll_waiters"] == waiters == (kernel.polled_bytes > 32 * 1024)
    step = _step_text(program)
    step = step[step.index('T.sblock("step")'):]
    assert ("halstm_wait_value" in step) == waiters
    before_staging = step[:step.index("halstm_poll_stage")]
    assert before_staging.count("x_proj0_t[") == 1 and before_staging.count("T.tvm_storage_sync") == 1


def test_cells_with_dependent_gates_keep_their_extra_grid_sync():
    text = _step_text(_program(halstm.ResetBeforeGRU, batch=3))
    step = text[text.index('T.sblock("step")'):]
    assert step.count("T.cuda.grid_sync()") == 2 and "halstm_poll_stage" not in step
    text = _step_text(_program(halstm.LSTM, batch=3), poll_states=False)
    assert text[text.index('T.sblock("step")'):].count("T.cuda.grid_sync()") == 1


@pytest.mark.parametrize("dtype, call", [("float16", "halstm_poll_stage<16, 2>"), ("float32", "halstm_poll_stage<16, 4>")])
def test_polled_states_replace_the_step_grid_sync(dtype, call):
    """LSTM: h's sequence past the initial state is filled with the sentinel before the time loop
    (then the only grid sync); each step stages h through the polling helper (tensor cores at fp16:
    8 halves a vector; FFMA at fp32: 4 floats), stores h through halstm_not_sentinel (c, which no
    other block reads, as it is), and ends with a block's sync."""
    text = _step_text(_program(dtype=dtype))
    setup, step = text[:text.index('T.sblock("step")')], text[text.index('T.sblock("step")'):]
    assert setup.count("T.cuda.grid_sync()") == 1 and "grid_sync" not in step
    assert re.search(r"h_seq\[16 \+ .*\] = T.reinterpret\(", setup) and "c_seq[16" not in setup
    assert step.count(call) == 1 and "t > 0" in step
    assert re.search(r'h_next\[.*\] = T.call_extern\("' + dtype + '", "halstm_not_sentinel"', step)
    assert not re.search(r'c_next\[.*\] = T.call_extern', step)
    assert step.rstrip().endswith('T.tvm_storage_sync("shared", T.bool(False), -1)')


def test_polled_kernel_compiles_with_its_helpers(tmp_path):
    """The helpers come with the kernel's source (targets/cuda.py), which nvcc compiles."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    f = halstm.compile(halstm.GRU(24, 24), 3, 16, "float16", target=H100, recipe="cuda-persistent")
    source = f.module.mod.imports[0].inspect_source()
    assert "halstm_poll_stage<" in source and "template <int N, int W, typename... P>" in source
    assert_nvcc_compiles(source, tmp_path)


@pytest.mark.parametrize("cell, dtype", [(halstm.LSTM, "float16"), (halstm.ResetBeforeGRU, "float32")],
                         ids=["LSTM-float16", "ResetBeforeGRU-float32"])
def test_a_call_packs_no_step_weights_and_copies_no_states_in_kernels_of_their_own(cell, dtype):
    """The persistent kernel reads the step's weights from the parameters (ResetBeforeGRU: two step
    GEMMs) and copies the initial states itself: besides it, a call launches only the hoisted GEMM and
    the packing of its weights. Every kernel's pointer arguments name what it reads and writes."""
    f = halstm.compile(cell(20, 24), 3, 16, dtype, target=H100, recipe="cuda-persistent")
    kernels = re.findall(r'extern "C" __global__ void __launch_bounds__\(\d+\) (\w+)\(([^)]*)\) \{',
                         f.module.mod.imports[0].inspect_source())
    persistent = [args for _, args in kernels if "_seq_ptr" in args]
    assert len(persistent) == 1 and not any("w_packed1" in args or "w_packed2" in args for _, args in kernels)
    step_weights = {m.weight for g in f.plan.step_gemms for m in g.members}
    assert all(f"{w}_ptr" in persistent[0] for w in step_weights), persistent[0]
    assert len(kernels) == 3, [name for name, _ in kernels]  # W_ih packed, the hoisted GEMM, the persistent kernel


def _persistent_kernel(source: str, name: str) -> tuple[str, str]:
    """(the module's helper definitions, its cooperative kernel (the one that grid-syncs) renamed)."""
    head = source[:source.index('extern "C" __global__')]
    kernels = re.split(r'(?=extern "C" __global__ void __launch_bounds__\(\d+\) \w+\([^)]*\) \{)', source)
    (kernel,) = [k for k in kernels if k.startswith("extern") and "tvm_builtin_cuda_grid_sync();" in k]
    return head, re.sub(r"(__launch_bounds__\(\d+\) )\w+\(", rf"\1{name}(", kernel, count=1)


def _ptxas(sources: list[str], tmp_path) -> str:
    """nvcc for an H100 on the kernels; ptxas' report. The longest of the modules' helper
    definitions serves all: they differ only in what their kernels use (WMMA adds <mma.h>)."""
    path = tmp_path / "k.cu"
    path.write_text(max((head for head, _ in sources), key=len) + "".join(kernel for _, kernel in sources))
    return subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-w", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                           str(path)], capture_output=True, text=True, check=True).stderr


def _generate(cell, steps: int, batch: int, dtype: str, knobs: dict | None = None) -> tuple[str, str]:
    """The persistent kernel's CUDA source (no nvcc needed: the module holds source until it loads)."""
    f = halstm.compile(cell, steps, batch, dtype, target=H100, recipe="cuda-persistent", knobs=knobs)
    assert f.recipe.name == "cuda-persistent"
    return _persistent_kernel(f.module.mod.imports[0].inspect_source(), f"persistent_{batch}_{cell.hidden_size}")


# test_matches_reference_on_gpu's (batch, hidden); a Latin square of cells and dtypes over them: every
# (cell, size), (cell, dtype) and (size, dtype) pair once, 12 compiles instead of the GPU test's 36. The
# kernel's plan (knobs, which shared buffers and their sizes) follows from cell and size alone at these
# sizes, the dtype changes the weights' and operand's element type and with it the code generated.
GPU_SIZES = ((1, 50), (3, 100), (16, 200))
GENERATED = [(cell, DTYPES[(c + s) % len(DTYPES)], batch, hidden)
             for c, cell in enumerate(CELLS) for s, (batch, hidden) in enumerate(GPU_SIZES)]


@pytest.mark.parametrize("cell, dtype, batch, hidden", GENERATED,
                         ids=[f"{c.__name__}-{d}-{b}x{h}" for c, d, b, h in GENERATED])
def test_generates_cuda_at_the_gpu_test_sizes(cell, dtype, batch, hidden):
    """Code generation on any machine for what the GPU test runs (its cells, T=24, I=32): a failure of
    TVM's lowering (as its merge of the shared allocations failing on a buffer of 32 bits or less: the
    one-sum g_s2 of ResetBeforeGRU at B=1, H=50) shows without a GPU or nvcc."""
    _generate(cell(32, hidden), 24, batch, dtype)


COMPILED = [(cell, dtype) for dtype in DTYPES for cell in CELLS]


# CI: each dtype once (3 of 12): GRU bf16, PeepholeLSTM fp32 (two states, peepholes), ResetBeforeGRU fp16
# (two GEMMs sharing an operand); LSTM's kernel, one of PeepholeLSTM's without the peepholes, nvcc
# compiles on the GPU machine (slow), its CUDA generated in CI (test_generates_cuda_at_the_gpu_test_sizes)
@NVCC
@pytest.mark.parametrize("cell, dtype", representative(
    COMPILED, [f"{c.__name__}-{d}" for c, d in COMPILED],
    {"GRU-bfloat16", "PeepholeLSTM-float32", "ResetBeforeGRU-float16"}))
def test_compiles(cell, dtype, tmp_path):
    """B=1, H=50 and 256; B=16, H=512 and 768: the persistent kernel through nvcc (one call for all)."""
    sources = [_generate(cell(hidden, hidden), 2, batch, dtype)
               for batch, hidden in ((1, 50), (1, 256), (16, 512), (16, 768))]
    _ptxas(sources, tmp_path)


@NVCC
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_streamed_operand_compiles(dtype, tmp_path):
    """B=256, H=1024: the operand's fragments straight from global memory, 4 accumulators a warp
    (WMMA's loads take a global pointer); the batch over 2 blocks a unit group."""
    c = halstm.LSTM(1024, 1024)
    knobs = {"units": 16, "row_blocks": 2}
    f = halstm.compile(c, 2, 256, dtype, target=H100, recipe="cuda-persistent", knobs=knobs)
    source = f.module.mod.imports[0].inspect_source()
    assert re.search(r"load_matrix_sync\(a_f_ptr\w*\[0\], \(&\(h_seq_ptr\[", source)
    assert "acc_f_ptr[4];" in source and "a_s1" not in source
    _ptxas([_persistent_kernel(source, "streamed")], tmp_path)


@NVCC
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_register_tile_stays_in_registers(dtype, tmp_path):
    """ptxas: no stack frame (the tile's arrays and, at fp16, the resident weight fragments are
    registers, not local memory). Cells with two grid
    syncs may show a few bytes: registers saved around the grid sync's call."""
    f = halstm.compile(halstm.LSTM(512, 512), 2, 16, dtype, target=H100, recipe="cuda-persistent")
    out = _ptxas([_persistent_kernel(f.module.mod.imports[0].inspect_source(), "persistent")], tmp_path)
    props = out[out.index("Function properties for persistent"):]
    assert re.match(r"Function properties for persistent\n\s+0 bytes stack frame, 0 bytes spill", props), props[:200]


# --- the kernel's IR run in Python, one emulated thread at a time (tests/cuda_emulator.py) ------------------

def _is_sync(stmt, op: str) -> bool:
    return isinstance(stmt, tvm.tirx.Evaluate) and isinstance(stmt.value, tvm.ir.Call) and stmt.value.op.name == op


def _phases(stmts, unsynced=()):
    """Top-level statements split at their syncs: (code, ends with a grid sync); the syncs at the
    indices ``unsynced`` left out (a kernel missing them)."""
    out, current = [], []
    for n, stmt in enumerate(stmts):
        grid = _is_sync(stmt, "tirx.cuda.grid_sync")
        if grid or _is_sync(stmt, "tirx.tvm_storage_sync"):
            if n in unsynced:
                continue
            body = "\n".join("    " + line for line in current + ["if False:", "    yield"])
            out.append((compile_text(f"def phase():\n{body}", "<kernel>"), grid))
            current = []
        else:
            current += python_lines(stmt)
    assert not current, "statements after the last grid sync"
    return out


def _kernel_parts(func):
    """(the thread variables, the "persistent" block, its statements before the time loop, the time
    loop, the "step" block) of the persistent kernel's function."""
    loops = {}
    tvm_ffi.structural_walk(func, (tvm.tirx.For, lambda f: loops.update({f.thread_binding.thread_tag: f})
                                   if f.thread_binding is not None else None))
    bx, tx = loops["blockIdx.x"].loop_var, loops["threadIdx.x"].loop_var
    persistent = loops["threadIdx.x"].body.block
    *setup, time_loop = persistent.body.seq
    return (bx, tx), persistent, setup, time_loop, time_loop.body.block


def _emulate(cell, steps, batch, knobs, staged=True, seed=0, dtype="float32", target=H100, unsynced=()):
    """Run the persistent kernel's IR (setup, then the step for every t) for every block and thread,
    phase by phase; returns the output sequence (T, B, H) and the final states, as the compiled
    function does. ``unsynced``: step syncs left out (``_phases``)."""
    rng = np.random.default_rng(seed)
    program = halstm.lower(cell, steps=steps, batch=batch, dtype=dtype)
    kernel = PersistentKernel.plan(program, target, CudaPersistent().resolve(program, target, knobs))
    kernel.staged = staged and kernel.staged
    (bx_var, tx_var), persistent, setup, time_loop, step = _kernel_parts(kernel.func())
    x, params, states = (upcast(d) if isinstance(d, dict) else np.float64(d)
                         for d in random_inputs(cell, steps, batch, rng))
    B, H, plan, memory = batch, cell.hidden_size, program.plan, Memory()
    env = {"T": T}
    for name, value in params.items():
        env[name] = Buffer(name, value, memory)
    for g in plan.hoisted:  # the prologue's GEMMs; the kernel reads the step's weights where they are
        packed = np.concatenate([params[m.weight] for m in g.members]).T
        env[g.name] = Buffer(g.name, _hoisted_operand(g, x.reshape(steps * B, -1), params) @ packed, memory)
    env["x"] = Buffer("x", x.reshape(steps * B, -1), memory)
    seqs = {s: np.full(((steps + 1) * B, H), np.nan) for s in cell.states}  # the kernel copies the initial states
    for s in cell.states:
        env[f"{s}0"] = Buffer(f"{s}0", states[s], memory)
        env[f"{s}_seq"] = Buffer(f"{s}_seq", seqs[s], memory)
    for b in kernel.elementwise_blocks:
        if b.buffer not in {f"{s}_next" for s in cell.states}:
            env[b.buffer] = Buffer(b.buffer, np.zeros((B, H)), memory)
    if kernel.reductions:  # the unit groups' partial sums of each reduction's rows
        parts = np.full((len(kernel.reductions) * 2 * B, kernel.groups), np.nan)
        env["sum_parts"] = Buffer("sum_parts", parts, memory)
    buffers = {b.name: (int(b.shape[0]), b.scope()) for b in persistent.alloc_buffers}
    assert buffers == {n: (size, scope) for n, size, _, scope in kernel.buffers()}
    blocks = [{n: Buffer(n, np.full(size, np.nan), memory, shared=True) for n, size, _, scope in kernel.buffers()
               if scope == "shared.dyn"} for _ in range(kernel.grid)]
    registers = {n: (size, scope) for n, size, _, scope in kernel.buffers() if scope == "local" or "wmma" in scope}

    def run(code, t):
        # the step's views: rows of their buffers, from the first row of their region at this step
        first = {time_loop.loop_var.name: t}
        views = {m.buffer.name: env[m.source.source.name].view(eval(python_expr(m.source.region[0].min), first))  # noqa: S307
                 for m in step.match_buffers}
        for bx in range(kernel.grid):
            running = []
            for tx in range(kernel.threads):
                names = {bx_var.name: bx, tx_var.name: tx, time_loop.loop_var.name: t}
                scope = {**env, **views, **blocks[bx], **threads[bx][tx], **names}
                exec(code, scope)  # noqa: S102 (defines the phase as a generator: its lane sums in lockstep)
                running.append(((bx, tx), scope["phase"]()))
            assert not lockstep(running, memory)

    # registers live across phases: one set a thread
    threads = [[{n: Fragment((size,)) if "wmma" in scope else np.zeros(size) for n, (size, scope) in registers.items()}
                for _ in range(kernel.threads)] for _ in range(kernel.grid)]
    for code, grid in _phases(setup):
        memory.phase += 1
        run(code, 0)
        memory.interval += grid
    phases = _phases(step.body.seq, unsynced)
    for t in range(steps):
        for code, grid in phases:
            memory.phase += 1
            run(code, t)
            memory.interval += grid
    y = seqs[cell.states[0]][B:].reshape(steps, B, H)
    return y, {s: seqs[s][-B:] for s in cell.states}, (x, params, states)


def _hoisted_operand(gemm, rows, params):
    """A hoisted GEMM's operand over all rows of x (x itself, or an expression of it: tanh(x)), by
    the float64 oracle a row at a time (the plan traced one row)."""
    leaves = [op for op in upstream(gemm.operand) if isinstance(op, te.PlaceholderOp)]
    bound = {op: params[op.name] for op in leaves if op.name in params}
    x = next((op for op in leaves if op.name == "x"), None)
    if x is None or gemm.operand.op.same_as(x):
        return rows
    return np.concatenate([_Evaluator({**bound, x: row[None]}).tensor(gemm.operand) for row in rows])


EMULATED = [  # (B, I, H, knobs): ragged K (H=10: not whole vectors), tiles past the batch, spare threads,
    # more tiles than threads
    (3, 5, 10, {"threads": 32, "units": 5, "tile_rows": 2, "tile_cols": 2, "max_split": 4}),
    (1, 4, 12, {"threads": 32, "units": 3, "tile_rows": 1, "tile_cols": 4, "max_split": 32}),
    (4, 6, 8, {"threads": 64, "units": 2, "tile_rows": 4, "tile_cols": 4, "max_split": 2}),
    (4, 3, 8, {"threads": 16, "units": 2, "tile_rows": 1, "tile_cols": 1, "max_split": 2}),  # tiles > threads
    (6, 5, 8, {"threads": 32, "units": 4, "tile_rows": 2, "tile_cols": 2, "max_split": 4, "row_blocks": 3}),
]
TENSOR_CORES = [  # (B, I, H, units, threads): the batch padded to 16 rows, columns to 16, ragged K; split-K
    # over the warps; more tiles than warps (3 warps, 4 tiles: two rounds, idle warps in the second)
    (3, 5, 10, 5, 64),
    (18, 20, 24, 4, 128),
    (20, 7, 12, 6, 96),
]


def _check_emulation(cell, B, I, H, knobs, staged=True, **lowering):
    """float64 throughout (the emulator's casts keep the value): the reference up to float64 rounding."""
    c = cell(I, H)
    y, final, (x, params, states) = _emulate(c, 3, B, {"tensor_cores": False, **knobs}, staged, **lowering)
    want_y, want_states = halstm.reference(c, x, params, states)
    assert rel_err(y, want_y) < 1e-12
    for s in c.states:
        assert rel_err(final[s], want_states[s]) < 1e-12


STEP_TEXT = [(cell, shape, staged) for cell in CELLS for shape in EMULATED for staged in (True, False)]


# CI: each shape staged and global, the cells spread over them (10 of 40: a shape meets each cell with
# the operand staged or global, each cell both ways); the other cases repeat a shape's index math with
# another cell (slow)
@pytest.mark.parametrize("cell, shape, staged", representative(
    STEP_TEXT, ["{}-B{}-I{}-H{}-{}".format(c.__name__, *s[:3], "staged" if st else "global") for c, s, st in STEP_TEXT],
    ["{}-B{}-I{}-H{}-{}".format(CELLS[(i + 2 * (not staged)) % len(CELLS)].__name__, *s[:3],
                                "staged" if staged else "global")
     for i, s in enumerate(EMULATED) for staged in (True, False)]))
def test_emulated_step_text_matches_reference_without_races(cell, shape, staged):
    _check_emulation(cell, *shape, staged)


@pytest.mark.parametrize("cell, rounds", [(halstm.LayerNormGRU, [["x_proj0_weight_ih_sum", "x_proj0_weight_ih_sqdev",
                                                                    "gemm0_weight_hh_sum", "gemm0_weight_hh_sqdev"]]),
                                         (halstm.LayerNormLSTM, [["x_proj0_weight_ih_sum", "x_proj0_weight_ih_sqdev",
                                                                  "gemm0_weight_hh_sum", "gemm0_weight_hh_sqdev"],
                                                                 ["T_add_sum", "T_add_sqdev"]])],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_layer_norm_variance_runs_in_its_mean_round(cell, rounds):
    """A variance sums deviations from each group's own mean, so it needs no round of its own: one
    grid-level exchange a step for the GRU's two layer norms, two for the LSTM's (c's after the gates')."""
    program = _program(cell, batch=16, hidden=64, dtype="float16")
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {}))
    assert [[r.buffer for r in level] for level in kernel.rounds()] == rounds
    apart = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {"merge_variances": False}))
    assert [[r.buffer for r in level] for level in apart.rounds()] == [
        [r for r in level if r.endswith("_sum")] if n % 2 == 0 else [r for r in level if r.endswith("_sqdev")]
        for level in rounds for n in range(2)]


def _calls(node) -> list[str]:
    """The calls in ``node``: an extern call by its function's name, another by its op's."""
    names = []
    tvm_ffi.structural_walk(node, (tvm.ir.Call, lambda c: names.append(
        c.args[0].value if c.op.name == "tirx.call_extern" else c.op.name) and None))
    return names


def _step_calls(func) -> list[str]:
    """The grid syncs and device helpers the kernel's time loop calls, in order."""
    return [n for n in _calls(_kernel_parts(func)[3]) if n == "tirx.cuda.grid_sync" or n.startswith("halstm_")]


@pytest.mark.parametrize("cell, rounds", [(halstm.LayerNormGRU, 1), (halstm.LayerNormLSTM, 2)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_polled_sums_replace_the_rounds_grid_syncs(cell, rounds):
    """poll_sums: a round's parts are stored tagged with the step and polled, and the step (its
    states polled too) has no grid sync; without the knob, a grid sync a round."""
    program = _program(cell, batch=16, hidden=64, dtype="float16")
    polled = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {}))
    assert polled.poll_sums and polled.polled == tuple(cell.states[:1])
    calls = _step_calls(polled.func())
    assert "tirx.cuda.grid_sync" not in calls
    assert calls.count("halstm_poll_parts") >= rounds and "halstm_store_part" in calls
    synced = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {"poll_sums": False}))
    calls = _step_calls(synced.func())
    assert calls.count("tirx.cuda.grid_sync") == rounds
    assert not [c for c in calls if c in ("halstm_poll_parts", "halstm_store_part")]


@pytest.mark.parametrize("cell, rounds", [(halstm.LayerNormGRU, 1), (halstm.LayerNormLSTM, 2)],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_rounds_sums_take_one_pass_of_lane_sums(cell, rounds):
    """Each round's sums, the block's part and the groups' total, in one pass each: a variance's
    lanes add its mean's sum and then its own (two lane sums a pass), with no shared scratch and no
    block barrier before the part is stored."""
    program = _program(cell, batch=16, hidden=64, dtype="float16")
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {}))
    assert _step_calls(kernel.func()).count("halstm_lane_sum") == 4 * rounds
    gemms = ({f"{n}{g.index}" for g in kernel.gemms for n in ("w_s", "part")} | {a.name for a in kernel.operands.values()}
             | {f"x_s{i}" for i, *_ in kernel.hoisted})
    assert {name for name, *_, scope in kernel.buffers() if scope == "shared.dyn"} - gemms == {"sums_s", "parts_s"}


def test_plans_are_kept_by_the_knobs_they_read_and_each_call_has_its_own():
    """``PersistentKernel.plan`` keeps recent plans by the knobs the kernel reads (not the prologue's):
    a setting that differs in those alone gets the kept plan, as a kernel of its own that a caller
    may change; one that differs in a kernel knob gets its own plan."""
    recipe, program = CudaPersistent(), _program(dtype="float16")
    knobs = recipe.defaults(program, H100)
    first = PersistentKernel.plan(program, H100, knobs)
    first.staged = not first.staged
    again = PersistentKernel.plan(program, H100, {**knobs, "tc_hoisted_frags": 4, "wgmma": not knobs["wgmma"]})
    assert again is not first and again.staged != first.staged
    assert PersistentKernel.plan(program, H100, {**knobs, "threads": 512}).threads == 512


def test_the_math_reads_a_staged_state_from_its_operand():
    """GRU's z * h reads h at its own units from the operand the block staged for the GEMM; not
    where the operand buffer also stages another GEMM's (ResetBeforeGRU's r * h on tensor cores), nor
    where the operands are read from global memory."""
    def kernel(cell):
        program = _program(cell, batch=16, hidden=64, dtype="float16")
        return PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {}))

    gru = kernel(halstm.GRU)
    assert list(gru.staged_states) == ["h_t"]
    reads = []  # the time loop's loads (the staging polls through pointers, the GEMM's fragments too)
    tvm_ffi.structural_walk(_kernel_parts(gru.func())[3],
                            (tvm.ir.TensorLoad, lambda load: reads.append(load.source.name)))
    assert gru.staged_states["h_t"].name in reads and "h_t" not in reads
    assert kernel(halstm.ResetBeforeGRU).staged_states == {}
    gru.staged = False
    assert gru.staged_states == {}


@pytest.mark.parametrize("cell", [halstm.LayerNormLSTM, halstm.LayerNormGRU], ids=lambda c: c.__name__)
def test_reductions_generate_cuda_for_a_single_row(cell):
    """One row a block and a phase of one reduction (c's mean): the sums' passes store to shared
    memory where TVM's barriers cannot go inside their conditions (it failed to generate code)."""
    _generate(cell(32, 50), 4, 1, "float32")


def test_emulator_finds_parts_polled_before_they_are_stored():
    """Without the barrier between the block's stores of its parts and its polls, the emulation
    (a phase at a time, block after block) finds a block polling parts that no block stored yet."""
    B, I, H, knobs = EMULATED[0]
    knobs = {"tensor_cores": False, **knobs}
    program = _program(halstm.LayerNormGRU, batch=B, hidden=H, inputs=I)
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, knobs))
    stmts = list(_kernel_parts(kernel.func())[-1].body.seq)
    polls = next(n for n, stmt in enumerate(stmts) if "halstm_poll_parts" in _calls(stmt))
    assert _is_sync(stmts[polls - 1], "tirx.tvm_storage_sync")
    _emulate(halstm.LayerNormGRU(I, H), 2, B, knobs)
    with pytest.raises(Race, match="polled for tag 1"):
        _emulate(halstm.LayerNormGRU(I, H), 2, B, knobs, unsynced={polls - 1})


def test_mean_of_finds_a_variance_only_around_the_mean_of_its_own_value():
    row, unit = tvm.tirx.Var("row", "int32"), tvm.tirx.Var("unit", "int32")
    a, b = (tvm.tirx.decl_buffer((4, 8), "float32", name=n) for n in "ab")
    m = tvm.tirx.decl_buffer((4,), "float32", name="m")

    def variance(value, width=8, n=8.0):
        centred = value - m[row] / tvm.tirx.const(n, "float32")
        return Reduction("v", row, unit, centred * centred, width)

    mean = Reduction("m", tvm.tirx.Var("r", "int32"), tvm.tirx.Var("u", "int32"), None, 8)
    mean = dataclasses.replace(mean, value=a[mean.row, mean.unit])  # its own variables, as each block has
    assert mean_of(variance(a[row, unit]), [mean]) is mean
    assert mean_of(variance(b[row, unit]), [mean]) is None  # around another value's mean
    assert mean_of(variance(a[row, unit], n=4.0), [mean]) is None  # not divided by the columns summed
    assert mean_of(variance(a[row, unit] * 2.0), [mean]) is None
    centred = a[row, unit] - m[row] / tvm.tirx.const(8.0, "float32")
    assert mean_of(Reduction("v", row, unit, centred * a[row, unit], 8), [mean]) is None  # not a square


@pytest.mark.parametrize("knobs", [{}, {"tensor_cores": True, "threads": 64}, {"row_blocks": 3},
                                   {"merge_variances": False}, {"poll_sums": False}],
                         ids=["ffma", "tensor-cores", "row-blocks", "variance-after-mean", "grid-synced-sums"])
@pytest.mark.parametrize("cell", [halstm.LayerNormLSTM, halstm.LayerNormGRU], ids=lambda c: c.__name__)
def test_emulated_layer_norm_matches_reference_without_races(cell, knobs):
    """A cell's own reductions (layer norms over a gate's or all gates' columns, the variance with
    its mean or in a round after it): each block's partial sums of its units, exchanged through
    global memory across a grid sync, summed in shared memory, read by the math of the block's rows."""
    B, I, H, base = EMULATED[4] if "row_blocks" in knobs else EMULATED[0]
    knobs = {**base, **knobs}
    dtype = "float16" if knobs.get("tensor_cores") else "float32"
    program = _program(cell, batch=B, hidden=H, inputs=I, dtype=dtype)
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {"tensor_cores": False, **knobs}))
    assert kernel is not None and kernel.reductions
    _check_emulation(cell, B, I, H, knobs, dtype=dtype)


@pytest.mark.parametrize("cell", X_IN_STEP, ids=lambda c: c.__name__)
def test_emulated_step_that_reads_x_itself_matches_reference_without_races(cell):
    """The math reads the step's rows of x (``x_t``) at its own (row, unit), from global memory."""
    _check_emulation(cell, 3, 10, 10, {"threads": 32, "units": 5, "tile_rows": 2, "tile_cols": 2, "max_split": 4})


RESIDENT = [(cell, shape, resident) for resident in (True, False) for shape in TENSOR_CORES for cell in CELLS]


# CI: each cell, each shape and both weight placements (4 of 24)
@pytest.mark.parametrize("cell, shape, resident", representative(
    RESIDENT, ["{}-B{}-I{}-H{}-{}".format(c.__name__, *s[:3], "resident-weights" if r else "weights-from-shared")
               for c, s, r in RESIDENT],
    {"LSTM-B18-I20-H24-resident-weights", "GRU-B20-I7-H12-weights-from-shared",
     "PeepholeLSTM-B3-I5-H10-weights-from-shared", "ResetBeforeGRU-B20-I7-H12-resident-weights"}))
def test_emulated_tensor_core_text_matches_reference_without_races(cell, shape, resident):
    """The WMMA calls emulated on whole tiles (fragment loads, mma, stores at the offsets and leading
    dimensions the text gives): index math, padding and the split-K parts, in float64; the weight
    fragments loaded once before the time loop (kept in registers) or from shared memory every step."""
    B, I, H, units, threads = shape
    knobs = {"threads": threads, "units": units, "tile_rows": 1, "tile_cols": 1, "max_split": 32, "tensor_cores": True,
             "resident_weights": resident}
    program = _program(cell, batch=B, hidden=H, inputs=I)
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, knobs))
    gemms = kernel.gemms
    assert [g.resident for g in gemms] == [resident and g.rounds == 1 for g in gemms]
    _check_emulation(cell, B, I, H, knobs)


STREAMED = [  # (B, I, H, knobs): tensor cores, the operand staged or its fragments loaded from global memory;
    # the batch over 2 blocks a unit group; 2 fragments a warp, split-K over the warps; more tiles than warps
    (32, 7, 32, {"threads": 64, "units": 8, "row_blocks": 2, "warp_frags": 2}),
    (48, 5, 16, {"threads": 32, "units": 4, "row_blocks": 1, "warp_frags": 4}),
    # 4 chunks of K (GRU: 3 fragments a warp)
    (16, 5, 64, {"threads": 32, "units": 16, "row_blocks": 1, "warp_frags": 4}),
]


ROW_BLOCKS = [(cell, shape, staged) for staged in (False, True) for shape in STREAMED for cell in CELLS]


# CI: each shape once, streamed and staged (3 of 24): LSTM streamed with more tiles than warps,
# PeepholeLSTM staged over two row blocks, GRU staged over four chunks of K; ResetBeforeGRU's two
# GEMMs sharing one operand run emulated in test_emulated_gemms_sharing_one_staged_operand_match_reference
@pytest.mark.parametrize("cell, shape, staged", representative(
    ROW_BLOCKS, ["{}-B{}-I{}-H{}-{}".format(c.__name__, *s[:3], "staged" if st else "streamed") for c, s, st in ROW_BLOCKS],
    {"LSTM-B48-I5-H16-streamed", "GRU-B16-I5-H64-staged", "PeepholeLSTM-B32-I7-H32-staged"}))
def test_emulated_tensor_core_row_blocks_and_fragments_match_reference_without_races(cell, shape, staged):
    B, I, H, knobs = shape
    knobs = {**knobs, "max_split": 32, "tensor_cores": True, "stage_operand": staged}
    program = _program(cell, batch=B, hidden=H, inputs=I)
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, knobs))
    assert kernel.staged == staged and kernel.grid == H // knobs["units"] * knobs["row_blocks"]
    _check_emulation(cell, B, I, H, knobs, staged=staged)


def test_emulated_gemms_sharing_one_staged_operand_match_reference():
    """ResetBeforeGRU fp16 on tensor cores (B=3, H=36, 2 warps) in 13 KiB of shared memory: room for
    one staged operand (16 rows of 72, 2.25 KiB) beside the weights and partial tiles (10.4 KiB),
    not for two (14.4 KiB): h and r * h take turns in one buffer. Their GEMMs split K differently
    (2 tiles in 1 part, 1 tile in 2: rows of 56 and 72 elements); both use the wider rows."""
    B, I, H = 3, 5, 36
    knobs = {"threads": 64, "units": 12, "tile_rows": 1, "tile_cols": 1, "max_split": 32, "tensor_cores": True}
    program = _program(halstm.ResetBeforeGRU, batch=B, hidden=H, dtype="float16", inputs=I, steps=3)
    small = dataclasses.replace(H100, shared_memory=13 * 1024)
    kernel = PersistentKernel.plan(program, small, CudaPersistent().resolve(program, small, knobs))
    assert kernel is not None and kernel.staged, "two operands do not fit in 13 KiB"
    assert sorted({g.stride for g in kernel.gemms}) == [56, 72]
    _check_emulation(halstm.ResetBeforeGRU, B, I, H, knobs, dtype="float16", target=small)


@pytest.mark.parametrize("cell", [halstm.LSTM, halstm.GRU], ids=lambda c: c.__name__)
def test_emulated_waiters_match_reference_without_races(cell):
    B, I, H, knobs = EMULATED[0]
    program = _program(cell, batch=B, hidden=H, inputs=I)
    assert PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {**knobs, "poll_waiters": True})).polled
    _check_emulation(cell, B, I, H, {**knobs, "poll_waiters": True})


def test_emulator_finds_a_race():
    """Without the sync between the partial tiles and the math that adds them, the emulation reports
    a race."""
    B, I, H, knobs = EMULATED[0]
    knobs = {"tensor_cores": False, **knobs}
    program = _program(halstm.LSTM, batch=B, hidden=H, inputs=I)
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, knobs))
    stmts = list(_kernel_parts(kernel.func())[-1].body.seq)

    def stores_partials(stmt):
        found = []
        tvm_ffi.structural_walk(stmt, (tvm.tirx.BufferStore, lambda st: found.append(st.buffer.name.startswith("part")) and None))
        return any(found)

    gemm = next(n for n, stmt in enumerate(stmts) if stores_partials(stmt))
    sync = next(n for n in range(gemm, len(stmts)) if _is_sync(stmts[n], "tirx.tvm_storage_sync"))
    _emulate(halstm.LSTM(I, H), 2, B, knobs)
    with pytest.raises(Race):
        _emulate(halstm.LSTM(I, H), 2, B, knobs, unsynced={sync})


def test_emulator_finds_a_step_that_does_not_wait_for_the_states():
    """Polled states without the polling (plain staging, no grid sync): the emulation reports that
    a block reads h that other blocks write."""
    B, I, H, knobs = EMULATED[0]
    poll = PersistentKernel.poll_operand

    def plain(self, g, v):  # every step's staging as the first step's: plain loads
        t, self.t = self.t, tvm.tirx.IntImm("int32", 0)
        try:
            poll(self, g, v)
        finally:
            self.t = t

    try:
        PersistentKernel.poll_operand = plain
        with pytest.raises(Race, match="h_seq"):
            _emulate(halstm.LSTM(I, H), 2, B, {"tensor_cores": False, **knobs})
    finally:
        PersistentKernel.poll_operand = poll


# --- on a GPU ------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("batch, hidden", [(1, 50), (3, 100), (16, 200)], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.__name__)
def test_matches_reference_on_gpu(cell, dtype, batch, hidden, rng):
    """H not a multiple of the tile nor of 4 units (50: 25 blocks of 2; 100, 200), T=24; tensor cores
    (the default for fp16/bf16) at B=16."""
    _check_on_gpu(cell(32, hidden), 24, batch, dtype, rng)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("knobs", [
    {"units": 8, "tile_rows": 2, "tile_cols": 8, "threads": 128, "max_split": 8},
    {"units": 16, "tile_rows": 1, "tile_cols": 2, "threads": 512, "max_split": 128},
    {"poll_waiters": True},
], ids=["few-blocks", "many-parts", "waiters"])
def test_other_knobs_match_reference_on_gpu(knobs, rng):
    _check_on_gpu(halstm.LSTM(16, 256), 20, 3, "float32", rng, knobs)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("batch, hidden, knobs", [
    (3, 100, {"tensor_cores": True}),  # 13 padding rows; one unit a block: 4 columns padded to 16, idle warps
    (20, 64, {"tensor_cores": True, "units": 8, "threads": 64}),  # 2 x 2 tiles for 2 warps: two rounds
    (32, 256, {"tensor_cores": True, "threads": 512}),  # split-K over 16 warps
    (32, 256, {"tc_hoisted_frags": 4}),  # the hoisted GEMM in 128 x 128 tiles, its C tile in 66 KiB
    # the operand's fragments from global memory (ResetBeforeGRU's r * h: staged), the batch over 2
    # blocks a unit group, 4 fragments a warp
    (32, 256, {"tensor_cores": True, "stage_operand": False, "row_blocks": 2, "units": 8, "warp_frags": 4}),
], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.__name__)
def test_tensor_cores_match_reference_on_gpu(cell, dtype, batch, hidden, knobs, rng):
    _check_on_gpu(cell(32, hidden), 20, batch, dtype, rng, knobs)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("batch, hidden, knobs", [(1, 50, {}), (16, 200, {}), (64, 256, {}), (32, 256, {"row_blocks": 2, "units": 4}),
                                                  (16, 128, {"poll_states": False}),
                                                  (16, 128, {"merge_variances": False}),
                                                  (16, 128, {"poll_sums": False})], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell", [halstm.LayerNormLSTM, halstm.LayerNormGRU], ids=lambda c: c.__name__)
def test_layer_norm_matches_reference_on_gpu(cell, dtype, batch, hidden, knobs, rng):
    """The cells' own reductions across the grid (``PersistentKernel.reduce``), T=24."""
    _check_on_gpu(cell(32, hidden), 24, batch, dtype, rng, knobs)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("cell", [halstm.LayerNormLSTM, halstm.LayerNormGRU], ids=lambda c: c.__name__)
def test_layer_norm_cells_match_reference_on_gpu(cell, dtype, batch, rng):
    """The defaults at H=512: 32 unit groups exchanging the sums' parts (four row blocks of 16 rows
    at B=64 on tensor cores)."""
    _check_on_gpu(cell(64, 512), 12, batch, dtype, rng)


def _check_on_gpu(c, T, batch, dtype, rng, knobs=None):
    torch = pytest.importorskip("torch")
    f = halstm.compile(c, T, batch, dtype, target=CudaTarget.detect(), recipe="cuda-persistent", knobs=knobs)
    x, params, states = random_inputs(c, T, batch, rng, dtype)
    to_gpu = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(getattr(torch, dtype)).cuda()
    y, final = f(to_gpu(x), {k: to_gpu(v) for k, v in params.items()}, {k: to_gpu(v) for k, v in states.items()})
    want_y, want_states = halstm.reference(c, np.asarray(x, np.float64), upcast(params), upcast(states))
    assert rel_err(y.float().cpu().numpy(), want_y) < TOLERANCE[dtype], f.knobs
    for s in c.states:
        assert rel_err(final[s].float().cpu().numpy(), want_states[s]) < TOLERANCE[dtype], f.knobs


def _reversed_loop(cell_type, gathered=True):
    """The reversed loop of ``cell_type``'s backward (its adjoint cell) for ``_check_emulation``."""
    return lambda inputs, hidden: AdjointCell(make_plan(cell_type(inputs, hidden)), gathered)


REVERSED_LOOP_SHAPES = {"ffma": EMULATED[0], "row-blocks": EMULATED[4],
                        "tensor-cores": (3, 5, 10, {"tensor_cores": True, "threads": 64, "units": 5})}
# CI: each (cell, shape) pair once, the operand gathered where the cell's and the shape's places add up
# even (9 of 18): every cell and every shape in both forms
REVERSED_LOOP = [(c, cell, s, kind, shape, gathered)
                 for c, cell in enumerate((halstm.LSTM, halstm.GRU, halstm.PeepholeLSTM))
                 for s, (kind, shape) in enumerate(REVERSED_LOOP_SHAPES.items()) for gathered in (True, False)]
REVERSED_LOOP_IDS = [f"{cell.__name__}-{kind}-{'gathered' if gathered else 'a-gemm-a-gate'}"
                     for _, cell, _, kind, _, gathered in REVERSED_LOOP]


@pytest.mark.parametrize("cell, shape, gathered", representative(
    [(cell, shape, gathered) for _, cell, _, _, shape, gathered in REVERSED_LOOP], REVERSED_LOOP_IDS,
    [name for (c, _, s, _, _, gathered), name in zip(REVERSED_LOOP, REVERSED_LOOP_IDS) if gathered == ((c + s) % 2 == 0)]))
def test_emulated_reversed_loop_matches_reference_without_races(cell, shape, gathered):
    """The backward's reversed loop (``halstm.adjoint``) in the persistent kernel: its step GEMM's
    operand gathered from the gates' adjoints of the last step (staged from their sequences), or a
    GEMM a gate (each gate's adjoint polled as stored), the transposed weights on chip, the adjoint
    math re-indexed onto the block's units."""
    B, I, H, knobs = shape
    program = halstm.lower(_reversed_loop(cell, gathered)(I, H), 2, B)
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {"tensor_cores": False, **knobs}))
    assert kernel and bool(kernel.polled) == (not gathered)
    _check_emulation(_reversed_loop(cell, gathered), B, I, H, knobs)


def test_a_state_clamped_twice_and_read_four_times_is_computed_once_a_step():
    """GatedNormRNN clamps its cell state twice (NaN-propagating min and max read each operand three
    times) and its output reads that state four times: inlined into the output, the step's
    expression grew to 300 KB, whose conditions TVM's buffer compaction did not get through in
    minutes. Kept as a block of its own (``recipe._copied_conditions``), the persistent kernel
    computes it once a step, matches float64 without races (its hoisted operand tanh(x) included),
    and TVM lowers it for an H100."""
    from test_backward import GatedNormRNN

    B, I, H, knobs = EMULATED[0]
    program = _program(GatedNormRNN, batch=B, hidden=H, inputs=I, dtype="float32")
    kernel = PersistentKernel.plan(program, H100, CudaPersistent().resolve(program, H100, {"tensor_cores": False, **knobs}))
    assert "minimum" in [b.buffer for b in kernel.elementwise_blocks]
    _check_emulation(GatedNormRNN, B, I, H, knobs)
    compiled = halstm.compile(GatedNormRNN(32, 32), 5, 16, "float32", target=H100)
    assert compiled.recipe.name == "cuda-persistent"
