"""The on-disk cache of compiled modules (halstm.cache): hits, misses, damaged entries, processes at once."""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import halstm
from conftest import random_inputs
from halstm import cache
from halstm.gradients import compile_backward
from halstm.targets import CpuTarget

STEPS, BATCH = 3, 2


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """An empty cache a test, with this process's counts at zero."""
    monkeypatch.setenv("HALSTM_CACHE_DIR", str(tmp_path / "modules"))
    monkeypatch.delenv("HALSTM_CACHE", raising=False)
    monkeypatch.setattr(cache, "stats", {"hits": 0, "misses": 0})
    return tmp_path / "modules"


def entries(folder):
    return sorted(folder.glob("*.so")) if folder.exists() else []


def no_builds(monkeypatch):
    """Fail the test if anything is built."""
    def build(*args, **kwargs):
        raise AssertionError("target.build called on a cache hit")

    monkeypatch.setattr(CpuTarget, "build", build)


def test_hit_runs_as_compiled_and_builds_nothing(cache_dir, monkeypatch, rng):
    cell = halstm.LSTM(8, 16)
    x, params, states = random_inputs(cell, STEPS, BATCH, rng)
    f, b = halstm.compile(cell, STEPS, BATCH), compile_backward(cell, STEPS, BATCH)
    # the forward, the backward's reversed loop (compiled as a forward) and the backward's functions
    assert cache.stats == {"hits": 0, "misses": 3} and len(entries(cache_dir)) == 3
    no_builds(monkeypatch)
    g, c = halstm.compile(cell, STEPS, BATCH), compile_backward(cell, STEPS, BATCH)
    assert cache.stats == {"hits": 3, "misses": 3}
    assert {g.cached, c.cached, c.adjoint.cached} == set(entries(cache_dir))
    assert (g.recipe, g.knobs, g.record, g.signature) == (f.recipe, f.knobs, f.record, f.signature)
    y, final = g(x, params, states)
    y_want, final_want = f(x, params, states)
    np.testing.assert_array_equal(y, y_want)
    for s in cell.states:
        np.testing.assert_array_equal(final[s], final_want[s])
    seqs = g.sequences(x, params, states)
    grads = {s: rng.standard_normal(v.shape).astype(np.float32) for s, v in seqs.items()}
    for got, want in zip(c(x, params, seqs, grads), b(x, params, seqs, grads)):
        for name in (got if isinstance(got, dict) else [None]):
            np.testing.assert_array_equal(got if name is None else got[name], want if name is None else want[name])


def test_hit_builds_what_it_skipped_on_access(cache_dir):
    cell = halstm.GRU(8, 16)
    halstm.compile(cell, STEPS, BATCH)
    g = halstm.compile(cell, STEPS, BATCH)
    assert isinstance(g, cache.CachedCell)
    assert g.schedule.trace is not None
    halstm.export(g, cache_dir.parent / "gru.so")  # needs g.module
    assert halstm.load(cache_dir.parent / "gru.so").signature == g.signature


