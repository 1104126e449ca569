"""Where a call's host time goes: one compiled cell called with torch tensors, timed as a whole
(``f(x, params, states)``, argument checks and DLPack included) and prepared (``f.prepare``: the
kernels alone), then the call under cProfile and, on a GPU, one call's device timeline (each kernel's
start after the call began and its duration, from torch.profiler's CUPTI trace):

    python benchmarks/call_overhead.py LSTM 100,16,512 float16 --device cuda

With --backward, the same for the compiled backward (``b(x, params, seqs, grads)`` against
``b.prepare``):

    python benchmarks/call_overhead.py LSTM 5,2,16 --backward --reps 3000

With --training, a training step of the cell's one-layer ``halstm.nn`` module (``y, _ = model(x);
y.backward(dy)``, x a leaf that requires its gradient) against its kernels alone (the forward's and
the backward's prepared calls, taken in turn with the steps), then torch.nn's LSTM/GRU step (cuDNN
on a GPU; timed apart: on the CPU its thread pool and TVM's slow each other down when they take
turns), each step's host time by phase (``host_phases``), the halstm step under cProfile and, on a
GPU, one step's device timeline beside the host's launches and autograd's nodes. At tiny shapes on the CPU the step is mostly host time:

    python benchmarks/call_overhead.py LSTM 5,2,16 --training --reps 3000

Times are host wall-clock medians of --reps calls, each followed by a device synchronisation.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import statistics
import time

import torch

import halstm
from halstm.bench import alternating_median_ms, median_ms
from halstm.cells import BUILTIN
from halstm.targets import CudaTarget


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cell", choices=sorted(BUILTIN))
    ap.add_argument("shape", help="T,B,H (I = H)")
    ap.add_argument("dtype", nargs="?", default="float32")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--recipe", default=None, help="a recipe by name instead of halstm's choice")
    ap.add_argument("--knobs", type=json.loads, default=None, help="JSON object of knob overrides")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--backward", action="store_true", help="the compiled backward instead")
    mode.add_argument("--training", action="store_true", help="a training step of halstm.nn instead")
    a = ap.parse_args()
    T, B, H = map(int, a.shape.split(","))
    cell = BUILTIN[a.cell](H, H)
    target = CudaTarget.detect() if a.device == "cuda" else "cpu"
    f = halstm.compile(cell, T, B, a.dtype, target=target, recipe=a.recipe, knobs=a.knobs)
    dt = getattr(torch, a.dtype)
    x = torch.randn(T, B, H, dtype=dt, device=a.device)
    params = {n: (torch.rand(s, device=a.device) * 0.1 - 0.05).to(dt) for n, s in cell.parameters().items()}
    states = {s: torch.randn(B, H, dtype=dt, device=a.device) for s in cell.states}
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    if a.backward:
        return backward(a, cell, target, f, x, params, states, sync)
    if a.training:
        return training(a, cell, target, f, x, states, sync)

    call = 1e3 * median_ms(lambda: f(x, params, states), a.reps, warmup=10, sync=sync)
    prepared = 1e3 * median_ms(f.prepare(x, params, states), a.reps, warmup=10, sync=sync)
    print(f"{a.cell} T={T} B={B} H={H} {a.dtype} on {a.device}, recipe {f.recipe.name}: call {call:.1f} us, "
          f"prepared {prepared:.1f} us, overhead {call - prepared:.1f} us")
    profiled(lambda: f(x, params, states), a.reps, sync)
    if a.device == "cuda":
        timeline(lambda: f(x, params, states))
        if a.cell in ("LSTM", "GRU"):
            print("cuDNN, same inputs:")
            timeline(cudnn_call(a.cell, H, dt, x, params, states))


def backward(a, cell, target, f, x, params, states, sync):
    """The compiled backward's call against its kernels alone."""
    T, B, H = x.shape
    b = halstm.compile_backward(cell, T, B, a.dtype, target=target)
    seqs = f.sequences(x, params, states)
    grads = {s: torch.randn_like(v) for s, v in seqs.items()}
    call = 1e3 * median_ms(lambda: b(x, params, seqs, grads), a.reps, warmup=10, sync=sync)
    prepared = 1e3 * median_ms(b.prepare(x, params, seqs, grads), a.reps, warmup=10, sync=sync)
    print(f"backward of {a.cell} T={T} B={B} H={H} {a.dtype} on {a.device}: call {call:.1f} us, "
          f"prepared {prepared:.1f} us, overhead {call - prepared:.1f} us")
    profiled(lambda: b(x, params, seqs, grads), a.reps, sync)


