"""Export, then load and run in a process that has only the TVM runtime."""

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm

import halstm
from conftest import TOLERANCE, assert_nvcc_compiles, gpu_available, random_inputs, rel_err
from halstm import deploy
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


# What load refuses. One tiny LSTM exported once; each case edits or damages a copy.

ModuleRefused = deploy.ModuleRefused


@pytest.fixture(scope="module")
def lstm_export(tmp_path_factory):
    cell = halstm.LSTM(8, 16)
    path = tmp_path_factory.mktemp("lstm") / "lstm.so"
    halstm.export(halstm.compile(cell, steps=3, batch=2, database=False), path)
    return cell, path


@pytest.fixture
def module(lstm_export, tmp_path):
    """A fresh copy of the exported module and its sidecar."""
    _, source = lstm_export
    for name in (source.name, source.name + ".json"):
        shutil.copy(source.with_name(name), tmp_path / name)
    return tmp_path / source.name


def edit_sidecar(path, change):
    meta_path = deploy.sidecar(path)
    meta = json.loads(meta_path.read_text())
    change(meta)
    meta_path.write_text(json.dumps(meta))


def test_sidecar_records_the_file_versions_and_host_requirement(lstm_export):
    _, path = lstm_export
    meta = deploy.read_meta(path)
    assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert meta["size"] == path.stat().st_size
    assert meta["tvm"] == tvm.__version__ and meta["halstm"] == importlib.metadata.version("halstm")
    target = meta["target"]
    assert target["triple"].split("-")[0] in ("x86_64", "aarch64") and target["mcpu"] and target["mattr"] == []
    assert set(target["features"]) <= deploy.CPU_FEATURES.keys()
    assert meta["signature"]["states"] == ["h", "c"] and meta["signature"]["output"] == "h"
    assert sorted(os.listdir(path.parent)) == ["lstm.so", "lstm.so.json"]  # no temporary file left


