"""Diagonal recurrences (h' = a(x) * h + b(x)) over long sequences, one run: halstm's parallel scan
over T beside its sequential time loop, a torch loop of the cell's step (eager and torch.compile) and
a torch parallel scan, forward and forward + backward.

Contenders (``--skip`` leaves any out by name):
  halstm-scan        halstm.compile(cell, T, B, dtype, target, recipe="cuda-scan" or "cpu-scan")
  halstm-persistent  halstm's sequential time loop, recipe "cuda-persistent" (CUDA only)
  halstm-step-loop   the same, recipe "cuda-step-loop" or "cpu-step-loop"
  torch-eager        a Python loop over T of the cell's step in torch (benchmarks/gpu.py's torch_cell)
  torch-compile      the same loop, of torch.compile(step): the step is what is compiled (compiling
                     the loop would unroll its thousands of steps). On CUDA, forward: mode
                     "reduce-overhead" (a CUDA graph replay a step, each step's states cloned out of
                     the graph's pool, as its replays overwrite them); in training and on the CPU the
                     default mode (replays would overwrite the activations the backward keeps).
  torch-scan         torch._higher_order_ops.associative_scan of the (a, b) pairs along T, combined as
                     ((a1, b1), (a2, b2)) -> (a1 a2, a2 b1 + b2), under torch.compile as it requires;
                     a and b from one jvp of the step over all T*B rows at zero states (b the value,
                     a the slope), accumulated in float32; states that do not read themselves (an
                     SRU's h) computed after the scan by the step over all rows. Cells whose step is
                     not elementwise affine in a state that reads itself are refused.
Training (--modes training): a step is y = f(x) and the gradients of x and every parameter for a random
dL/dy; halstm's is the compiled forward and ``compile_backward(..., loop_recipe=<the recipe>)`` called
on prepared arguments (the forward's state sequences bound once), timed together.

Every contender is checked first against a float64 torch loop of the step on the same inputs, at a
small shape and at each benchmark shape (relative norm error of y, and in training of every gradient;
fp32 1e-5, bf16/fp16 1e-2); one that fails (unless --time-failing) or does not build is reported and
not timed (at no shape, where that was at the small one). Timing: median ms (CUDA events), repetitions
fitted to about --budget seconds a contender (3 to --rounds). Compile time: halstm's compile and first
call; torch's first call.

    python benchmarks/scan.py                                # MinGRU, T 1024/4096/16384, B=8, H=1024, CUDA
    python benchmarks/scan.py --cells MinGRU,MinLSTM,SRU,RGLRU --shapes 4096x8x1024 --dtypes bfloat16 --out DIR
    python benchmarks/scan.py --device cpu --tiny --cells GRU   # smoke test of this script on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch
from gpu import torch_cell  # the custom cells' step in torch
from torch._higher_order_ops import associative_scan

import halstm
from halstm.gradients import compile_backward

SHAPES = "1024x8x1024,4096x8x1024,16384x8x1024"  # T x B x H (I = H)
TINY = (16, 2, 32)
CHECK = (64, 8, 64)
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
RECIPES = {"halstm-scan": "{}-scan", "halstm-persistent": "cuda-persistent", "halstm-step-loop": "{}-step-loop"}
SEQUENTIAL = ("halstm-persistent", "halstm-step-loop")
TORCH = ("torch-eager", "torch-compile", "torch-scan")
notes = set()  # said once a run


def one_line(e: Exception) -> str:
    line = ([ln.strip() for ln in str(e).splitlines() if ln.strip()] or [""])[0]
    return (line if line.startswith(type(e).__name__) else f"{type(e).__name__}: {line}")[:240]


def as_tuple(states):
    return states if isinstance(states, tuple) else (states,)


def torch_step(cell, p):
    """The cell's step in torch from its parameter dict: ``states' = step(x, *states)``."""
    if type(cell).__name__ == "GRU":  # not diagonal: a smoke test of the script on a cell at hand
        def gru(x, h):
            xr, xz, xn = (x @ p["weight_ih"].T + p["bias_ih"]).chunk(3, 1)
            hr, hz, hn = (h @ p["weight_hh"].T + p["bias_hh"]).chunk(3, 1)
            r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
            return ((1 - z) * torch.tanh(xn + r * hn) + z * h,)
        return gru
    try:
        return torch_cell(type(cell).__name__, p)
    except KeyError:
        raise NotImplementedError(f"benchmarks/gpu.py's torch_cell has no {type(cell).__name__}") from None


def loop(step, cell, x, graphs=False):
    """The output sequence (T, B, H) of the step looped over x from zero states; ``graphs``: each
    step a CUDA graph replay, its states cloned out of the graph's pool before the next."""
    out, ys = cell.states.index(cell.output), []
    states = tuple(x.new_zeros(x.shape[1], cell.hidden_size) for _ in cell.states)
    for t in range(x.shape[0]):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        states = as_tuple(step(x[t], *states))
        if graphs:
            states = tuple(s.clone() for s in states)
        ys.append(states[out])
    return torch.stack(ys)


