"""How long halstm takes to compile a cell for training, as halstm.nn compiles one layer direction: the
forward and the backward, both for any sequence length, each cell in a fresh process (nothing cached
in memory, the compiled-module cache off). A GPU is not needed to compile for one:

    python benchmarks/compile_time.py --cells LayerNormLSTM,LayerNormGRU --batch 16 --hidden 512 \
        --dtype float16 --arch sm_90 --sms 132

--profile prints each compile's cProfile summary (the calls with the most cumulative time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def compile_once(cell_name: str, batch: int, hidden: int, dtype: str, arch: str, sms: int, profile: bool) -> dict:
    """In this process: seconds to compile the forward and the backward, and the recipes chosen."""
    import time

    import halstm
    from halstm.targets import CudaTarget

    target = CudaTarget(arch, sms=sms)
    cell = getattr(halstm, cell_name)(hidden, hidden)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    start = time.perf_counter()
    forward = halstm.compile(cell, None, batch, dtype, target=target)
    middle = time.perf_counter()
    backward = halstm.compile_backward(cell, None, batch, dtype, target=target)
    end = time.perf_counter()
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    return {"cell": cell_name, "forward s": round(middle - start, 2), "backward s": round(end - middle, 2),
            "forward recipe": forward.recipe.name, "reversed loop recipe": backward.adjoint.recipe.name}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="LSTM,GRU,PeepholeLSTM,LayerNormLSTM,LayerNormGRU")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512, help="H (I = H)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: compile this cell, print JSON
    a = ap.parse_args()
    if a.one:
        print(json.dumps(compile_once(a.one, a.batch, a.hidden, a.dtype, a.arch, a.sms, a.profile)))
        return
    env = {**os.environ, "HALSTM_CACHE": "0"}
    print("| cell | forward s | backward s | forward recipe | reversed loop recipe |\n|---|---|---|---|---|")
    for name in a.cells.split(","):
        args = [sys.executable, __file__, "--one", name, "--batch", str(a.batch), "--hidden", str(a.hidden),
                "--dtype", a.dtype, "--arch", a.arch, "--sms", str(a.sms)] + (["--profile"] if a.profile else [])
        row = json.loads(subprocess.run(args, env=env, check=True, text=True,
                                        stdout=subprocess.PIPE).stdout.splitlines()[-1])
        print(f"| {name} | {row['forward s']} | {row['backward s']} | {row['forward recipe']} "
              f"| {row['reversed loop recipe']} |", flush=True)


if __name__ == "__main__":
    main()
