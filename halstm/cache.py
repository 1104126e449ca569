"""An on-disk cache of compiled modules: a second process that compiles the same problem loads it.

Entries live in ``$HALSTM_CACHE_DIR``, else ``$XDG_CACHE_HOME/halstm/modules`` (``~/.cache`` by
default); ``HALSTM_CACHE=0`` turns the cache off. An entry is named by the SHA-256 of its key, a
canonical JSON of: the kind (forward or backward), the SHA-256 of the lowered, unscheduled
program's TVMScript (the cell's expressions with T, B, dtype, sizes and weight layout: what
``lowering.cell_hash`` hashes at T=B=1),
the cell's name, T, B, dtype, sizes, ``allow_tf32``, the target (``deploy``'s sidecar fields: key,
LLVM triple, -mcpu, -mattr, CPU extensions; GPU architecture and instruction set), the recipe's
name and resolved knobs (a tuning record that changes them changes the key), the halstm and TVM
versions and a SHA-256 of halstm's sources and the recipe's file (an edited recipe misses).

A forward entry is ``halstm.export``'s module and sidecar, read back with ``halstm.load`` (which
checks the module's size and SHA-256 before opening it); a backward entry, whose module holds three
functions, the module and a sidecar of its size, SHA-256, key and scratch buffers. Each file is written to a
temporary name and renamed (the module first), so processes compiling at once each write whole
files and a reader never opens a partial one. An entry refused on load (``ModuleRefused``,
``OSError``: truncated, changed, missing its sidecar) is deleted and built again. A write that
fails (a read-only folder) warns once; the function is still returned.

What a hit skips, measured with cProfile on the 2-core CPU machine, LSTM I=H=256 T=50 B=16:
the forward's 1.76 s were 1.15 s of ``recipe.apply`` (0.7 s of it parsing the lowered TVMScript),
0.28 s of ``target.build`` and 0.09 s of lowering; the backward's 4.64 s, 2.44 s of scheduling
and 2.05 s of building. Caching ``target.build`` alone would save 16% and 44%, so a hit skips
scheduling and building both: it lowers and loads. The recipe, knobs and layout chosen for a
problem are kept beside the modules too (``decided``), so that a hit does not choose them again (the
persistent kernel's recipe analyses the step's IR to choose). It returns ``CachedCell`` / ``CachedBackward``: the loaded
functions with ``compile``'s ``program``, ``target``, ``recipe``, ``knobs`` and ``record``;
``schedule``/``schedules`` and the forward's ``module`` (which ``export`` needs: a loaded module
cannot be exported again) are built on first access.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from dataclasses import asdict
from pathlib import Path

import tvm
import tvm_ffi

from . import deploy
from .cell import BUILD_LOCK
from .compiler import CompiledCell
from .gradients import CompiledBackward
from .lowering import cell_hash
from .runtime import Arg, SequenceFunction, check_dimension

FORMAT = 2  # of a backward entry's sidecar
stats = {"hits": 0, "misses": 0}  # this process's lookups, for tests and diagnostics
_warned = False  # a failed write warns once a process


def folder() -> Path:
    """``$HALSTM_CACHE_DIR``, else ``$XDG_CACHE_HOME/halstm/modules`` (``~/.cache`` by default)."""
    if os.environ.get("HALSTM_CACHE_DIR"):
        return Path(os.environ["HALSTM_CACHE_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "halstm" / "modules"


def enabled() -> bool:
    return os.environ.get("HALSTM_CACHE", "1") != "0"


def forward(program, target, recipe, knobs: dict, record, build) -> CompiledCell:
    """``build()``'s ``CompiledCell`` for ``program`` scheduled by ``recipe`` with ``knobs``, from
    the cache where an entry is there, else built and stored."""
    key = _key("forward", [program], target, recipe, knobs)
    return _cached(key, build, deploy.export,
                   lambda path: CachedCell(program, target, recipe, knobs, record, deploy.load(path), path, build))


def backward(program, target, recipe, knobs: dict, adjoint, build) -> CompiledBackward:
    """``build()``'s ``CompiledBackward`` for the ``BackwardProgram`` ``program``, as ``forward``
    (its reversed loop ``adjoint``, compiled and cached as a forward)."""
    key = _key("backward", list(program.functions.values()), target, recipe, knobs)
    key["steps"] = program.steps  # the functions' own are one step over all rows; None: any T

    def store(compiled, path):
        deploy._write_atomically(path, lambda tmp: compiled.module.export_library(str(tmp)))
        meta = {"format": FORMAT, "size": path.stat().st_size, "sha256": deploy._sha256(path), "key": key,
                "scratch": {name: [asdict(a) for a in args] for name, args in compiled.scratch.items()}}
        deploy._write_atomically(deploy.sidecar(path), lambda tmp: tmp.write_text(json.dumps(meta) + "\n"))

    def load(path):
        meta = _backward_meta(path, key)
        deploy._check_file(path, meta)
        if target.kind == "cuda":
            deploy._compile_kernels_for(target.isa)
        return CachedBackward(program, target, recipe, knobs, tvm_ffi.load_module(str(path)), adjoint,
                              _scratch(meta, path), path, build)

    return _cached(key, build, store, load)


def decided(program, target, question: dict, decide, usable=lambda answer: True) -> dict:
    """``decide()``'s answer (a JSON object) to ``question`` (a JSON object) about ``program`` on
    ``target``, kept in the cache: the recipe, knobs and layout ``halstm.compile`` chooses before it
    lowers the program, which a cache hit would otherwise pay before loading anything. Keyed by the
    cell (``lowering.cell_hash``), the problem's sizes and options, the target, the versions and
    halstm's code; an entry that cannot be read, is not for this key or whose answer
    is not ``usable`` is decided again and replaced. Not kept where ``decide`` raises or its answer
    does not come back from JSON as it was (a registered recipe's knobs of other types)."""
    if not enabled():
        return decide()
    key = {"kind": "decision", "question": question, "cell_hash": cell_hash(program.cell), **_problem(program, target),
           "halstm": deploy._halstm_version(), "tvm": tvm.__version__, "code": _code(None)}
    key = json.loads(json.dumps(key, sort_keys=True, default=repr))  # as read back
    path = _entry(key, ".decision.json")
    try:
        entry = json.loads(path.read_text())
        if (isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("answer"), dict)
                and usable(entry["answer"])):
            return entry["answer"]
    except (OSError, ValueError):
        pass
    answer = decide()
    try:
        entry = json.dumps({"key": key, "answer": answer}, sort_keys=True)
    except (TypeError, ValueError):  # a registered recipe's knobs that JSON does not hold: decided each time
        return answer
    if json.loads(entry)["answer"] != answer:  # tuples would come back as lists
        return answer
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        deploy._write_atomically(path, lambda tmp: tmp.write_text(entry + "\n"))
    except OSError as error:
        _warn_unwritable(path, error)
    return answer