def scanned_states(step, cell, x) -> list[int]:
    """The states the step is elementwise affine in, of those that read themselves (jvp, float64:
    the slope along ones is the same at two states, and along v it is that slope times v)."""
    n, found = len(cell.states), []
    at = [[torch.randn(x.shape[0], cell.hidden_size, dtype=x.dtype, device=x.device) for _ in range(n)] for _ in "ab"]
    for i, s in enumerate(cell.states):
        def slope(states, v):
            tangents = tuple(v if j == i else torch.zeros_like(v) for j in range(n))
            return as_tuple(torch.func.jvp(lambda *S: as_tuple(step(x, *S)), tuple(states), tangents)[1])[i]
        ones, v = torch.ones_like(at[0][0]), torch.randn_like(at[0][0])
        a = slope(at[0], ones)
        if not a.any():
            continue  # s' does not read s: computed after the scan
        if not (torch.allclose(slope(at[1], ones), a) and torch.allclose(slope(at[0], v), a * v)):
            raise NotImplementedError(f"{s}' is not elementwise affine in {s}: not a diagonal recurrence")
        found.append(i)
    if not found:
        raise NotImplementedError("no state reads itself")
    return found


def combine(left, right):
    (a1, b1), (a2, b2) = left, right
    return a1 * a2, a2 * b1 + b2


def parallel(step, cell, scanned, mode):
    """x -> the output sequence by associative scans over T (torch-scan)."""
    n, out, H = len(cell.states), cell.states.index(cell.output), cell.hidden_size

    def forward(x):
        T, B, _ = x.shape
        X = x.reshape(T * B, -1)
        zero = X.new_zeros(T * B, H)
        tangents = tuple(torch.ones_like(zero) if i in scanned else zero for i in range(n))
        values, slopes = torch.func.jvp(lambda *S: as_tuple(step(X, *S)), (zero,) * n, tangents)
        seqs = {}
        for i in scanned:
            a, b = (v.view(T, B, H).float() for v in (slopes[i], values[i]))
            seqs[i] = associative_scan(combine, (a, b), dim=0, combine_mode=mode)[1].to(x.dtype)
        if out in seqs:
            return seqs[out]
        before = [torch.cat([zero[:B][None], seqs[i][:-1]]).reshape(T * B, H) if i in seqs else zero for i in range(n)]
        return as_tuple(step(X, *before))[out].view(T, B, H)

    return forward


class Problem:
    """A cell's inputs and parameters (its init_parameters), the loss's gradient dy, on the device."""

    def __init__(self, name, T, B, H, dtype, device, training, seed=0):
        self.cell, self.T, self.B, self.H, self.dtype = getattr(halstm, name)(H, H), T, B, H, dtype
        self.device, self.training, dt = device, training, getattr(torch, dtype)
        g = torch.Generator(device).manual_seed(seed)
        self.x = torch.randn(T, B, H, generator=g, device=device).to(dt)
        self.dy = torch.randn(T, B, H, generator=g, device=device).to(dt)
        self.params = {n: torch.from_numpy(v).to(device, dt) for n, v in self.cell.init_parameters(seed).items()}

    @property
    def labels(self):
        return ["y"] + (["dx", *self.params] if self.training else [])


