"""Shared helpers: fresh random inputs every run, errors as relative norms against float64."""

import difflib
import os
import pathlib
import subprocess

import ml_dtypes
import numpy as np
import pytest
import tvm
import tvm_ffi

TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
TF32_TOLERANCE = 1e-3  # float32 tensors, GEMMs as TF32 (allow_tf32)
NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def rel_err(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture
def rng():
    """A generator seeded from the OS: each run sees new inputs (the seed is printed on failure;
    HALSTM_TEST_SEED=<seed> runs with it again)."""
    seed = int(os.environ.get("HALSTM_TEST_SEED") or np.random.SeedSequence().entropy)
    print(f"rng seed {seed}")
    return np.random.default_rng(seed)


def random_inputs(cell, steps, batch, rng, dtype="float32"):
    """x, parameters and initial states, none of them zero, in ``dtype``."""
    cast = NUMPY_DTYPE[dtype]
    x = rng.standard_normal((steps, batch, cell.input_size)).astype(cast)
    bound = 1 / np.sqrt(cell.hidden_size)
    params = {n: rng.uniform(-bound, bound, s).astype(cast) for n, s in cell.parameters().items()}
    states = {s: (0.5 * rng.standard_normal((batch, cell.hidden_size))).astype(cast) for s in cell.states}
    return x, params, states


def representative(cases, ids, keep):
    """``cases`` (tuples of argument values, named ``ids``) for ``pytest.mark.parametrize``, those not
    named in ``keep`` marked ``slow``: CI (``-m "not slow"``) runs the representative ``keep`` of a
    parametrisation that repeats one code path, the GPU machine (``-m "gpu or slow"``) every case."""
    ids = list(ids)
    unknown = set(keep) - set(ids)
    assert not unknown, f"representative cases that are not cases: {sorted(unknown)}"
    return [pytest.param(*case, id=name, marks=() if name in keep else pytest.mark.slow)
            for case, name in zip(cases, ids)]


def gpu_available() -> bool:
    """Whether TVM sees a CUDA device (the GPU tests' condition)."""
    try:
        return tvm.cuda(0).exist
    except Exception:
        return False


def assert_nvcc_compiles(source: str, folder, arch: str = "sm_90a") -> None:
    """nvcc compiles CUDA ``source`` for ``arch`` (a cubin in ``folder``): an H100 as CudaTarget builds for it."""
    path = folder / "module.cu"
    path.write_text(source)
    nvcc = subprocess.run(["nvcc", f"-arch={arch}", "-cubin", "-w", "-o", str(folder / "module.cubin"), str(path)],
                          capture_output=True, text=True)
    assert nvcc.returncode == 0, nvcc.stderr[-2000:]


def outputs_on_gpu(f, cell, steps, batch, rng, dtype):
    """``f`` run on the GPU on fresh random inputs beside the float64 reference: (name, got, want) for
    the output sequence and each final state, as NumPy arrays."""
    import torch

    import halstm

    x, params, states = random_inputs(cell, steps, batch, rng, dtype)
    to_gpu = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(getattr(torch, dtype)).cuda()
    y, final = f(to_gpu(x), {k: to_gpu(v) for k, v in params.items()}, {k: to_gpu(v) for k, v in states.items()})
    want_y, want_states = halstm.reference(cell, np.asarray(x, np.float64), upcast(params), upcast(states))
    got = [("y", y, want_y)] + [(s, final[s], want_states[s]) for s in cell.states]
    return [(name, value.float().cpu().numpy(), want) for name, value, want in got]


def upcast(values: dict):
    return {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}


@pytest.fixture(autouse=True)
def private_tuning_database(tmp_path, monkeypatch):
    """No test reads or writes the user's tuning records or compiled-module cache; the cache is off
    but in tests/test_cache.py (storing every compile of the suite cost CI time, not coverage)."""
    monkeypatch.setenv("HALSTM_TUNING_DB", str(tmp_path / "tuning.jsonl"))
    monkeypatch.setenv("HALSTM_CACHE_DIR", str(tmp_path / "modules"))
    monkeypatch.setenv("HALSTM_CACHE", "0")


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite the golden IR in tests/golden/ instead of comparing against it")


@pytest.fixture
def golden(request):
    """``golden(name, mod)``: ``mod`` is structurally equal (``tvm.ir.assert_structural_equal``'s check,
    free variables mapped) to the TVMScript in tests/golden/<name>.py; with ``--update-golden``, that
    file is rewritten from ``mod`` instead. ``mod`` is compared as printed and parsed back, as the
    file is: printing drops details that parsing fills in its own way (a ``tvm_access_ptr``'s pointer
    type). A module whose printed TVMScript does not parse back (the scans' chunk buffers, declared
    twice in it) is compared as text."""
    update = request.config.getoption("--update-golden")
    folder = pathlib.Path(__file__).parent / "golden"

    def check(name: str, mod: tvm.IRModule) -> None:
        path = folder / f"{name}.py"
        text = mod.script() + "\n"
        if update:
            folder.mkdir(exist_ok=True)
            path.write_text(text)
            return
        rerun = f"run `pytest {request.node.nodeid} --update-golden` and review the diff"
        if not path.exists():
            pytest.fail(f"no golden IR {path}: {rerun}", pytrace=False)
        expected = path.read_text()
        try:
            now = tvm.script.from_source(text)
        except tvm.error.DiagnosticError:  # printed TVMScript that does not parse back: compared as text
            mismatch = None if text == expected else ("the text",)
        else:
            mismatch = tvm_ffi.get_first_structural_mismatch(now, tvm.script.from_source(expected), map_free_vars=True)
        if mismatch is not None:
            diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                                f"golden/{name}.py", "now", n=2))
            pytest.fail(f"the IR differs from {path} at {mismatch[0]}; if the change is meant, {rerun}:\n"
                        f"{diff[:6000]}", pytrace=False)

    return check
