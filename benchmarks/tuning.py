"""The tuner against the default schedule and against torch, with tuning time.

    python benchmarks/tuning.py --out DIR [--target cuda] [--shapes 100,1,256 100,64,1024] [--trials 12]

Per shape (LSTM, fp32, I=H): the default compile (no database), a tuning run (its records in
DIR/tuning.jsonl), the tuned compile, and torch.nn.LSTM (cuDNN on a GPU), each timed as the median
of 20 calls after warm-up on the same inputs. Writes DIR/tune-results.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import halstm
from halstm.database import Database
from halstm.targets import resolve


def median_ms(run, sync, repeat=20):
    for _ in range(3):
        run()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["100,1,256", "100,64,1024"])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = resolve(args.target)
    device = "cuda" if args.target == "cuda" else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    db = Database(args.out / "tuning.jsonl")
    rows = [f"Measured {time.strftime('%Y-%m-%d')} on {target.key}; LSTM fp32, medians of 20 calls after warm-up.", "",
            "| T | B | I=H | default ms (recipe) | tuned ms (recipe, knobs) | tuning s | torch ms | tuned / default | torch / tuned |",
            "|---|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        T, B, H = (int(v) for v in shape.split(","))
        cell = halstm.LSTM(H, H)
        x = torch.randn(T, B, H, device=device)
        params = {k: torch.from_numpy(v).to(device) for k, v in cell.init_parameters(seed=0).items()}
        default = halstm.compile(cell, T, B, target=target, database=False)
        default_ms = median_ms(default.prepare(x, params), sync)
        start = time.perf_counter()
        halstm.tune(cell, T, B, "float32", target, database=db, trials=args.trials)
        tuning_s = time.perf_counter() - start
        tuned = halstm.compile(cell, T, B, target=target, database=db)
        tuned_ms = median_ms(tuned.prepare(x, params), sync)
        lstm = torch.nn.LSTM(H, H).to(device)
        with torch.no_grad():
            torch_ms = median_ms(lambda: lstm(x), sync)
        rows.append(f"| {T} | {B} | {H} | {default_ms:.3f} ({default.recipe.name}) | {tuned_ms:.3f} "
                    f"({tuned.recipe.name} {tuned.knobs}) | {tuning_s:.0f} | {torch_ms:.3f} | "
                    f"{tuned_ms / default_ms:.2f} | {torch_ms / tuned_ms:.2f} |")
        print(rows[-1], flush=True)
    (args.out / "tune-results.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
