"""Where a call's GPU time goes, kernel by kernel: halstm's compiled cell and cuDNN's torch.nn.LSTM/GRU on
the same inputs, and cuBLAS (torch.matmul) on the hoisted input GEMM's shape, in one process:

    python3 benchmarks/kernel_breakdown.py LSTM 100,256,1024 float16 --recipe cuda-step-loop --knobs '{}' \
        '{"tc_warps_m":4}'

Kernel times come from torch.profiler (CUPTI sees every kernel of the process, TVM's included): the
sum over --reps calls after warm-up, divided by --reps, per kernel name.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import halstm
from halstm.cells import BUILTIN
from halstm.targets import CudaTarget

from gpu import inputs, storage, timed  # noqa: E402 (beside this script)
from knob_sweep import cudnn_module  # noqa: E402


def kernel_times(fn, reps: int) -> dict[str, tuple[float, int]]:
    """us a call and launches a call of each kernel ``fn`` launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total, count = defaultdict(float), defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total[event.name] += event.device_time_total
            count[event.name] += 1
    return {name: (total[name] / reps, count[name] // reps) for name in total}


def report(title: str, times: dict[str, tuple[float, int]], wall_ms: float) -> None:
    busy = sum(us for us, _ in times.values())
    print(f"\n{title}: {wall_ms:.3f} ms a call (CUDA events), kernels {busy / 1e3:.3f} ms")
    print("| kernel | us a call | launches | share |\n|---|---|---|---|")
    for name, (us, n) in sorted(times.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name[:70]} | {us:.1f} | {n} | {us / busy:.0%} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cell", choices=sorted(BUILTIN))
    ap.add_argument("shape", help="T,B,H (I = H)")
    ap.add_argument("dtype", default="float16")
    ap.add_argument("--recipe", default="cuda-step-loop", help="the recipe the --knobs settings apply to")
    ap.add_argument("--knobs", nargs="*", default=[], help="JSON objects, each a setting to break down "
                    "after halstm's own choice (the database's or the defaults)")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    T, B, H = map(int, a.shape.split(","))
    cell = BUILTIN[a.cell](H, H)
    x, params, states = inputs(cell, T, B, a.dtype, seed=0)
    for knobs in [None] + [json.loads(k) for k in a.knobs]:  # {} is the recipe's defaults
        recipe = None if knobs is None else a.recipe
        f = halstm.compile(cell, T, B, storage(a.dtype), target=CudaTarget.detect(), recipe=recipe, knobs=knobs,
                           allow_tf32=a.dtype == "tf32")
        call = lambda: f(x, params, states)  # noqa: E731
        report(f"halstm {a.cell} ({T},{B},{H}) {a.dtype}, {f.recipe.name} {json.dumps(knobs or {})}",
               kernel_times(call, a.reps), timed(call, reps=a.reps))
    module, hx = cudnn_module(a.cell, H, a.dtype, params, states)
    if module is not None:
        with torch.no_grad():
            call = lambda: module(x, hx)  # noqa: E731
            report(f"cuDNN {a.cell}", kernel_times(call, a.reps), timed(call, reps=a.reps))
    rows, cols = T * B, params["weight_ih"].shape[0]  # every built-in cell's input projection
    w = torch.randn(H, cols, dtype=x.dtype, device="cuda")
    xs = x.reshape(rows, H)
    ms = timed(lambda: xs @ w, reps=a.reps)
    print(f"\ncuBLAS {rows} x {cols} x {H} {x.dtype}: {ms:.3f} ms, {2 * rows * cols * H / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
