"""Export, then load and run in a process that has only the TVM runtime."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import halstm
from conftest import TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err
from halstm.schedules.cuda_tensorcore import tensorize_works
from halstm.targets import CudaTarget


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cell = halstm.PeepholeLSTM(9, 12)
    path = tmp_path_factory.mktemp("export") / "peephole.so"
    halstm.export(halstm.compile(cell, steps=5, batch=3), path)
    return cell, path


def test_sidecar_says_what_the_module_is(exported):
    cell, path = exported
    meta = json.loads(path.with_name(path.name + ".json").read_text())
    assert meta["cell"] == "PeepholeLSTM" and meta["target"]["kind"] == "cpu"
    assert meta["signature"]["steps"] == 5 and meta["signature"]["dtype"] == "float32"
    assert meta["recipe"] == "cpu-step-loop" and len(meta["cell_hash"]) == 16
    assert meta["cell_hash"] != halstm.lowering.cell_hash(halstm.PeepholeLSTM(9, 13))


def run_with_runtime_only(path, tmp_path, x, params, states):
    """``y`` of the module at ``path`` run in a process with the TVM runtime alone."""
    np.savez(tmp_path / "in.npz", x=x, **{f"p_{k}": v for k, v in params.items()}, **{f"s_{k}": v for k, v in states.items()})
    script = textwrap.dedent(f"""
        import numpy as np, halstm.deploy as deploy
        data = np.load({str(tmp_path / "in.npz")!r})
        params = {{k[2:]: data[k] for k in data if k.startswith("p_")}}
        states = {{k[2:]: data[k] for k in data if k.startswith("s_")}}
        f = deploy.load({str(path)!r}, steps={x.shape[0]})
        y, final = f(data["x"], params, states)
        np.save({str(tmp_path / "y.npy")!r}, y)
        maps = open("/proc/self/maps").read()
        assert "libtvm_compiler" not in maps, "the compiler library was loaded"
        assert "libtvm_runtime" in maps
        print("ok", f)
    """)
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return np.load(tmp_path / "y.npy")


def test_runtime_only_process_loads_and_runs(exported, tmp_path, rng):
    cell, path = exported
    x, params, states = random_inputs(cell, 5, 3, rng)
    y_ref, _ = halstm.reference(cell, x, params, states)
    assert rel_err(run_with_runtime_only(path, tmp_path, x, params, states), y_ref) < TOLERANCE["float32"]


def export_wgmma_gru(target, path):
    """A GRU whose GEMMs run on wgmma (fp16, B=64, the step loop) where ``target`` is an H100."""
    cell = halstm.GRU(64, 64)
    f = halstm.compile(cell, 3, 64, "float16", target=target, recipe="cuda-step-loop", database=False)
    return cell, f, halstm.export(f, path)


@pytest.mark.skipif(not tensorize_works(), reason="Schedule.tensorize crashes with this apache-tvm-ffi")
def test_a_cuda_module_is_compiled_at_load_for_the_instruction_set_it_was_built_for(tmp_path):
    """An exported CUDA module holds CUDA source, compiled when it loads (NVRTC) for the
    instruction set its sidecar names: sm_90a on an H100, whose wgmma the plain sm_90 lacks."""
    _, f, path = export_wgmma_gru(CudaTarget("sm_90", sms=132), tmp_path / "gru.so")
    meta = halstm.deploy.read_meta(path)
    assert (meta["target"]["arch"], meta["target"]["isa"]) == ("sm_90", "sm_90a")
    source = f.module.mod.imports[0].inspect_source()
    assert "wgmma.mma_async" in source
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    assert_nvcc_compiles(source, tmp_path, meta["target"]["isa"])
    with pytest.raises(AssertionError, match="wgmma.mma_async .* not supported on .target 'sm_90'"):
        assert_nvcc_compiles(source, tmp_path, "sm_90")


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="no CUDA device")
def test_runtime_only_process_runs_a_cuda_module(tmp_path, rng):
    """Exported for the GPU here (on an H100, the GEMMs on wgmma), run with the runtime alone."""
    cell, _, path = export_wgmma_gru(CudaTarget.detect(), tmp_path / "gru.so")
    x, params, states = random_inputs(cell, 3, 64, rng)
    x, params, states = (x.astype(np.float16), {k: v.astype(np.float16) for k, v in params.items()},
                         {k: v.astype(np.float16) for k, v in states.items()})
    y_ref, _ = halstm.reference(cell, x, params, states)
    y = run_with_runtime_only(path, tmp_path, x, params, states)
    assert rel_err(y.astype(np.float64), y_ref) < TOLERANCE["float16"]


def test_load_refuses_a_mismatch(exported, tmp_path):
    cell, path = exported
    with pytest.raises(ValueError, match="compiled for steps=5, not 7"):
        halstm.load(path, steps=7)
    with pytest.raises(FileNotFoundError, match="missing"):
        halstm.load(tmp_path / "nothing.so")
    f = halstm.load(path)
    with pytest.raises(ValueError, match=r"x: expected shape \(5, 3, 9\)"):
        f(np.ones((6, 3, 9), np.float32), cell.init_parameters(0))


def test_cli_exports_and_describes_a_module(tmp_path, capsys, rng):
    from halstm.cli import main

    out = tmp_path / "gru.so"
    argv = ["export", "--cell", "GRU", "--input-size", "6", "--hidden-size", "8", "--steps", "3",
            "--batch", "2", "-o", str(out)]
    assert main(argv) == 0
    assert main(["info", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out} and {out}.json" in printed
    assert '"cell": "GRU"' in printed and '"recipe": "cpu-step-loop"' in printed
    cell = halstm.GRU(6, 8)
    x, params, states = random_inputs(cell, 3, 2, rng)
    y, _ = halstm.load(out, batch=2)(x, params, states)
    assert rel_err(y, halstm.reference(cell, x, params, states)[0]) < TOLERANCE["float32"]
