"""The tuner on the CPU: records, resumption after a kill, failures skipped, the database read back."""

import os
import subprocess
import sys
import time

import pytest

import halstm
from halstm import targets
from halstm.cli import main
from halstm.database import Database, Record, tuning_key
from halstm.gradients import compile_backward, reversed_loop
from halstm.lowering import lower
from halstm.schedules import CpuStepLoop, Recipe
from halstm.tuner import tune
from test_tuner_safety import Chatty


def test_interrupted_run_resumes_and_compile_uses_the_best(tmp_path):
    db = Database(tmp_path / "db.jsonl")
    trials = 3  # one or two measured before the kill, the rest after
    argv = [sys.executable, "-m", "halstm.cli", "tune", "--cell", "GRU", "--input-size", "12",
            "--hidden-size", "16", "--steps", "4", "--batch", "3", "--trials", str(trials),
            "--database", str(db.path), "--builders", "1"]
    run = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (db.path.exists() and db.path.read_text().count("\n") >= 1) and time.time() < deadline:
        time.sleep(0.2)
    run.kill()
    run.wait()
    first = db.records()
    assert 1 <= len(first) < trials, "the run was not interrupted part-way"

    best = tune(halstm.GRU(12, 16), 4, 3, database=db, trials=trials, log=lambda _: None, builders=1)
    records = db.records()
    searched, finals = records[:trials], records[trials:]
    assert len({r.candidate for r in searched}) == trials and not any(r.final for r in searched), \
        "a measured candidate was measured again"
    assert [r.candidate for r in searched[: len(first)]] == [r.candidate for r in first]
    default = CpuStepLoop().defaults(lower(halstm.GRU(12, 16), 4, 3, "float32"), targets.resolve("cpu"))
    assert all(r.final for r in finals) and {r.candidate for r in finals} == {r.candidate for r in searched}
    assert default in [r.knobs for r in finals], "the default is timed side by side with the fastest"
    assert best.final and best.ms == min(r.ms for r in finals)

    logged = []
    assert tune(halstm.GRU(12, 16), 4, 3, database=db, trials=trials, log=logged.append, builders=1) == best
    assert logged == [f"{trials} candidates already measured in {db.path}"] and db.records() == records

    f = halstm.compile(halstm.GRU(12, 16), 4, 3, database=db)
    assert (f.recipe.name, f.knobs) == (best.recipe, best.knobs)


def test_compile_takes_the_record_of_the_nearest_sequence_length(tmp_path):
    """Without a record for its T, compile takes the best one tuned at the nearest T (by ratio, the
    larger T of two as near) for the same cell, batch, dtype and target; one for its own T wins, and
    one whose knobs this halstm does not have is passed over with a warning."""
    db = Database(tmp_path / "db.jsonl")
    cell, target = halstm.GRU(12, 16), targets.resolve("cpu")

    def record(steps, batch, knobs, ms):
        db.append(Record(tuning_key(cell, steps, batch, "float32", target), "cpu-step-loop", knobs, ms))

    at4, at64 = {"rows": 2, "vectors": 1, "panel": 32}, {"rows": 8, "vectors": 1, "panel": 128}
    record(4, 3, at4, 1.0)
    record(64, 3, at64, 5.0)
    record(64, 3, {"rows": 6, "vectors": 1, "panel": 64}, 9.0)
    record(10, 2, {"rows": 4, "vectors": 3, "panel": 256}, 0.5)  # another batch: never borrowed
    db.append(Record({"cell": "GRU", "input_size": 12}, "cpu-step-loop", at64, 0.1))  # a key without steps
    assert db.nearest_steps(tuning_key(cell, 16, 3, "float32", target)).knobs == at64, "4x from both: the larger"
    f = halstm.compile(cell, 8, 3, database=db)
    assert (f.knobs, f.record.key["steps"]) == (at4, 4)
    assert halstm.compile(cell, 32, 3, database=db).knobs == at64
    assert halstm.compile(cell, 9, 2, database=db).knobs == {"rows": 4, "vectors": 3, "panel": 256}

    own = {"rows": 4, "vectors": 2, "panel": 64}
    record(32, 3, own, 3.0)
    assert halstm.compile(cell, 32, 3, database=db).knobs == own
    record(8, 3, {"tiles": 3}, 0.1)
    with pytest.warns(UserWarning, match="does not run here; using the defaults"):
        f = halstm.compile(cell, 8, 3, database=db)
    assert (f.knobs, f.record) == (CpuStepLoop().defaults(lower(cell, 8, 3, "float32"), target), None)


