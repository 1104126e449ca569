"""The CUDA step-loop recipe's schedules of the backward's blocks over all T*B rows: a column's sum
over the rows (a bias gradient) in two kernels whose warps read consecutive columns, a transposing
copy as a tiled transpose through shared memory. Their kernels, as TVM lowers them, run in Python
(cuda_emulator.run_kernel) against NumPy; every kernel of the backward's functions but the GEMMs'
reads and writes global memory coalesced."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import rel_err, representative
from cuda_emulator import run_kernel
from tvm import sym, te
from tvm.ir import TensorLoad
from tvm.s_tir import Schedule
from tvm.tirx.analysis import undefined_vars

import halstm
from halstm.gradients import lower_backward_for
from halstm.schedules.cuda_blocks import bind_column_reduction, schedule_transpose
from halstm.schedules.recipe import reduces_columns
from halstm.targets import CudaTarget

H100 = CudaTarget("sm_90", sms=132)
THREADS = 256
WARP = 32
SECTOR = 32  # bytes


def _schedule(inputs, outputs) -> Schedule:
    return Schedule(tvm.IRModule({"main": te.create_prim_func([*inputs, *outputs])}))


def _kernels(mod) -> dict:
    """The kernels TVM's CUDA pipeline makes of ``mod`` by name, in launch order."""
    _, device = H100.split(mod)
    kernels = {gv.name_hint: f for m in device.values() for gv, f in m.functions.items()}
    return {n: kernels[n] for n in sorted(kernels, key=lambda n: (len(n), n))}


def _accesses(func) -> list:
    """(buffer, flat index) of each load and store of global memory in a lowered kernel."""
    found = []

    def add(buffer, indices):
        if buffer.scope() == "global":
            found.append((buffer, indices[-1]))

    tvm_ffi.structural_walk(func.body, [(tvm.tirx.BufferStore, lambda s: add(s.buffer, s.indices)),
                                        (TensorLoad, lambda e: add(e.source, e.indices))])
    return found