def test_fresh_process_compiles_nothing(cache_dir, tmp_path, rng):
    cell = halstm.LSTM(8, 16)
    x, params, _ = random_inputs(cell, STEPS, BATCH, rng)
    np.savez(tmp_path / "inputs.npz", x=x, **params)
    y = halstm.compile(cell, STEPS, BATCH)(x, params)[0]
    [entry] = entries(cache_dir)
    mtime = entry.stat().st_mtime_ns
    script = textwrap.dedent(f"""
        import numpy as np, halstm
        from halstm import cache
        from halstm.targets import CpuTarget
        CpuTarget.build = None  # a build would fail
        inputs = dict(np.load({str(tmp_path / "inputs.npz")!r}))
        x = inputs.pop("x")
        f = halstm.compile(halstm.LSTM(8, 16), {STEPS}, {BATCH})
        assert cache.stats == {{"hits": 1, "misses": 0}}, cache.stats
        np.save({str(tmp_path / "y.npy")!r}, f(x, inputs)[0])
        print(f.cached)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(entry)
    assert entry.stat().st_mtime_ns == mtime
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), y)


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache holding LSTM(8, 16)'s forward and backward (three entries), compiled once for the tests
    that damage a copy of it."""
    folder = tmp_path_factory.mktemp("filled") / "modules"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HALSTM_CACHE_DIR", str(folder))
        patch.delenv("HALSTM_CACHE", raising=False)
        cell = halstm.LSTM(8, 16)
        halstm.compile(cell, STEPS, BATCH)
        compile_backward(cell, STEPS, BATCH)
    assert len(entries(folder)) == 3
    return folder


@pytest.mark.parametrize("damage", ["truncate", "sidecar"])
def test_damaged_entry_is_rebuilt(cache_dir, filled, damage):
    cell = halstm.LSTM(8, 16)
    shutil.copytree(filled, cache_dir)
    for entry in entries(cache_dir):
        if damage == "truncate":
            entry.write_bytes(entry.read_bytes()[:1000])
        else:
            entry.with_name(entry.name + ".json").unlink()
    f, b = halstm.compile(cell, STEPS, BATCH), compile_backward(cell, STEPS, BATCH)
    assert not isinstance(f, cache.CachedCell) and not isinstance(b, cache.CachedBackward)
    assert cache.stats == {"hits": 0, "misses": 3}
    assert isinstance(halstm.compile(cell, STEPS, BATCH), cache.CachedCell)
    assert isinstance(compile_backward(cell, STEPS, BATCH), cache.CachedBackward)


def test_off_writes_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("HALSTM_CACHE", "0")
    cell = halstm.LSTM(8, 16)
    halstm.compile(cell, STEPS, BATCH)
    compile_backward(cell, STEPS, BATCH)
    assert not cache_dir.exists() and cache.stats == {"hits": 0, "misses": 0}


@pytest.mark.parametrize("change", [{"knobs": {"rows": 2}}, {"dtype": "float16"}, {"steps": STEPS + 1},
                                    {"allow_tf32": True}])
def test_another_problem_or_knob_misses(cache_dir, change):
    cell = halstm.LSTM(8, 16)
    halstm.compile(cell, STEPS, BATCH)
    f = halstm.compile(cell, **{"steps": STEPS, "batch": BATCH, **change})
    assert not isinstance(f, cache.CachedCell) and len(entries(cache_dir)) == 2


def test_unwritable_folder_warns_once(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HALSTM_CACHE_DIR", str(tmp_path / "file" / "modules"))
    monkeypatch.setattr(cache, "_warned", False)
    cell = halstm.LSTM(8, 16)
    with pytest.warns(UserWarning, match="cannot be cached"):
        f = halstm.compile(cell, STEPS, BATCH)
    assert isinstance(f, halstm.CompiledCell)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        compile_backward(cell, STEPS, BATCH)


def _compile_in_process(folder):
    os.environ["HALSTM_CACHE_DIR"] = folder
    cell = halstm.LSTM(8, 16)
    f = halstm.compile(cell, STEPS, BATCH)
    x = np.ones((STEPS, BATCH, 8), np.float32)
    return f(x, cell.init_parameters(seed=0))[0]


def test_processes_at_once_on_an_empty_cache(cache_dir):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        first, second = pool.map(_compile_in_process, [str(cache_dir)] * 2)
    np.testing.assert_array_equal(first, second)
    assert len(entries(cache_dir)) == 1
    assert not [p for p in cache_dir.iterdir() if p.name.startswith(".")]  # no temporary file left
    assert isinstance(halstm.compile(halstm.LSTM(8, 16), STEPS, BATCH), cache.CachedCell)


def decisions(folder):
    return sorted(folder.glob("*.decision.json")) if folder.exists() else []


def test_a_kept_choice_is_not_decided_again(cache_dir, monkeypatch):
    """The recipe, knobs and layout chosen for a program are kept beside its module: a later compile
    of the same problem reads them (the persistent kernel's recipe chooses from the parsed program);
    another question (knobs asked for) is decided."""
    cell = halstm.LSTM(8, 16)
    f = halstm.compile(cell, STEPS, BATCH)
    assert len(decisions(cache_dir)) == 1

    def choose(*args):
        raise AssertionError("decided again")

    monkeypatch.setattr(halstm.compiler, "_choose", choose)
    g = halstm.compile(cell, STEPS, BATCH)
    assert (g.recipe, g.knobs, g.program.layout) == (f.recipe, f.knobs, f.program.layout)
    with pytest.raises(AssertionError, match="decided again"):
        halstm.compile(cell, STEPS, BATCH, knobs={"rows": 2})


@pytest.mark.parametrize("answer", [{"recipe": "no-such-recipe"}, "not an object", {"layout": {"tiles": 3}}])
def test_an_unusable_kept_choice_is_decided_again(cache_dir, answer):
    cell = halstm.LSTM(8, 16)
    f = halstm.compile(cell, STEPS, BATCH)
    [path] = decisions(cache_dir)
    entry = json.loads(path.read_text())
    entry["answer"] = {**entry["answer"], **answer} if isinstance(answer, dict) else answer
    path.write_text(json.dumps(entry))
    g = halstm.compile(cell, STEPS, BATCH)
    assert (g.recipe, g.knobs) == (f.recipe, f.knobs)
    assert json.loads(path.read_text())["answer"]["recipe"] == f.recipe.name  # replaced


def test_a_stale_record_warns_on_every_compile(cache_dir, tmp_path, monkeypatch):
    """A tuning record whose knobs do not run here is passed over with a warning, also where the
    choice is read from the cache."""
    cell = halstm.LSTM(8, 16)
    program = halstm.lower(cell, STEPS, BATCH, "float32")
    key = halstm.database.tuning_key(cell, STEPS, BATCH, "float32", CpuTarget.host())
    db = tmp_path / "tuning.jsonl"
    db.write_text(json.dumps({"key": key, "recipe": "cpu-step-loop", "knobs": {"rows": 0, "vectors": 2, "panel": 64},
                              "ms": 1.0}) + "\n")
    monkeypatch.setenv("HALSTM_TUNING_DB", str(db))
    for _ in range(2):
        with pytest.warns(UserWarning, match="does not run here; using the defaults"):
            f = halstm.compile(cell, STEPS, BATCH)
        assert f.record is None and f.knobs == halstm.schedules.CpuStepLoop().defaults(program, CpuTarget.host())
    assert len(decisions(cache_dir)) == 1


def test_a_choice_json_does_not_hold_is_decided_each_time(cache_dir):
    """A registered recipe's knobs of types JSON changes or cannot hold are not kept."""
    program, target = halstm.lower(halstm.LSTM(8, 16), STEPS, BATCH), CpuTarget.host()
    calls = []
    for answer in ({"knobs": {"tile": (4, 8)}}, {"knobs": {"tile": object()}}):
        for _ in range(2):
            assert cache.decided(program, target, {"asked": None}, lambda: calls.append(1) or answer) is answer
    assert len(calls) == 4 and not decisions(cache_dir)
    kept = {"knobs": {"tile": 4}}
    for _ in range(2):
        assert cache.decided(program, target, {"asked": None}, lambda: calls.append(1) or kept) == kept
    assert len(calls) == 5 and len(decisions(cache_dir)) == 1


def test_a_choice_for_an_unregistered_recipe_is_kept(cache_dir, monkeypatch):
    """A recipe object passed to compile, not registered, is decided once too."""
    class Mine(halstm.schedules.CpuStepLoop):
        name = "mine-unregistered"

    cell = halstm.LSTM(8, 16)
    f = halstm.compile(cell, STEPS, BATCH, recipe=Mine())
    monkeypatch.setattr(halstm.compiler, "_choose", lambda *args: pytest.fail("decided again"))
    g = halstm.compile(cell, STEPS, BATCH, recipe=Mine())
    assert g.recipe.name == "mine-unregistered" and g.knobs == f.knobs
