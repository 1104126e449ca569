"""On the GPU machine: the tuner against the default schedule and against cuDNN, with tuning time.

    python benchmarks/gpu_tune.py --out $OUT [--shapes 100,1,256 100,64,1024] [--trials 12]

Per shape (LSTM, fp32, I=H): the default compile (no database), a tuning run (its records in
OUT/tuning.jsonl), the tuned compile, and torch.nn.LSTM (cuDNN), each timed as the median of 20
calls after warm-up on the same inputs. Writes OUT/tune-results.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import halstm
from halstm.database import Database
from halstm.targets import CudaTarget


def median_ms(run, repeat=20):
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["100,1,256", "100,64,1024"])
    parser.add_argument("--trials", type=int, default=12)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target = CudaTarget.detect()
    db = Database(args.out / "tuning.jsonl")
    rows = [f"Measured {time.strftime('%Y-%m-%d')} on {target.name} ({target.arch}, {target.sms} SMs); LSTM fp32, "
            "medians of 20 calls after warm-up.", "",
            "| T | B | I=H | default ms (recipe) | tuned ms (recipe, knobs) | tuning s | cuDNN ms | tuned / default | cuDNN / tuned |",
            "|---|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        T, B, H = (int(v) for v in shape.split(","))
        cell = halstm.LSTM(H, H)
        x = torch.randn(T, B, H, device="cuda")
        params = {k: torch.from_numpy(v).cuda() for k, v in cell.init_parameters(seed=0).items()}
        default = halstm.compile(cell, T, B, target=target, database=False)
        default_ms = median_ms(default.prepare(x, params))
        start = time.perf_counter()
        halstm.tune(cell, T, B, "float32", target, database=db, trials=args.trials)
        tuning_s = time.perf_counter() - start
        tuned = halstm.compile(cell, T, B, target=target, database=db)
        tuned_ms = median_ms(tuned.prepare(x, params))
        lstm = torch.nn.LSTM(H, H).cuda()
        with torch.no_grad():
            cudnn_ms = median_ms(lambda: lstm(x))
        rows.append(f"| {T} | {B} | {H} | {default_ms:.3f} ({default.recipe.name}) | {tuned_ms:.3f} "
                    f"({tuned.recipe.name} {tuned.knobs}) | {tuning_s:.0f} | {cudnn_ms:.3f} | "
                    f"{tuned_ms / default_ms:.2f} | {cudnn_ms / tuned_ms:.2f} |")
        print(rows[-1], flush=True)
    (args.out / "tune-results.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