def test_training_tune_records_the_reversed_loop_that_compile_backward_then_uses(tmp_path, capsys):
    """``halstm tune --training`` tunes the forward and the backward's reversed loop (the adjoint cell,
    T + 1 steps), each under its own key; compile_backward compiles the loop with its best record."""
    db = Database(tmp_path / "db.jsonl")
    # one trial each: no side-by-side timing (its candidates compiled again); the record compile_backward
    # takes is the database's (its record, not only its knobs, which the defaults would also give)
    argv = ["tune", "--training", "--cell", "LSTM", "--input-size", "8", "--hidden-size", "8", "--steps", "3",
            "--batch", "2", "--trials", "1", "--builders", "1", "--database", str(db.path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "forward: cpu-step-loop" in out and "reversed loop: cpu-step-loop" in out, out
    cell, target = halstm.LSTM(8, 8), targets.resolve("cpu")
    adjoint = reversed_loop(cell, 3, 2, "float32", target)
    keys = {(r.key["cell"], r.key["steps"]) for r in db.records()}
    assert keys == {("LSTM", 3), (adjoint.name, 4)}
    best = db.best(tuning_key(adjoint, 4, 2, "float32", target))
    backward = compile_backward(cell, 3, 2, database=db)
    assert backward.adjoint.record == best and backward.adjoint.knobs == best.knobs


class WrongGRU(halstm.GRU):
    """GRU's signature with different math: what a miscompiled candidate looks like."""

    def step(self, p, x, h):
        return halstm.tanh(super().step(p, x, h))


class OnCpu(Recipe):
    """The CPU recipe at its defaults, under knobs of a test's own."""

    cpu = CpuStepLoop()

    def is_applicable(self, program, target):
        return self.cpu.is_applicable(program, target)

    def layout(self, program, target, knobs):
        return self.cpu.layout(program, target, self.cpu.defaults(program, target))


class Unreliable(OnCpu):
    """The CPU recipe, made to fail in every way a candidate can."""

    name = "unreliable"
    knobs = {"mode": ("ok", "raise", "hang", "crash", "wrong")}

    def apply(self, program, target, mode):
        if mode == "raise":
            raise ValueError("this candidate does not compile")
        if mode == "hang":
            time.sleep(3600)
        if mode == "crash":
            os._exit(3)
        if mode == "wrong":
            program = lower(WrongGRU(program.cell.input_size, program.cell.hidden_size), program.steps,
                            program.batch, program.dtype, layout=program.layout)
        return self.cpu.apply(program, target)


@pytest.mark.parametrize("builders", (1, 3), ids=("compiled-when-timed", "compiled-first-on-3"))
def test_failed_candidates_are_recorded_and_skipped(builders, tmp_path):
    """Every way a candidate fails is recorded, whether it is compiled in the measuring process or
    first by builder processes (then a compile that hangs or kills its builder is one failure; the
    default is a round of its own, then three of its four neighbours, as many as builders)."""
    db = Database(tmp_path / "db.jsonl")
    logged = []
    # the hang waits out the timeout: 15 s, five times or more what the other candidates' compiles took on
    # the loaded 2-core CPU machine (a job's time starts once its worker has imported the compiler)
    best = tune(halstm.GRU(8, 8), 3, 2, database=db, recipes=[Unreliable()], trials=None, timeout=15,
                log=logged.append, builders=builders)
    assert any(line.startswith("built [3/3] on 3 processes") for line in logged) == (builders == 3)
    errors = {r.knobs["mode"]: r.error for r in db.records()}
    assert errors["ok"] is None and best.knobs == {"mode": "ok"}
    assert "does not compile" in errors["raise"]
    assert "timed out" in errors["hang"]
    assert "worker died (exit code 3)" in errors["crash"]
    assert "wrong result" in errors["wrong"]


class SlowToBuild(OnCpu):
    """The CPU recipe, its compile delayed by the knob's seconds."""

    name = "slow-to-build"
    knobs = {"delay": (0.0, 4.0, 0.01)}

    def apply(self, program, target, delay):
        time.sleep(delay)
        return self.cpu.apply(program, target)


def test_a_cpu_candidate_is_timed_once_its_round_is_built(tmp_path):
    """A CPU function runs on every core: the one built at once waits for the slow one's compile. The
    cell writes to fd 1 as it is traced, in the builders too: their answers still arrive, every
    candidate is recorded and the three are timed again side by side (test_tuner_safety's fd 1 test
    with the compiles in builder processes, one tuning run for both)."""
    db = Database(tmp_path / "db.jsonl")
    logged = []
    tune(Chatty(8, 8), 3, 2, database=db, recipes=[SlowToBuild()], trials=None, log=logged.append, builders=2)
    round_built = logged.index(next(line for line in logged if line.startswith("built [2/2]")))
    fast = logged.index(next(line for line in logged if "{'delay': 0.01}" in line and line.startswith("|")))
    assert fast > round_built, "\n".join(logged)
    records = db.records()
    assert [r.final for r in records] == [False] * 3 + [True] * 3, records
    assert all(r.error is None for r in records), records


def test_reader_survives_a_torn_last_line(tmp_path):
    db = Database(tmp_path / "db.jsonl")
    key = {"cell": "GRU", "steps": 3}
    db.append(Record(key, "cpu-step-loop", {"rows": 4}, ms=2.0))
    db.append(Record(key, "cpu-step-loop", {"rows": 2}, ms=1.0))
    with open(db.path, "ab") as f:
        f.write(b'{"error": null, "key": {"cell": "GR')  # a tuner killed mid-write
    assert [r.ms for r in db.records(key)] == [2.0, 1.0]
    db.append(Record(key, "cpu-step-loop", {"rows": 8}, ms=0.5))
    with pytest.warns(UserWarning, match="db.jsonl:3: unreadable record skipped"):
        assert [r.ms for r in db.records(key)] == [2.0, 1.0, 0.5]
    with pytest.warns(UserWarning):
        assert db.best(key).knobs == {"rows": 8}
        assert db.best({"cell": "LSTM"}) is None


def test_best_is_the_fastest_finalist_until_more_candidates_are_measured(tmp_path):
    """Timed alone, b looked faster than a; side by side at the end of the run, a was: a is the best
    until another candidate is measured after the final timing, and then the fastest of all."""
    db = Database(tmp_path / "db.jsonl")
    key = {"cell": "GRU", "steps": 3}
    for knobs, ms, final in (("a", 1.0, False), ("b", 0.9, False), ("c", None, False), ("a", 1.0, True),
                             ("b", 1.1, True)):
        db.append(Record(key, "cpu-step-loop", {"rows": knobs}, ms, final=final))
    assert db.best(key).knobs == {"rows": "a"} and db.best(key).final
    db.append(Record(key, "cpu-step-loop", {"rows": "d"}, 0.95))
    assert db.best(key).knobs == {"rows": "b"} and not db.best(key).final


def test_info_summarises_a_database(tmp_path, capsys):
    db = Database(tmp_path / "db.jsonl")
    key = {"cell": "GRU", "input_size": 4, "hidden_size": 4, "steps": 3, "batch": 2, "dtype": "float32",
           "target": "llvm"}
    db.append(Record(key, "cpu-step-loop", {"rows": 4}, ms=2.0))
    db.append(Record(key, "cpu-step-loop", {"rows": 2}, error="timed out"))
    assert main(["info", str(db.path)]) == 0
    out = capsys.readouterr().out
    assert "GRU I=4 H=4 T=3 B=2 float32 on llvm: 2 measured (1 failed), best 2.000 ms" in out
    db.append(Record(key, "cpu-step-loop", {"rows": 8}, ms=1.5))
    db.append(Record(key, "cpu-step-loop", {"rows": 4}, ms=1.8, final=True))
    db.append(Record(key, "cpu-step-loop", {"rows": 8}, ms=1.9, final=True))
    assert main(["info", str(db.path)]) == 0
    out = capsys.readouterr().out
    assert "3 measured (1 failed), 2 timed again side by side, best 1.800 ms: cpu-step-loop {'rows': 4}" in out


class Grid(Recipe):
    """Two knobs and a default, nothing to compile: what the search plans over."""

    def __init__(self, name, default):
        self.name, self.default = name, default
        self.knobs = {"a": (0, 1, 2, 3), "b": (0, 1, 2)}

    def defaults(self, program, target):
        return self.default

    def is_applicable(self, program, target):
        return True


def test_rounds_start_at_the_defaults_then_search_nearest_the_fastest():
    from halstm.database import candidate_id
    from halstm.tuner import next_round, spaces

    fast, slow = Grid("fast", {"a": 1, "b": 1}), Grid("slow", {"a": 0, "b": 0})
    searched = spaces(None, None, [fast, slow])
    assert [(r.name, len(k)) for r, k in searched] == [("fast", 12), ("slow", 12)]
    assert [(r.name, k) for r, k in next_round(searched, {}, 4)] == [("fast", fast.default), ("slow", slow.default)]

    results = {candidate_id("fast", fast.default): 1.0, candidate_id("slow", slow.default): 2.0}
    first = next_round(searched, results, 5)  # fast's 5 neighbours; slow (2x slower) waits
    assert {r.name for r, _ in first} == {"fast"}
    assert sorted((k["a"], k["b"]) for _, k in first) == [(0, 1), (1, 0), (1, 2), (2, 1), (3, 1)]

    results |= {candidate_id("fast", k): 0.5 if k == {"a": 3, "b": 1} else 1.5 for _, k in first}
    second = next_round(searched, results, 2)  # around the new fastest, a=3 b=1
    assert [(k["a"], k["b"]) for _, k in second] in ([(3, 0), (3, 2)], [(3, 2), (3, 0)])

    results |= {candidate_id("fast", k): 1.5 for _, k in next_round(searched, results, 12)}
    assert {r.name for r, _ in next_round(searched, results, 12)} == {"slow"}, "fast is exhausted"


def test_finalists_are_the_fastest_and_the_defaults_near_them():
    """The 4 fastest by each candidate's latest record, the fast recipe's default although 6th (within
    1.25x), not the slow recipe's (1.6x), nor a failure."""
    from halstm.tuner import finalists, spaces

    fast, slow = Grid("fast", {"a": 1, "b": 1}), Grid("slow", {"a": 0, "b": 0})
    searched = spaces(None, None, [fast, slow])
    times = {(0, 0): 1.0, (0, 1): 1.02, (0, 2): 1.04, (2, 0): 1.06, (2, 1): 1.08, (1, 1): 1.1, (3, 0): None}
    records = [Record({}, "fast", {"a": 0, "b": 2}, 0.5)]  # measured again later: its latest counts
    records += [Record({}, "fast", {"a": a, "b": b}, ms) for (a, b), ms in times.items()]
    records += [Record({}, "slow", slow.default, 1.6), Record({}, "slow", {"a": 3, "b": 2}, 1.2)]
    chosen = finalists(records, searched)
    assert [(r.recipe, r.knobs["a"], r.knobs["b"], r.ms) for r in chosen] == [
        ("fast", 0, 0, 1.0), ("fast", 0, 1, 1.02), ("fast", 0, 2, 1.04), ("fast", 2, 0, 1.06), ("fast", 1, 1, 1.1)]


H100 = targets.CudaTarget("sm_90", sms=132, name="NVIDIA H100 80GB HBM3")


@pytest.fixture
def four_gpus(monkeypatch):
    """Four visible GPUs, the third of another kind."""
    other = targets.CudaTarget("sm_90", sms=114, name="NVIDIA H100 PCIe")
    monkeypatch.setattr("halstm.targets.cuda.visible_gpus", lambda: [H100, H100, other, H100])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_measuring_gpus_are_the_visible_devices_of_the_targets_kind(four_gpus, monkeypatch):
    from halstm.tuner import measuring_gpus

    assert measuring_gpus(None, H100) == [None]  # one worker, seeing what this process sees
    assert measuring_gpus([0, 3], H100) == ["0", "3"]
    assert measuring_gpus([1], targets.CudaTarget("sm_90", sms=132)) == ["1"]  # a target without a name
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the indices are this process's
    assert measuring_gpus([0, 3], H100) == ["4", "7"]
    with pytest.raises(ValueError, match="GPU 2 is cuda-sm_90-114sm.*measured on GPUs of the target's kind"):
        measuring_gpus("all", H100)
    for wrong in ([4], [0, 0], [], "some", [-1]):
        with pytest.raises(ValueError, match="distinct indices of the 4 visible CUDA devices"):
            measuring_gpus(wrong, H100)
    with pytest.raises(ValueError, match="only a CUDA target measures on GPUs"):
        measuring_gpus([0], targets.resolve("cpu"))


def test_tune_refuses_gpus_before_measuring(four_gpus, tmp_path):
    db = tmp_path / "db.jsonl"
    with pytest.raises(ValueError, match="GPU 2 is"):
        tune(halstm.cells.LSTM(4, 8), 3, 2, "float32", H100, database=db, gpus="all")
    assert not db.exists()
    code = main(["tune", "--cell", "LSTM", "--input-size", "4", "--hidden-size", "8", "--steps", "3", "--batch", "2",
                 "--target", "cpu", "--gpus", "0", "--database", str(db)])
    assert code == 1 and not db.exists()


def test_a_worker_takes_the_tensorize_probe_from_its_parent(monkeypatch):
    """The tuner hands its probe's answer to its workers: their first compiles start no probe."""
    from halstm.schedules import cuda_tensorcore

    monkeypatch.setattr(cuda_tensorcore.subprocess, "run", lambda *a, **k: pytest.fail("probed again"))
    try:
        for given, expected in (("1", True), ("0", False)):
            monkeypatch.setenv(cuda_tensorcore.PROBED, given)
            cuda_tensorcore.tensorize_works.cache_clear()
            assert cuda_tensorcore.tensorize_works() is expected
    finally:
        cuda_tensorcore.tensorize_works.cache_clear()


def test_tensorize_is_probed_only_for_versions_not_tried(monkeypatch):
    """For the TVM and apache-tvm-ffi versions of TENSORIZE_WORKS_WITH the answer is known, no
    subprocess started; for others the probe runs (here: as if it crashed)."""
    import subprocess

    from halstm.schedules import cuda_tensorcore

    monkeypatch.delenv(cuda_tensorcore.PROBED, raising=False)
    probes = []

    def probe(*args, **kwargs):
        probes.append(args)
        return subprocess.CompletedProcess(args, -11)

    monkeypatch.setattr(cuda_tensorcore.subprocess, "run", probe)
    try:
        for (tvm_version, ffi_version), works in cuda_tensorcore.TENSORIZE_WORKS_WITH.items():
            monkeypatch.setattr(cuda_tensorcore.tvm, "__version__", tvm_version)
            monkeypatch.setattr(cuda_tensorcore.tvm_ffi, "__version__", ffi_version)
            cuda_tensorcore.tensorize_works.cache_clear()
            assert cuda_tensorcore.tensorize_works() is works and not probes
        monkeypatch.setattr(cuda_tensorcore.tvm_ffi, "__version__", "0.9.9")
        cuda_tensorcore.tensorize_works.cache_clear()
        assert cuda_tensorcore.tensorize_works() is False and len(probes) == 1
    finally:
        cuda_tensorcore.tensorize_works.cache_clear()


@pytest.fixture(scope="module")
def two_measuring_workers():
    """Two measuring workers, one a GPU they would see (CPU jobs leave it unused), started once for the
    tests of the dispatch: each start imports TVM in a process of its own."""
    from halstm.tuner_workers import Worker

    with Worker(gpu="0") as first, Worker(gpu="1") as second:
        yield first, second


def test_a_round_spread_over_two_measuring_workers_measures_each_job_once(tmp_path, two_measuring_workers):
    """The dispatch that spreads a round over one measuring worker a GPU, with two CPU workers."""
    import numpy as np

    from halstm.oracle import reference
    from halstm.tuner import _inputs
    from halstm.tuner_workers import Job, measure_jobs

    cell, target, recipe = halstm.GRU(8, 8), targets.resolve("cpu"), CpuStepLoop()
    x, params, states = _inputs(cell, 3, 2, "float32", np.random.default_rng(0))
    expected, _ = reference(cell, x, params, states)
    knobs = [{**recipe.defaults(lower(cell, 3, 2), target), "rows": r} for r in (1, 2, 4)]
    jobs = [Job(cell, 3, 2, "float32", target, recipe, k, (x, params, states), expected, 2) for k in knobs]
    first, second = two_measuring_workers
    done = list(measure_jobs(jobs, [first, second], [], 60, lambda _: None, str(tmp_path), overlap=False))
    assert sorted(j.knobs["rows"] for j, *_ in done) == [1, 2, 4]
    assert all(ms is not None and error is None for _, ms, error, _ in done)
    assert {gpu for *_, gpu in done} == {"0", "1"}  # both took jobs


def test_jobs_built_one_at_a_time_take_turns_on_the_measuring_workers(tmp_path, two_measuring_workers):
    """Built by one compile process, jobs reach the measuring workers one at a time, each finding
    both free: they take turns (the first free one took them all before)."""
    import numpy as np

    from halstm.oracle import reference
    from halstm.tuner import _inputs
    from halstm.tuner_workers import Job, Worker, measure_jobs

    cell, target, recipe = halstm.GRU(8, 8), targets.resolve("cpu"), CpuStepLoop()
    x, params, states = _inputs(cell, 3, 2, "float32", np.random.default_rng(0))
    expected, _ = reference(cell, x, params, states)
    knobs = [{**recipe.defaults(lower(cell, 3, 2), target), "rows": r} for r in (1, 2, 4, 8)]
    jobs = [Job(cell, 3, 2, "float32", target, recipe, k, (x, params, states), expected, 2) for k in knobs]
    first, second = two_measuring_workers
    with Worker() as builder:
        done = list(measure_jobs(jobs, [first, second], [builder], 60, lambda _: None, str(tmp_path), overlap=True))
    assert all(ms is not None and error is None for _, ms, error, _ in done)
    assert sorted(gpu for *_, gpu in done) == ["0", "0", "1", "1"]