def _cached(key: dict, build, store, load):
    """The entry for ``key`` loaded, else ``build()`` stored; an entry ``load`` refuses is deleted."""
    if not enabled():
        return build()
    path = _entry(key, ".so")
    if path.exists():
        try:
            compiled = load(path)
        except (deploy.ModuleRefused, OSError):
            for stale in (path, deploy.sidecar(path)):
                stale.unlink(missing_ok=True)
        else:
            stats["hits"] += 1
            return compiled
    stats["misses"] += 1
    compiled = build()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        store(compiled, path)
    except OSError as error:
        _warn_unwritable(path, error)
    return compiled


def _entry(key: dict, suffix: str) -> Path:
    """The path of the entry for ``key``: the SHA-256 of its canonical JSON, and ``suffix``."""
    return folder() / (_sha256(json.dumps(key, sort_keys=True, separators=(",", ":"))) + suffix)


def _warn_unwritable(path: Path, error: OSError) -> None:
    """Warn once a process that entries cannot be written where ``path`` would go."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"{path.parent}: compiled modules cannot be cached there ({error.strerror or error}); "
                      "set HALSTM_CACHE_DIR to a writable folder, or HALSTM_CACHE=0", stacklevel=4)


def _backward_meta(path: Path, key: dict) -> dict:
    """A backward entry's sidecar, refused unless it is one, for ``key``."""
    meta_path = deploy.sidecar(path)
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as error:
        raise deploy.ModuleRefused(f"{meta_path}: not a JSON sidecar ({error})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("key") != key:
        raise deploy.ModuleRefused(f"{meta_path}: not a backward entry of format {FORMAT} for this key")
    if not isinstance(meta.get("size"), int) or not isinstance(meta.get("sha256"), str):
        raise deploy.ModuleRefused(f"{meta_path}: size and sha256: expected an int and a str")
    return meta


def _scratch(meta: dict, path: Path) -> dict[str, tuple[Arg, ...]]:
    """A backward entry's scratch buffers by function (``halstm.scratch``), refused unless well formed."""
    try:
        scratch = {name: tuple(Arg.from_json(a) for a in args) for name, args in meta["scratch"].items()}
        for args in scratch.values():
            for a in args:
                for d in a.shape:
                    check_dimension(d, follows_steps=True)
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise deploy.ModuleRefused(f"{deploy.sidecar(path)}: scratch: {error!r}") from None
    return scratch


def _key(kind: str, programs: list, target, recipe, knobs: dict) -> dict:
    return {
        "kind": kind, "program": _sha256("\n".join(p.source for p in programs)), **_problem(programs[0], target),
        "recipe": recipe.name, "lifts_scratch": bool(getattr(target, "lifts_scratch", False)),
        # JSON keeps knob types apart (1, 1.0 and true differ), as check_knobs does
        "knobs": json.loads(json.dumps(knobs, sort_keys=True, default=repr)),
        "halstm": deploy._halstm_version(), "tvm": tvm.__version__, "code": recipe_code(recipe),
    }


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _problem(program, target) -> dict:
    """A program's sizes and options, and the target's sidecar fields."""
    cell = program.cell
    return {"cell": cell.name, "steps": program.steps, "batch": program.batch, "dtype": program.dtype, "input_size": cell.input_size,
            "hidden_size": cell.hidden_size, "allow_tf32": program.allow_tf32, "target": deploy._target_meta(target)}


def recipe_code(recipe) -> str:
    """The SHA-256 of halstm's sources and of the file defining ``recipe`` (``_code``)."""
    return _code(_file_of(recipe))


def _file_of(recipe) -> str | None:
    """The file defining the recipe's class, from its methods' code (a class of a script that was
    run, not imported, has no module in sys.modules); None where Python keeps no file."""
    for value in vars(type(recipe)).values():
        code = getattr(value, "__code__", None)
        if code is not None and os.path.isfile(code.co_filename):
            return code.co_filename
    return None


@functools.cache
def _code(recipe_file: str | None) -> str:
    """The SHA-256 of halstm's sources (the halstm, schedules and targets packages) and of the file
    defining the recipe: an edit between two versions misses."""
    from halstm import schedules, targets

    roots = [Path(__file__).parent, Path(schedules.__file__).parent, Path(targets.__file__).parent]
    files = sorted({f for root in roots for f in root.glob("*.py")} | ({Path(recipe_file)} if recipe_file else set()))
    digest = hashlib.sha256()
    for f in files:
        if f.is_file():
            digest.update(f"{f.name}\0".encode() + f.read_bytes() + b"\0")
    return digest.hexdigest()


class _Rebuilt:
    """What a cache hit skipped, built on first access (``_build``: the compiler's own build)."""

    @functools.cached_property
    def _built(self):
        with BUILD_LOCK:
            return self._build()


class CachedCell(_Rebuilt, CompiledCell):
    """``halstm.compile``'s result loaded from the cache entry ``cached`` (a path). ``schedule`` and
    ``module`` are built on first access."""

    def __init__(self, program, target, recipe, knobs: dict, record, loaded, cached: Path, build):
        SequenceFunction.__init__(self, loaded._main, loaded.signature, loaded._device)
        self.program, self.target, self.recipe, self.knobs, self.record = program, target, recipe, knobs, record
        self.cached, self._build = cached, build

    schedule = property(lambda self: self._built.schedule)
    module = property(lambda self: self._built.module)


class CachedBackward(_Rebuilt, CompiledBackward):
    """``compile_backward``'s result loaded from the cache entry ``cached`` (a path). ``schedules``
    are built on first access."""

    def __init__(self, program, target, recipe, knobs: dict, module, adjoint, scratch: dict, cached: Path, build):
        self.program, self.target, self.recipe, self.knobs, self.module = program, target, recipe, knobs, module
        self.adjoint, self.scratch, self.cached, self._build = adjoint, scratch, cached, build

    schedules = property(lambda self: self._built.schedules)
