"""The tuner against the default schedule and against torch, with tuning time.

    python benchmarks/tuning.py --out DIR [--target cuda] [--shapes 100,1,256 100,64,1024] [--trials 12]
                                [--dtypes float32 tf32 float16] [--cells LSTM GRU]

Per cell, shape and dtype (I=H): the default compile (no database), a tuning run (its records in
DIR/tuning.jsonl), the tuned compile, and torch.nn.LSTM or GRU (cuDNN on a GPU; in fp32 also with TF32
off), each timed as the median of 20 calls after warm-up on the same inputs, the first three side by
side (one call of each in turn). Writes
DIR/tune-results.md. dtype tf32: float32 tensors compiled with allow_tf32 (cuDNN with TF32, its
default). The tuner compiles candidates on the CPU's cores less one before timing them.
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch

import halstm
from halstm.bench import alternating_median_ms, median_ms
from halstm.database import Database
from halstm.targets import resolve

from gpu import storage  # noqa: E402 (beside this script: what a benchmark dtype stores)


def measure_shape(cell_name, T, B, H, name, target, device, sync, db, trials) -> str:
    cell = getattr(halstm, cell_name)(H, H)
    dtype, tf32 = storage(name), name == "tf32"
    dt = getattr(torch, dtype)
    x = torch.randn(T, B, H, device=device).to(dt)
    params = {k: torch.from_numpy(v).to(device, dt) for k, v in cell.init_parameters(seed=0).items()}
    default = halstm.compile(cell, T, B, dtype, target=target, database=False, allow_tf32=tf32)
    start = time.perf_counter()
    halstm.tune(cell, T, B, dtype, target, database=db, trials=trials, allow_tf32=tf32)
    tuning_s = time.perf_counter() - start
    tuned = halstm.compile(cell, T, B, dtype, target=target, database=db, allow_tf32=tf32)
    module = getattr(torch.nn, cell_name)(H, H).to(device, dt)
    with torch.no_grad():
        calls = {"default": default.prepare(x, params), "tuned": tuned.prepare(x, params), "torch": lambda: module(x)}
        ms = alternating_median_ms(calls, sync, 3, 20)
        default_ms, tuned_ms, torch_ms = ms["default"], ms["tuned"], ms["torch"]
        strict_ms = None
        if device == "cuda" and name == "float32":
            torch.backends.cudnn.allow_tf32 = False
            strict_ms = median_ms(lambda: module(x), 20, warmup=3, sync=sync)
            torch.backends.cudnn.allow_tf32 = True
    strict = "-" if strict_ms is None else f"{strict_ms:.3f}"
    return (f"| {cell_name} | {T} | {B} | {H} | {name} | {default_ms:.3f} ({default.recipe.name}) | {tuned_ms:.3f} "
            f"({tuned.recipe.name} {tuned.knobs}) | {tuning_s:.0f} | {torch_ms:.3f} | {strict} | "
            f"{tuned_ms / default_ms:.2f} | {torch_ms / tuned_ms:.2f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["100,1,256", "100,64,1024"])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--cells", nargs="+", default=["LSTM"], choices=["LSTM", "GRU"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = resolve(args.target)
    device = "cuda" if args.target == "cuda" else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    db = Database(args.out / "tuning.jsonl")
    rows = [f"Measured {time.strftime('%Y-%m-%d')} on {target.key}; medians of 20 calls after warm-up.", "",
            "| cell | T | B | I=H | dtype | default ms (recipe) | tuned ms (recipe, knobs) | tuning s | torch ms | torch no-TF32 ms "
            "| tuned / default | torch / tuned |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cell, shape, dtype in itertools.product(args.cells, args.shapes, args.dtypes):
        T, B, H = (int(v) for v in shape.split(","))
        rows.append(measure_shape(cell, T, B, H, dtype, target, device, sync, db, args.trials))
        print(rows[-1], flush=True)
        (args.out / "tune-results.md").write_text("\n".join(rows) + "\n")  # kept if a later shape hangs


if __name__ == "__main__":
    main()