def training(a, cell, target, f, x, states, sync):
    """A training step of halstm.nn against its kernels alone, taken in turn (``alternating_median_ms``),
    and torch.nn's step, then the halstm step under cProfile."""
    T, B, H = x.shape
    twin = getattr(torch.nn, a.cell) if a.cell in ("LSTM", "GRU") else None
    module = getattr(halstm.nn, a.cell) if twin else functools.partial(halstm.nn.RNN, BUILTIN[a.cell])
    model = module(H, H, device=a.device, dtype=x.dtype)
    params = {n: getattr(model, n + "_l0").detach() for n in cell.parameters()}
    b = halstm.compile_backward(cell, T, B, a.dtype, target=target)
    seqs = f.sequences(x, params, states)
    grads = {cell.output: torch.randn_like(seqs[cell.output])}
    forward, backward = f.prepare(x, params, states), b.prepare(x, params, seqs, grads)
    xs, dy = x.clone().requires_grad_(), torch.randn_like(x)

    def step(model):
        def run():
            y, _ = model(xs)
            y.backward(dy)
        return run

    steps = {"halstm": step(model), "kernels": lambda: (forward(), backward())}
    us = {name: 1e3 * ms for name, ms in alternating_median_ms(steps, sync, 10, a.reps).items()}
    if twin:
        us["torch"] = 1e3 * median_ms(step(twin(H, H, device=a.device, dtype=x.dtype)), a.reps, 10, sync)
    print(f"training step of halstm.nn {a.cell} T={T} B={B} H={H} {a.dtype} on {a.device}: {us['halstm']:.1f} us, "
          f"kernels {us['kernels']:.1f} us, beyond them {us['halstm'] - us['kernels']:.1f} us"
          + (f"; torch.nn.{a.cell} {us['torch']:.1f} us" if "torch" in us else ""))
    host_phases("halstm", model, xs, dy, a.reps, sync)
    if twin:
        host_phases(f"torch.nn.{a.cell}", twin(H, H, device=a.device, dtype=x.dtype), xs, dy, a.reps, sync)
    profiled(steps["halstm"], a.reps, sync)
    if a.device == "cuda":
        timeline(steps["halstm"], grad=True)
        if twin:
            print(f"torch.nn.{a.cell}:")
            timeline(step(twin(H, H, device=a.device, dtype=x.dtype)), grad=True)


def host_phases(name, model, x, dy, reps, sync):
    """Where a training step's wall time goes on the host, medians of ``reps`` steps: the forward's
    call, the backward's (``y.backward``, autograd's engine included), and the wait for the device
    after both returned (the device's work the host's did not cover)."""
    times = []
    for i in range(reps + 10):
        sync()
        start = time.perf_counter()
        y, _ = model(x)
        forward = time.perf_counter()
        y.backward(dy)
        backward = time.perf_counter()
        sync()
        if i >= 10:
            times.append((forward - start, backward - forward, time.perf_counter() - backward))
    us = [1e6 * statistics.median(t) for t in zip(*times)]
    print(f"{name} host: forward {us[0]:.0f} us, backward {us[1]:.0f} us, then the device's wait {us[2]:.0f} us")


def profiled(call, reps, sync):
    """cProfile's top entries by own time over ``reps`` calls."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(reps):
        call()
    sync()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)


def cudnn_call(name, H, dt, x, params, states):
    mod = getattr(torch.nn, name)(H, H).cuda().to(dt)
    mod.load_state_dict({f"{k}_l0": v for k, v in params.items()})
    hx = (states["h"][None], states["c"][None]) if name == "LSTM" else states["h"][None]
    return lambda: mod(x, hx)


def timeline(call, grad: bool = False):
    """One call's kernels as the device ran them, in us from the call's start on the host, each after
    the host's launch of it (``launched``): where the device waits on the host, and how long each
    kernel takes. ``grad``: with autograd recording (a training step), else under no_grad."""
    from torch.profiler import ProfilerActivity, profile

    recording = torch.enable_grad if grad else torch.no_grad
    with recording():
        call()
    torch.cuda.synchronize()
    with recording(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.profiler.record_function("call"):
            call()
        torch.cuda.synchronize()
    events = prof.events()
    start = next(e for e in events if e.name == "call" and e.device_type.name == "CPU").time_range.start
    launches = sorted(e.time_range.start for e in events
                      if e.device_type.name == "CPU" and ("Launch" in e.name or e.name.startswith("cudaMemcpy")))
    kernels = sorted((e for e in events if e.device_type.name == "CUDA" and e.name != "call"),  # its range's mirror
                     key=lambda e: e.time_range.start)
    print("device timeline of one call (us after the call began on the host; launched: the host's n-th launch):")
    for n, e in enumerate(kernels):
        launched = f"{launches[n] - start:9.1f}" if n < len(launches) else " " * 9
        print(f"  {e.time_range.start - start:9.1f} +{e.time_range.elapsed_us():8.1f}  launched {launched}  {e.name[:60]}")
    nodes = sorted((e for e in events if e.device_type.name == "CPU" and "evaluate_function" in e.name),
                   key=lambda e: e.time_range.start)
    if nodes:
        print("autograd's nodes on the host (us after the call began):")
        for e in nodes:
            print(f"  {e.time_range.start - start:9.1f} +{e.time_range.elapsed_us():8.1f}  {e.name[:80]}")


if __name__ == "__main__":
    main()
