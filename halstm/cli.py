"""The ``halstm`` command."""

from __future__ import annotations

import argparse
from pathlib import Path


def _shape(text: str) -> tuple[int, int, int]:
    try:
        T, B, H = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected T,B,H (three integers), got {text!r}") from None
    return T, B, H


def main(argv=None) -> int:
    from . import bench
    from .cells import BUILTIN

    parser = argparse.ArgumentParser(prog="halstm", description="Recurrent cells compiled by TVM.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "bench",
        help="compile built-in cells, check them, time them against PyTorch and NumPy",
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
    args = parser.parse_args(argv)

    print(bench.HEADER)
    rows = bench.run(args.cells, args.shapes, args.target, args.repeat)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(bench.report(rows))
    bench.plot(rows, args.out / "results.png")
    print(f"\nwrote {args.out / 'results.md'} and {args.out / 'results.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