def torch_contender(name, prob, dtype=None, compile_mode=None, scan_mode="generic"):
    """(run, result) of a torch contender; ``dtype``: in that dtype instead (the float64 reference)."""
    dt = getattr(torch, dtype or prob.dtype)
    x, dy = prob.x.to(dt), prob.dy.to(dt)
    params = {n: torch.nn.Parameter(v.to(dt), requires_grad=prob.training) for n, v in prob.params.items()}
    step, cell = torch_step(prob.cell, params), prob.cell
    if name == "torch-eager":
        forward = lambda x: loop(step, cell, x)  # noqa: E731
    elif name == "torch-compile":
        graphs = compile_mode == "reduce-overhead"
        compiled = torch.compile(step, mode=compile_mode, dynamic=False)
        forward = lambda x: loop(compiled, cell, x, graphs)  # noqa: E731
    else:
        with torch.no_grad():
            scanned = scanned_states(torch_step(cell, {n: v.double() for n, v in params.items()}), cell, x[0].double())
        forward = torch.compile(parallel(step, cell, scanned, scan_mode), dynamic=False)
    if not prob.training:
        def run():
            with torch.no_grad():
                return forward(x)
        return run, lambda: [run()]
    x = x.clone().requires_grad_()

    def train():
        x.grad = None
        for p in params.values():
            p.grad = None
        y = forward(x)
        y.backward(dy)
        return y

    return train, lambda: [train().detach(), x.grad, *(p.grad for p in params.values())]


def backward_for(prob, target, recipe):
    """compile_backward with its reversed loop's recipe, where it takes one."""
    args = (prob.cell, prob.T, prob.B, prob.dtype, target)
    try:
        return compile_backward(*args, loop_recipe=recipe)
    except TypeError as e:
        if "loop_recipe" not in str(e):
            raise
        if "loop_recipe" not in notes:
            notes.add("loop_recipe")
            print("note: compile_backward takes no loop_recipe: the reversed loop's recipe could not be chosen "
                  "(the default choice runs)", flush=True)
        return compile_backward(*args)


def halstm_contender(name, prob):
    """(run, result) of a halstm contender: prepared calls of the compiled functions."""
    target, recipe = prob.device, RECIPES[name].format(prob.device)
    x, p, cell = prob.x, prob.params, prob.cell
    f = halstm.compile(cell, prob.T, prob.B, prob.dtype, target, recipe=recipe)
    if not prob.training:
        return f.prepare(x, p), lambda: [f(x, p)[0]]
    g = backward_for(prob, target, recipe)
    grads = {cell.output: torch.cat([torch.zeros_like(prob.dy[:1]), prob.dy])}
    seqs = f.sequences(x, p)
    forward, backward = f.prepare(x, p), g.prepare(x, p, seqs, grads)

    def result():
        seqs = f.sequences(x, p)
        dx, dparams, _ = g(x, p, seqs, grads)
        return [seqs[cell.output][1:], dx, *(dparams[n] for n in p)]

    return (lambda: (forward(), backward())), result


def build(name, prob):
    """(run, result, seconds to build and run once) of a contender."""
    start = time.perf_counter()
    if name.startswith("halstm"):
        run, result = halstm_contender(name, prob)
        run()
    else:  # torch-scan: combine_mode "pointwise" (one Triton scan; CUDA alone) where it runs, else "generic"
        graphs = prob.device == "cuda" and not prob.training
        # pointwise's gradients were off (1.5e-1 against float64, MinGRU T=64, H200): generic in training
        pointwise = prob.device == "cuda" and name == "torch-scan" and not prob.training
        for mode in ("pointwise", "generic")[0 if pointwise else 1:]:
            torch._dynamo.reset()  # compiled for this problem's shapes alone: no recompile limit met
            try:
                run, result = torch_contender(name, prob, compile_mode="reduce-overhead" if graphs else None,
                                              scan_mode=mode)
                run()
                break
            except Exception as e:
                if mode == "generic" or isinstance(e, NotImplementedError):
                    raise
                print(f"  torch-scan: combine_mode pointwise fails ({one_line(e)}); generic instead", flush=True)
    if prob.device == "cuda":
        torch.cuda.synchronize()
    return run, result, time.perf_counter() - start


