"""Recipes as rewrites: the IR before and after the CPU recipe."""

import numpy as np
import tvm

import halstm
from conftest import random_inputs, rel_err
from halstm.compiler import signature
from halstm.layout import PackedLayout
from halstm.runtime import SequenceFunction
from halstm.schedules import CpuStepLoop, recipes_for
from halstm.schedules.recipe import is_reduction
from halstm.targets import CpuTarget

TARGET = CpuTarget(mcpu="x86-64-v3", cores=2, lanes=8)


def step_of(script: str) -> str:
    return script[script.index('T.sblock("step")'):]


def test_lowered_step_is_plain_blocks_on_row_views():
    program = halstm.lower(halstm.LSTM(8, 16), steps=3, batch=2)
    text = program.func.script()
    assert "for t in range(3):" in text
    assert "h_t = T.match_buffer(h_seq[t * 2:t * 2 + 2, 0:16], (2, 16), offset_factor=1)" in text
    step = step_of(text)
    assert 'T.sblock("gemm0")' in step and "T.parallel" not in step
    assert step.count("T.sblock(") > 5  # gates, slices and activations, each its own block


def test_cpu_recipe_fuses_elementwise_and_tiles_gemms():
    cell = halstm.LSTM(8, 16)
    recipe = CpuStepLoop()
    program = halstm.lower(cell, 3, 2, layout=recipe.layout(None, TARGET, recipe.defaults(None, TARGET)))
    assert program.layout == PackedLayout(tile=16)
    assert [r.name for r in recipes_for(program, TARGET)] == ["cpu-step-loop"]
    sch = recipe.apply(program, TARGET)
    step = step_of(sch.mod.script())
    blocks = [line.split('"')[1] for line in step.splitlines() if "T.sblock(" in line]
    # one GEMM (init, update, write-back of its register tile) and one block per next state
    assert blocks == ["step", "gemm0_init", "gemm0_update", "gemm0_local", "h_next", "c_next"]
    assert "T.parallel" in step and "T.vectorized" in step
    assert "w_packed1[v_n // 16, v_k, v_n % 16]" in step
    assert "sch.cache_write" in str(sch.trace) and "sch.compute_inline" in str(sch.trace)


def test_cpu_search_space_prunes_spilling_and_ragged_tiles():
    program = halstm.lower(halstm.LSTM(8, 16), steps=3, batch=64)
    space = CpuStepLoop().space(program, TARGET)
    tiles = {(k["rows"], k["vectors"]) for k in space}
    assert (4, 2) in tiles and (2, 4) in tiles
    assert (8, 3) not in tiles and (4, 3) not in tiles  # more accumulators than registers allow
    assert all(rows != 6 for rows, _ in tiles)  # 64 rows do not split into tiles of 6
    assert CpuStepLoop().defaults(program, TARGET) in space


def test_cpu_recipe_schedules_the_backwards_sums_transposes_and_gemms_over_all_rows():
    """The backward's functions over all T*B rows: LSTM's gate adjoints read from the reversed loop's
    states (nothing derived again, so no activation computed), written once for both GEMMs whose
    results they are the adjoint of, bias gradients summed down strips of columns (the rows a serial
    loop, the strip vectorised), dG transposed once in tiles, and with AVX-512's registers 8-row
    register tiles for their GEMMs (the weight gradients' and prepare's); the forward's step GEMM
    keeps the knob's 4 rows."""
    from halstm.gradients import lower_backward_for

    target = CpuTarget(mcpu="skylake-avx512", cores=2, lanes=16)
    recipe, knobs, program, _ = lower_backward_for(halstm.LSTM(16, 32), 4, 8, "float32", target)
    rows = recipe.apply(program.rows, target, **knobs)
    blocks = [rows.get(b).name_hint for b in rows.get_child_blocks(rows.get_sblock("step"))]
    assert "dx_proj0_t" in blocks and "dgemm0_t" not in blocks  # one buffer for both GEMMs' dG
    script = rows.mod.script()
    assert "dgemm0_3_seq[" in script and "adjoint_x[" not in script and "T.sigmoid" not in script
    _, rows_loop, strip = rows.get_loops(rows.get_sblock("d_bias_ih_T_add_update"))
    assert rows.get(rows_loop).extent == 32 and rows.get(strip).extent == 64  # T*B rows; 4 vectors
    assert rows.get(strip).kind == tvm.tirx.ForKind.VECTORIZED
    weights = recipe.apply(program.weights, target, **knobs)
    tiles, *tile = weights.get_loops(weights.get_sblock("dx_proj0_transposed"))
    assert weights.get(tiles).kind == tvm.tirx.ForKind.PARALLEL
    assert [weights.get(loop).extent for loop in tile] == [32, 32]
    prepare = recipe.apply(program.prepare, target, **knobs)
    for sch, gemm in ((weights, "grad_w_gemm0_update"), (prepare, "gemm0_update")):
        assert [sch.get(loop).extent for loop in sch.get_loops(sch.get_sblock(gemm))][-2:] == [8, 32]
    forward = halstm.lower(halstm.LSTM(16, 32), 4, 8, layout=program.prepare.layout)
    step = recipe.apply(forward, target, **knobs)
    assert [step.get(loop).extent for loop in step.get_loops(step.get_sblock("gemm0_update"))][-2:] == [4, 32]


