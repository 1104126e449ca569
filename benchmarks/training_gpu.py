"""Training benchmark, one run: forward + backward through time, halstm beside cuDNN and torch.compile.

A step is ``y, _ = model(x); y.backward(dy)``, with the gradients of x and every parameter. LSTM and GRU
run as ``halstm.nn.LSTM``/``GRU`` beside ``torch.nn.LSTM``/``GRU`` (cuDNN) on the same state_dict; a
custom cell (PeepholeLSTM, LayerNormLSTM, ...) as ``halstm.nn.RNN`` beside the same cell's step in torch
(benchmarks/gpu.py), looped, and ``torch.compile`` (default mode) of that loop. float32 runs twice on
each side: exact ("halstm", "cuDNN fp32") and with TF32 tensor cores ("halstm TF32": ``allow_tf32=True``;
"cuDNN": torch's default, TF32 allowed).

First every model's gradients at a small shape are checked against float64 (the same model upcast)
within the dtype's tolerance (fp32 1e-5; fp16, bf16 1e-2). Then medians after warm-up (CUDA events),
each step's peak memory above what was allocated before it, and halstm's compile time (its first step:
the forward, the backward and its reversed loop). Writes results.md and results.json into --out.

    python benchmarks/training_gpu.py --cells LSTM,GRU,PeepholeLSTM --shapes 100x16x512 --dtypes float16
    python benchmarks/training_gpu.py --device cpu --tiny     # smoke test of this script on a CPU

--profile (CUDA) also prints, per contender, where a step's time goes: each kernel's time a step
(torch.profiler, which sees TVM's kernels too) and the host time to issue a step (ten steps issued
between synchronisations).

On the CPU the baseline is torch.nn's LSTM/GRU ("torch": oneDNN), or a custom cell's eager loop (no
torch.compile), and each contender is timed in a process of its own (this script with ``--only``; every thread pool ``--threads`` threads; in
halstm's OpenMP waiting passively; torch's timed both with OpenMP's default waiting and passive, the
faster counting, as ``halstm bench`` does): in one process torch's OpenMP threads and TVM's pool take
turns on the same cores, and a pool's spinning slows the other's steps. ``--rounds``
alternates the contenders' processes that many times; the table gives each one's median of its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
from gpu import torch_cell  # the custom cells' step in torch

import halstm
import halstm.nn
from halstm.bench import worker_environment

SHAPES = ((100, 1, 256), (100, 16, 512), (100, 64, 1024), (100, 256, 1024), (1024, 16, 768))  # T, B, I = H
TINY = ((5, 2, 16),)
CHECK = (8, 4, 32)
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
TF32_TOLERANCE = 1e-3
CUDNN = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU}


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


def models(cell: str, T: int, H: int, device: str, dtype: torch.dtype, use_compile: bool,
           allow_tf32: bool = False, recompute: bool = False) -> dict:
    """Name -> (forward, module holding its parameters): halstm first, then the baselines on the
    same parameters."""
    if cell in CUDNN:
        reference = CUDNN[cell](H, H).to(device, dtype)
        ours = getattr(halstm.nn, cell)(H, H, allow_tf32=allow_tf32, recompute=recompute).to(device, dtype)
        ours.load_state_dict(reference.state_dict())
        baseline = "cuDNN" if device == "cuda" else "torch"
        return {"halstm": (lambda x: ours(x)[0], ours), baseline: (lambda x: reference(x)[0], reference)}
    ours = halstm.nn.RNN(getattr(halstm, cell), H, H, allow_tf32=allow_tf32, recompute=recompute).to(device, dtype)
    step = torch_cell(cell, {n: getattr(ours, f"{n}_l0") for n in ours.cell.parameters()})

    def loop(x):
        state = tuple(x.new_zeros(x.shape[1], H) for _ in ours.cell.states)
        ys = []
        for t in range(x.shape[0]):
            state = step(x[t], *state)
            ys.append(state[0])
        return torch.stack(ys)

    found = {"halstm": (lambda x: ours(x)[0], ours), "torch eager": (loop, ours)}
    if use_compile:
        found["torch.compile"] = (torch.compile(loop), ours)
    return found


def training_step(model, x, dy):
    forward, module = model

    def run():
        module.zero_grad(set_to_none=True)
        x.grad = None
        forward(x).backward(dy)

    return run


def gradients(model, x, dy) -> list:
    training_step(model, x, dy)()
    return [x.grad] + [p.grad for p in model[1].parameters()]


def check(cell: str, dtype: torch.dtype, device: str, allow_tf32: bool = False) -> float:
    """The largest relative error of halstm's gradients (x and every parameter) against the same
    model in float64."""
    T, B, H = CHECK
    ours = models(cell, T, H, device, dtype, False, allow_tf32)["halstm"]
    exact = models(cell, T, H, device, torch.float64, False)
    exact = exact["torch eager"] if cell not in CUDNN else exact["cuDNN" if device == "cuda" else "torch"]
    exact[1].load_state_dict({k: v.double() for k, v in ours[1].state_dict().items()})
    x = torch.randn(T, B, H, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, B, H, device=device, dtype=dtype)
    x64 = x.detach().double().requires_grad_()
    got, want = gradients(ours, x, dy), gradients(exact, x64, dy.double())
    return max(float((g.double() - w).norm() / w.norm()) for g, w in zip(got, want))


def peak_mb(fn, device: str) -> float | None:
    """Memory a step allocates at its peak beyond what was allocated before it, MB."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)


