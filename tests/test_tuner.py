"""The tuner on the CPU: records, resumption after a kill, failures skipped, the database read back."""

import os
import subprocess
import sys
import time

import pytest

import halstm
from halstm.cli import main
from halstm.database import Database, Record
from halstm.lowering import lower
from halstm.schedules import CpuStepLoop, Recipe
from halstm.tuner import tune


def test_interrupted_run_resumes_and_compile_uses_the_best(tmp_path):
    db = Database(tmp_path / "db.jsonl")
    argv = [sys.executable, "-m", "halstm.cli", "tune", "--cell", "GRU", "--input-size", "12",
            "--hidden-size", "16", "--steps", "4", "--batch", "3", "--trials", "4", "--database", str(db.path),
            "--builders", "1"]
    run = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (db.path.exists() and db.path.read_text().count("\n") >= 1) and time.time() < deadline:
        time.sleep(0.2)
    run.kill()
    run.wait()
    first = db.records()
    assert 1 <= len(first) < 4, "the run was not interrupted part-way"

    best = tune(halstm.GRU(12, 16), 4, 3, database=db, trials=4, log=lambda _: None, builders=1)
    records = db.records()
    assert len(records) == 4
    assert len({r.candidate for r in records}) == 4, "a measured candidate was measured again"
    assert [r.candidate for r in records[: len(first)]] == [r.candidate for r in first]
    assert best.ms == min(r.ms for r in records)

    f = halstm.compile(halstm.GRU(12, 16), 4, 3, database=db)
    assert (f.recipe.name, f.knobs) == (best.recipe, best.knobs)


class WrongGRU(halstm.GRU):
    """GRU's signature with different math: what a miscompiled candidate looks like."""

    def step(self, p, x, h):
        return halstm.tanh(super().step(p, x, h))


class Unreliable(Recipe):
    """The CPU recipe, made to fail in every way a candidate can."""

    name = "unreliable"
    knobs = {"mode": ("ok", "raise", "hang", "crash", "wrong")}
    cpu = CpuStepLoop()

    def is_applicable(self, program, target):
        return self.cpu.is_applicable(program, target)

    def layout(self, program, target, knobs):
        return self.cpu.layout(program, target, self.cpu.defaults(program, target))

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
    first by builder processes (then a compile that hangs or kills its builder is one failure)."""
    db = Database(tmp_path / "db.jsonl")
    logged = []
    best = tune(halstm.GRU(8, 8), 3, 2, database=db, recipes=[Unreliable()], trials=None, timeout=30,
                log=logged.append, builders=builders)
    assert any(line.startswith("built [5/5] on 3 processes") for line in logged) == (builders == 3)
    errors = {r.knobs["mode"]: r.error for r in db.records()}
    assert errors["ok"] is None and best.knobs == {"mode": "ok"}
    assert "does not compile" in errors["raise"]
    assert "timed out" in errors["hang"]
    assert "worker died (exit code 3)" in errors["crash"]
    assert "wrong result" in errors["wrong"]


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


def test_info_summarises_a_database(tmp_path, capsys):
    db = Database(tmp_path / "db.jsonl")
    key = {"cell": "GRU", "input_size": 4, "hidden_size": 4, "steps": 3, "batch": 2, "dtype": "float32",
           "target": "llvm"}
    db.append(Record(key, "cpu-step-loop", {"rows": 4}, ms=2.0))
    db.append(Record(key, "cpu-step-loop", {"rows": 2}, error="timed out"))
    assert main(["info", str(db.path)]) == 0
    out = capsys.readouterr().out
    assert "GRU I=4 H=4 T=3 B=2 float32 on llvm: 2 measured (1 failed), best 2.000 ms" in out


def test_candidates_interleave_recipes_and_their_switches():
    """A short budget tries both recipes and, within the step loop, tensor cores on and off (its
    FFMA settings outnumber the tensor-core ones a hundredfold)."""
    from halstm.schedules import CudaPersistent, CudaStepLoop
    from halstm.schedules.cuda_tensorcore import tensorize_works
    from halstm.targets import CudaTarget
    from halstm.tuner import candidates

    if not tensorize_works():
        pytest.skip("Schedule.tensorize does not work with this apache-tvm-ffi")
    program = lower(halstm.LSTM(512, 512), steps=2, batch=64, dtype="float16")
    first = candidates(program, CudaTarget("sm_90", sms=132), [CudaStepLoop(), CudaPersistent()], limit=8)
    step_loop = [k for r, k in first if r.name == "cuda-step-loop"]
    assert len(step_loop) == 4 and {k["tensor_cores"] for k in step_loop[1:3]} == {True, False}
    assert {k["tensor_cores"] for r, k in first if r.name == "cuda-persistent"} == {True, False}
