"""Training benchmark, one run: fp32 forward + backward through time, T=100, B=64, I=H=1024.

halstm (``halstm.nn.LSTM``) beside cuDNN (``torch.nn.LSTM`` on the same state_dict, with TF32 as
torch allows it by default and in full fp32), and a custom cell (PeepholeLSTM) as ``halstm.nn.RNN``
beside the same cell trained as a torch eager loop and as ``torch.compile`` of that loop. A step is
y = model(x); y.backward(dy), with the gradients of x and every parameter. First the gradients are
checked against torch at a small shape (full fp32, 1e-5); then medians after warm-up (CUDA events).
Writes results.md and results.json into --out.

    python benchmarks/training_gpu.py [--out DIR] [--no-compile]
    python benchmarks/training_gpu.py --device cpu --tiny     # smoke test of this script on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from gpu import torch_cell  # the custom cells' step in torch (benchmarks/gpu.py)

import halstm
import halstm.nn

SHAPE = (100, 64, 1024)  # T, B, I = H
TINY = (5, 2, 16)
CHECK = (20, 4, 32)


def timed(fn, device: str, warm: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() after warm-up."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(times))


def lstms(T: int, H: int, device: str, use_compile: bool) -> dict:
    """Name -> (forward, module holding its parameters): halstm.nn.LSTM and torch.nn.LSTM (cuDNN)
    with the same weights."""
    reference = torch.nn.LSTM(H, H).to(device)
    ours = halstm.nn.LSTM(H, H).to(device)
    ours.load_state_dict(reference.state_dict())
    return {"halstm": (lambda x: ours(x)[0], ours), "cuDNN": (lambda x: reference(x)[0], reference)}


def peepholes(T: int, H: int, device: str, use_compile: bool) -> dict:
    """PeepholeLSTM as halstm.nn.RNN, and a torch loop over the same parameters (eager, compiled)."""
    ours = halstm.nn.RNN(halstm.PeepholeLSTM, H, H).to(device)
    step = torch_cell("PeepholeLSTM", {n: getattr(ours, f"{n}_l0") for n in ours.cell.parameters()})

    def loop(x):
        h = x.new_zeros(x.shape[1], H)
        state, ys = (h, torch.zeros_like(h)), []
        for t in range(T):
            state = step(x[t], *state)
            ys.append(state[0])
        return torch.stack(ys)

    models = {"halstm": (lambda x: ours(x)[0], ours), "eager": (loop, ours)}
    if use_compile:
        models["torch.compile"] = (torch.compile(loop, mode="reduce-overhead"), ours)
    return models


CELLS = {"LSTM": lstms, "PeepholeLSTM": peepholes}


def training_step(model, x, dy):
    forward, module = model

    def run():
        module.zero_grad(set_to_none=True)
        x.grad = None
        forward(x).backward(dy)

    return run


def gradients(model, x, dy) -> list:
    training_step(model, x, dy)()
    return [x.grad.clone()] + [p.grad.clone() for p in model[1].parameters()]


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check(device: str) -> list[tuple]:
    """halstm's gradients against cuDNN and torch eager at a small shape, in full fp32."""
    T, B, H = CHECK
    torch.backends.cudnn.allow_tf32 = False
    x = torch.randn(T, B, H, device=device, requires_grad=True)
    dy = torch.randn(T, B, H, device=device)
    rows = []
    for cell, build in CELLS.items():
        models = build(T, H, device, False)
        baseline = "cuDNN" if "cuDNN" in models else "eager"
        err = max(rel(a, b) for a, b in zip(gradients(models["halstm"], x, dy), gradients(models[baseline], x, dy)))
        rows.append((cell, baseline, err, err < 1e-5))
        print("check", cell, "vs", baseline, f"{err:.1e}", "PASS" if err < 1e-5 else "FAIL", flush=True)
    torch.backends.cudnn.allow_tf32 = True
    return rows


def bench(shape, device: str, use_compile: bool) -> list[dict]:
    T, B, H = shape
    x = torch.randn(T, B, H, device=device, requires_grad=True)
    dy = torch.randn(T, B, H, device=device)
    rows = []
    for cell, build in CELLS.items():
        models = build(T, H, device, use_compile)
        row = {"cell": cell, "T": T, "B": B, "H": H}
        t0 = time.time()
        training_step(models["halstm"], x, dy)()  # compiles the forward and the backward
        row["halstm compile s"] = round(time.time() - t0, 1)
        for name, model in models.items():
            row[name] = timed(training_step(model, x, dy), device)
        if "cuDNN" in models and device == "cuda":
            torch.backends.cudnn.allow_tf32 = False
            row["cuDNN fp32"] = timed(training_step(models["cuDNN"], x, dy), device)
            torch.backends.cudnn.allow_tf32 = True
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(rows, device_name: str) -> str:
    lines = [(f"Device: {device_name}. fp32 training step (forward + backward), median ms after warm-up; "
              "ratio: the baseline's time over halstm's (> 1: halstm faster)."), "",
             "| cell | T | B | H | halstm ms | baseline | baseline ms | ratio | halstm compile s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for base in ("cuDNN", "cuDNN fp32", "eager", "torch.compile"):
            if base in r:
                lines.append(f"| {r['cell']} | {r['T']} | {r['B']} | {r['H']} | {r['halstm']:.2f} | {base} | "
                             f"{r[base]:.2f} | {r[base] / r['halstm']:.2f} | {r['halstm compile s']} |")
    return "\n".join(lines) + "\n\ncuDNN: torch's default (TF32 allowed); cuDNN fp32: TF32 off.\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--tiny", action="store_true", help=f"T, B, H = {TINY} instead of {SHAPE}")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    checks = check(args.device)
    rows = bench(TINY if args.tiny else SHAPE, args.device, not args.no_compile)
    text = "## Gradients against torch (T, B, H = {}, {}, {}; fp32, TF32 off)\n\n".format(*CHECK)
    text += "| cell | against | max relative error | ok |\n|---|---|---|---|\n"
    text += "\n".join(f"| {c} | {b} | {e:.1e} | {ok} |" for c, b, e, ok in checks)
    text += "\n\n## Timing\n\n" + table(rows, name)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump({"checks": checks, "rows": rows}, fh)
    print(text)
    return 0 if all(c[-1] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
