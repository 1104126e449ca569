"""The ``halstm`` command: bench, tune, export, info.

TVM, torch and NumPy are imported inside the command that runs, so that ``--help`` and a mistake
in the arguments answer at once. An error is one line on stderr (``--debug``: its traceback), exit
status 2 for a mistake in the command line, 1 for a failure while running.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from . import bench

CELL_HELP = ("a built-in cell such as LSTM or GRU (a wrong name lists them all), or your own: module:Class "
             "(a module in the current folder or installed) or path/to/file.py:Class")


class CliError(Exception):
    """An error explained in one line: ``status`` 2 for a mistake in the command line, 1 otherwise."""

    def __init__(self, message: str, status: int = 2):
        super().__init__(message)
        self.status = status


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise CliError(f"{message} (see {self.prog} --help)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _steps(text: str) -> int | None:
    """A sequence length, or "any": a function for every length (``halstm.compile(cell, None, B)``)."""
    if text == "any":
        return None
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or any, got {text!r}") from None


def _shape(text: str) -> tuple[int, int, int]:
    values = text.split(",")
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected T,B,H (three positive integers), got {text!r}")
    return tuple(_positive(v) for v in values)


def _add_problem(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cell", required=True, help=CELL_HELP)
    p.add_argument("--input-size", type=_positive, required=True, help="I: features of x")
    p.add_argument("--hidden-size", type=_positive, required=True, help="H: size of each state")
    p.add_argument("--steps", type=_steps, required=True,
                   help='T: sequence length compiled for; "any" (export): a module for every length')
    p.add_argument("--batch", type=_positive, required=True, help="B: sequences per call")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--target", default="cpu", choices=["cpu", "cuda"], help="cpu (default) or cuda")
    p.add_argument("--allow-tf32", action="store_true",
                   help="float32 GEMMs on tensor cores as TF32 (CUDA, sm_80+; relative error ~1e-3)")
    p.add_argument("--database", type=Path, default=None,
                   help="tuning records (default: $HALSTM_TUNING_DB or ~/.cache/halstm/tuning.jsonl)")


def _builtin(name: str):
    from .cells import BUILTIN

    if name not in BUILTIN:
        raise CliError(f"unknown cell {name!r}: the built-in cells are {', '.join(sorted(BUILTIN))}; "
                       "your own is module:Class or path/to/file.py:Class")
    return BUILTIN[name]


def _cell_class(text: str):
    """The cell class that --cell names: a built-in one, module:Class or path/to/file.py:Class."""
    where, colon, name = text.rpartition(":")
    if not colon:
        return _builtin(text)
    file = Path(where)
    if file.suffix == ".py":
        if not file.is_file():
            raise CliError(f"--cell {text}: {file} does not exist")
        folder, module = str(file.resolve().parent), file.stem
    else:
        folder, module = os.getcwd(), where
    sys.path.insert(0, folder)  # for this import only
    try:
        found = importlib.import_module(module)
    except Exception as e:
        if isinstance(e, ModuleNotFoundError) and e.name and (module + ".").startswith(e.name + "."):
            raise CliError(f"--cell {text}: no module {module!r} in the current folder or installed") from e
        raise CliError(f"--cell {text}: importing {module} failed: {_last_line(e)}", 1) from e
    finally:
        sys.path.remove(folder)
    import cloudpickle

    from .cell import Cell

    cls = getattr(found, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Cell)):
        raise CliError(f"--cell {text}: {found.__file__} has no Cell subclass {name!r}")
    cloudpickle.register_pickle_by_value(found)  # tune's workers lack the folder on their import path
    return cls


def _target(name: str):
    """The target --target names, or an error that says what to pass without a GPU."""
    from halstm import targets

    if name == "cuda":
        import tvm

        if not tvm.cuda(0).exist:
            raise CliError("--target cuda: no CUDA GPU was found on this machine; "
                           "use --target cpu, or run where TVM sees a GPU", 1)
    return targets.resolve(name)


def _writable_folder(folder: Path, option: str) -> None:
    """Fail before any work unless ``option``'s output can go in ``folder``."""
    if not folder.is_dir():
        raise CliError(f"{option}: {folder} is not a folder" if folder.exists() else
                       f"{option}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CliError(f"{option}: folder {folder} is not writable")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="halstm", description="Recurrent cells written as math, compiled by TVM.")
    debug = "print an error's traceback, not its one-line message"
    parser.add_argument("--debug", action="store_true", help=debug)
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench", help="compile built-in cells, check them, time them against PyTorch and NumPy",
        description="Compiles each cell at each shape, checks it against the float64 reference, times "
        "it side by side with torch.nn.LSTM/GRU and a NumPy loop (medians after warm-up), prints a "
        "markdown table and writes it with a plot to --out.",
    )
    b.add_argument("--target", default="cpu", choices=["cpu", "cuda"], help="cpu (default) or cuda")
    b.add_argument("--cells", nargs="+", default=list(bench.DEFAULT_CELLS), metavar="CELL",
                   help=f"built-in cells (default: {' '.join(bench.DEFAULT_CELLS)})")
    b.add_argument("--shapes", nargs="+", type=_shape, default=list(bench.DEFAULT_SHAPES),
                   metavar="T,B,H", help="sequence length, batch, input=hidden size")
    b.add_argument("--repeat", type=_positive, default=5, help="timed runs per measurement (median)")
    b.add_argument("--threads", type=_positive, default=None,
                   help="threads for each contender, each timed in a process of its own (default: all cores)")
    b.add_argument("--out", type=Path, default=Path("bench-results"), help="where the table and plot go")
    b.set_defaults(run=_bench)

    t = sub.add_parser(
        "tune", help="search recipes and knobs for one cell and shape; record them",
        description="Measures candidate schedules (recipe x knobs) on this machine, each checked against "
        "the float64 reference, and appends every result to the tuning database. Interrupted, it "
        "resumes where it stopped. halstm.compile and halstm export then use the best record.",
    )
    _add_problem(t)
    t.add_argument("--trials", type=_positive, default=24, help="candidates to try in all (default 24)")
    t.add_argument("--timeout", type=float, default=300, help="seconds before a candidate counts as hung")
    t.add_argument("--builders", type=_positive, default=None,
                   help="processes compiling candidates at once, each timed as soon as it is built "
                   "(default: the CPU's cores less one a measuring GPU; 1: each compiled as it is timed)")
    t.add_argument("--gpus", type=_gpus, default=None,
                   help="CUDA: the GPUs that time candidates at once: all, or indices such as 0,1 (of one kind; "
                   "default: the first)")
    t.add_argument("--training", action="store_true",
                   help="also tune the backward's reversed time loop (recorded under its own key; "
                   "halstm.nn and compile_backward use it), --trials candidates each")
    t.set_defaults(run=_tune)

    e = sub.add_parser(
        "export", help="compile one cell and shape to a module file for deployment",
        description="Compiles (with the best tuning record, if any) and writes OUT plus OUT.json, its "
        "metadata. halstm.load(OUT) runs it with the TVM runtime alone.",
    )
    _add_problem(e)
    e.add_argument("-o", "--out", type=Path, required=True, help="the module file to write (e.g. lstm.so)")
    e.set_defaults(run=_export)

    i = sub.add_parser("info", help="what an exported module or a tuning database holds",
                       description="For a module: its metadata. For a .jsonl database: each tuned "
                       "problem with its best record and how many candidates were measured.")
    i.add_argument("path", type=Path)
    i.set_defaults(run=_info)

    for command in (b, t, e, i):  # also accepted after the command
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug)
    return parser


