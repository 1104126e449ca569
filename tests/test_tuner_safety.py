"""The tuner's safety: what its worker imports, what may write to its stdout, and what is refused
before anything is measured (a problem that cannot be tuned, a database that cannot be written)."""

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

import halstm
from halstm import tuner_workers
from halstm.cli import main
from halstm.database import Database
from halstm.schedules import CpuStepLoop
from halstm.tuner import tune

SMALL = dict(recipes=[CpuStepLoop()], trials=1, builders=1, timeout=60, log=lambda _: None)


class Chatty(halstm.LSTM):
    """An LSTM whose step writes to fd 1 as it is traced (in the worker too, where it is compiled),
    as a C library that prints does."""

    def step(self, p, x, h, c):
        os.write(1, b"garbage on fd 1, no header\n")
        return super().step(p, x, h, c)


def test_a_script_cell_is_tuned_and_nothing_is_imported_from_the_temporary_or_working_folder(tmp_path):
    """A script tunes a cell class of its ``__main__`` (it reaches the worker by value; the worker
    finds halstm where the script did), run from a folder holding a cloudpickle.py and a numpy.py,
    with others in the temporary folder: none of them is imported, and the worker's folders go."""
    marker, temp, work = tmp_path / "imported", tmp_path / "temp", tmp_path / "work"
    for folder in (temp, work):
        folder.mkdir()
        for name in ("cloudpickle", "numpy"):
            (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(f"""
        import halstm
        from halstm.schedules import CpuStepLoop

        class Mine(halstm.GRU):
            pass

        best = halstm.tune(Mine(8, 16), 3, 2, database={str(tmp_path / "db.jsonl")!r}, recipes=[CpuStepLoop()],
                           trials=1, builders=1, timeout=60, log=lambda _: None)
        print(best.recipe, best.error, best.ms is not None)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=work, timeout=300,
                         env={**os.environ, "TMPDIR": str(temp)})
    assert not marker.exists(), f"the worker imported a planted module: {marker.read_text()}"
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["cpu-step-loop", "None", "True"]
    assert sorted(p.name for p in temp.iterdir()) == ["cloudpickle.py", "numpy.py"]


def test_a_candidate_writing_to_fd_1_is_measured(tmp_path):
    """Whatever the worker writes to its stdout, the answers arrive: the run ends and records. Built by
    two processes that write to it too, candidates are measured and timed again side by side:
    test_tuner's test_a_cpu_candidate_is_timed_once_its_round_is_built tunes this cell so."""
    db = Database(tmp_path / "db.jsonl")
    best = tune(Chatty(8, 16), 3, 2, database=db, **SMALL)
    records = db.records()
    assert [r.final for r in records] == [False], records
    assert all(r.error is None for r in records) and best is not None, records


@pytest.mark.parametrize("answer", (b"garbage, not a header", tuner_workers._HEADER.pack(tuner_workers._TAG, 1 << 62)),
                         ids=("malformed", "oversized"))
def test_a_malformed_answer_fails_the_candidate_and_restarts_the_worker(answer):
    with tuner_workers.Worker() as worker:
        worker.close()
        worker.process = subprocess.Popen([sys.executable, "-c", f"import os; os.write(1, {answer!r})"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        worker.started = time.monotonic()
        ms, error = worker.answer(30)
        assert ms is None and error.startswith("the worker's answer was malformed")
        assert worker.process.poll() is None, "a fresh worker was started"


def test_a_jobs_time_starts_once_its_worker_has_started(tmp_path):
    """A worker that takes longer to import than a job's timeout still answers its first job: the
    job's time starts when the worker says it is ready (a restarted worker's 10-12 s of imports on a
    loaded 2-core machine timed out candidates that compile in seconds)."""
    slow_start = ("import sys, time; time.sleep(3); "
                  "from halstm.tuner_workers import _READY, _receive, _send; "
                  "out = open(1, 'wb', closefd=False); _send(out, _READY); "
                  "_receive(sys.stdin.buffer); _send(out, (1.5, None))")
    with tuner_workers.Worker() as worker:
        worker.close()
        worker.process = subprocess.Popen([sys.executable, "-c", slow_start], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, cwd=tmp_path)
        worker.booted = False
        assert worker.run({"a job": 1}, timeout=1) == (1.5, None)


@pytest.mark.parametrize("change, match", [
    ({"steps": 0}, "steps must be a positive integer, got 0"),
    ({"batch": -1}, "batch must be a positive integer, got -1"),
    ({"steps": 2.5}, "steps must be a positive integer, got 2.5"),
    ({"dtype": "float64"}, "dtype must be one of"),
    ({"target": "tpu"}, "unknown target 'tpu'"),
    ({"repeat": 0}, "repeat must be a positive integer, got 0"),
    ({"timeout": 0}, "timeout must be a positive number of seconds, got 0"),
    ({"trials": 0}, "trials must be a positive integer or None, got 0"),
    ({"builders": 0}, "builders must be a positive integer or None, got 0"),
], ids=("steps", "batch", "float-steps", "dtype", "target", "repeat", "timeout", "trials", "builders"))
def test_a_bad_problem_is_refused_before_anything_is_recorded(change, match, tmp_path):
    logged, path = [], tmp_path / "db.jsonl"
    with pytest.raises(ValueError, match=re.escape(match)):
        tune(**{"cell": halstm.LSTM(8, 16), "steps": 3, "batch": 2} | change, database=path, log=logged.append)
    assert not path.exists() and not logged


@pytest.mark.parametrize("flag, value", [("--steps", "0"), ("--batch", "-2"), ("--input-size", "0"),
                                         ("--target", "tpu")])
def test_the_command_refuses_a_bad_problem_before_anything_is_recorded(flag, value, tmp_path, capsys):
    path = tmp_path / "db.jsonl"
    argv = {"--cell": "LSTM", "--input-size": "8", "--hidden-size": "16", "--steps": "3", "--batch": "2",
            "--database": str(path)} | {flag: value}
    assert main(["tune", *[a for item in argv.items() for a in item]]) != 0
    assert flag in capsys.readouterr().err and not path.exists()


def _folder_in_its_place(tmp_path):
    (tmp_path / "db.jsonl").mkdir()
    return tmp_path / "db.jsonl"


def _under_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    return tmp_path / "file" / "db.jsonl"


def _read_only(tmp_path):
    (tmp_path / "db.jsonl").write_text("")
    (tmp_path / "db.jsonl").chmod(0o444)
    return tmp_path / "db.jsonl"


@pytest.mark.parametrize("unwritable", [
    _folder_in_its_place, _under_a_file,
    pytest.param(_read_only, marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")),
], ids=("folder-in-its-place", "under-a-file", "read-only"))
def test_an_unwritable_database_is_refused_before_anything_is_measured(unwritable, tmp_path):
    path = unwritable(tmp_path)
    logged = []
    with pytest.raises(OSError, match=re.escape(str(path))):
        tune(halstm.LSTM(8, 16), 3, 2, database=path, **SMALL | {"log": logged.append})
    assert not logged, "a candidate was measured"
