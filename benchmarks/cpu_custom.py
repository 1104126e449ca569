"""Custom cells' forward on the CPU: halstm beside torch.compile (default mode) and eager torch.

A call is ``y = model(x)`` under ``torch.no_grad()``: ``halstm.nn.RNN`` of the cell, and a Python loop of
the same cell's step in torch (benchmarks/gpu.py's ``torch_cell``) on the same parameters, eager and
compiled with ``torch.compile`` (its default mode; "reduce-overhead" is CUDA graphs). First each
contender's output at a small shape is checked against float64 (halstm's cell in float64, through
``halstm.reference``) within fp32's tolerance (1e-5).

Each contender is timed in a process of its own (this script with ``--only``; every thread pool
``--threads`` threads; halstm's OpenMP waiting passively, torch's timed with OpenMP's default waiting
and passive, the faster counting, as ``halstm bench`` does), alternating ``--rounds`` times: the
table gives each one's median of its rounds' medians, and the compile time of halstm's and torch's
first call.

    python benchmarks/cpu_custom.py --cells PeepholeLSTM,ResetBeforeGRU --shapes 100x1x256,100x16x512
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

import halstm
from halstm.bench import worker_environment
from training_gpu import models  # noqa: E402 (beside this script: the same models)

CONTENDERS = ("halstm", "torch.compile", "torch eager")
CHECK = (6, 3, 24)  # T, B, H of the float64 check
TOLERANCE = 1e-5


def check(cell: str) -> dict:
    """Each contender's relative error against float64 at CHECK (one cell, fp32)."""
    T, B, H = CHECK
    found = models(cell, T, H, "cpu", torch.float32, use_compile=True)
    module = found["halstm"][1]
    x = torch.randn(T, B, H)
    params = {n: getattr(module, f"{n}_l0").detach().double().numpy() for n in module.cell.parameters()}
    states = {s: np.zeros((B, H)) for s in module.cell.states}
    want, _ = halstm.reference(module.cell, x.double().numpy(), params, states)
    with torch.no_grad():
        return {name: float(np.linalg.norm(forward(x).double().numpy() - want) / np.linalg.norm(want))
                for name, (forward, _) in found.items()}


def alone(cell: str, shape, name: str) -> dict:
    """This process: ``name``'s first call (s) and median ms of its calls after warm-up."""
    T, B, H = shape
    torch.manual_seed(0)
    forward, _ = models(cell, T, H, "cpu", torch.float32, use_compile=name == "torch.compile")[name]
    x = torch.randn(T, B, H)
    with torch.no_grad():
        start = time.perf_counter()
        forward(x)
        first = time.perf_counter() - start
        for _ in range(2):
            forward(x)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            forward(x)
            times.append(1e3 * (time.perf_counter() - start))
    return {"first s": round(first, 1), "ms": float(np.median(times))}


def in_process(cell: str, shape, name: str, env: dict) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--only", name, "--cells", cell,
               "--shapes", "x".join(map(str, shape))]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name} process: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(cell: str, shape, rounds: int, threads: int) -> dict:
    """One cell and shape: each contender's median over ``rounds`` processes, alternating."""
    times, first = {}, {}
    for _ in range(rounds):
        for name in CONTENDERS:
            ways = (True,) if name == "halstm" or "OMP_WAIT_POLICY" in os.environ else (False, True)
            found = min((in_process(cell, shape, name, worker_environment(threads, passive)) for passive in ways),
                        key=lambda f: f["ms"])
            times.setdefault(name, []).append(found["ms"])
            first.setdefault(name, found["first s"])
    T, B, H = shape
    out = {"cell": cell, "T": T, "B": B, "H": H}
    for name in CONTENDERS:
        out[name], out[f"{name} rounds"], out[f"{name} first s"] = float(np.median(times[name])), times[name], first[name]
    print(json.dumps(out), flush=True)
    return out


def table(rows) -> str:
    lines = ["| cell | (T, B, H) | halstm ms | torch.compile ms | torch eager ms | torch.compile / halstm | "
             "first call s: halstm, torch.compile |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cell']} | ({r['T']},{r['B']},{r['H']}) | {r['halstm']:.2f} | {r['torch.compile']:.2f} | "
              f"{r['torch eager']:.2f} | {r['torch.compile'] / r['halstm']:.2f}x | {r['halstm first s']}, "
              f"{r['torch.compile first s']} |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="PeepholeLSTM,ResetBeforeGRU")
    ap.add_argument("--shapes", default="100x1x256,100x16x512,100x64x512", help="TxBxH,... (I = H)")
    ap.add_argument("--rounds", type=int, default=3, help="the contenders' processes alternated this many times")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="each pool's threads")
    ap.add_argument("--only", choices=CONTENDERS, help=argparse.SUPPRESS)  # time this contender alone
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.only:
        print(json.dumps(alone(args.cells, shapes[0], args.only)))
        return 0
    cells = args.cells.split(",")
    checks = {cell: check(cell) for cell in cells}
    for cell, errors in checks.items():
        print("check", cell, json.dumps(errors), flush=True)
    if not all(e < TOLERANCE for errors in checks.values() for e in errors.values()):
        print("a contender's output is off float64: not timed", file=sys.stderr)
        return 1
    rows = [row(cell, shape, args.rounds, args.threads) for shape in shapes for cell in cells]
    text = (f"CPU forward, float32, {args.threads} threads a pool, medians of {args.rounds} processes each; "
            "float64 check (T, B, H = {}, {}, {}): ".format(*CHECK)
            + "; ".join(f"{c} " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()) for c, errs in checks.items())
            + "\n\n" + table(rows) + "\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_custom.md"), "w") as fh:
        fh.write(text)
    with open(os.path.join(args.out, "cpu_custom.json"), "w") as fh:
        json.dump({"checks": checks, "rows": rows}, fh)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
