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
import time
import warnings
from dataclasses import asdict, dataclass, field
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


@dataclass
class Record:
    key: dict
    recipe: str
    knobs: dict
    ms: float | None = None  # median time of one call; None when the candidate failed
    error: str | None = None
    final: bool = False  # timed again at the end of a tuning run, side by side with the other finalists
    when: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))

    @property
    def candidate(self) -> str:
        return candidate_id(self.recipe, self.knobs)


def candidate_id(recipe: str, knobs: dict) -> str:
    return recipe + " " + json.dumps(knobs, sort_keys=True)


class Database:
    def __init__(self, path=None):
        self.path = Path(path) if path is not None else default_path()

    def append(self, record: Record) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(asdict(record), sort_keys=True) + "\n").encode()
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

    def records(self, key: dict | None = None) -> list[Record]:
        if not self.path.exists():
            return []
        lines = self.path.read_bytes().split(b"\n")
        out = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = Record(**json.loads(line))
            except (ValueError, TypeError):
                torn = number == len(lines) or (number == len(lines) - 1 and not lines[-1])
                if not torn:
                    warnings.warn(f"{self.path}:{number}: unreadable record skipped", stacklevel=2)
                continue
            if key is None or record.key == key:
                out.append(record)
        return out

    def best(self, key: dict, recipes: set[str] | None = None) -> Record | None:
        """The fastest successful record for ``key`` (among ``recipes``, if given): ``fastest``."""
        return fastest([r for r in self.records(key) if recipes is None or r.recipe in recipes])

    def nearest_steps(self, key: dict, recipes: set[str] | None = None) -> Record | None:
        """The best record of ``key`` but for its sequence length: at the recorded length nearest
        ``key``'s by ratio (the larger where two are as near). What the knobs choose, the kernels
        of a step and their tiles, does not depend on the number of steps."""
        others = [r for r in self.records() if {**r.key, "steps": key["steps"]} == key
                  and r.key.get("steps") != key["steps"] and (recipes is None or r.recipe in recipes)]
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
