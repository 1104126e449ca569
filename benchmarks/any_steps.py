"""A function for any sequence length against one compiled for the T it runs, one run: each function
for any T (``halstm.compile(cell, None, B)``) is first checked against float64 at several T, then
both are timed side by side at each shape's T (medians of alternating rounds), on the GPU or the CPU.

    python benchmarks/any_steps.py [--device cuda|cpu] [--cells LSTM,GRU] [--dtypes float16,float32]
                                   [--shapes 100x1x256,100x16x512] [--recipes cuda-persistent,...]
    python benchmarks/any_steps.py --backward ...    # compile_backward for any T against fixed T

On the GPU every function is compiled in parallel worker processes first (``benchmarks/gpu.py``'s
``Built``); the CPU compiles in this process.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

import halstm
from gpu import CELLS, TOL, Built, applicable, rel, storage  # benchmarks/ is on the path of a script run
from halstm.targets import CudaTarget

SHAPES = {"cuda": "100x1x256,100x16x512,100x64x1024,100x256x1024", "cpu": "100x16x512,100x64x512"}
CHECK_STEPS = (1, 3, 37)  # T at which each function for any T is checked, besides the timed shape's


def parse(text: str):
    return [tuple(int(d) for d in s.split("x")) for s in text.split(",")]


def jobs(args, target):
    """Pairs of ``gpu.py`` jobs (cell, T, B, I, H, dtype, recipe): the fixed T's, then T "any"'s, where
    the recipe applies."""
    out = []
    for name in args.cells.split(","):
        for T, B, H in parse(args.shapes):
            for dtype in args.dtypes.split(","):
                for recipe in args.recipes.split(","):
                    if applicable(name, T, B, H, H, dtype, recipe, target, every_recipe=True):
                        out.append(((name, T, B, H, H, dtype, recipe), (name, "any", B, H, H, dtype, recipe)))
    return out


def compiled(job, target):
    name, T, B, I, H, dtype, recipe = job
    return halstm.compile(CELLS[name](I, H), None if T == "any" else T, B, storage(dtype), target=target,
                          recipe=recipe, allow_tf32=dtype == "tf32")


def check(f, cell, T, B, dtype, device, seed) -> float:
    """The largest relative error against float64 over the outputs and final states at T steps."""
    x, p, s = inputs(cell, T, B, dtype, seed, device)
    y, finals = f(x, p, s)
    f64 = lambda d: {k: v.double().cpu().numpy() for k, v in d.items()}  # noqa: E731
    want_y, want = halstm.reference(cell, x.double().cpu().numpy(), f64(p), f64(s))
    return max([rel(y.double().cpu().numpy(), want_y)] + [rel(finals[k].double().cpu().numpy(), want[k]) for k in want])


def inputs(cell, T, B, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    bound = 1 / cell.hidden_size ** 0.5
    dt = getattr(torch, storage(dtype))
    x = torch.randn(T, B, cell.input_size, generator=g).to(dt).to(device)
    params = {n: ((torch.rand(s, generator=g) * 2 - 1) * bound).to(dt).to(device) for n, s in cell.parameters().items()}
    states = {s: (0.5 * torch.randn(B, cell.hidden_size, generator=g)).to(dt).to(device) for s in cell.states}
    return x, params, states


def timed_pair(run_fixed, run_any, device: str, rounds: int = 15) -> tuple[float, float]:
    """Medians (ms) of the two, timed in alternation after a warm-up."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for run in (run_fixed, run_any) * 3:
        run()
    sync()
    times = ([], [])
    for _ in range(rounds):
        for i, run in enumerate((run_fixed, run_any)):
            start = time.perf_counter()
            run()
            sync()
            times[i].append((time.perf_counter() - start) * 1e3)
    return float(np.median(times[0])), float(np.median(times[1]))


def backward_pairs(args, target, device: str) -> None:
    """The backward (``halstm.compile_backward``) for any T against the fixed-T one, compiled in
    this process: their results compared, then both timed (prepared calls, the reversed loop and
    the functions around it)."""
    print("| cell | T | B | H | dtype | fixed backward ms | any T ms | any / fixed | any T against fixed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cells.split(","):
        for T, B, H in parse(args.shapes):
            for dtype in args.dtypes.split(","):
                cell, tf32 = CELLS[name](H, H), dtype == "tf32"
                options = dict(dtype=storage(dtype), target=target, allow_tf32=tf32)
                forward = halstm.compile(cell, T, B, **options)
                fixed, anyb = (halstm.compile_backward(cell, steps, B, **options) for steps in (T, None))
                x, p, s = inputs(cell, T, B, dtype, 0, device)
                seqs = forward.sequences(x, p, s)
                grads = {k: torch.randn_like(v) for k, v in seqs.items()}
                want, got = fixed(x, p, seqs, grads), anyb(x, p, seqs, grads)
                flat = lambda r: [r[0], *r[1].values(), *r[2].values()]  # noqa: E731
                error = max(rel(g.double().cpu().numpy(), w.double().cpu().numpy()) for g, w in zip(flat(got), flat(want)))
                a, b = timed_pair(fixed.prepare(x, p, seqs, grads), anyb.prepare(x, p, seqs, grads), device)
                print(f"| {name} | {T} | {B} | {H} | {dtype} | {a:.3f} | {b:.3f} | {b / a:.3f} | {error:.1e} |",
                      flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--cells", default="LSTM,GRU")
    parser.add_argument("--dtypes", default=None, help="default: float16,float32 on cuda, float32 on cpu")
    parser.add_argument("--shapes", default=None, help="TxBxH,... (I = H)")
    parser.add_argument("--recipes", default=None, help="default: cuda-persistent,cuda-step-loop or cpu-step-loop")
    parser.add_argument("--backward", action="store_true", help="the backward (compile_backward) instead")
    args = parser.parse_args()
    device = args.device
    args.dtypes = args.dtypes or ("float16,float32" if device == "cuda" else "float32")
    args.shapes = args.shapes or SHAPES[device]
    args.recipes = args.recipes or ("cuda-persistent,cuda-step-loop" if device == "cuda" else "cpu-step-loop")
    target = CudaTarget("sm_90", sms=torch.cuda.get_device_properties(0).multi_processor_count) \
        if device == "cuda" else halstm.targets.resolve("cpu")
    if args.backward:
        return backward_pairs(args, target, device)
    pairs = jobs(args, target)
    if device == "cuda":
        built = Built([job for pair in pairs for job in pair], target, workers=os.cpu_count() or 1)
        load = lambda job: built.load(job)[0]  # noqa: E731
    else:
        load = lambda job: compiled(job, target)  # noqa: E731
    print("| cell | T | B | H | dtype | recipe | fixed ms | any T ms | any / fixed | any T's error (at T) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for fixed_job, any_job in pairs:
        name, T, B, _, H, dtype, recipe = fixed_job
        cell = CELLS[name](H, H)
        fixed, anyf = load(fixed_job), load(any_job)
        errors = {t: check(anyf, cell, t, B, dtype, device, seed=t) for t in (*CHECK_STEPS, T)}
        worst = max(errors, key=errors.get)
        verdict = "" if errors[worst] < TOL[dtype] else " FAIL"
        x, p, s = inputs(cell, T, B, dtype, 0, device)
        a, b = timed_pair(fixed.prepare(x, p, s), anyf.prepare(x, p, s), device)
        print(f"| {name} | {T} | {B} | {H} | {dtype} | {recipe} | {a:.3f} | {b:.3f} | {b / a:.3f} | "
              f"{errors[worst]:.1e} ({worst}){verdict} |", flush=True)


if __name__ == "__main__":
    main()
