"""The CPU target's vectorisable exp: accurate, IEEE at the extremes (inf, 0, NaN as torch), and really vectorised."""

import numpy as np
import tvm
from tvm import te
from tvm.s_tir import Schedule

from halstm.targets import resolve


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
