"""GPU benchmark, one run: check every CUDA recipe x cell x dtype against the float64 reference, then time
halstm (each applicable recipe) against cuDNN (torch.nn.LSTM/GRU) and, for the custom cells, a torch eager
loop and torch.compile(mode="reduce-overhead") of the same cell. Writes results.md, results.json and
results.png into the folder given (default $OUT).

    python benchmarks/gpu.py [--shapes 0,1,2] [--cells LSTM,GRU] [--out DIR] [--no-compile] [--no-check]

Every halstm function is first compiled in parallel worker processes (the machine's cores; one at a
time, compiling would take most of the benchmark's time) and exported; the timed run loads them
(``halstm.load``) and reports each one's own compile time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

import halstm
from halstm import schedules
from halstm.bench import save_png
from halstm.targets import CudaTarget

SHAPES = [(100, 1, 256), (100, 16, 512), (100, 64, 1024), (100, 256, 1024), (512, 64, 512),
          (100, 64, 2048), (1024, 16, 768), (100, 8, 512), (100, 64, 512)]
CELLS = {"LSTM": halstm.LSTM, "GRU": halstm.GRU, "PeepholeLSTM": halstm.PeepholeLSTM,
         "ResetBeforeGRU": halstm.ResetBeforeGRU, "LayerNormLSTM": halstm.LayerNormLSTM,
         "LayerNormGRU": halstm.LayerNormGRU}
TOL = {"float32": 1e-5, "tf32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2}
# "tf32": float32 tensors, GEMMs on tensor cores as TF32 (halstm.compile's allow_tf32; cuDNN's default)
RECIPES = [r.name for r in schedules.BUILTIN if r.name.startswith("cuda")]
CHECK_SHAPE = (3, 2, 20, 24)  # T, B, I, H


def storage(dtype: str) -> str:
    """The tensors' dtype of a benchmark dtype."""
    return "float32" if dtype == "tf32" else dtype


def applicable(name, T, B, I, H, dtype, recipe, target, every_recipe=False) -> bool:
    program = halstm.lower(CELLS[name](I, H), T, B, storage(dtype), allow_tf32=dtype == "tf32")
    found = [r.name for r in schedules.recipes_for(program, target)]
    if recipe == "cuda-persistent" and not every_recipe:
        # slower than the step loop where recipes_for does not prefer it (docs/results.md);
        # --every-recipe times it
        return found[:1] == [recipe]
    return recipe in found


def build(job, target, folder):
    """Compile and export one function (in a worker process): (job, seconds or None, error or None)."""
    path = os.path.join(folder, "-".join(map(str, job)) + ".so")
    name, T, B, I, H, dtype, recipe = job  # T "any": a function for any sequence length
    start = time.time()
    try:
        halstm.export(halstm.compile(CELLS[name](I, H), None if T == "any" else T, B, storage(dtype), target=target,
                                     recipe=recipe,
                                     allow_tf32=dtype == "tf32"), path)
        return job, round(time.time() - start, 1), None
    except Exception as e:  # recorded, the run goes on
        return job, None, str(e).strip().splitlines()[-1][:200]


class Built:
    """Every function of the run compiled in parallel, then loaded on demand."""

    def __init__(self, jobs, target, workers):
        self.folder = tempfile.mkdtemp(prefix="halstm-gpu-")
        ctx = multiprocessing.get_context("spawn")  # the parent holds a CUDA context
        start = time.time()
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            done = list(pool.map(build, jobs, [target] * len(jobs), [self.folder] * len(jobs)))
        self.results = {job: (seconds, error) for job, seconds, error in done}
        print(f"compiled {len(jobs)} functions in {time.time() - start:.0f} s on {workers} processes", flush=True)

    def load(self, job):
        """(function, compile seconds); raises with the compile error if it failed."""
        seconds, error = self.results[job]
        if error:
            raise RuntimeError(error)
        return halstm.load(os.path.join(self.folder, "-".join(map(str, job)) + ".so")), seconds


