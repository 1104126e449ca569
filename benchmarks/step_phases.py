"""Where a persistent kernel's step goes: clock64 stamps after every __syncthreads of its time loop.

    python3 benchmarks/step_phases.py LSTM 100,16,512 float16 --knobs '{}' '{"poll_states":false}'

For each setting the cuda-persistent kernel is compiled twice: as generated, and with the time loop
instrumented (TVM's ``tvm_callback_cuda_postproc`` rewrites the source before nvcc): every thread
adds the clock64 cycles since the previous stamp to a per-phase register after each block barrier
(and grid sync) of the loop, and thread 0 of the first and last block prints the sums after the
loop, with the %globaltimer nanoseconds of the loop. A phase is the code between two barriers,
ending with the wait at the second: the phase that waits on other blocks (the poll for the states,
or the grid sync) carries the cross-block latency. Both builds are checked against float64 and timed
(prepared, median of --reps), so the stamps' own cost shows as their difference. The phases are
printed with the kernel's source lines that end them (the barriers' preceding statement).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from functools import partial

import torch
import tvm

import halstm
from halstm.cells import BUILTIN
from halstm.schedules import CudaPersistent
from halstm.targets import CudaTarget
from halstm.targets.cuda import rewrite_generated_source

from gpu import inputs, rel, storage, timed  # noqa: E402 (beside this script)

BARRIERS = ("__syncthreads();", "tvm_builtin_cuda_grid_sync();")
LOOP = re.compile(r"\n[ \t]*for \(int t = 0; t < \d+; \+\+t\) \{\n")
PHASES_LINE = re.compile(r"halstm phases block (\d+) ns (\d+) cycles (.*)")
TANH_APPROX = """__device__ __forceinline__ float halstm_tanh_approx(float x) {
  float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y;
}
"""
# What-if rewrites of the generated source (--variants), each built, checked and timed as the others.
# H100, LSTM fp16 (100,16,512): tanh-approx no faster (0.236 / 0.236 ms); polling without waiters is
# faster where a block stages at most 32 KiB, the default there (``poll_waiters``; docs/results.md).
VARIANTS = {
    # tanh by the SFU's approximation (max relative error 2^-11) instead of libdevice's tanhf
    "tanh-approx": lambda s: s.replace('extern "C" __global__', TANH_APPROX + 'extern "C" __global__', 1)
                              .replace("tanhf(", "halstm_tanh_approx("),
    # with poll_waiters, the waiters do not wait (the barrier after them stays): the staging polls
    "no-wait": lambda s: re.sub(r"halstm_wait_value<(\d+)>\(\(0 < t\)", r"halstm_wait_value<\1>(false", s),
    # upper bounds, wrong results (fp16/bf16 sources): the elementwise math's loads of a state at the
    # block's own units (LSTM's c, GRU's h), of the biases, or the step's input projection, replaced
    # by constants; libdevice's expf by the SFU's __expf
    "no-state-load": lambda s: re.sub(r"\(\(float\)\w+_seq_ptr\[[^\]]*\]\)", "0.5f", s),
    "no-bias-load": lambda s: re.sub(r"\(\(float\)bias\w*_ptr\[[^\]]*\]\)", "0.01f", s),
    "no-x-proj": lambda s: re.sub(r"= x_proj\d+_ptr\[[^\]]*\];", "= 0.01f;", s),
    "fast-exp": lambda s: s.replace("expf(", "__expf("),
}


def instrument(source: str) -> tuple[str, list[str]]:
    """``source`` with the persistent kernel's time loop stamped; the statement before each stamp."""
    setup_end = source.find("tvm_builtin_cuda_grid_sync();")  # the setup's grid sync, before the loop
    m = LOOP.search(source, max(setup_end, 0))
    if setup_end < 0 or m is None:
        return source, []
    depth, end = 1, m.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        end += 1
    body, out, labels = source[m.end():end - 1], [], []
    for line in body.split("\n"):
        out.append(line)
        if line.strip() in BARRIERS:
            before = next((s.strip() for s in reversed(out[:-1]) if s.strip() not in ("}", "")), "")
            labels.append(before[:90])
            out.append(f"halstm_stamp({len(labels) - 1});")
    n = len(labels)
    prologue = (f"long long halstm_ph[{n}] = {{0}}; long long halstm_last = clock64(); "
                "unsigned long long halstm_ns0; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(halstm_ns0));\n"
                "#define halstm_stamp(k) { long long now_ = clock64(); halstm_ph[k] += now_ - halstm_last; "
                "halstm_last = now_; }\n")
    fmt = " ".join(["%lld"] * n)
    epilogue = ("\n{ unsigned long long ns1; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(ns1));\n"
                "if (threadIdx.x == 0 && (blockIdx.x == 0 || blockIdx.x == gridDim.x - 1)) "
                f"printf(\"halstm phases block %d ns %llu cycles {fmt}\\n\", blockIdx.x, ns1 - halstm_ns0, "
                + ", ".join(f"halstm_ph[{k}]" for k in range(n)) + "); }\n")
    loop_start = m.start() + 1
    return (source[:loop_start] + prologue + source[loop_start:m.end()] + "\n".join(out)
            + source[end - 1:end] + epilogue + source[end:]), labels