def test_a_gather_stays_before_a_gemm_and_inlines_into_a_sum():
    """A block that gathers several buffers: the reversed loop's GEMM operand (the gate blocks side
    by side) stays a copy of its own before the CPU's GEMM micro-kernel (inlined there, the loop of
    LSTM (100,16,512) took twice as long); rows' bias sums read the loop's gate blocks themselves."""
    from halstm.gradients import lower_backward_for

    target = CpuTarget(mcpu="skylake-avx512", cores=2, lanes=16)
    recipe, knobs, program, _ = lower_backward_for(halstm.LSTM(16, 32), 4, 8, "float32", target)
    loop = halstm.lower(program.adjoint, 5, 8, layout=program.prepare.layout)
    step = recipe.apply(loop, target, **knobs)
    assert "gemm0_operand" in [step.get(b).name_hint for b in step.get_child_blocks(step.get_sblock("step"))]
    rows = recipe.apply(program.rows, target, **knobs)
    sums = [b for b in rows.get_child_blocks(rows.get_sblock("step")) if is_reduction(rows, b)]
    assert sums and all(any(r.source.name == "dgemm0_0_seq" for r in rows.get(b).reads) for b in sums
                        if rows.get(b).name_hint.endswith("_update"))


def test_gpu_recipe_preference_follows_the_measured_sizes():
    """Persistent kernel first up to B=64, fp32 and fp16, and above where it streams the step's operand
    on tensor cores (fp16 B=256, H=1024; not ResetBeforeGRU, whose r * h cannot stream) and the step
    loop's math does not fuse into its GEMM's kernel (GRU; not LSTM, PeepholeLSTM) and its step GEMM
    is not on wgmma (Hopper); not where its
    FFMA GEMM reads the operand from global memory against the step loop's tensor cores, exact fp32 as
    three TF32 products on a Hopper GPU included (H100, docs/results.md#design-choices-measured)."""
    from halstm.schedules.cuda_tensorcore import tensorize_works
    from halstm.targets import CudaTarget

    h100 = CudaTarget("sm_90", sms=132)

    def first(batch, hidden, dtype, cell=halstm.LSTM):
        return recipes_for(halstm.lower(cell(hidden, hidden), 2, batch, dtype), h100)[0].name

    split = "cuda-step-loop" if tensorize_works() else "cuda-persistent"  # exact fp32 on wgmma
    assert first(64, 512, "float16") == first(64, 1024, "float16") == first(64, 512, "float32") == "cuda-persistent"
    assert first(64, 1024, "float32") == split
    # GRU streams; but on a Hopper GPU the step loop's step GEMM runs on wgmma (H100 fp16 (100,256,1024): 2.078 ms against 2.29)
    assert first(256, 1024, "float16", halstm.GRU) == first(256, 1024, "bfloat16", halstm.GRU) == "cuda-step-loop"
    a100 = CudaTarget("sm_80", sms=108)
    assert recipes_for(halstm.lower(halstm.GRU(1024, 1024), 2, 256, "float16"), a100)[0].name == "cuda-persistent"
    assert first(128, 256, "float32") == first(256, 1024, "float32") == "cuda-step-loop"
    assert first(256, 1024, "float16", halstm.ResetBeforeGRU) == first(256, 512, "float16") == "cuda-step-loop"
    # streamed, but the step loop's LSTM and PeepholeLSTM steps are one kernel each (the math in the GEMM's)
    assert first(256, 1024, "float16") == first(256, 1024, "float16", halstm.PeepholeLSTM) == "cuda-step-loop"
    # its step GEMM on FFMA with the operand in global memory, the step loop's on tensor cores (fp16: the
    # tensor-core tile does not fit beside the weights; TF32 is not in the persistent kernel); but a step
    # of two stages costs the step loop twice the launches, and in strict fp32 both run FFMA
    gru = halstm.lower(halstm.GRU(2048, 2048), 2, 64, "float16")
    assert [r.name for r in recipes_for(gru, h100)] == ["cuda-step-loop", "cuda-persistent"]

    def first_tf32(cell, allow_tf32=True):
        return recipes_for(halstm.lower(cell(1024, 1024), 2, 64, "float32", allow_tf32=allow_tf32), h100)[0].name

    assert first_tf32(halstm.LSTM) == first_tf32(halstm.GRU) == first_tf32(halstm.PeepholeLSTM) == "cuda-step-loop"
    assert first_tf32(halstm.ResetBeforeGRU) == first_tf32(halstm.ResetBeforeGRU, False) == "cuda-persistent"
    assert first_tf32(halstm.LSTM, False) == split
    cpu = halstm.lower(halstm.LSTM(1024, 1024), 2, 64, "float16")
    assert [r.name for r in recipes_for(cpu, TARGET)] == ["cpu-step-loop"]
    # a layer norm in the step: staged up to 64 rows; streamed (B=256) its sums' rounds are not taken first
    for cell in (halstm.LayerNormGRU, halstm.LayerNormLSTM):
        assert first(16, 512, "float16", cell) == first(64, 512, "float16", cell) == "cuda-persistent"
        assert first(256, 1024, "float16", cell) == "cuda-step-loop"


