"""The examples run as shipped; the recipe of examples/my_recipe.py is checked as a recipe's tests
would be (docs/writing-a-recipe.md)."""

import runpy
import sys
from pathlib import Path

import pytest
import tvm
from tvm import te
from tvm.s_tir import Schedule
from tvm.script import tirx as T

import halstm
from conftest import TOLERANCE, random_inputs, rel_err

EXAMPLES = Path(__file__).parents[1] / "examples"
EXAMPLE = EXAMPLES / "custom_cell.py"
RECIPE_EXAMPLE = EXAMPLES / "my_recipe.py"


def test_readme_example_runs(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "stage 1: gemm0 = h @ [w_h]^T" in out
    error = float(out.rsplit(":", 1)[1])
    assert error < 1e-5


def test_recipe_example_runs(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(RECIPE_EXAMPLE), "--repeat", "3"])  # its small default shapes
    runpy.run_path(str(RECIPE_EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "with cpu-batch-rows {'rows': 2, 'vectors': 2}>" in out
    assert "sch.parallel(" in out and "the elementwise blocks fused" in out
    assert "gemm0 after it: b_0 parallel" in out
    assert "replaying the trace gives the same module" in out
    error = float(out.split("relative error against float64:")[1].split()[0])
    assert error < 1e-5
    assert "median of 3 calls: cpu-batch-rows" in out  # timings printed, not compared


@pytest.fixture(scope="module")
def example():
    """The example's definitions (its main() not run)."""
    return runpy.run_path(str(RECIPE_EXAMPLE), run_name="my_recipe")


@pytest.mark.parametrize("knobs", [{"rows": 1, "vectors": 1}, {"rows": 4, "vectors": 2}])
def test_recipe_matches_float64(example, knobs, rng):
    """B=6: rows=4 leaves a predicated tile at the edge."""
    cell = halstm.GRU(input_size=16, hidden_size=32)
    f = halstm.compile(cell, 5, 6, recipe=example["CpuBatchRows"](), knobs=knobs)
    assert f.knobs == knobs
    x, params, states = random_inputs(cell, 5, 6, rng)
    y, final = f(x, params, states)
    y_ref, final_ref = halstm.reference(cell, x, params, states)
    assert rel_err(y, y_ref) < TOLERANCE["float32"]
    assert rel_err(final["h"], final_ref["h"]) < TOLERANCE["float32"]


def test_recipe_trace_replays(example):
    cell = halstm.LSTM(input_size=8, hidden_size=16)
    f = halstm.compile(cell, 3, 2, recipe=example["CpuBatchRows"]())
    tvm.ir.assert_structural_equal(example["replayed"](f.program, f.schedule), f.schedule.mod)


@T.prim_func(s_tir=True)
def gemm_row_tasks(a: T.Buffer((4, 8), "float32"), w: T.Buffer((8, 32), "float32"), gemm0: T.Buffer((4, 32), "float32")):
    T.func_attr({"tirx.noalias": True})
    gemm0_local = T.sblock_alloc_buffer((4, 32), scope="local")
    for b_0 in T.parallel(2):
        for n_0 in range(2):
            for b_1_init in T.unroll(2):
                for n_1_init in T.vectorized(16):
                    with T.sblock("gemm0_init"):
                        v_b = T.axis.spatial(4, b_0 * 2 + b_1_init)
                        v_n = T.axis.spatial(32, n_0 * 16 + n_1_init)
                        T.reads()
                        T.writes(gemm0_local[v_b, v_n])
                        gemm0_local[v_b, v_n] = T.float32(0.0)
            for k in range(8):
                for b_1 in T.unroll(2):
                    for n_1 in T.vectorized(16):
                        with T.sblock("gemm0_update"):
                            v_b = T.axis.spatial(4, b_0 * 2 + b_1)
                            v_n = T.axis.spatial(32, n_0 * 16 + n_1)
                            v_k = T.axis.reduce(8, k)
                            T.reads(gemm0_local[v_b, v_n], a[v_b, v_k], w[v_k, v_n])
                            T.writes(gemm0_local[v_b, v_n])
                            gemm0_local[v_b, v_n] = gemm0_local[v_b, v_n] + a[v_b, v_k] * w[v_k, v_n]
            for ax0 in range(2):
                for ax1 in T.vectorized(16):
                    with T.sblock("gemm0_local"):
                        v0 = T.axis.spatial(4, b_0 * 2 + ax0)
                        v1 = T.axis.spatial(32, n_0 * 16 + ax1)
                        T.reads(gemm0_local[v0, v1])
                        T.writes(gemm0[v0, v1])
                        gemm0[v0, v1] = gemm0_local[v0, v1]


def test_row_tasks_structure(example):
    """The GEMM rewrite on a 4 x 32 x 8 GEMM, rows=2, cols=16: two parallel row tasks, each over
    both column strips, a 2 x 16 tile in registers over k."""
    a = te.placeholder((4, 8), "float32", name="a")
    w = te.placeholder((8, 32), "float32", name="w")
    k = te.reduce_axis((0, 8), name="k")
    gemm = te.compute((4, 32), lambda b, n: te.sum(a[b, k] * w[k, n], axis=k), name="gemm0")
    sch = Schedule(tvm.IRModule({"main": te.create_prim_func([a, w, gemm])}))
    example["row_tasks"](sch, sch.get_sblock("gemm0"), rows=2, cols=16)
    tvm.ir.assert_structural_equal(sch.mod["main"], gemm_row_tasks.with_attr("global_symbol", "main"))
