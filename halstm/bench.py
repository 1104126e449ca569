"""``halstm bench``: compile built-in cells, check them against the reference, time them side by side
with PyTorch (nn.LSTM/nn.GRU, when installed) and a plain NumPy loop, print a table, save a plot.
Each contender is timed alone in a worker process of its own, so that thread pools do not fight."""

from __future__ import annotations

import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# NumPy, the compiler and matplotlib are imported where they are used: the command line reads this
# module's defaults for `halstm bench --help`, which must not wait for them.

DEFAULT_CELLS = ("LSTM", "GRU", "PeepholeLSTM", "ResetBeforeGRU")
DEFAULT_SHAPES = ((100, 1, 256), (100, 16, 512), (100, 64, 512))  # (T, B, I=H)


@dataclass
class Row:
    cell: str
    steps: int
    batch: int
    hidden: int
    compile_s: float
    error: float
    halstm_ms: float
    torch_ms: float | None
    numpy_ms: float | None


def median_ms(fn, repeat: int, warmup: int = 2, sync=None) -> float:
    """Median wall-clock ms of ``repeat`` calls after ``warmup`` (``sync`` waits for the device)."""
    return alternating_median_ms({"fn": fn}, sync or (lambda: None), warmup, repeat)["fn"]


def alternating_median_ms(fns: dict, sync, warmup: int, repeat: int) -> dict[str, float]:
    """Each function's median ms, the functions run in turn (``sync`` waits for the device), so that
    load from other work on a shared machine falls on all of them alike."""
    times = {name: [] for name in fns}
    for i in range(warmup + repeat):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[name].append(1e3 * (time.perf_counter() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def numpy_loop(name: str, x, p):
    """The textbook float32 NumPy loop of LSTM/GRU: the baseline a researcher writes first."""
    import numpy as np

    h = np.zeros((x.shape[1], p["weight_hh"].shape[1]), x.dtype)
    c = np.zeros_like(h)
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    for xt in x:
        gx = xt @ p["weight_ih"].T + p["bias_ih"]
        gh = h @ p["weight_hh"].T + p["bias_hh"]
        if name == "LSTM":
            i, f, g, o = np.split(gx + gh, 4, axis=1)
            c = sig(f) * c + sig(i) * np.tanh(g)
            h = sig(o) * np.tanh(c)
        else:
            (xr, xz, xn), (hr, hz, hn) = np.split(gx, 3, axis=1), np.split(gh, 3, axis=1)
            r, z = sig(xr + hr), sig(xz + hz)
            h = (1 - z) * np.tanh(xn + r * hn) + z * h
    return h


def torch_timer(name: str, size: int, p, x, device: str, repeat: int):
    """The median ms of torch.nn.LSTM/GRU on the same weights and input (cuDNN on a GPU), or None
    without torch."""
    try:
        import torch
    except ImportError:
        return None
    module = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU}[name](size, size)
    module.load_state_dict({f"{k}_l0": torch.from_numpy(v) for k, v in p.items()})
    module = module.eval().to(device)
    xt = torch.from_numpy(x).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        module(xt)
        sync()

    with torch.no_grad():
        return median_ms(run, repeat)


def run(cell_names=DEFAULT_CELLS, shapes=DEFAULT_SHAPES, target="cpu", repeat=5, seed=None, log=print,
        threads=None):
    """Compile each cell at each shape, check it against the float64 reference, then time it and its
    torch and NumPy counterparts, each in a worker process of its own (``Contender``) one after the
    other, so that no other thread pool spins beside it; ``threads`` each (default: all cores). torch
    is timed twice, with OpenMP's passive and its default waiting (unless OMP_WAIT_POLICY is set), and
    its faster time counts."""
    import numpy as np

    from . import cells
    from .oracle import reference

    threads = threads or len(os.sched_getaffinity(0))
    rows = []
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(prefix="halstm-bench-") as tmp:
        contenders = {name: Contender(name, threads) for name in ("halstm", "torch", "numpy")}
        if "OMP_WAIT_POLICY" not in os.environ:  # torch at its best: the faster of both ways of waiting
            contenders["torch spinning"] = Contender("torch", threads, passive=False)
        try:
            for name in cell_names:
                for T, B, H in shapes:
                    cell = cells.BUILTIN[name](H, H)
                    params = cell.init_parameters(seed=int(rng.integers(1 << 31)))
                    x = rng.standard_normal((T, B, H)).astype(np.float32)
                    inputs, output = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "y.npy")
                    np.savez(inputs, x=x, **{f"p_{k}": v for k, v in params.items()})
                    job = dict(cell=name, inputs=inputs, target=getattr(target, "kind", target),
                               repeat=repeat)
                    compiled = contenders["halstm"].ask(op="compile", output=output, **job)
                    y_ref, _ = reference(cell, x, params)  # the whole sequence: about a second at B=64, H=512
                    y = np.load(output)
                    error = float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))
                    halstm_ms = contenders["halstm"].ask(op="time", **job)["ms"]
                    torch_ms = numpy_ms = None
                    if name in ("LSTM", "GRU"):
                        numpy_ms = contenders["numpy"].ask(op="time", **job)["ms"]
                        torch_ms = min(contenders[n].ask(op="time", device=compiled["device"], **job)["ms"]
                                       for n in ("torch", "torch spinning") if n in contenders)
                    row = Row(name, T, B, H, compiled["compile_s"], error, halstm_ms, torch_ms, numpy_ms)
                    log(format_row(row))
                    rows.append(row)
        finally:
            for contender in contenders.values():
                contender.close()
    log(f"\n{timing_note(threads)}")
    return rows


