"""Tuning records: append-only JSON lines, one measured candidate a line.

A record's key is the cell (name and hash of its lowered expressions), the shapes, the dtype and the
target (for a GPU: model, architecture, SM count). Appends are one ``write`` on an ``O_APPEND``
descriptor followed by ``fsync``, so concurrent tuners interleave whole lines; a reader skips a torn
last line (a tuner killed mid-write) and any line it cannot parse, and says so.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path


def default_path() -> Path:
    """``$HALSTM_TUNING_DB``, else ``$XDG_CACHE_HOME/halstm/tuning.jsonl`` (``~/.cache`` by default)."""
    if os.environ.get("HALSTM_TUNING_DB"):
        return Path(os.environ["HALSTM_TUNING_DB"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "halstm" / "tuning.jsonl"


def tuning_key(cell, steps: int, batch: int, dtype: str, target, allow_tf32: bool = False) -> dict:
    """What a record is for; ``allow_tf32`` appears only when set (records made before it keep
    their keys)."""
    from .lowering import cell_hash

    return {
        "cell": cell.name,
        "cell_hash": cell_hash(cell),
        "input_size": cell.input_size,
        "hidden_size": cell.hidden_size,
        "steps": steps,
        "batch": batch,
        "dtype": dtype,
        "target": target.key,
    } | ({"allow_tf32": True} if allow_tf32 else {})


class RecordError(ValueError):
    """A tuning record that is malformed: what is wrong with it."""


# The fields of a record's key (``tuning_key``) and their types; the sizes are positive. A key may
# lack some of them (records written by hand, or by an older halstm): such a key matches no problem.
KEY_FIELDS = {"cell": str, "cell_hash": str, "input_size": int, "hidden_size": int, "steps": int, "batch": int,
              "dtype": str, "target": str, "allow_tf32": bool}
SIZES = ("input_size", "hidden_size", "steps", "batch")


@dataclass(frozen=True)
class Record:
    key: dict
    recipe: str
    knobs: dict
    ms: float | None = None  # median time of one call; None when the candidate failed
    error: str | None = None
    final: bool = False  # timed again at the end of a tuning run, side by side with the other finalists
    when: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))
    line: int | None = field(default=None, compare=False)  # where it was read from (``Database.read``)

    @property
    def candidate(self) -> str:
        return candidate_id(self.recipe, self.knobs)

    @classmethod
    def parse(cls, data, line: int | None = None) -> Record:
        """The record a database line's JSON value holds; RecordError naming what is malformed."""
        if not isinstance(data, dict):
            raise RecordError(f"a record is a JSON object, got {_json_type(data)}")
        names = {f.name for f in fields(cls)} - {"line"}
        unknown, missing = set(data) - names, {"key", "recipe", "knobs"} - set(data)
        if unknown or missing:
            raise RecordError(f"unknown field(s) {sorted(unknown)}" if unknown
                              else f"missing field(s) {sorted(missing)}")
        key, recipe, knobs = data["key"], data["recipe"], data["knobs"]
        ms, error, final = data.get("ms"), data.get("error"), data.get("final", False)
        if not isinstance(key, dict):
            raise RecordError(f"key: expected an object, got {_json_type(key)}")
        for name, value in key.items():
            want = KEY_FIELDS.get(name)
            if not (_is_scalar(value) if want is None else type(value) is want):
                raise RecordError(f"key {name!r}: expected {want.__name__ if want else 'a JSON scalar'}, got {value!r}")
            if name in SIZES and value < 1:
                raise RecordError(f"key {name!r}: expected a positive integer, got {value!r}")
        if not isinstance(recipe, str) or not recipe:
            raise RecordError(f"recipe: expected a name, got {recipe!r}")
        if not isinstance(knobs, dict):
            raise RecordError(f"knobs: expected an object of knob values, got {_json_type(knobs)}")
        bad = {name: value for name, value in knobs.items() if not _is_scalar(value)}
        if bad:
            raise RecordError(f"knobs: expected JSON scalars, got {bad}")
        if ms is not None and not (type(ms) in (int, float) and 0 < ms <= sys.float_info.max):
            raise RecordError(f"ms: expected a positive number of milliseconds or null (failed), got {ms!r}")
        if error is not None and not isinstance(error, str):
            raise RecordError(f"error: expected a message or null, got {error!r}")
        if type(final) is not bool:
            raise RecordError(f"final: expected true or false, got {final!r}")
        if not isinstance(data.get("when", ""), str):
            raise RecordError(f"when: expected a time stamp, got {data['when']!r}")
        return cls(**{**data, "ms": None if ms is None else float(ms)}, line=line)

    def to_json(self) -> str:
        """The record as ``parse`` reads it: one line of JSON, without its line number."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if f.name != "line"}, sort_keys=True)


def _is_scalar(value) -> bool:
    return value is None or type(value) in (str, int, float, bool)


def _json_type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def candidate_id(recipe: str, knobs: dict) -> str:
    return recipe + " " + json.dumps(knobs, sort_keys=True)


class Database:
    def __init__(self, path=None):
        self.path = Path(path) if path is not None else default_path()

    def append(self, record: Record) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (record.to_json() + "\n").encode()
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a torn line: end it, so it does not swallow this record
                    line = b"\n" + line
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self) -> tuple[list[Record], list[str]]:
        """Every well-formed record in the order written (each with its ``line``), and for each other
        line but a torn last one (a tuner killed mid-write) why it was skipped: "PATH:LINE: unreadable
        record skipped: why". No database file: none of either. A file that cannot be read raises
        OSError."""
        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return [], []
        records, problems = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                records.append(Record.parse(json.loads(line), number))
            except RecordError as e:
                problems.append(f"{self.path}:{number}: unreadable record skipped: {e}")
            except (ValueError, RecursionError) as e:  # not JSON (or UTF-8), or nested past the parser's depth
                torn = number == len(lines) or (number == len(lines) - 1 and not lines[-1])
                if not torn:
                    problems.append(f"{self.path}:{number}: unreadable record skipped: not JSON ({e})")
        return records, problems

    def records(self, key: dict | None = None) -> list[Record]:
        """The records of ``key`` (all, without one) as ``read``, warning of each line skipped."""
        records, problems = self.read()
        for problem in problems:
            warnings.warn(problem, stacklevel=2)
        return [r for r in records if key is None or r.key == key]

    def best(self, key: dict, recipes: set[str] | None = None) -> Record | None:
        """``best(self.records(), key, recipes)``."""
        return best(self.records(), key, recipes)

    def nearest_steps(self, key: dict, recipes: set[str] | None = None) -> Record | None:
        """``nearest_steps(self.records(), key, recipes)``."""
        return nearest_steps(self.records(), key, recipes)


def best(records: list[Record], key: dict, recipes: set[str] | None = None) -> Record | None:
    """The fastest successful one of ``records`` for ``key`` (among ``recipes``, if given): ``fastest``."""
    return fastest([r for r in records if r.key == key and (recipes is None or r.recipe in recipes)])


def nearest_steps(records: list[Record], key: dict, recipes: set[str] | None = None) -> Record | None:
    """The best of ``records`` for ``key`` but for its sequence length: at the recorded length
    nearest ``key``'s by ratio (the larger where two are as near). What the knobs choose, the kernels
    of a step and their tiles, does not depend on the number of steps."""
    others = [r for r in records if "steps" in r.key and r.key["steps"] != key["steps"]
              and {**r.key, "steps": key["steps"]} == key and (recipes is None or r.recipe in recipes)]
    if not others:
        return None
    steps = min({r.key["steps"] for r in others}, key=lambda s: (abs(math.log(s / key["steps"])), -s))
    return fastest([r for r in others if r.key["steps"] == steps])


def fastest(records: list[Record]) -> Record | None:
    """The fastest successful one of one key's records, in the order written: of the finalists
    where the records end with a tuning run's side-by-side timing of them (``tuner.runoff``), which
    rank candidates whose separate timings differ by noise; else of all."""
    measured = [r for r in records if r.ms is not None]
    finals = list(itertools.takewhile(lambda r: r.final, reversed(measured)))
    return min(finals or measured, key=lambda r: r.ms, default=None)