def hooked(rewrite):
    """Install ``rewrite`` after halstm's own source rewriting (for the next compiles)."""
    rewrite_generated_source()
    name = "tvm_callback_cuda_postproc"
    halstms = tvm.get_global_func(name)
    tvm.register_global_func(name, lambda s, t: rewrite(halstms(s, t)), override=True)
    return halstms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cell", choices=sorted(BUILTIN))
    ap.add_argument("shape", help="T,B,H (I = H)")
    ap.add_argument("dtype")
    ap.add_argument("--knobs", nargs="*", default=["{}"], help="JSON objects over the recipe's defaults")
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS))
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    os.environ["HALSTM_CACHE"] = "0"  # a rewritten build must not load (nor be stored as) the plain one
    T, B, H = map(int, a.shape.split(","))
    cell, target = BUILTIN[a.cell](H, H), CudaTarget.detect()
    x, params, states = inputs(cell, T, B, a.dtype, seed=0)
    f64 = lambda d: {k: v.double().cpu().numpy() for k, v in d.items()}  # noqa: E731
    want_y, _ = halstm.reference(cell, x.double().cpu().numpy(), f64(params), f64(states))
    print(f"{a.cell} ({T},{B},{H}) {a.dtype} on {target.name}, cuda-persistent", flush=True)
    for knobs in map(json.loads, a.knobs):
        labels = []

        def stamped(source):
            out, found = instrument(source)
            labels.extend(found)
            return out

        row, printed = {"knobs": knobs}, ""
        for build, rewrite in {"plain": None, "stamped": stamped, **{v: VARIANTS[v] for v in a.variants}}.items():
            halstms = hooked(rewrite) if rewrite is not None else None
            try:
                f = halstm.compile(cell, T, B, storage(a.dtype), target=target, recipe=CudaPersistent(),
                                   knobs=knobs, database=False, allow_tf32=a.dtype == "tf32")
            finally:
                if halstms is not None:
                    tvm.register_global_func("tvm_callback_cuda_postproc", halstms, override=True)
            measure = partial(_measure, f, x, params, states, want_y, a.reps, row, build)
            if build == "stamped":
                printed = _printed(measure)
            else:
                measure()
        print(json.dumps(row), flush=True)
        for block, runs in _phases(printed).items():
            ns = sum(r[0] for r in runs) / len(runs)
            cycles = [sum(r[1][k] for r in runs) / len(runs) for k in range(len(labels))]
            total = sum(cycles)
            print(f"\nblock {block} ({len(runs)} calls): {ns / T / 1e3:.2f} us a step by globaltimer, "
                  f"{total / T:.0f} cycles a step ({ns / total:.3f} ns a cycle)\n"
                  "| phase ends after | cycles a step | share |\n|---|---|---|")
            for label, c in zip(labels, cycles):
                print(f"| `{label}` | {c / T:.0f} | {c / total:.0%} |")
        sys.stdout.flush()


def _measure(f, x, params, states, want_y, reps, row, build):
    y, _ = f(x, params, states)
    torch.cuda.synchronize()
    row[f"{build} error"] = rel(y.double().cpu().numpy(), want_y)
    row[f"{build} prepared ms"] = timed(f.prepare(x, params, states), reps=reps)


def _printed(call) -> str:
    """What the process (the kernels' printf among it) writes to stdout while ``call`` runs."""
    sys.stdout.flush()
    with tempfile.TemporaryFile(mode="w+") as tmp:
        saved = os.dup(1)
        os.dup2(tmp.fileno(), 1)
        try:
            call()
            torch.cuda.synchronize()
            sys.stdout.flush()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        return tmp.read()


def _phases(text: str) -> dict[int, list[tuple[int, list[int]]]]:
    """Every printed line's (ns, cycles by phase), by block."""
    out = {}
    for m in PHASES_LINE.finditer(text):
        out.setdefault(int(m.group(1)), []).append((int(m.group(2)), [int(v) for v in m.group(3).split()]))
    return out


if __name__ == "__main__":
    main()
