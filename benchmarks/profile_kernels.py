"""Run one compiled cell a few times on the GPU, for a profiler to read its kernels:

    ncu --clock-control none --print-summary per-kernel python benchmarks/profile_kernels.py LSTM 4,64,1024 float32

--knobs takes a JSON object of knob overrides for halstm.compile (which refuses a setting the recipe
says cannot run; settings its tuner would skip as slow or redundant are allowed).
"""

from __future__ import annotations

import argparse
import json

import torch

import halstm
from halstm.cells import BUILTIN
from halstm.targets import CudaTarget


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cell", choices=sorted(BUILTIN))
    ap.add_argument("shape", help="T,B,H (I = H)")
    ap.add_argument("dtype", nargs="?", default="float32")
    ap.add_argument("--recipe", default=None)
    ap.add_argument("--knobs", type=json.loads, default=None, help="JSON object of knob overrides")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    T, B, H = map(int, a.shape.split(","))
    cell = BUILTIN[a.cell](H, H)
    f = halstm.compile(cell, T, B, a.dtype, target=CudaTarget.detect(), recipe=a.recipe, knobs=a.knobs)
    print(f"{a.cell} T={T} B={B} H={H} {a.dtype}: recipe {f.recipe.name} {f.knobs}")
    dt = getattr(torch, a.dtype)
    x = torch.randn(T, B, H, dtype=dt, device="cuda")
    params = {n: (torch.rand(s, device="cuda") * 0.1 - 0.05).to(dt) for n, s in cell.parameters().items()}
    for _ in range(a.repeat):
        f(x, params)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