def profile(name: str, step, reps: int = 5, top: int = 12) -> None:
    """Print a step's kernels (us a step, launches a step) and its host time to issue."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    issue = (time.perf_counter() - t0) / 10
    torch.cuda.synchronize()
    with profiler(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name][0] += e.device_time_total / reps
            kernels[e.name][1] += 1
    total = sum(us for us, _ in kernels.values())
    print(f"  {name}: kernels {total / 1e3:.3f} ms a step, host {1e3 * issue:.3f} ms to issue one")
    for kernel, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"    {us:9.1f} us  x{n // reps:<4d} {kernel[:100]}")


def bench(cell: str, shape, dtype: torch.dtype, device: str, use_compile: bool, show: bool = False,
          recompute: bool = False, only: str | None = None) -> dict:
    """One row: every contender's step timed (``only``: that one's alone)."""
    T, B, H = shape
    x = torch.randn(T, B, H, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, B, H, device=device, dtype=dtype)
    found = models(cell, T, H, device, dtype, use_compile)
    if only is not None:
        found = {only: found[only]}
    if device == "cuda" and dtype == torch.float32:
        found["halstm TF32"] = models(cell, T, H, device, dtype, False, allow_tf32=True)["halstm"]
        found["halstm TF32"][1].load_state_dict(found["halstm"][1].state_dict())
    if recompute:
        found["halstm recompute"] = models(cell, T, H, device, dtype, False, recompute=True)["halstm"]
        found["halstm recompute"][1].load_state_dict(found["halstm"][1].state_dict())
    row = {"cell": cell, "T": T, "B": B, "H": H, "dtype": str(dtype).replace("torch.", "")}
    if "halstm" in found:
        t0 = time.time()
        training_step(found["halstm"], x, dy)()  # compiles the forward, the backward and its reversed loop
        row["halstm compile s"] = round(time.time() - t0, 1)
    for name, model in found.items():
        step = training_step(model, x, dy)
        if name in ("halstm TF32", "halstm recompute"):
            t0 = time.time()
            step()
            row[f"{name} compile s"] = round(time.time() - t0, 1)
        if name == "torch.compile":
            t0 = time.time()
            step()
            row["torch.compile s"] = round(time.time() - t0, 1)
        row[name] = timed(step, device)
        row[f"{name} MB"] = peak_mb(step, device)
        if show:
            profile(name, step)
    if "cuDNN" in found and device == "cuda" and dtype == torch.float32:
        torch.backends.cudnn.allow_tf32 = False
        row["cuDNN fp32"] = timed(training_step(found["cuDNN"], x, dy), device)
        torch.backends.cudnn.allow_tf32 = True
    print(json.dumps(row), flush=True)
    return row


def apart(cell: str, shape, dtype: str, rounds: int, threads: int) -> dict:
    """A CPU row whose contenders (halstm, torch) each ran in a process of their own, alternating
    ``rounds`` times: each one's median of its rounds (its rounds' times kept too)."""
    row, times = {}, {}
    baseline = "torch" if cell in CUDNN else "torch eager"
    for _ in range(rounds):
        for name in ("halstm", baseline):
            # the baseline at its best: OpenMP's default waiting (spinning) and passive, the faster
            found = min((_alone(name, cell, shape, dtype, worker_environment(threads, passive))
                         for passive in ((True,) if name == "halstm" or "OMP_WAIT_POLICY" in os.environ else
                                         (False, True))), key=lambda f: f[name])
            times.setdefault(name, []).append(found[name])
            row.update({k: v for k, v in found.items() if k != name})
    for name, values in times.items():
        row[name], row[f"{name} rounds"] = float(np.median(values)), values
    return row


def _alone(name: str, cell: str, shape, dtype: str, env: dict) -> dict:
    """The row of one CPU contender timed in a process of its own with ``env``."""
    command = [sys.executable, os.path.abspath(__file__), "--device", "cpu", "--only", name, "--cells", cell,
               "--shapes", "x".join(map(str, shape)), "--dtypes", dtype, "--no-compile"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name} process: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows, device_name: str) -> str:
    lines = [f"Device: {device_name}. Training step (forward + backward), median ms after warm-up; ratio: the "
             "baseline's time over halstm's (> 1: halstm faster); MB: a step's peak memory.", "",
             "| cell | dtype | T | B | H | halstm ms | halstm MB | baseline | baseline ms | baseline MB | ratio | "
             "halstm compile s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for base in ("cuDNN", "cuDNN fp32", "torch", "torch eager", "torch.compile"):
            ours = "halstm TF32" if base == "cuDNN" and "halstm TF32" in r else "halstm"
            if base not in r:
                continue
            for ours in (ours, "halstm recompute") if ours == "halstm" and "halstm recompute" in r else (ours,):
                lines.append(f"| {r['cell']} | {r['dtype']} | {r['T']} | {r['B']} | {r['H']} | {ours}: {r[ours]:.3f} | "
                             f"{r[ours + ' MB']} | {base} | {r[base]:.3f} | {r.get(base + ' MB')} | "
                             f"{r[base] / r[ours]:.2f} | {r.get(ours + ' compile s', r['halstm compile s'])} |")
    return "\n".join(lines) + ("\n\ntorch: torch.nn on the CPU (oneDNN), each contender timed in a process of its own. "
                               "cuDNN: torch's default (TF32 allowed in float32), beside halstm TF32 in float32; "
                               "cuDNN fp32: TF32 off, beside exact halstm. halstm recompute: the backward computes "
                               "the input projections again (``recompute=True``) instead of taking the forward's.\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--cells", default="LSTM,GRU,PeepholeLSTM,LayerNormLSTM")
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES), help="TxBxH,...")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--tiny", action="store_true", help=f"T, B, H = {TINY[0]}, float32")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--profile", action="store_true", help="each step's kernels and host time (CUDA)")
    ap.add_argument("--recompute", action="store_true",
                    help="also halstm with recompute=True: the backward computes the input projections again")
    ap.add_argument("--rounds", type=int, default=3, help="CPU: the contenders' processes alternated this many times")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU: each pool's threads")
    ap.add_argument("--only", help=argparse.SUPPRESS)  # CPU: time this contender alone, print its row
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.profile and args.device != "cuda":
        ap.error("--profile needs --device cuda")
    if args.device == "cpu" and args.recompute:
        ap.error("--recompute: the CPU's contenders run in processes of their own, halstm's as nn builds it")
    torch.manual_seed(0)
    if args.only:
        bench(args.cells, tuple(int(v) for v in args.shapes.split("x")), getattr(torch, args.dtypes), "cpu",
              False, only=args.only)
        return 0
    cells = args.cells.split(",")
    shapes = TINY if args.tiny else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dtypes = ["float32"] if args.tiny else args.dtypes.split(",")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    checks = []
    for cell in cells:
        for dtype in dtypes:
            tf32 = [False, True] if dtype == "float32" and args.device == "cuda" else [False]
            for allow_tf32 in tf32:
                err = check(cell, getattr(torch, dtype), args.device, allow_tf32)
                label = "tf32" if allow_tf32 else dtype
                checks.append((cell, label, err, err < (TF32_TOLERANCE if allow_tf32 else TOLERANCE[dtype])))
                print("check", cell, label, f"{err:.1e}", "PASS" if checks[-1][-1] else "FAIL", flush=True)
    if args.device == "cpu":
        rows = [apart(cell, shape, dtype, args.rounds, args.threads) for shape in shapes for dtype in dtypes
                for cell in cells]
    else:
        rows = [bench(cell, shape, getattr(torch, dtype), args.device, not args.no_compile, args.profile,
                      args.recompute) for shape in shapes for dtype in dtypes for cell in cells]
    text = "## Gradients against float64 (T, B, H = {}, {}, {})\n\n".format(*CHECK)
    text += "| cell | dtype | max relative error | within tolerance |\n|---|---|---|---|\n"
    text += "\n".join(f"| {c} | {d} | {e:.1e} | {ok} |" for c, d, e, ok in checks)
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