def _last_line(e: BaseException) -> str:
    """``e`` in one line: its type and the last line of its message (where TVM's errors say what)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1]}" if lines else type(e).__name__


def main(argv=None) -> int:
    args = None
    try:
        args = _parser().parse_args(argv)
        return args.run(args)
    except Exception as e:
        if args is not None and args.debug:
            traceback.print_exc()
        elif isinstance(e, CliError):
            print(f"halstm: error: {e}", file=sys.stderr)
        else:
            print(f"halstm: error: {_last_line(e)} (--debug shows the traceback)", file=sys.stderr)
        return e.status if isinstance(e, CliError) else 1


def _problem(args):
    """The cell and target of tune's and export's arguments."""
    return _cell_class(args.cell)(args.input_size, args.hidden_size), _target(args.target)


def _bench(args) -> int:
    for name in args.cells:
        _builtin(name)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"--out: cannot make folder {args.out}: {e.strerror}") from e
    _writable_folder(args.out, "--out")
    target = _target(args.target)
    print(bench.HEADER)
    rows = bench.run(args.cells, args.shapes, target, args.repeat, threads=args.threads)
    (args.out / "results.md").write_text(bench.report(rows, args.threads))
    bench.plot(rows, args.out / "results.png")
    print(f"\nwrote {args.out / 'results.md'} and {args.out / 'results.png'}")
    return 0


def _gpus(text: str):
    """--gpus: "all", or comma-separated device indices."""
    if text == "all":
        return text
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'all' or indices such as 0,1, got {text!r}") from None


def _tune(args) -> int:
    if args.steps is None:
        raise CliError("tune times one sequence length: give --steps a number (a function for any length "
                       "uses the record of the length nearest to 100)")
    cell, target = _problem(args)
    from .tuner import tune, tune_training

    search = dict(database=args.database, trials=args.trials, timeout=args.timeout, builders=args.builders,
                  allow_tf32=args.allow_tf32, gpus=args.gpus)
    if args.training:
        found = zip(("forward", "reversed loop"), tune_training(cell, args.steps, args.batch, args.dtype, target,
                                                                  **search))
    else:
        found = [("best", tune(cell, args.steps, args.batch, args.dtype, target, **search))]
    for what, best in found:
        if best is None:
            raise CliError(f"{what}: no candidate succeeded (the failures are listed above)", 1)
        print(f"{what}: {best.recipe} {best.knobs} {best.ms:.3f} ms")
    return 0


def _export(args) -> int:
    if args.out.is_dir():
        raise CliError(f"-o {args.out} is a folder: give the module file to write, e.g. {args.out / 'cell.so'}")
    _writable_folder(args.out.parent, f"-o {args.out}")
    cell, target = _problem(args)
    from .compiler import compile as compile_cell
    from .deploy import export

    f = compile_cell(cell, args.steps, args.batch, args.dtype, target, database=args.database,
                     allow_tf32=args.allow_tf32)
    export(f, args.out)
    source = "defaults" if f.record is None else f"tuning record of T={f.record.key['steps']}, {f.record.ms:.3f} ms"
    print(f"wrote {args.out} and {args.out}.json: {f!r} ({source})")
    return 0


def _info(args) -> int:
    if not args.path.exists():
        raise CliError(f"{args.path} does not exist")
    from .database import Database, fastest
    from .deploy import read_meta

    if args.path.suffix == ".jsonl":
        records, unreadable = Database(args.path).read()
        for line in unreadable:
            print(line, file=sys.stderr)
        problems: dict[str, list] = {}
        for r in records:
            problems.setdefault(json.dumps(r.key, sort_keys=True), []).append(r)
        print(f"{args.path}: {len(records)} records, {len(problems)} problems")
        for _, mine in sorted(problems.items()):
            k = mine[0].key
            head = (f"{k.get('cell')} I={k.get('input_size')} H={k.get('hidden_size')} T={k.get('steps')} "
                    f"B={k.get('batch')} {k.get('dtype')} on {k.get('target')}")
            best, tried = fastest(mine), [r for r in mine if not r.final]
            failed, finals = sum(r.ms is None for r in tried), len(mine) - len(tried)
            verdict = f"best {best.ms:.3f} ms: {best.recipe} {best.knobs}" if best else "no success"
            again = f", {finals} timed again side by side" if finals else ""
            print(f"  {head}: {len(tried)} measured ({failed} failed){again}, {verdict}")
    else:
        print(json.dumps(read_meta(args.path), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