def errors(got, want, labels):
    """(largest relative norm error, the result it is of)."""
    errs = [float((g.double() - w).norm() / max(float(w.norm()), 1e-300)) for g, w in zip(got, want)]
    worst = int(np.argmax(errs))
    return errs[worst], labels[worst]


def clock(run, device) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - t0)


def measure(run, device, budget_s, most) -> tuple[float, int]:
    """Median ms of run(), over repetitions fitted to about ``budget_s`` (3 to ``most``). Its build
    and its check called it twice: a slow one's first timed call counts, a fast one warms up twice more."""
    first = clock(run, device)
    slow = first >= 100
    for _ in range(0 if slow else 2):
        clock(run, device)
    reps = int(min(most, max(3, 1e3 * budget_s / max(first, 1e-3))))
    times = [first] * slow + [clock(run, device) for _ in range(reps - slow)]
    return float(np.median(times)), reps


def contest(prob, names, ref, args, row, checks, dropped, timed=True):
    """Check, then time (``timed``) each contender on ``prob``; results into ``row``. ``dropped``: the
    contenders not to try, each with what to report (those that fail here are added)."""
    tol, labels = TOLERANCE[prob.dtype], prob.labels
    want = [w.double() for w in ref]
    for name in names:
        if name in dropped:
            row[name] = dropped[name]
            continue
        try:
            run, result, seconds = build(name, prob)
            err, worst = errors(result(), want, labels)
        except Exception as e:  # reported; the run goes on
            what = "recipe not available" if "recipe" in str(e) else "does not run"
            print(f"  {name}: {what} ({one_line(e)})", flush=True)
            row[name] = dropped[name] = "n/a"
            continue
        ok = err < tol
        checks.append(dict(cell=prob.cell.name, dtype=prob.dtype, mode=row["mode"], T=prob.T, B=prob.B, H=prob.H,
                           contender=name, error=err, worst=worst, ok=ok))
        print(f"  check T={prob.T} B={prob.B} H={prob.H} {name}: {err:.1e} ({worst}) {'PASS' if ok else 'FAIL'}, "
              f"built and first call {seconds:.1f} s", flush=True)
        row[f"{name} compile s"] = round(seconds, 1)
        if not ok and not args.time_failing:
            row[name] = dropped[name] = "fail"
            continue
        row[f"{name} failed"] = not ok
        if timed:
            row[name], row[f"{name} reps"] = measure(run, prob.device, args.budget, args.rounds)
        del run, result
        if prob.device == "cuda":
            torch.cuda.empty_cache()


def ratio(row, ours, others):
    """(other's best time / ours, which other) where both ran."""
    times = {n: row[n] for n in others if isinstance(row.get(n), float)}
    if not isinstance(row.get(ours), float) or not times:
        return None, None
    best = min(times, key=times.get)
    return times[best] / row[ours], best + " FAIL" * row.get(f"{best} failed", False)