def test_compile_parses_the_lowered_function_once(monkeypatch):
    """Parsing TVMScript is most of lowering (a function's shell, ``halstm.splice``): compile lowers a
    second time for the recipe's weight layout, and only that program is parsed; compiling it again
    with other knobs (as the tuner does) parses nothing."""
    parse, parsed = tvm.script.from_source, []
    monkeypatch.setattr(tvm.script, "from_source", lambda source, **options: parsed.append(source) or parse(
        source, **options))
    halstm.lowering.parsed.cache_clear()
    halstm.lowering.spliced.cache_clear()
    f = halstm.compile(halstm.LSTM(8, 16), 3, 2, target=TARGET, database=False)
    assert f.program.layout == PackedLayout(tile=16) and len(parsed) == 1
    g = halstm.compile(halstm.LSTM(8, 16), 3, 2, target=TARGET, knobs={"panel": 32})
    assert g.knobs["panel"] == 32 and len(parsed) == 1


def test_grouped_columns_are_a_permutation_and_keep_the_math():
    """PackedLayout.units stores an LSTM's 4H gate columns as [i f g o] of 4 units, then the next 4
    units (a fused step epilogue's layout, schedules/cuda.py): ``column`` and ``logical`` are
    inverse permutations, a width that is no multiple of H keeps its order, and the unscheduled
    program computes the same sequences grouped as plain, and as with weights packed (N, K)
    (``k_major``, wgmma's operand); as three TF32 products (``tf32x3``; the hoisted GEMMs' alone,
    ``hoisted_only``, the step's weights (K, N)) within 1e-6 of them."""
    grouped = PackedLayout(units=4, width=16)
    for rows in (64, 48):
        stored = [grouped.column(n, rows) for n in range(rows)]
        assert sorted(stored) == list(range(rows)) and stored != list(range(rows))
        assert [grouped.logical(p, rows) for p in stored] == list(range(rows))
    assert stored[:8] == [0, 1, 2, 3, 12, 13, 14, 15]  # GRU: units 0-3 of gate r, then of gate z
    assert [grouped.column(n, 40) for n in range(40)] == list(range(40))
    rng = np.random.default_rng()
    for cell in (halstm.LSTM(8, 16), halstm.ResetBeforeGRU(8, 16)):
        x, params, states = random_inputs(cell, 3, 2, rng)
        runs, programs = [], [halstm.lower(cell, 3, 2, layout=layout)
                              for layout in (PackedLayout(), grouped, PackedLayout(k_major=True),
                                             PackedLayout(k_major=True, tf32x3=True),
                                             PackedLayout(k_major=True, tf32x3=True, hoisted_only=True))]
        for program in programs:
            module = tvm.compile(program.mod, tvm.target.Target({"kind": "llvm"}))
            runs.append(SequenceFunction(module["main"], signature(program), tvm.cpu()).sequences(x, params, states))
        gates = program.plan.stages[0][0].rows // 16
        assert f"= gemm0[v_b, v_n % 16 // 4 * {4 * gates} + v_n // 16 * 4 + v_n % 4]" in programs[1].mod.script()
        assert "w_packed1[v_n, v_k]" in programs[2].mod.script() and "T.reinterpret" in programs[3].mod.script()
        hoisted_only = programs[4].mod.script()
        assert "w_packed0[v_n, v_k]" in hoisted_only and "w_packed1[v_k, v_n]" in hoisted_only
        assert "x_proj0_operand = T.sblock_alloc_buffer((6, 24))" in hoisted_only  # split: K three times
        assert "gemm0_operand = T.sblock_alloc_buffer((2, 16))" in hoisted_only  # the step's: a copy
        for s in cell.states:
            assert np.array_equal(runs[0][s], runs[1][s]) and np.abs(runs[0][s][1:]).max() > 0.1
            assert np.array_equal(runs[0][s], runs[2][s]) and rel_err(runs[3][s], runs[0][s]) < 1e-6
            assert rel_err(runs[4][s], runs[0][s]) < 1e-6


def test_applying_a_recipe_leaves_the_program_as_it_was():
    """A schedule works on a copy of the lowered function: applied to a backward's weights function,
    TVM's schedule had rewritten the program's own blocks, and a second apply failed."""
    from halstm.backward import lower_backward

    program = lower_backward(halstm.PeepholeLSTM(16, 16), 5, 2).weights
    recipe, target = CpuStepLoop(), halstm.targets.resolve("cpu")
    before = program.func.script()
    first = recipe.apply(program, target).mod
    assert program.func.script() == before
    tvm.ir.assert_structural_equal(recipe.apply(program, target).mod, first)
