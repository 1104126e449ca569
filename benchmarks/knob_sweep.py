"""Time one cell at one shape with several knob settings of one recipe, side by side with cuDNN:

    python3 benchmarks/knob_sweep.py LSTM 100,64,1024 float16 --recipe cuda-step-loop \\
        --knobs '{"tc_step_k":32,"tc_prefetch":false,"tc_fill":false}' '{"tc_step_k":64}' --out $OUT

Each setting (the recipe's defaults first, then each --knobs JSON object over them) is compiled,
checked once against the float64 reference (``halstm.reference``) at that shape with the same inputs,
and timed: median of --reps calls after warm-up, CUDA events, with benchmarks/gpu.py's inputs and timer. LSTM and
GRU are timed against torch.nn.LSTM/GRU (cuDNN) in the same run, before and after the settings (both
medians are kept; the ratio uses their mean). Prints a markdown table (knobs, ms, us/step, ratio
cuDNN/halstm, error) and writes sweep-<cell>-<T>x<B>x<H>-<dtype>-<recipe>.json (and .md) into --out
(default $OUT, else the current folder). A setting the recipe's valid() rejects, or that fails to
compile or run, is reported as such and the sweep goes on. With --reversed-loop the settings are the
cell's backward's reversed loop's (its adjoint cell, ``halstm.gradients.reversed_loop``, over T + 1
steps, as ``compile_backward`` builds it), without cuDNN:

    python3 benchmarks/knob_sweep.py GRU 100,16,512 float16 --recipe cuda-persistent --reversed-loop \
        --knobs '{"units":4}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import halstm
from halstm import schedules
from halstm.cells import BUILTIN
from halstm.targets import CudaTarget

from gpu import TOL, inputs, rel, storage, timed  # noqa: E402 (beside this script: the same inputs, timing)


def cudnn_module(name, H, dtype, params, states):
    """torch.nn.LSTM/GRU (cuDNN) with the same weights, and its initial state (None, None for other
    cells)."""
    if name not in ("LSTM", "GRU"):
        return None, None
    mod = getattr(torch.nn, name)(H, H).cuda().to(getattr(torch, storage(dtype)))
    mod.load_state_dict({f"{k}_l0": v for k, v in params.items()})
    hx = (states["h"][None], states["c"][None]) if name == "LSTM" else states["h"][None]
    return mod, hx


def cudnn(name, H, dtype, params, states, x, reps):
    """Median ms of torch.nn.LSTM/GRU on the same inputs and weights (None for other cells)."""
    mod, hx = cudnn_module(name, H, dtype, params, states)
    if mod is None:
        return None
    with torch.no_grad():
        return timed(lambda: mod(x, hx), reps=reps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cell", choices=sorted(BUILTIN))
    ap.add_argument("shape", help="T,B,H (I = H)")
    ap.add_argument("dtype", choices=sorted(TOL))
    ap.add_argument("--recipe", default="cuda-step-loop", choices=[r.name for r in schedules.BUILTIN])
    ap.add_argument("--knobs", nargs="*", default=[], help="JSON objects, each a setting over the defaults")
    ap.add_argument("--no-defaults", action="store_true", help="only the --knobs settings")
    ap.add_argument("--reversed-loop", action="store_true", help="the settings of the backward's reversed loop")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    T, B, H = map(int, a.shape.split(","))
    cell = BUILTIN[a.cell](H, H)
    target = CudaTarget.detect()
    if a.reversed_loop:
        from halstm.gradients import reversed_loop

        cell = reversed_loop(cell, T, B, storage(a.dtype), target, allow_tf32=a.dtype == "tf32")
        T += 1  # the loop runs T + 1 steps
    name = cell.name  # the cell's, or its adjoint's ("LSTMAdjoint")
    recipe = next(r for r in schedules.BUILTIN if r.name == a.recipe)
    tf32 = a.dtype == "tf32"
    program = halstm.lower(cell, T, B, storage(a.dtype), allow_tf32=tf32)
    defaults = recipe.defaults(program, target)
    settings = ([] if a.no_defaults else [{}]) + [json.loads(k) for k in a.knobs]
    print(f"{name} T={T} B={B} H={H} {a.dtype} on {target.name} ({target.sms} SMs), recipe {a.recipe}")
    print(f"defaults: {json.dumps(defaults)}", flush=True)

    x, params, states = inputs(cell, T, B, a.dtype, seed=0)
    f64 = lambda d: {k: v.double().cpu().numpy() for k, v in d.items()}
    start = time.time()
    want_y, want_states = halstm.reference(cell, x.double().cpu().numpy(), f64(params), f64(states))
    print(f"float64 reference in {time.time() - start:.1f} s", flush=True)

    rows = []
    base_before = cudnn(name, H, a.dtype, params, states, x, a.reps)
    for overrides in settings:
        row = {"knobs": overrides}
        rows.append(row)
        try:
            row["resolved"] = recipe.resolve(program, target, overrides)  # raises on an unknown knob
            row["valid"] = recipe.valid(program, target, row["resolved"])
        except Exception as e:
            row.update(valid=False, error=str(e).strip().splitlines()[-1][:300])
            print(json.dumps(row), flush=True)
            continue
        if not row["valid"]:
            row["error"] = "rejected by the recipe's valid()"
            print(json.dumps(row), flush=True)
            continue
        try:
            start = time.time()
            f = halstm.compile(cell, T, B, storage(a.dtype), target=target, recipe=recipe, knobs=overrides,
                               database=False, allow_tf32=tf32)
            row["compile s"] = round(time.time() - start, 1)
            y, final = f(x, params, states)
            torch.cuda.synchronize()
            row["error"] = max([rel(y.double().cpu().numpy(), want_y)]
                               + [rel(final[k].double().cpu().numpy(), want_states[k]) for k in want_states])
            row["correct"] = row["error"] < TOL[a.dtype]
            row["ms"] = timed(lambda: f(x, params, states), reps=a.reps)
            row["prepared ms"] = timed(f.prepare(x, params, states), reps=a.reps)  # without argument checks
        except Exception as e:  # recorded, the sweep goes on
            row["error"] = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        print(json.dumps(row), flush=True)
    base_after = cudnn(name, H, a.dtype, params, states, x, a.reps)
    base = None if base_before is None else (base_before + base_after) / 2

    lines = [f"{name} T={T} B={B} H={H} {a.dtype}, {a.recipe}, {target.name}: median of {a.reps} calls, "
             f"CUDA events; cuDNN {_ms(base_before)} ms before the settings, {_ms(base_after)} after",
             "", "| knobs | ms | prepared ms | us/step | cuDNN/halstm | rel. error |", "|---|---|---|---|---|---|"]
    for row in rows:
        ms = row.get("ms")
        error = row.get("error")
        check = (f"{error:.1e}" + ("" if row.get("correct") else " FAIL")) if isinstance(error, float) else str(error)
        lines.append(f"| {_label(row['knobs'], defaults, recipe)} | {_ms(ms)} | "
                     f"{_ms(row.get('prepared ms'))} | {'' if ms is None else f'{1000 * ms / T:.1f}'} | "
                     f"{'' if ms is None or base is None else f'{base / ms:.2f}'} | {check} |")
    if base is not None:
        lines.append(f"| cuDNN (torch.nn.{a.cell}) | {_ms(base)} | | {1000 * base / T:.1f} | 1.00 | |")
    text = "\n".join(lines)
    print("\n" + text)
    os.makedirs(a.out, exist_ok=True)
    result = {"cell": name, "T": T, "B": B, "H": H, "dtype": a.dtype, "recipe": a.recipe, "device": target.name,
              "sms": target.sms, "reps": a.reps, "defaults": defaults, "cudnn ms": [base_before, base_after],
              "rows": rows}
    stem = os.path.join(a.out, f"sweep-{name}-{T}x{B}x{H}-{a.dtype}-{a.recipe}")
    with open(stem + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    with open(stem + ".md", "w") as fh:
        fh.write(text + "\n")
    return 0 if all(r.get("correct", False) for r in rows if r.get("valid")) else 1


def _label(overrides: dict, defaults: dict, recipe) -> str:
    """The setting as given, or for the defaults those that differ from each knob's first value."""
    if overrides:
        return f"`{json.dumps(overrides)}`"
    moved = {n: v for n, v in defaults.items() if v != recipe.knobs[n][0]}
    return f"defaults `{json.dumps(moved)}`" if moved else "defaults"


def _ms(v) -> str:
    return "" if v is None else f"{v:.3f}"


if __name__ == "__main__":
    sys.exit(main())
