"""The IR itself, before and after each recipe, against golden TVMScript in tests/golden/ (the numeric
checks are elsewhere): a change to lowering or to a schedule shows as a diff of these files.
Regenerate with ``pytest tests/test_golden.py --update-golden`` and review the diff."""

import halstm
from halstm.schedules import CpuScan, CpuStepLoop, CudaPersistent, CudaScan, CudaStepLoop
from halstm.schedules.cuda_tensorcore import tensorize_works
from halstm.targets import CpuTarget, CudaTarget

LSTM = halstm.LSTM(8, 16)
STEPS = 3
CPU = CpuTarget(mcpu="x86-64-v3", cores=2, lanes=8)  # fixed lanes: the same IR on any host
H100 = CudaTarget("sm_90", sms=132)
A100 = CudaTarget("sm_80", sms=108)
TENSORIZE = "Schedule.tensorize does not work with this apache-tvm-ffi: pin 0.1.14.post0"


def scheduled(recipe, cell, batch, dtype, target, knobs=None, steps=STEPS):
    """The module ``recipe`` makes of ``cell``, as ``halstm.compile`` schedules it: lowered in the
    recipe's weight layout for its knobs (defaults but ``knobs``)."""
    program = halstm.lower(cell, steps, batch, dtype)
    assert recipe.is_applicable(program, target)
    knobs = recipe.resolve(program, target, knobs)
    layout = recipe.layout(program, target, knobs)
    if layout != program.layout:
        program = halstm.lower(cell, steps, batch, dtype, layout=layout)
    return recipe.apply(program, target, **knobs).mod


def test_lower(golden):
    golden("lower_lstm", halstm.lower(LSTM, STEPS, 2).mod)


def test_cpu_step_loop(golden):
    golden("cpu_step_loop_lstm", scheduled(CpuStepLoop(), LSTM, 2, "float32", CPU))


def test_cuda_step_loop_fp32_on_ffma_cores(golden):
    golden("cuda_step_loop_lstm_fp32",
           scheduled(CudaStepLoop(), LSTM, 2, "float32", H100, {"tensor_cores": False}))


def test_cuda_step_loop_fp16_on_wmma(golden):
    """B=16: the step GEMM's rows fill a fragment, so it runs on tensor cores too (an A100: no wgmma)."""
    assert tensorize_works(), TENSORIZE
    golden("cuda_step_loop_lstm_fp16_wmma", scheduled(CudaStepLoop(), LSTM, 16, "float16", A100))


def test_cuda_step_loop_fp16_on_wgmma(golden):
    """I = H = 64: wgmma's K tiles (64 fp16) and column tiles (64) fit both GEMMs, weights (N, K)."""
    assert tensorize_works(), TENSORIZE
    golden("cuda_step_loop_lstm_fp16_wgmma",
           scheduled(CudaStepLoop(), halstm.LSTM(64, 64), 16, "float16", H100))


def test_cuda_persistent(golden):
    golden("cuda_persistent_lstm", scheduled(CudaPersistent(), LSTM, 2, "float32", H100))


def test_cuda_step_loop_layer_norm_in_one_kernel_a_row(golden):
    """The step's layer norms (sums over a row) and elementwise math: one kernel, a block a row."""
    golden("cuda_step_loop_layernorm_gru",
           scheduled(CudaStepLoop(), halstm.LayerNormGRU(8, 16), 2, "float32", H100))


def test_cpu_step_loop_layer_norm_sums_in_lanes(golden):
    """The step's layer norms: each row's sums in SIMD lanes (``cpu.row_sums``: rfactor, a vector of
    partial sums in registers), the lanes added after."""
    golden("cpu_step_loop_layernorm_gru", scheduled(CpuStepLoop(), halstm.LayerNormGRU(8, 16), 2, "float32", CPU))


MIN_GRU = halstm.MinGRU(8, 16)


def test_cpu_scan_in_chunks(golden):
    """A diagonal cell's scan: the coefficients over all rows, then chunks of 64 steps scanned in
    parallel, their carries, and the chunks' second pass (T=80: a whole chunk and a part)."""
    golden("cpu_scan_mingru", scheduled(CpuScan(), MIN_GRU, 2, "float32", CPU, {"chunk": 64}, steps=80))


def test_cuda_scan_in_chunks(golden):
    golden("cuda_scan_mingru", scheduled(CudaScan(), MIN_GRU, 2, "float32", H100, {"chunk": 32}, steps=40))
