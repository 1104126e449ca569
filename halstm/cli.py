"""The ``halstm`` command: bench, tune, export, info."""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path


def _shape(text: str) -> tuple[int, int, int]:
    try:
        T, B, H = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T,B,H (three integers), got {text!r}") from None
    return T, B, H


def _cell_type(text: str):
    """A built-in cell name, or module:Class for one of your own."""
    from .cells import BUILTIN

    if text in BUILTIN:
        return BUILTIN[text]
    module, _, name = text.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a built-in cell ({', '.join(sorted(BUILTIN))}) nor module:Class"
        ) from None


def _add_problem(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cell", type=_cell_type, required=True,
                   help="LSTM, GRU, PeepholeLSTM, ResetBeforeGRU, or module:Class for your own cell")
    p.add_argument("--input-size", type=int, required=True, help="I: features of x")
    p.add_argument("--hidden-size", type=int, required=True, help="H: size of each state")
    p.add_argument("--steps", type=int, required=True, help="T: sequence length compiled for")
    p.add_argument("--batch", type=int, required=True, help="B: sequences per call")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--target", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--allow-tf32", action="store_true",
                   help="float32 GEMMs on tensor cores as TF32 (CUDA, sm_80+; relative error ~1e-3)")
    p.add_argument("--database", type=Path, default=None,
                   help="tuning records (default: $HALSTM_TUNING_DB or ~/.cache/halstm/tuning.jsonl)")


def main(argv=None) -> int:
    from . import bench
    from .cells import BUILTIN

    parser = argparse.ArgumentParser(prog="halstm", description="Recurrent cells written as math, compiled by TVM.")
    sub = parser.add_subparsers(dest="command", required=True)

    b = sub.add_parser(
        "bench", help="compile built-in cells, check them, time them against PyTorch and NumPy",
        description="Compiles each cell at each shape, checks it against the float64 reference, times "
        "it side by side with torch.nn.LSTM/GRU and a NumPy loop (medians after warm-up), prints a "
        "markdown table and writes it with a plot to --out.",
    )
    b.add_argument("--target", default="cpu", help="cpu (default) or cuda")
    b.add_argument("--cells", nargs="+", default=list(bench.DEFAULT_CELLS), choices=sorted(BUILTIN))
    b.add_argument("--shapes", nargs="+", type=_shape, default=list(bench.DEFAULT_SHAPES),
                   metavar="T,B,H", help="sequence length, batch, input=hidden size")
    b.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (median)")
    b.add_argument("--out", type=Path, default=Path("bench-results"), help="where the table and plot go")

    t = sub.add_parser(
        "tune", help="search recipes and knobs for one cell and shape; record them",
        description="Measures candidate schedules (recipe x knobs) on this machine, each checked against "
        "the float64 reference, and appends every result to the tuning database. Interrupted, it "
        "resumes where it stopped. halstm.compile and halstm export then use the best record.",
    )
    _add_problem(t)
    t.add_argument("--trials", type=int, default=24, help="candidates to try in all (default 24)")
    t.add_argument("--timeout", type=float, default=300, help="seconds before a candidate counts as hung")
    t.add_argument("--builders", type=int, default=None,
                   help="processes compiling candidates at once before they are timed one by one "
                   "(default: the CPU's cores less one; 1: each compiled as it is timed)")

    e = sub.add_parser(
        "export", help="compile one cell and shape to a module file for deployment",
        description="Compiles (with the best tuning record, if any) and writes OUT plus OUT.json, its "
        "metadata. halstm.load(OUT) runs it with the TVM runtime alone.",
    )
    _add_problem(e)
    e.add_argument("-o", "--out", type=Path, required=True, help="the module file to write (e.g. lstm.so)")

    i = sub.add_parser("info", help="what an exported module or a tuning database holds",
                       description="For a module: its metadata. For a .jsonl database: each tuned "
                       "problem with its best record and how many candidates were measured.")
    i.add_argument("path", type=Path)

    args = parser.parse_args(argv)
    return {"bench": _bench, "tune": _tune, "export": _export, "info": _info}[args.command](args)


def _bench(args) -> int:
    from . import bench

    print(bench.HEADER)
    rows = bench.run(args.cells, args.shapes, args.target, args.repeat)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(bench.report(rows))
    bench.plot(rows, args.out / "results.png")
    print(f"\nwrote {args.out / 'results.md'} and {args.out / 'results.png'}")
    return 0


def _tune(args) -> int:
    from .tuner import tune

    cell = args.cell(args.input_size, args.hidden_size)
    best = tune(cell, args.steps, args.batch, args.dtype, args.target, database=args.database,
                trials=args.trials, timeout=args.timeout, allow_tf32=args.allow_tf32, builders=args.builders)
    if best is None:
        print("no candidate succeeded")
        return 1
    print(f"best: {best.recipe} {best.knobs} {best.ms:.3f} ms")
    return 0


def _export(args) -> int:
    from .compiler import compile as compile_cell
    from .deploy import export

    cell = args.cell(args.input_size, args.hidden_size)
    f = compile_cell(cell, args.steps, args.batch, args.dtype, args.target, database=args.database,
                     allow_tf32=args.allow_tf32)
    export(f, args.out)
    source = "defaults" if f.record is None else f"tuning record of T={f.record.key['steps']}, {f.record.ms:.3f} ms"
    print(f"wrote {args.out} and {args.out}.json: {f!r} ({source})")
    return 0


def _info(args) -> int:
    from .database import Database, fastest
    from .deploy import read_meta

    if args.path.suffix == ".jsonl":
        records = Database(args.path).records()
        problems: dict[str, list] = {}
        for r in records:
            problems.setdefault(json.dumps(r.key, sort_keys=True), []).append(r)
        print(f"{args.path}: {len(records)} records, {len(problems)} problems")
        for _, mine in sorted(problems.items()):
            k = mine[0].key
            head = (f"{k['cell']} I={k['input_size']} H={k['hidden_size']} T={k['steps']} B={k['batch']} "
                    f"{k['dtype']} on {k['target']}")
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