def _excess_sectors(func) -> int:
    """The most 32-byte sectors a warp's access (threadIdx.x 0..31, every other variable 0) touches
    past those of 32 consecutive elements (32 vectors of them, for a vector access) and one more
    (where they straddle a sector): 0 where the kernel's accesses are all coalesced, 27 for fp32
    where consecutive threads are rows apart."""
    worst = 0
    for buffer, index in _accesses(func):
        lanes = int(index.lanes) if isinstance(index, tvm.tirx.Ramp) else 1
        stride = index.stride if isinstance(index, tvm.tirx.Ramp) else 0
        first = index.base if isinstance(index, tvm.tirx.Ramp) else index
        size = tvm.DataType(buffer.dtype).bits // 8
        touched = set()
        for thread in range(WARP):
            analyzer = sym.Analyzer()
            for v in undefined_vars(first, []):
                analyzer.bind(v, thread if v.name == "threadIdx.x" else 0)
            for lane in range(lanes):
                touched.add(analyzer.simplify(first + lane * stride).value * size // SECTOR)
        worst = max(worst, len(touched) - (WARP * lanes * size // SECTOR + 1))
    return worst


def _shared_tiles(func) -> list:
    tiles = []
    tvm_ffi.structural_walk(func.body, (tvm.tirx.AllocBuffer, lambda a: tiles.append(a.buffer)
                                        if a.buffer.scope() == "shared" else None))
    return tiles


# --- column sums ------------------------------------------------------------------------------------

def _column_sum(rows: int, cols: int):
    x = te.placeholder((rows, cols), "float32", name="x")
    r = te.reduce_axis((0, rows), name="r")
    return x, te.compute((cols,), lambda j: te.sum(x[r, j], axis=r), name="s")


@pytest.mark.parametrize("rows, cols", [(150, 40), (128, 64), (5, 20)])
def test_column_sum_runs_as_row_slices_then_their_sum(rows, cols, rng):
    """sum over r of x[r, j]: each slice's partial sums, then their sum, each kernel's warps at
    consecutive columns, the second's lanes combined by TVM's cross-thread reduction: 150 rows make
    two whole slices of 64 and a ragged one, 5 rows less than one; 40 columns a warp and a ragged
    one (the partial sums' 120 columns less than a thread block)."""
    x, s = _column_sum(rows, cols)
    sch = _schedule([x], [s])
    assert reduces_columns(sch, sch.get_sblock("s"))
    bind_column_reduction(sch, sch.get_sblock("s"), THREADS)
    kernels = list(_kernels(sch.mod).values())
    assert len(kernels) == 2
    assert [_excess_sectors(k) for k in kernels] == [0, 0]
    value = rng.standard_normal((rows, cols))
    arrays = {"x_ptr": value.ravel().copy(), "s_ptr": np.full(cols, np.nan)}
    for kernel in kernels:
        run_kernel(kernel, arrays)
    assert rel_err(arrays["s_ptr"], value.sum(axis=0)) < 1e-12


def test_sums_down_columns_are_told_from_sums_along_rows():
    """A sum down columns reads rows apart along its reduced axis, and consecutive elements (or one
    element, as a layer norm gain's gradient reads the row's rstd[r]) along its output's; a layer
    norm's sums along a row (its variance reads the row's mean[b]) are the other way round and keep
    bind_reduction's schedule (a thread block a row, its threads at consecutive elements)."""
    x = te.placeholder((6, 40), "float32", name="x")
    per_row = te.placeholder((6,), "float32", name="per_row")
    r, k = te.reduce_axis((0, 6), name="r"), te.reduce_axis((0, 40), name="k")
    gain = te.compute((40,), lambda j: te.sum(x[r, j] * per_row[r], axis=r), name="gain")
    variance = te.compute((6,), lambda b: te.sum((x[b, k] - per_row[b]) * (x[b, k] - per_row[b]), axis=k),
                          name="variance")
    sch = _schedule([x, per_row], [gain, variance])
    assert reduces_columns(sch, sch.get_sblock("gain"))
    assert not reduces_columns(sch, sch.get_sblock("variance"))


# --- transposing copies -----------------------------------------------------------------------------

@pytest.mark.parametrize("rows, cols", [(50, 70), (64, 32), (20, 24)])
def test_transposing_copies_of_one_nest_share_a_tiled_kernel(rows, cols, rng):
    """Two transposes merged into one loop nest (merge_next_states: the weights function's
    d<gemm>_transposed), one a cast: one kernel, a shared tile each, reads and writes coalesced,
    each output exactly its source's transpose; 50 x 70 is ragged both ways, 20 x 24 less than a
    tile."""
    a = te.placeholder((rows, cols), "float16", name="a")
    b = te.placeholder((rows, cols), "float32", name="b")
    at = te.compute((cols, rows), lambda n, r: a[r, n], name="at")
    bt = te.compute((cols, rows), lambda n, r: b[r, n].astype("float16"), name="bt")
    sch = _schedule([a, b], [at, bt])
    sch.merge(sch.get_loops(sch.get_sblock("at"))[-1], sch.get_loops(sch.get_sblock("bt"))[-1])
    assert schedule_transpose(sch, sch.get_sblock("at"))
    kernels = list(_kernels(sch.mod).values())
    assert len(kernels) == 1 and len(_shared_tiles(kernels[0])) == 2
    assert _excess_sectors(kernels[0]) == 0
    sources = {name: rng.standard_normal((rows, cols)) for name in ("a", "b")}
    arrays = {f"{n}_ptr": v.ravel().copy() for n, v in sources.items()}
    run_kernel(kernels[0], arrays)
    for name, source in sources.items():
        assert np.array_equal(arrays[f"{name}t_ptr"].reshape(cols, rows), source.T), name


def _refused(make) -> None:
    """schedule_transpose returns False for the first block ``make`` names, the module unchanged."""
    sch, name = make()
    before = sch.mod
    assert not schedule_transpose(sch, sch.get_sblock(name))
    tvm.ir.assert_structural_equal(sch.mod, before)


def test_blocks_that_also_read_along_their_rows_are_not_transposed():
    """A block that reads a value of its row (a layer norm's row sum s[b]), one that reads a
    flattened weight at n * K + k (a weight gradient's term), and a nest that holds a copy beside a
    transpose stay flat (bind_flat): tiled, the reads along the rows would go uncoalesced."""
    a = te.placeholder((24, 40), "float32", name="a")
    s = te.placeholder((24,), "float32", name="s")
    flat = te.placeholder((1, 24 * 40), "float32", name="flat")

    def scaled():
        y = te.compute((24, 40), lambda b, n: a[b, n] * s[b], name="y")
        return _schedule([a, s], [y]), "y"

    def unflattened():
        w = te.compute((24, 40), lambda n, k: flat[0, n * 40 + k], name="w")
        return _schedule([flat], [w]), "w"

    def mixed():
        t = te.compute((40, 24), lambda n, r: a[r, n], name="t")
        c = te.compute((40, 24), lambda n, r: a[n % 24, r], name="c")
        sch = _schedule([a], [t, c])
        sch.merge(sch.get_loops(sch.get_sblock("t"))[-1], sch.get_loops(sch.get_sblock("c"))[-1])
        return sch, "t"

    for make in (scaled, unflattened, mixed):
        _refused(make)


# --- the backward's functions -------------------------------------------------------------------------

# CI: LSTM (the bias gradients' column sums, the transposing copies) and LayerNormLSTM (sums over the
# hidden units besides); GRU's kernels are of LSTM's kinds, other math in them (slow)
@pytest.mark.parametrize("cell_type", representative([(c,) for c in (halstm.LSTM, halstm.GRU, halstm.LayerNormLSTM)],
                                                     ["LSTM", "GRU", "LayerNormLSTM"], ["LSTM", "LayerNormLSTM"]))
def test_backward_kernels_but_the_gemms_are_coalesced(cell_type):
    """Every kernel of the backward's functions (prepare, rows, weights) that computes no GEMM reads
    and writes global memory coalesced: the bias gradients' sums over the T*B rows (one thread block
    a column, its threads rows apart, took 178 us for 6400 x 4096 fp32 on an H200) and the
    transposing copies (one element a thread, 334 us for two 4096 x 6400 fp16 copies) included. fp16
    at H=128: the GEMMs on wgmma, whose blocks, tensorized, share the scope of the sums (rfactor
    refuses that scope: the sums are scheduled before the GEMMs). T*B = 128 rows split into whole
    slices (``whole_slices``; sums that do not keep ``bind_reduction``)."""
    recipe, knobs, program, scheduled = lower_backward_for(cell_type(128, 128), 8, 16, "float16", H100)
    assert scheduled  # the recipe's schedules, made on the way
    gemms = {g.name for p in program.functions.values() for g in p.plan.gemms}
    for name, sch in scheduled.items():
        for kernel_name, kernel in _kernels(sch.mod).items():
            written = set()
            tvm_ffi.structural_walk(kernel.body, (tvm.tirx.BufferStore, lambda s: written.add(s.buffer.name)))
            if not written & gemms:
                assert _excess_sectors(kernel) == 0, (name, kernel_name, sorted(written))
