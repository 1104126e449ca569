"""Training on batches of changing shape: how often halstm.nn compiles, and what it costs.

A training loop of ``--batches`` steps (``y, _ = model(x); y.backward(dy)``) over batches whose
sequence length is drawn from [--min-steps, --max-steps] and whose batch size cycles through
``--batch-sizes``, run twice, each time in a fresh process sharing one compiled-module cache
(``$HALSTM_CACHE_DIR``, a new temporary folder unless set): the first process compiles, the second
should load everything. Prints a line a step (T, B, ms, functions compiled and loaded so far) and a
summary per process. The modules torch imports on its first backward given a gradient (sympy), as any
torch training loop's, are imported and timed before the first step.

    python benchmarks/dynamic.py [--device cpu|cuda] [--cell LSTM] [--dtype float32] [--layers 2] [--bidirectional]
                                 [--batches 20] [--batch-sizes 8,16] [--input 64] [--hidden 128]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time


# halstm.nn's compilers by what they build (``halstm.nn._compiled``'s first key): the forward, or the one
# that keeps its GEMM results for the backward (while training); the backward, or one that takes the
# forward's kept results
FUNCTIONS = {"forward": ("compile", "_compile_keeping"),
             "backward": ("compile_backward", "_compile_backward_given", "_compile_backward_given_results")}


def loop(args) -> dict:
    """One process's training loop; returns its summary."""
    started = time.perf_counter()
    import torch

    import halstm.nn
    from halstm import cache

    torch.manual_seed(args.seed)
    model = getattr(halstm.nn, args.cell)(args.input, args.hidden, num_layers=args.layers,
                                          bidirectional=args.bidirectional).to(args.device, getattr(torch, args.dtype))
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    lengths = torch.randint(args.min_steps, args.max_steps + 1, (args.batches,)).tolist()
    imported = time.perf_counter() - started
    # torch's first backward given a gradient imports its symbolic shapes (and sympy), as any torch
    # training loop's does: timed apart from the first step
    start = time.perf_counter()
    importlib.import_module("torch.fx.experimental.symbolic_shapes")
    torch_imports = time.perf_counter() - start
    steps = []
    for i, T in enumerate(lengths):
        B = sizes[i % len(sizes)]
        x = torch.randn(T, B, args.input, device=args.device, dtype=getattr(torch, args.dtype))
        start = time.perf_counter()
        y, _ = model(x)
        y.backward(torch.randn_like(y))
        if args.device == "cuda":
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) * 1e3
        compiled = {kind: sum(k[0] in names for k in halstm.nn._COMPILED) for kind, names in FUNCTIONS.items()}
        steps.append({"T": T, "B": B, "ms": ms, **compiled, **cache.stats})
        print(f"  step {i:2d}: T={T:3d} B={B:3d} {ms:9.1f} ms   forward functions {compiled['forward']}, "
              f"backward {compiled['backward']}; cache: {cache.stats['misses']} built, "
              f"{cache.stats['hits']} loaded", flush=True)
    return {"import_s": imported, "torch_imports_s": torch_imports, "first_ms": steps[0]["ms"], "total_s": sum(s["ms"] for s in steps) / 1e3,
            "built": cache.stats["misses"], "loaded": cache.stats["hits"],
            "forward_functions": steps[-1]["forward"], "backward_functions": steps[-1]["backward"],
            "lengths": sorted(set(lengths)), "batch_sizes": sizes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cell", default="LSTM", choices=("LSTM", "GRU"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bidirectional", action="store_true")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--batch-sizes", default="8,16")
    parser.add_argument("--min-steps", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--input", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("SUMMARY " + json.dumps(loop(args)), flush=True)
        return
    env = dict(os.environ)
    env.setdefault("HALSTM_CACHE_DIR", tempfile.mkdtemp(prefix="halstm-dynamic-"))
    env.pop("HALSTM_CACHE", None)
    print(f"{args.cell}, {args.layers} layers{', bidirectional' if args.bidirectional else ''}, I={args.input}, "
          f"H={args.hidden}, {args.batches} batches, T in [{args.min_steps}, {args.max_steps}], "
          f"B in {args.batch_sizes}, {args.device}; cache {env['HALSTM_CACHE_DIR']}")
    summaries = []
    for run in ("first process", "second process"):
        print(run, flush=True)
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child"], env=env, text=True,
                              stdout=subprocess.PIPE)
        lines = done.stdout.splitlines()
        print("\n".join(line for line in lines if not line.startswith("SUMMARY ")))
        summary = next((line for line in lines if line.startswith("SUMMARY ")), None)
        if done.returncode:
            print(f"  the process exited with status {done.returncode}"
                  f"{' after its loop' if summary else ''}", flush=True)
        if summary is None:
            return 1
        summaries.append(json.loads(summary[8:]))
    print("\n| process | functions compiled | loaded from the cache | torch's backward imports s | first step s | "
          "whole loop s | distinct T | forward / backward functions |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in zip(("first", "second"), summaries):
        print(f"| {name} | {s['built']} | {s['loaded']} | {s['torch_imports_s']:.2f} | {s['first_ms'] / 1e3:.2f} | "
              f"{s['total_s']:.1f} | "
              f"{len(s['lengths'])} | {s['forward_functions']} / {s['backward_functions']} |")


if __name__ == "__main__":
    sys.exit(main())