@pytest.fixture(scope="module")
def damaged_loads(lstm_export, tmp_path_factory):
    """What load says of damaged copies, in another process: before the check, opening a module
    truncated to 10-50 % killed the process (SIGBUS)."""
    _, source = lstm_export
    folder = tmp_path_factory.mktemp("damaged")
    data = source.read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    cases = {f"truncated{p}": data[: len(data) * p // 100] for p in (10, 50, 90)} | {"flipped": bytes(flipped)}
    for name, content in cases.items():
        (folder / f"{name}.so").write_bytes(content)
        shutil.copy(deploy.sidecar(source), folder / f"{name}.so.json")
    script = textwrap.dedent(f"""
        import json, halstm.deploy as deploy
        said = {{}}
        for name in {sorted(cases)!r}:
            try:
                deploy.load({str(folder)!r} + "/" + name + ".so")
                said[name] = "loaded"
            except deploy.ModuleRefused as error:
                said[name] = str(error)
        print(json.dumps(said))
    """)
    env = {**os.environ, "TVM_USE_RUNTIME_LIB": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"
    return folder, json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("percent", [10, 50, 90])
def test_a_truncated_module_is_refused_before_it_is_opened(damaged_loads, lstm_export, percent):
    folder, said = damaged_loads
    size = lstm_export[1].stat().st_size
    assert said[f"truncated{percent}"] == (
        f"{folder}/truncated{percent}.so: size: expected {size} bytes (the sidecar's), "
        f"found {size * percent // 100}; the file was truncated or changed after export")


def test_a_modified_module_is_refused(damaged_loads, lstm_export):
    folder, said = damaged_loads
    sha = deploy.read_meta(lstm_export[1])["sha256"]
    expected = (rf"{re.escape(str(folder))}/flipped\.so: SHA-256: expected {sha} \(the sidecar's\), "
                "found [0-9a-f]{64}; the file was changed after export")
    assert re.fullmatch(expected, said["flipped"])


def test_an_edited_cell_hash_or_another_cell_is_refused(lstm_export, module):
    cell, _ = lstm_export
    halstm.load(module, cell=cell)
    message = r"cell hash: expected '[0-9a-f]{16}' \(the cell given\), found '[0-9a-f]{16}' \(the sidecar's\)"
    with pytest.raises(ModuleRefused, match=message):
        halstm.load(module, cell=halstm.LSTM(8, 17))
    edit_sidecar(module, lambda m: m.update(cell_hash="0" * 16))
    message = rf"{re.escape(str(module))}: cell hash: .* found '0{{16}}' \(the sidecar's\)"
    with pytest.raises(ModuleRefused, match=message):
        halstm.load(module, cell=cell)


@pytest.mark.parametrize("field, what", [("tvm", "TVM version"), ("halstm", "halstm version")])
def test_another_version_is_refused(module, field, what):
    edit_sidecar(module, lambda m: m.update({field: "0.0.1"}))
    message = rf"{re.escape(str(module))}: {what}: expected 0\.0\.1 \(the export's\), found \S+ \(this process\)"
    with pytest.raises(ModuleRefused, match=message):
        halstm.load(module)


def test_another_cpu_architecture_is_refused(module):
    edit_sidecar(module, lambda m: m["target"].update(triple="riscv64-unknown-linux-gnu"))
    message = rf"{re.escape(str(module))}: CPU architecture: expected riscv64 .* found \S+ \(this host\)"
    with pytest.raises(ModuleRefused, match=message):
        halstm.load(module)


def test_a_cpu_feature_the_host_lacks_is_refused(module):
    """Checked against the host, not the file: the module's SHA-256 still matches."""
    edit_sidecar(module, lambda m: m["target"]["features"].append("avx9000"))
    message = r"CPU features: expected \[.*'avx9000'.*\] \(compiled for -mcpu=.*\), found \['avx9000'\] absent"
    with pytest.raises(ModuleRefused, match=message):
        halstm.load(module)


def test_an_avx512_module_is_refused_on_a_host_without_avx512(module, tmp_path, monkeypatch):
    def needs_avx512(meta):
        meta["target"]["features"] = sorted(set(meta["target"]["features"]) | {"avx512f"})

    edit_sidecar(module, needs_avx512)
    features = deploy.read_meta(module)["target"]["features"]
    cpuinfo = tmp_path / "cpuinfo"
    flags = [deploy.CPU_FEATURES[f] for f in features if f != "avx512f"]
    cpuinfo.write_text("processor\t: 0\nflags\t\t: " + " ".join(flags) + "\n")
    monkeypatch.setattr(deploy, "CPUINFO", cpuinfo)
    with pytest.raises(ModuleRefused, match=r"found \['avx512f'\] absent on this host"):
        halstm.load(module)
    cpuinfo.write_text(cpuinfo.read_text().replace("flags\t\t: ", "flags\t\t: avx512f "))
    halstm.load(module)


def test_without_proc_cpuinfo_llvm_describes_the_host(module, tmp_path, monkeypatch):
    monkeypatch.setattr(deploy, "CPUINFO", tmp_path / "absent")
    halstm.load(module)


def test_an_edited_output_name_is_refused(lstm_export, module):
    cell, _ = lstm_export
    edit_sidecar(module, lambda m: m["signature"].update(output="y"))
    with pytest.raises(ModuleRefused, match=r"signature.output: expected one of the states \['h', 'c'\], found 'y'"):
        halstm.load(module)
    edit_sidecar(module, lambda m: m["signature"].update(output="c"))
    with pytest.raises(ModuleRefused, match=r"output: expected 'h' \(the cell given\), found 'c' \(the sidecar's\)"):
        halstm.load(module, cell=cell)


def swap(name: str) -> str:
    return {"h0": "c0", "c0": "h0", "h_seq": "c_seq", "c_seq": "h_seq", "h": "c", "c": "h"}.get(name, name)


def test_swapped_state_names_are_refused(lstm_export, module):
    cell, _ = lstm_export

    def swap_arguments(meta):
        for arg in meta["signature"]["args"]:
            arg["name"] = swap(arg["name"])

    edit_sidecar(module, swap_arguments)
    with pytest.raises(ModuleRefused, match=r"signature.args by role: expected \{.*'state': \['h0', 'c0'\]"):
        halstm.load(module)
    edit_sidecar(module, lambda m: m["signature"].update(states=["c", "h"], output="c"))
    message = (rf"{re.escape(str(module))}: argument 1 \(name, shape, dtype\): expected \('h0', \(2, 16\), 'float32'\) "
               r"\(the module's\), found \('c0', \(2, 16\), 'float32'\) \(the sidecar's\)")
    with pytest.raises(ModuleRefused, match=message):
        halstm.load(module)
    with pytest.raises(ModuleRefused, match=r"states: expected \['h', 'c'\] \(the cell given\), found \['c', 'h'\]"):
        halstm.load(module, cell=cell)


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("sha256"),
     r"the sidecar: expected the fields \[.*\], found \['sha256'\] missing and \[\] unknown"),
    (lambda m: m.update(size=str(m["size"])), r"size: expected int, found '\d+'"),
    (lambda m: m["signature"]["args"][0].update(shape=[6, 8.5]),
     r"signature.args\[0\].shape\[1\]: expected int or list or str, found 8.5"),
    (lambda m: m["signature"]["args"][0].update(shape=[6, "8"]), r"signature.args x: shape: expected an int, found '8'"),
    (lambda m: m["signature"]["args"][0].update(shape=[6, "T"]), r"signature.args x: shape: expected an int, found 'T'"),
    (lambda m: m["signature"]["args"].insert(0, {"name": "s", "shape": [4], "dtype": "float32", "role": "scratch",
                                                 "extra_steps": None}),
     r"signature.args s: the scratch buffers come last"),
    (lambda m: m["target"].pop("features"), r"target: expected the fields .* found \['features'\] missing"),
])
def test_a_sidecar_without_its_fields_is_refused(module, change, message):
    edit_sidecar(module, change)
    with pytest.raises(ModuleRefused, match=rf"{re.escape(str(module))}\.json: {message}"):
        halstm.load(module)


def test_bare_relative_and_home_paths_load_from_where_they_name(module, monkeypatch):
    folder = module.parent
    monkeypatch.chdir(folder)
    assert halstm.load("lstm.so").signature.steps == 3
    monkeypatch.chdir(folder.parent)
    assert halstm.load(f"{folder.name}/lstm.so").signature.steps == 3
    monkeypatch.setenv("HOME", str(folder))
    assert halstm.load("~/lstm.so").signature.steps == 3
