"""Global buffers passed in by the caller (``halstm.scratch``): lifted out of TVM's workspace pool into
trailing parameters, sized for each call's T, allocated with the call. Checked as IR (the lift itself;
no workspace left in the host code of CUDA builds) and by running lifted functions on the CPU, through
a CPU target that lifts as the CUDA target does, against float64."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import TOLERANCE, random_inputs, rel_err, representative
from tvm.script import tirx as T

import halstm
from halstm import deploy
from halstm.gradients import compile_backward, reference_backward
from halstm.frames import Pack
from halstm.runtime import Arg, dimension
from halstm.scratch import lift
from halstm.targets import CpuTarget, CudaTarget

B, I, H = 3, 12, 20


class LiftingCpu(CpuTarget):
    """The host CPU, its functions' global buffers passed in by the caller as on CUDA."""

    lifts_scratch = True


@pytest.fixture(scope="module")
def lifting_cpu():
    return LiftingCpu(**dataclasses.asdict(CpuTarget.host()))


@T.prim_func(s_tir=True)
def allocating(n_steps: T.int32, x: T.Buffer((n_steps * 2, 4), "float32"), y: T.Buffer((n_steps * 2, 4), "float32")):
    padded = T.alloc_buffer(((n_steps * 2 + 7) // 8 * 8, 4))
    with T.sblock("copy"):
        tile = T.sblock_alloc_buffer((4,), scope="shared")
        rows = T.sblock_alloc_buffer((n_steps * 2, 4), "float16")
        for i, j in T.grid(n_steps * 2, 4):
            padded[i, j] = x[i, j]
            tile[j] = padded[i, j]
            rows[i, j] = T.Cast("float16", tile[j])
            y[i, j] = T.Cast("float32", rows[i, j])


@T.prim_func(s_tir=True)
def lifted(n_steps: T.int32, x: T.Buffer((n_steps * 2, 4), "float32"), y: T.Buffer((n_steps * 2, 4), "float32"),
           padded: T.Buffer(((n_steps * 2 + 7) // 8 * 8, 4)), rows: T.Buffer((n_steps * 2, 4), "float16")):
    T.func_attr({"global_symbol": "allocating"})
    with T.sblock("root"):
        T.reads()  # the blocks' regions as they were
        T.writes()
        with T.sblock("copy"):
            T.reads(x[0:n_steps * 2, 0:4], padded[0:n_steps * 2, 0:4])
            T.writes(padded[0:n_steps * 2, 0:4], y[0:n_steps * 2, 0:4])
            tile = T.sblock_alloc_buffer((4,), scope="shared")
            for i, j in T.grid(n_steps * 2, 4):
                padded[i, j] = x[i, j]
                tile[j] = padded[i, j]
                rows[i, j] = T.Cast("float16", tile[j])
                y[i, j] = T.Cast("float32", rows[i, j])


def test_global_allocations_become_trailing_parameters():
    func, args = lift(allocating)
    tvm.ir.assert_structural_equal(func, lifted)
    assert [(a.name, a.dtype, a.role) for a in args] == [("padded", "float32", "scratch"), ("rows", "float16", "scratch")]
    for steps in (1, 2, 5, 100):
        assert args[0].at(steps).shape == (-(-2 * steps // 8) * 8, 4)
        assert args[1].at(steps).shape == (2 * steps, 4)


def test_a_function_without_global_allocations_is_unchanged():
    func, args = lift(lifted)
    assert func.same_as(lifted) and args == ()


def test_a_dimension_not_of_the_sequence_length_is_refused():
    @T.prim_func(s_tir=True)
    def sized_by_m(m: T.int32, y: T.Buffer((m,), "float32")):
        rows = T.alloc_buffer((m,))
        for i in range(m):
            rows[i] = T.float32(1)
            y[i] = rows[i]

    with pytest.raises(ValueError, match="buffer 'rows'.*sequence length only"):
        lift(sized_by_m)


def test_a_global_buffer_of_each_parallel_task_is_refused():
    @T.prim_func(s_tir=True)
    def per_task(y: T.Buffer((4, 8), "float32")):
        for i in T.parallel(4):
            with T.sblock("task"):
                rows = T.sblock_alloc_buffer((8,))
                for j in range(8):
                    rows[j] = T.float32(1)
                    y[i, j] = rows[j]

    with pytest.raises(ValueError, match="buffer 'rows'.*parallel or thread-bound loop"):
        lift(per_task)


def test_dimensions_round_trip_through_json_and_evaluate_as_python():
    arg = Arg("b", (("*", ("//", ("+", ("*", "T", 3), 127), 128), 128), ("max", ("%", "T", 5), ("-", 9, "T")), 7),
              "float32", "scratch")
    again = Arg.from_json(json.loads(json.dumps(dataclasses.asdict(arg))))
    assert again == arg and hash(again) == hash(arg)
    for steps in (1, 4, 130):
        assert again.at(steps).shape == ((3 * steps + 127) // 128 * 128, max(steps % 5, 9 - steps), 7)
    assert dimension(4, 99) == 4


def host_workspace_calls(target: CudaTarget, mod: tvm.IRModule) -> int:
    """Calls of TVMBackendAllocWorkspace in ``mod``'s host code as ``target.build`` finalises it."""
    host, _ = target.split(mod)
    _, finalize_host, _ = tvm.tirx.get_default_tir_pipeline(target.tvm_target)
    with target._context():
        host = finalize_host()(host)
    calls = []
    tvm_ffi.structural_walk(host, (tvm.ir.Call, lambda c: calls.append(c.op.name)))
    return calls.count("tirx.TVMBackendAllocWorkspace")


@pytest.mark.parametrize("cell_type, dtype, steps", [(halstm.LSTM, "float16", None), (halstm.LayerNormGRU, "float16", 5),
                                                     (halstm.GRU, "float32", None), (halstm.MinGRU, "float16", None)],
                         ids=["LSTM-fp16-anyT", "LayerNormGRU-fp16-T5", "GRU-fp32-anyT", "MinGRU-fp16-anyT"])
def test_cuda_builds_leave_no_buffer_to_the_workspace_pool(cell_type, dtype, steps, monkeypatch):
    """Every function that ``compile`` and ``compile_backward`` build for CUDA, forward, reversed loop
    and the backward's three: its host code allocates nothing from TVM's workspace (which it did before
    the lift), and the scratch buffers a call allocates are the lifted ones."""
    target = CudaTarget("sm_90", sms=132)
    built = []

    def build(self, mod, **options):
        built.append(mod)
        return {gvar.name_hint: None for gvar in mod.get_global_vars()}

    monkeypatch.setattr(CudaTarget, "build", build)
    backward = compile_backward(cell_type(32, 64), steps, 4, dtype, target, database=False)
    forward = halstm.compile(cell_type(32, 64), steps, 4, dtype, target, database=False)
    assert len(built) == 3  # the reversed loop, the backward's functions, the forward
    assert forward.scratch and forward.signature.args[-len(forward.scratch):] == forward.scratch
    scratch = [backward.adjoint.scratch, sum(backward.scratch.values(), ()), forward.scratch]
    for mod, unlifted, lifted in zip(built, [backward.adjoint.schedule.mod, _backward_mod(backward),
                                             forward.schedule.mod], scratch):
        assert host_workspace_calls(target, mod) == 0
        assert (host_workspace_calls(target, unlifted) > 0) == bool(lifted)  # what the lift removed


def _backward_mod(backward) -> tvm.IRModule:
    return tvm.IRModule({name: s.mod["main"].with_attr("global_symbol", name) for name, s in backward.schedules.items()})


# CI: LayerNormGRU (the step loop's scratch, with sums over the hidden units) and MinGRU (the scan's);
# LSTM repeats the step loop's path with two states (slow)
@pytest.mark.parametrize("cell_type", representative([(c,) for c in (halstm.LSTM, halstm.LayerNormGRU, halstm.MinGRU)],
                                                     ["LSTM", "LayerNormGRU", "MinGRU"], ["LayerNormGRU", "MinGRU"]))
def test_lifted_functions_run_at_every_length(cell_type, lifting_cpu, rng):
    """Forward and backward compiled for any T with their scratch passed in, NumPy and torch inputs,
    against float64 at T = 1 and 7; with torch tensors the backward's functions' own scratch share
    bytes (``Pack``'s phases), a function's buffers written over by the next function's."""
    torch = pytest.importorskip("torch")
    cell = cell_type(I, H)
    forward = halstm.compile(cell, None, B, target=lifting_cpu, database=False)
    backward = compile_backward(cell, None, B, target=lifting_cpu, database=False)
    assert forward.scratch and all(backward.scratch.values())
    for steps in (1, 7):
        x, params, states = random_inputs(cell, steps, B, rng)
        want, _ = halstm.reference(cell, x, params, states)
        assert rel_err(forward(x, params, states)[0], want) < TOLERANCE["float32"]
        tensors = {n: torch.from_numpy(v) for n, v in params.items()}
        got = forward(torch.from_numpy(x), tensors, {s: torch.from_numpy(v) for s, v in states.items()})[0]
        assert rel_err(got.numpy(), want) < TOLERANCE["float32"]
        seqs = forward.sequences(x, params, states)
        grads = {s: rng.standard_normal((steps + 1, B, H)).astype(np.float32) for s in cell.states}
        wx, wparams, _ = reference_backward(cell, x, params, states, grads)
        as_torch = [{n: torch.from_numpy(np.asarray(v)) for n, v in d.items()} for d in (params, seqs, grads)]
        for dx, dparams, _ in (backward(x, params, seqs, grads), backward(torch.from_numpy(x), *as_torch)):
            assert rel_err(np.asarray(dx), wx) < TOLERANCE["float32"]
            assert all(rel_err(np.asarray(dparams[n]), w) < TOLERANCE["float32"] for n, w in wparams.items())
    pack = backward._plan_for(7).scratch
    assert pack.nbytes < Pack(pack.args).nbytes


def test_buffers_of_different_phases_share_bytes():
    """A pack lays out the buffers without a phase first, then each phase's from one region's start:
    a phase's buffers apart, other phases' over them."""
    args = [Arg(n, (rows, 16), "float32", "scratch") for n, rows in (("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 1))]
    pack = Pack(args, [None, "f", "f", "g", None])  # 64, 128, 192, 256 and 64 bytes
    assert pack.offsets == [0, 128, 256, 128, 64]
    assert pack.nbytes == 128 + max(128 + 192, 256)
    assert pack.ends == [64, 256, 448, 448, 448]
    assert Pack(args).offsets == [0, 64, 192, 384, 640] and Pack(args).nbytes == 704


def test_exports_and_cache_entries_carry_the_scratch(lifting_cpu, tmp_path, monkeypatch, rng):
    """An export's sidecar and a cached backward's keep the scratch buffers' shapes as expressions of T;
    loaded, they run at any T; a sidecar whose expression is not one is refused."""
    cell = halstm.GRU(I, H)
    path = halstm.export(halstm.compile(cell, None, B, target=lifting_cpu, database=False), tmp_path / "gru.so")
    loaded = halstm.load(path)
    assert loaded.scratch and any(not isinstance(d, int) for a in loaded.scratch for d in a.shape)
    for steps in (2, 9):
        x, params, states = random_inputs(cell, steps, B, rng)
        assert rel_err(loaded(x, params, states)[0], halstm.reference(cell, x, params, states)[0]) < TOLERANCE["float32"]
    meta_path = deploy.sidecar(path)
    meta = json.loads(meta_path.read_text())
    scratch = next(a for a in meta["signature"]["args"] if a["role"] == "scratch" and isinstance(a["shape"][0], list))
    scratch["shape"][0] = ["**", "T", 40]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(deploy.ModuleRefused, match=r"shape: expected an int or an expression of T"):
        halstm.load(path)
    scratch["shape"][0] = "T"  # an expression of T, but not the buffer's: the module refuses the call
    meta_path.write_text(json.dumps(meta))
    tampered = halstm.load(path)
    with pytest.raises(ValueError, match=rf"Invalid {scratch['name']}.shape\[0\]"):
        tampered(x, params, states)

    monkeypatch.setenv("HALSTM_CACHE", "1")
    monkeypatch.setenv("HALSTM_CACHE_DIR", str(tmp_path / "cache"))
    built = compile_backward(cell, None, B, target=lifting_cpu, database=False)
    cached = compile_backward(cell, None, B, target=lifting_cpu, database=False)
    assert built.cached is None and cached.cached is not None and cached.scratch == built.scratch
    x, params, states = random_inputs(cell, 4, B, rng)
    seqs = loaded.sequences(x, params, states)
    grads = {s: rng.standard_normal((5, B, H)).astype(np.float32) for s in cell.states}
    assert rel_err(cached(x, params, seqs, grads)[0], reference_backward(cell, x, params, states, grads)[0]) < 1e-5


def test_calls_on_the_cpu_take_turns_with_one_host_allocation(rng):
    """A CPU backward called with torch tensors gives its pack's allocation back after the call and the
    next call takes it (its pages already in); a call over more steps than it holds takes a new one.
    Results stay float64's, an earlier call's too after the later calls (they are not the pack's)."""
    torch = pytest.importorskip("torch")
    cell = halstm.LSTM(I, H)
    forward = halstm.compile(cell, None, B, database=False)
    backward = compile_backward(cell, None, B, database=False)
    held, results = [], []
    for steps in (5, 5, 3, 9):
        x, params, states = random_inputs(cell, steps, B, rng)
        seqs = forward.sequences(x, params, states)
        grads = {"h": rng.standard_normal((steps + 1, B, H)).astype(np.float32)}  # no gradient for c
        as_torch = [{n: torch.from_numpy(np.asarray(v)) for n, v in d.items()} for d in (params, seqs, grads)]
        dx, dparams, _ = backward(torch.from_numpy(x), *as_torch)
        wx, wparams, _ = reference_backward(cell, x, params, states, grads)
        assert rel_err(dx.numpy(), wx) < TOLERANCE["float32"]
        assert all(rel_err(dparams[n].numpy(), w) < TOLERANCE["float32"] for n, w in wparams.items())
        (flat,) = backward._scratch_pools._pools["cpu"]._free
        held.append((flat.data_ptr(), flat.numel()))
        results.append((dx, wx))
    assert held[0] == held[1] == held[2] and held[3][1] > held[2][1]
    assert all(rel_err(dx.numpy(), wx) < TOLERANCE["float32"] for dx, wx in results)