def inputs(cell, T, B, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    bound = 1 / cell.hidden_size ** 0.5
    dt = getattr(torch, storage(dtype))
    x = torch.randn(T, B, cell.input_size, generator=g).to(dt).cuda()
    params = {n: ((torch.rand(s, generator=g) * 2 - 1) * bound).to(dt).cuda() for n, s in cell.parameters().items()}
    states = {s: (0.5 * torch.randn(B, cell.hidden_size, generator=g)).to(dt).cuda() for s in cell.states}
    return x, params, states


def rel(got, want):
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check_jobs():
    return [(name, *CHECK_SHAPE, dtype, recipe) for name in CELLS for dtype in TOL for recipe in RECIPES]


def check(built):
    rows = []
    for job in check_jobs():
        name, T, B, I, H, dtype, recipe = job
        cell = CELLS[name](I, H)
        x, p, s = inputs(cell, T, B, dtype, seed=int(time.time()))
        try:
            f, _ = built.load(job)
            y, fin = f(x, p, s)
            torch.cuda.synchronize()
            f64 = lambda d: {k: v.double().cpu().numpy() for k, v in d.items()}
            wy, ws = halstm.reference(cell, x.double().cpu().numpy(), f64(p), f64(s))
            err = max([rel(y.double().cpu().numpy(), wy)] + [rel(fin[k].double().cpu().numpy(), ws[k]) for k in ws])
            ok = err < TOL[dtype]
        except Exception as e:  # recorded, the run goes on
            err, ok = str(e).splitlines()[-1][:120], False
        rows.append((name, dtype, recipe, err, ok))
        print("check", name, dtype, recipe, err, "PASS" if ok else "FAIL", flush=True)
    return rows


def timed(fn, warm=3, reps=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def graphed(fn):
    """``fn`` captured once as a CUDA graph (after a warm-up on a side stream, as torch asks);
    returns its replay. halstm launches on torch's current stream, so the capture sees its kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def measured_peak(dtype: str, n: int = 8192) -> float:
    """TFLOP/s of torch.matmul of two n x n matrices: fp32 without TF32 (torch's default for matmul)
    is the FFMA peak halstm's fp32 GEMMs can reach, tf32 and fp16/bf16 the tensor cores' peaks."""
    a, b = (torch.randn(n, n, device="cuda", dtype=getattr(torch, storage(dtype))) for _ in range(2))
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        return 2 * n ** 3 / timed(lambda: a @ b) / 1e9
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def torch_cell(name, p):
    """The custom cells' step in torch, from the same parameter dict."""
    def peephole(x, h, c):
        gi, gf, gg, go = (x @ p["weight_ih"].T + p["bias"] + h @ p["weight_hh"].T).chunk(4, 1)
        c2 = torch.sigmoid(gf + p["peep_f"] * c) * c + torch.sigmoid(gi + p["peep_i"] * c) * torch.tanh(gg)
        return torch.sigmoid(go + p["peep_o"] * c2) * torch.tanh(c2), c2

    def reset_before(x, h):
        xr, xz, xn = (x @ p["weight_ih"].T + p["bias"]).chunk(3, 1)
        r = torch.sigmoid(xr + h @ p["weight_hr"].T)
        z = torch.sigmoid(xz + h @ p["weight_hz"].T)
        n = torch.tanh(xn + (r * h) @ p["weight_hn"].T)
        return ((1 - z) * n + z * h,)

    ln = torch.nn.functional.layer_norm

    def layer_norm_lstm(x, h, c):
        width = p["bias"].shape
        gates = ln(x @ p["weight_ih"].T, width, p["gamma_ih"]) + ln(h @ p["weight_hh"].T, width, p["gamma_hh"]) + p["bias"]
        gi, gf, gg, go = gates.chunk(4, 1)
        c2 = torch.sigmoid(gf) * c + torch.sigmoid(gi) * torch.tanh(gg)
        return torch.sigmoid(go) * torch.tanh(ln(c2, c2.shape[-1:], p["gamma_c"], p["beta_c"])), c2

    def layer_norm_gru(x, h):
        width = p["bias_ih"].shape
        xr, xz, xn = (ln(x @ p["weight_ih"].T, width, p["gamma_ih"]) + p["bias_ih"]).chunk(3, 1)
        hr, hz, hn = (ln(h @ p["weight_hh"].T, width, p["gamma_hh"]) + p["bias_hh"]).chunk(3, 1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        return ((1 - z) * torch.tanh(xn + r * hn) + z * h,)

    def min_gru(x, h):
        z, h_tilde = (x @ p["weight_ih"].T + p["bias_ih"]).chunk(2, 1)
        z = torch.sigmoid(z)
        return ((1 - z) * h + z * h_tilde,)

    def min_lstm(x, h):
        f, i, h_tilde = (x @ p["weight_ih"].T + p["bias_ih"]).chunk(3, 1)
        f, i = torch.sigmoid(f), torch.sigmoid(i)
        return (f / (f + i) * h + i / (f + i) * h_tilde,)

    def sru(x, h, c):
        xt, f, r = (x @ p["weight"].T).chunk(3, 1)
        f, r = torch.sigmoid(f + p["bias_f"]), torch.sigmoid(r + p["bias_r"])
        c2 = f * c + (1 - f) * xt
        skip = x @ p["weight_skip"].T if "weight_skip" in p else x
        return r * torch.tanh(c2) + (1 - r) * skip, c2

    def rglru(x, h):
        r, i, u = (x @ p["weight_ih"].T + p["bias_ih"]).chunk(3, 1)
        log_a = -8 * torch.sigmoid(r) * torch.nn.functional.softplus(-p["log_a"])
        return (torch.exp(log_a) * h + torch.sqrt(-torch.expm1(2 * log_a)) * (torch.sigmoid(i) * u),)

    return {"PeepholeLSTM": peephole, "ResetBeforeGRU": reset_before, "LayerNormLSTM": layer_norm_lstm,
            "LayerNormGRU": layer_norm_gru, "MinGRU": min_gru, "MinLSTM": min_lstm, "SRU": sru, "RGLRU": rglru}[name]


def bench_jobs(shapes, cells, dtypes, target, every_recipe):
    return [(name, T, B, H, H, dtype, recipe) for T, B, H in shapes for name in cells
            for dtype in dtypes for recipe in RECIPES
            if applicable(name, T, B, H, H, dtype, recipe, target, every_recipe)]


def bench(built, shapes, cells, dtypes, use_compile, use_graphs, out):
    rows = []
    peaks = {dtype: round(measured_peak(dtype), 1) for dtype in dtypes}
    for T, B, H in shapes:
        for name in cells:
            for dtype in dtypes:
                cell = CELLS[name](H, H)
                x, p, s = inputs(cell, T, B, dtype, seed=0)
                row = {"T": T, "B": B, "H": H, "cell": name, "dtype": dtype, "peak TFLOP/s": peaks[dtype]}
                for recipe in RECIPES:
                    job = (name, T, B, H, H, dtype, recipe)
                    row[recipe] = None
                    if job not in built.results:
                        continue
                    try:
                        f, row[f"{recipe} compile s"] = built.load(job)
                        row[recipe] = timed(lambda: f(x, p, s))
                        row[f"{recipe} prepared"] = timed(f.prepare(x, p, s))  # without argument checks
                    except Exception as e:
                        row[f"{recipe} error"] = str(e).splitlines()[-1][:200]
                        continue
                    if not use_graphs:
                        continue
                    try:  # an experiment: what replaying the call's launches as a CUDA graph would save
                        row[f"{recipe} graphed"] = timed(graphed(lambda: f(x, p, s)))
                    except Exception as e:
                        row[f"{recipe} graph error"] = str(e).splitlines()[-1][:200]
                if name in ("LSTM", "GRU"):
                    mod = getattr(torch.nn, name)(H, H).cuda().to(getattr(torch, storage(dtype)))
                    mod.load_state_dict({f"{k}_l0": v for k, v in p.items()})
                    hx = (s["h"][None], s["c"][None]) if name == "LSTM" else s["h"][None]
                    with torch.no_grad():
                        row["cudnn"] = timed(lambda: mod(x, hx))  # TF32 allowed: torch's default
                        if dtype == "float32":
                            torch.backends.cudnn.allow_tf32 = False
                            row["cudnn fp32"] = timed(lambda: mod(x, hx))
                            torch.backends.cudnn.allow_tf32 = True
                else:
                    step = torch_cell(name, p)

                    def loop(step=step):
                        st = tuple(s[k] for k in cell.states)
                        ys = []
                        for t in range(T):
                            st = step(x[t], *st)
                            ys.append(st[0])
                        return torch.stack(ys)

                    with torch.no_grad():
                        row["eager"] = timed(loop, warm=1, reps=3)
                        if use_compile:
                            t0 = time.time()
                            comp = torch.compile(loop, mode="reduce-overhead")
                            comp(); comp()
                            row["compile s"] = round(time.time() - t0, 1)
                            row["torch.compile"] = timed(comp)
                print(json.dumps(row), flush=True)
                rows.append(row)
                with open(os.path.join(out, "results.json"), "w") as fh:
                    json.dump(rows, fh)
    return rows


def ms(v):
    return "-" if v is None else f"{v:.3f}"


def gemm_flops(row) -> int:
    """Multiply-adds x 2 of the cell's GEMMs (hoisted and recurrent) over the sequence."""
    plan = halstm.make_plan(CELLS[row["cell"]](row["H"], row["H"]))
    return 2 * row["T"] * row["B"] * sum(g.rows * g.depth for g in plan.gemms)


def table(rows, device):
    graphed = [f"{k} graphed" for k in RECIPES if any(f"{k} graphed" in r for r in rows)]  # --graphs
    lines = [f"GPU: {device}", "",
             "| T | B | H | cell | dtype | " + " | ".join(f"{k} ms" for k in RECIPES + graphed)
             + " | best us/step | best TFLOP/s | % of peak | cuDNN ms | cuDNN no-TF32 ms | eager ms | torch.compile ms | ratio cuDNN/best | halstm compile s |",
             "|" + "---|" * (14 + len(RECIPES) + len(graphed))]
    for r in rows:
        ours = [r.get(k) for k in RECIPES if r.get(k) is not None]
        best = min(ours) if ours else None
        base = r.get("cudnn") or r.get("torch.compile")
        ratio = f"{base / best:.2f}" if base and best else "-"
        comp = max([r.get(f"{k} compile s", 0) for k in RECIPES])
        step_us = "-" if best is None else f"{1000 * best / r['T']:.1f}"
        tflops = None if best is None else gemm_flops(r) / best / 1e9
        peak = "-" if tflops is None or "peak TFLOP/s" not in r else f"{100 * tflops / r['peak TFLOP/s']:.0f}"
        tflops = "-" if tflops is None else f"{tflops:.1f}"
        lines.append(f"| {r['T']} | {r['B']} | {r['H']} | {r['cell']} | {r['dtype']} | "
                     + " | ".join(ms(r.get(k)) for k in RECIPES + graphed)
                     + f" | {step_us} | {tflops} | {peak} | {ms(r.get('cudnn'))} | {ms(r.get('cudnn fp32'))} | "
                     f"{ms(r.get('eager'))} | {ms(r.get('torch.compile'))} | {ratio} | {comp} |")
    peaks = {r["dtype"]: r["peak TFLOP/s"] for r in rows if "peak TFLOP/s" in r}
    return ("\n".join(lines) + "\n\nratio: cuDNN time (LSTM/GRU) or torch.compile time (custom cells) over halstm's best; > 1 is faster.\n"
            + ("graphed: the same call captured once as a CUDA graph and replayed (not halstm's API; an experiment). "
               if graphed else "")
            + ("% of peak: best TFLOP/s over this GPU's measured peak, torch.matmul of 8192 x 8192 (fp32 without TF32): "
               + ", ".join(f"{d} {v} TFLOP/s" for d, v in peaks.items()) + ".\n" if peaks else ""))


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels, series = [], {k: [] for k in RECIPES + ["cudnn", "torch.compile"]}
    for r in rows:
        labels.append(f"{r['cell'][:5]} {r['dtype'].removeprefix('float')}\n{r['T']},{r['B']},{r['H']}")
        for k in series:
            series[k].append(1000 * r[k] / r["T"] if r.get(k) else np.nan)
    xs = np.arange(len(labels))
    w = 0.8 / len(series)
    for i, (k, v) in enumerate(series.items()):
        ax.bar(xs + i * w, v, w, label=k)
    ax.set_xticks(xs + 0.4, labels, fontsize=5, rotation=90)
    ax.set_yscale("log")
    ax.set_ylabel("us per step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path, dpi=80)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(map(str, range(len(SHAPES)))))
    ap.add_argument("--dtypes", default="float32,tf32,float16")
    ap.add_argument("--cells", default=",".join(CELLS), help="timed cells (the checks run every cell)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (20-30 s a cell)")
    ap.add_argument("--every-recipe", action="store_true",
                    help="time the persistent kernel also where recipes_for puts the step loop first")
    ap.add_argument("--graphs", action="store_true",
                    help="also time each call captured as a CUDA graph (an experiment; a failed capture may upset the run)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness checks at T=3, B=2")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                    help="processes compiling halstm functions")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    target = CudaTarget.detect()
    print(target, flush=True)
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else []
    dtypes, cells = args.dtypes.split(","), args.cells.split(",")
    jobs = ([] if args.no_check else check_jobs()) + bench_jobs(shapes, cells, dtypes, target, args.every_recipe)
    built = Built(jobs, target, args.workers)
    checks = [] if args.no_check else check(built)
    rows = bench(built, shapes, cells, dtypes, not args.no_compile, args.graphs, args.out)
    text = "## Correctness (T=3, B=2, I=20, H=24, relative norm error vs float64)\n\n| cell | dtype | recipe | error | ok |\n|---|---|---|---|---|\n"
    text += "\n".join(f"| {a} | {b} | {c} | {d if isinstance(d, str) else f'{d:.1e}'} | {e} |" for a, b, c, d, e in checks)
    text += "\n\n## Timing (median of 10 after warm-up, CUDA events; eager: median of 3)\n\n" + table(rows, target.name)
    with open(os.path.join(args.out, "results.md"), "w") as fh:
        fh.write(text)
    plot(rows, os.path.join(args.out, "results.png"))
    print(text)
    return 0 if all(c[-1] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
