"""Bad tuning records: a malformed line, knobs the recipe does not have or cannot run, a database that
cannot be read. Compiling passes each over with one warning naming the database and uses the
defaults; reading the database lists the good records and why each bad line was skipped."""

import json
import os
import re
import warnings

import pytest

import halstm
from halstm import targets
from halstm.database import Database, Record, RecordError, tuning_key
from halstm.lowering import lower
from halstm.schedules import CpuStepLoop
from conftest import TOLERANCE, random_inputs, rel_err

CELL = halstm.LSTM(8, 16)
T, B = 3, 2
GOOD_KNOBS = {"rows": 2, "vectors": 1, "panel": 32}


def key(steps=T, **change):
    return tuning_key(CELL, steps, B, "float32", targets.resolve("cpu")) | change


def line(for_key=None, recipe="cpu-step-loop", knobs=GOOD_KNOBS, ms=1.0, **more) -> dict:
    """A record as JSON would hold it (for CELL at T, B by default)."""
    return {"key": key() if for_key is None else for_key, "recipe": recipe, "knobs": knobs, "ms": ms, **more}


def defaults():
    return CpuStepLoop().defaults(lower(CELL, T, B, "float32"), targets.resolve("cpu"))


def compile_warning(path, rng):
    """Compile CELL with the database at ``path`` ($HALSTM_TUNING_DB): the function, checked against
    the reference, and the one warning that names ``path``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = halstm.compile(CELL, T, B)
    x, params, states = random_inputs(CELL, T, B, rng)
    y, _ = f(x, params, states)
    assert rel_err(y, halstm.reference(CELL, x, params, states)[0]) < TOLERANCE["float32"]
    named = [str(w.message) for w in caught if str(path) in str(w.message)]
    assert len(named) == 1, named
    return f, named[0]


BAD = {
    "no rows": line(knobs={"rows": 0, "vectors": 2, "panel": 64}),  # ZeroDivisionError
    "a million rows": line(knobs={"rows": 1000000, "vectors": 2, "panel": 64}),  # a minute's compile
    "no rows at another length": line(key(steps=6), knobs={"rows": 0, "vectors": 2, "panel": 64}),
    "ms not a number": line(ms="fast"),
    "knobs null": line(knobs=None),
    "key not an object": line(["LSTM", T, B]),
    "failed at T=0": line(key(steps=0), ms=None, error="timed out"),  # the nearest-T rule took log(0)
}


@pytest.mark.parametrize("record", BAD.values(), ids=BAD)
def test_a_bad_record_is_passed_over_with_one_warning(record, tmp_path, monkeypatch, rng):
    path = tmp_path / "tuning.jsonl"
    path.write_text(json.dumps(record) + "\n")
    monkeypatch.setenv("HALSTM_TUNING_DB", str(path))
    f, warning = compile_warning(path, rng)
    assert f.record is None and f.knobs == defaults()
    assert warning.startswith(f"{path}:1: ")


def test_a_bad_line_beside_good_records_leaves_them_usable(tmp_path, monkeypatch, rng):
    path = tmp_path / "tuning.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (line(ms=2.0), line(knobs=defaults(), ms="fast"))))
    monkeypatch.setenv("HALSTM_TUNING_DB", str(path))
    f, warning = compile_warning(path, rng)
    assert (f.record.ms, f.record.line, f.knobs) == (2.0, 1, GOOD_KNOBS)
    assert warning == (f"{path}:2: unreadable record skipped: ms: expected a positive number of milliseconds or "
                       f"null (failed), got 'fast'")


def test_a_database_that_is_a_directory_is_passed_over(tmp_path, monkeypatch, rng):
    path = tmp_path / "tuning.jsonl"
    path.mkdir()
    monkeypatch.setenv("HALSTM_TUNING_DB", str(path))
    f, warning = compile_warning(path, rng)
    assert f.record is None and "cannot be read" in warning


def test_a_database_without_read_permission_is_passed_over(tmp_path, monkeypatch, rng):
    path = tmp_path / "tuning.jsonl"
    path.write_text(json.dumps(line()) + "\n")
    path.chmod(0)
    if os.access(path, os.R_OK):
        pytest.skip("this user reads files whatever their permissions (root)")
    monkeypatch.setenv("HALSTM_TUNING_DB", str(path))
    f, warning = compile_warning(path, rng)
    assert f.record is None and "cannot be read" in warning


def test_nn_passes_a_bad_record_over(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import halstm.nn

    path = tmp_path / "tuning.jsonl"
    path.write_text(json.dumps(line(knobs={"rows": 0, "vectors": 2, "panel": 64})) + "\n")
    monkeypatch.setenv("HALSTM_TUNING_DB", str(path))
    monkeypatch.setattr(halstm.nn, "_COMPILED", {})
    ours, theirs = halstm.nn.LSTM(8, 16).eval(), torch.nn.LSTM(8, 16).eval()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(T, B, 8)
    with pytest.warns(UserWarning, match="does not run here; using the defaults") as caught:
        y = ours(x)[0]
    assert sum(str(path) in str(w.message) for w in caught) == 1
    assert rel_err(y.detach().numpy(), theirs(x)[0].detach().numpy()) < TOLERANCE["float32"]


MALFORMED = {
    "not an object": ([1, 2], "a record is a JSON object, got an array"),
    "unknown field": (line(speed=3), "unknown field(s) ['speed']"),
    "no knobs": ({"key": {}, "recipe": "r"}, "missing field(s) ['knobs']"),
    "steps 0": (line(key(steps=0)), "key 'steps': expected a positive integer, got 0"),
    "batch a string": (line(key(batch="2")), "key 'batch': expected int, got '2'"),
    "tf32 a number": (line(key(allow_tf32=1)), "key 'allow_tf32': expected bool, got 1"),
    "recipe null": (line(recipe=None), "recipe: expected a name, got None"),
    "knob a list": (line(knobs={"rows": [4]}), "knobs: expected JSON scalars, got {'rows': [4]}"),
    "ms zero": (line(ms=0), "ms: expected a positive number of milliseconds or null (failed), got 0"),
    "ms infinite": (line(ms=float("inf")), "got inf"),
    "ms true": (line(ms=True), "got True"),
    "error a number": (line(ms=None, error=3), "error: expected a message or null, got 3"),
    "final a string": (line(final="yes"), "final: expected true or false, got 'yes'"),
}


@pytest.mark.parametrize("data, message", MALFORMED.values(), ids=MALFORMED)
def test_parse_names_what_is_malformed(data, message):
    with pytest.raises(RecordError, match=re.escape(message)):
        Record.parse(data)


def test_parse_reads_what_the_tuner_writes():
    for record in (Record(key(), "cpu-step-loop", GOOD_KNOBS, 1.5),
                   Record(key(), "cpu-step-loop", GOOD_KNOBS, error="timed out"),
                   Record(key(), "cpu-step-loop", GOOD_KNOBS, 1.2, final=True)):
        assert Record.parse(json.loads(record.to_json()), 7) == record
    assert Record.parse(line(ms=2), 7).ms == 2.0 and Record.parse(line(), 7).line == 7


def test_read_lists_good_records_and_why_each_bad_line_was_skipped(tmp_path):
    """What ``halstm info`` lists: never an exception for a line, the torn last one said nothing of."""
    db = Database(tmp_path / "db.jsonl")
    db.path.write_text("".join(json.dumps(r) + "\n" for r in BAD.values()) + json.dumps(line()) + "\n"
                       + "{not json\n" + '{"key": {"cell": "LS')
    records, problems = db.read()
    assert [(r.line, r.knobs) for r in records] == [(1, BAD["no rows"]["knobs"]), (2, BAD["a million rows"]["knobs"]),
                                                    (3, BAD["no rows at another length"]["knobs"]), (8, GOOD_KNOBS)]
    assert [p.split(": ")[0] for p in problems] == [f"{db.path}:{n}" for n in (4, 5, 6, 7, 9)]
    assert all(": unreadable record skipped: " in p for p in problems)
    assert Database(tmp_path / "none.jsonl").read() == ([], [])
    with pytest.raises(IsADirectoryError):
        Database(tmp_path).read()


class WidePanel(CpuStepLoop):
    """A recipe whose default is outside its knob's candidates, as the CUDA recipes' can be."""

    name = "wide-panel"

    def defaults(self, program, target, switches=None):
        return {**super().defaults(program, target, switches), "panel": 48}


@pytest.mark.parametrize("knobs, why", [
    ({"rows": 4}, None),
    ({"panel": 48}, None),  # the default
    ({"rows": 4.0}, "knob rows=4.0 is neither one of (4, 2, 6, 8) nor the default 4"),
    ({"rows": True}, "knob rows=True is neither one of (4, 2, 6, 8) nor the default 4"),
    ({"panel": 40}, "knob panel=40 is neither one of (64, 32, 128, 256) nor the default 48"),
    ({"tiles": 3}, "recipe 'wide-panel' has no knob(s) ['tiles']"),
    ({"rows": 8, "vectors": 4}, None),  # runs, though the tuner does not measure it (valid: registers spill)
])
def test_check_knobs(knobs, why):
    assert WidePanel().check_knobs(lower(CELL, T, B, "float32"), targets.resolve("cpu"), knobs) == why