def table(rows, names, cell, dtype, mode) -> str:
    what = "forward" if mode == "forward" else "forward + backward"
    head = ["T", "B", "H", *(f"{n} ms" for n in names), "scan vs halstm loop", "scan vs best torch", "compile s"]
    lines = [f"### {cell} {dtype}, {what}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["T"]), str(r["B"]), str(r["H"])]
        cells += [f"{r[n]:.3f}{' FAIL' * r[n + ' failed']}" if isinstance(r.get(n), float) else str(r.get(n, "-"))
                  for n in names]
        for others in (SEQUENTIAL, TORCH):
            x, best = ratio(r, "halstm-scan", others)
            cells.append("-" if x is None else f"{x:.2f} ({best})")
        compiled = [f"{n} {r[n + ' compile s']}" for n in names if n != "torch-eager" and f"{n} compile s" in r]
        cells.append(", ".join(compiled) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def device_name(device) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    found = open("/proc/cpuinfo").read().split("model name") if os.path.exists("/proc/cpuinfo") else []
    model = found[1].split(":", 1)[1].splitlines()[0].strip() if len(found) > 1 else platform.processor()
    return f"{model}, {os.cpu_count()} cores"


def case(cell, dtype, mode, names, shapes, check_shape, args, checks) -> list[dict]:
    """One table's rows: every contender checked at the small shape, then checked and timed at each shape."""
    print(f"{cell} {dtype} {mode}", flush=True)
    dropped, rows, training = {}, [], mode == "training"
    small = Problem(cell, *check_shape, dtype, args.device, training, seed=1)
    try:
        ref = torch_contender("torch-eager", small, "float64")[1]()
    except NotImplementedError as e:
        print(f"  skipped: no float64 torch loop to check against ({e})", flush=True)
        return []
    contest(small, names, ref, args, {"mode": mode}, checks, dropped, timed=False)
    for T, B, H in shapes:
        prob = Problem(cell, T, B, H, dtype, args.device, training)
        ref = torch_contender("torch-eager", prob, "float64")[1]()
        rows.append({"cell": cell, "dtype": dtype, "mode": mode, "T": T, "B": B, "H": H})
        contest(prob, names, ref, args, rows[-1], checks, dict(dropped))
        print(json.dumps(rows[-1]), flush=True)
        del prob, ref
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--cells", default="MinGRU", help="halstm cell classes by name")
    ap.add_argument("--shapes", default=SHAPES, help="TxBxH,... (I = H)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="forward,training")
    ap.add_argument("--rounds", type=int, default=20, help="the most timed repetitions a contender")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed calls a contender, about")
    ap.add_argument("--skip", default="", help="contenders left out, by name, comma-separated")
    ap.add_argument("--time-failing", action="store_true", help="time contenders that fail the check too (FAIL)")
    ap.add_argument("--tiny", action="store_true", help=f"T, B, H = {TINY}: a smoke test")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="writes results.md and results.json here")
    args = ap.parse_args()
    if not set(args.modes.split(",")) <= {"forward", "training"}:
        ap.error("--modes: forward and/or training")
    torch.manual_seed(0)
    skip = set(args.skip.split(",")) | ({"halstm-persistent"} if args.device == "cpu" else set())
    names = [n for n in (*RECIPES, *TORCH) if n not in skip]
    shapes = [TINY] if args.tiny else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    check_shape = (8, 2, 16) if args.tiny else (min(CHECK[0], shapes[0][0]), *CHECK[1:])
    device = device_name(args.device)
    print(f"Device: {device}; torch {torch.__version__}; contenders: {', '.join(names)}", flush=True)
    rows, checks, text = [], [], [f"Device: {device}. Median ms after warm-up; ratios: the other's time over "
                                  "halstm-scan's (> 1: the scan is faster), the faster of them named.", ""]
    for cell in args.cells.split(","):
        for dtype in args.dtypes.split(","):
            for mode in args.modes.split(","):
                found = case(cell, dtype, mode, names, shapes, check_shape, args, checks)
                rows += found
                text += [table(found, names, cell, dtype, mode), ""] if found else []
    if "loop_recipe" in notes:
        text += ["compile_backward took no loop_recipe here: each halstm backward's reversed loop ran its default "
                 "recipe.", ""]
    failed = [c for c in checks if not c["ok"]]
    lines = [f"Checks against a float64 torch loop: {len(failed)} of {len(checks)} failed"]
    lines += [f"  {c['contender']} {c['cell']} {c['dtype']} {c['mode']} T={c['T']}: {c['error']:.1e} ({c['worst']})"
              for c in failed]
    print("\n".join(["", *text, *lines]))
    text += [f"### Checks against a float64 torch loop: {len(failed)} of {len(checks)} failed", "",
             "| cell | dtype | mode | T | B | H | contender | relative error | largest in | ok |", "|" + "---|" * 10]
    text += [f"| {c['cell']} | {c['dtype']} | {c['mode']} | {c['T']} | {c['B']} | {c['H']} | {c['contender']} | "
             f"{c['error']:.1e} | {c['worst']} | {'PASS' if c['ok'] else 'FAIL'} |" for c in checks]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.md"), "w") as fh:
            fh.write("\n".join(text) + "\n")
        with open(os.path.join(args.out, "results.json"), "w") as fh:
            json.dump({"device": device, "rows": rows, "checks": checks}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