def timing_note(threads: int) -> str:
    """The thread settings the contenders were timed with, for the output."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    waiting = (f"OMP_WAIT_POLICY={policy}" if policy else
               "OMP_WAIT_POLICY=PASSIVE; torch also with OpenMP's default waiting, its faster time shown")
    return (f"Each contender timed alone in a process of its own, one after the other, {threads} threads "
            f"each (TVM_NUM_THREADS, OMP_NUM_THREADS, OPENBLAS_NUM_THREADS = {threads}), {waiting}.")


class Contender:
    """A worker process (``python -m halstm.bench NAME``) that compiles or times one contender: halstm,
    torch or numpy. Started on first use with ``threads`` in its environment, it answers one JSON
    request a line with one JSON reply, so it imports its libraries once and its thread pool is the
    only one at work while it times."""

    def __init__(self, name: str, threads: int, passive: bool = True):
        self.name, self.process = name, None
        self.env = worker_environment(threads, passive)

    def ask(self, **request) -> dict:
        """The worker's reply to ``request`` (with the worker's ``pid``); its error, raised."""
        if self.process is None:
            self.process = subprocess.Popen([sys.executable, "-m", "halstm.bench", self.name], env=self.env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker exited (status {self.process.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{self.name} worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait()
            self.process = None


THREAD_VARIABLES = ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def worker_environment(threads: int, passive: bool = True) -> dict:
    """This process's environment with ``threads`` for every pool and, unless set (or ``passive`` is
    False), OpenMP's passive waiting: torch's OpenMP threads otherwise spin between parallel regions,
    which on a machine other work shares made nn.LSTM (100,64,512) 1612 ms instead of 110-145 (2
    cores, 2026-11-26); alone on the cores the spinning is faster (nn.LSTM (100,16,512) 33 ms against
    42-48 passive). TVM's pool keeps its own short spin, which yields the core: no faster without it."""
    env = dict(os.environ, **{v: str(threads) for v in THREAD_VARIABLES})
    if passive:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def serve(name: str) -> None:
    """The worker's loop: a JSON request a line on stdin, a JSON reply a line on what was stdout (which
    now goes to stderr, so that a library's own prints cannot corrupt the replies)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    compiled = {}
    for line in sys.stdin:
        try:
            reply = dict(_serve(name, json.loads(line), compiled), pid=os.getpid())
        except Exception as e:  # reported to the parent, which raises it
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def _serve(name: str, request: dict, compiled: dict) -> dict:
    import numpy as np

    with np.load(request["inputs"]) as data:
        x = data["x"]
        params = {k[2:]: data[k] for k in data.files if k.startswith("p_")}
    cell, repeat = request["cell"], request["repeat"]
    if name == "numpy":
        return {"ms": median_ms(lambda: numpy_loop(cell, x, params), repeat)}
    H = x.shape[2]
    if name == "torch":
        return {"ms": torch_timer(cell, H, params, x, request["device"], repeat)}
    if request["op"] == "compile":  # halstm: compile and run once, for the parent's check
        from . import cells
        from .compiler import compile as compile_cell

        start = time.perf_counter()
        f = compile_cell(cells.BUILTIN[cell](H, H), x.shape[0], x.shape[1], target=request["target"])
        compile_s = time.perf_counter() - start
        compiled.clear()  # one function at a time: the one just checked is the one timed next
        compiled[cell] = f
        np.save(request["output"], f(x, params)[0])
        return {"compile_s": compile_s, "device": f.target.kind}
    return {"ms": median_ms(compiled[cell].prepare(x, params), repeat)}  # arguments on the device beforehand


HEADER = ("| cell | T | B | I=H | compile s | rel. error | halstm ms | torch ms | NumPy ms | "
          "torch / halstm |\n|---|---|---|---|---|---|---|---|---|---|")


def _ms(v):
    return "-" if v is None else f"{v:.3g}"


def format_row(r: Row) -> str:
    ratio = "-" if r.torch_ms is None else f"{r.torch_ms / r.halstm_ms:.2f}x"
    return (f"| {r.cell} | {r.steps} | {r.batch} | {r.hidden} | {r.compile_s:.1f} | {r.error:.1e} | "
            f"{_ms(r.halstm_ms)} | {_ms(r.torch_ms)} | {_ms(r.numpy_ms)} | {ratio} |")


def save_run(run: dict, out: str, record: str | None = None) -> None:
    """Write one benchmark run as JSON to ``out`` and, with ``record``, append it to that JSON list
    (the results kept in docs/, a line a run's setting and a line each of its rows: half the bytes
    of one value a line)."""
    with open(out, "w") as f:
        json.dump(run, f, indent=1)
    if record:
        history = json.load(open(record)) if os.path.exists(record) else []
        with open(record, "w") as f:
            f.write(runs_as_lines(history + [run]))


def runs_as_lines(runs: list[dict]) -> str:
    """``runs`` as a JSON list: each run's fields but its "rows" on one line, then a line a row."""
    texts = []
    for run in runs:
        fields = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in run.items() if k != "rows"]
        if "rows" in run:
            fields.append('"rows": [\n  ' + ",\n  ".join(json.dumps(r) for r in run["rows"]) + "\n ]")
        texts.append("{" + ", ".join(fields) + "}")
    return "[\n " + ",\n ".join(texts) + "\n]\n"


def machine() -> str:
    import os

    return f"{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, {platform.system()}"


def report(rows: list[Row], threads: int | None = None) -> str:
    stamp = time.strftime("%Y-%m-%d")
    note = timing_note(threads or len(os.sched_getaffinity(0)))
    lines = [f"Measured {stamp} on {machine()}; medians after warm-up, fp32, I=H. {note}", "", HEADER]
    return "\n".join(lines + [format_row(r) for r in rows]) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.cell}\nB={r.batch} H={r.hidden}" for r in rows]
    xs = np.arange(len(rows))
    series = [("halstm", [r.halstm_ms for r in rows]), ("torch", [r.torch_ms for r in rows]),
              ("NumPy loop", [r.numpy_ms for r in rows])]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    for i, (label, values) in enumerate(series):
        ax.bar(xs + (i - 1) * 0.27, [v if v is not None else 0 for v in values], 0.27, label=label)
    ax.set_xticks(xs, labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel(f"ms per sequence (T={rows[0].steps})")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("halstm vs PyTorch and NumPy, CPU fp32 (lower is better)")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)


def save_png(fig, path, dpi: int) -> None:
    """``fig`` as a 64-colour palette PNG: a bar chart needs no more, and the file is a third of
    matplotlib's RGBA one (docs/gpu-results.png 43.4 -> 12.6 KB), which keeps the repository small."""
    from PIL import Image  # matplotlib's own dependency

    rgba = io.BytesIO()
    fig.savefig(rgba, format="png", dpi=dpi)
    Image.open(rgba).convert("RGB").quantize(colors=64).save(path, optimize=True)


if __name__ == "__main__":
    serve(sys.argv[1])
