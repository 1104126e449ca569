"""Convolution benchmark: halstm's LightweightConv1d / DynamicConv1d against plain PyTorch on the same
parameters, forward and forward+backward, at a small (B=8, T=128, C=512, K=7, H=8) and a realistic
(B=32, T=512, C=1024, K=31, H=16) configuration, causal, on each device given, side by side in one run.

PyTorch is fairseq's unfold formulation (``halstm.models.conv_reference``, what fairseq runs without
its CUDA kernels) and, for the lightweight layer, a depthwise ``F.conv1d`` (oneDNN / cuDNN). Time:
medians of runs that alternate between the implementations, after warm-up. Memory: how much the
process's memory grew over one call (the first after compiling): resident memory on the CPU, memory
in use on the device (torch's cache emptied before) on a GPU. TVM keeps its workspace between calls,
so a function may reuse up to a few MB an earlier one left. Each result is first checked against the
unfold reference. Prints a table, writes JSON (``--out``) and appends it to ``--record``.

    python benchmarks/conv.py [--devices cpu,cuda] [--configs small,realistic] [--out conv.json]
                              [--record docs/conv-results.json]
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import os
import time

# torch's OpenMP threads sleep once their work is done: spinning, they starved TVM's pool (2 cores:
# the small lightweight layer's forward+backward 16 ms against 3.3 ms). TVM's own pool keeps spinning:
# TVM_THREAD_POOL_SPIN_COUNT=0 as well made the realistic lightweight forward 187-233 ms instead of
# 72-81 once torch's pool had started. Set before torch and TVM start their pools.
WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}
for _name, _value in WAIT.items():
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import tvm  # noqa: E402

from halstm.bench import alternating_median_ms, machine, save_run  # noqa: E402
from halstm.models import conv_reference  # noqa: E402
from halstm.models.conv import ConvLayer  # noqa: E402
from halstm.models.conv_torch import DynamicConv1d, LightweightConv1d, compiled  # noqa: E402

CONFIGS = {"small": dict(B=8, T=128, C=512, K=7, H=8), "realistic": dict(B=32, T=512, C=1024, K=31, H=16)}


def implementations(layer: str, cfg: dict, device: str) -> dict:
    """name -> module, all on the same random parameters (causal, softmax-normalised kernels)."""
    C, K, H = cfg["C"], cfg["K"], cfg["H"]
    if layer == "lightweight":
        ours = LightweightConv1d(C, K, padding_l=K - 1, num_heads=H, weight_softmax=True, bias=True)
    else:
        ours = DynamicConv1d(C, K, padding_l=K - 1, num_heads=H, weight_softmax=True, bias=True, conv_bias=True)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.1)
    ours = ours.to(device)
    impls = {"halstm": ours, "torch-unfold": Unfold(ours)}
    if layer == "lightweight":
        impls["torch-conv1d"] = DepthwiseConv1d(ours)
    return impls


class Unfold(torch.nn.Module):
    """The plain PyTorch layer (fairseq's unfold) on another module's parameters."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        m = self.module
        if isinstance(m, LightweightConv1d):
            return conv_reference.lightweight_conv(x, m.weight.squeeze(1), m.bias, m.padding_l, m.weight_softmax)
        return conv_reference.dynamic_conv(x, m.weight_linear.weight, m.weight_linear.bias, m.conv_bias,
                                           m.num_heads, m.padding_l, m.weight_softmax)


class DepthwiseConv1d(Unfold):
    """The lightweight layer as a depthwise ``F.conv1d`` (each head's kernel repeated per channel)."""

    def forward(self, x):
        m = self.module
        T, _, C = x.shape
        w = F.softmax(m.weight, dim=-1) if m.weight_softmax else m.weight
        w = w.repeat_interleave(C // m.num_heads, dim=0)  # (C, 1, K)
        padded = F.pad(x.permute(1, 2, 0), (m.padding_l, m.kernel_size - 1 - m.padding_l))
        return F.conv1d(padded, w, m.bias, groups=C).permute(2, 0, 1)


def step(module, x, grad, backward: bool):
    if backward:
        module(x).backward(grad)
    else:
        with torch.no_grad():
            module(x)


class Memory:
    """Growth of the memory the process holds over one call: resident set (CPU), device memory in use
    (GPU)."""

    def __init__(self, device: str):
        self.device = device
        self._libc = ctypes.CDLL("libc.so.6") if device == "cpu" else None

    def used(self) -> int:
        if self.device == "cpu":
            with open("/proc/self/status") as f:
                return 1024 * int(next(line.split()[1] for line in f if line.startswith("VmHWM")))
        free, total = torch.cuda.mem_get_info()
        return total - free

    def growth_mb(self, fn) -> float:
        gc.collect()
        if self.device == "cpu":
            self._libc.malloc_trim(0)  # freed heap pages back to the system, so reusing them counts
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the high-water mark (VmHWM) restarts at the current resident set
        else:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        before = self.used()
        fn()
        if self.device == "cuda":
            torch.cuda.synchronize()
        return (self.used() - before) / 2**20


def rel_err(got, want) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def run(device: str, config: str, layer: str, warmup: int, repeat: int) -> list[dict]:
    cfg = CONFIGS[config]
    torch.manual_seed(0)
    impls = implementations(layer, cfg, device)
    x = torch.randn(cfg["T"], cfg["B"], cfg["C"], device=device, requires_grad=True)
    grad = torch.randn_like(x)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    ours = impls["halstm"]
    start = time.perf_counter()
    spec = ConvLayer(cfg["T"], cfg["B"], cfg["C"], cfg["K"], cfg["H"], ours.padding_l, True, layer == "dynamic")
    for backward in (False, True):
        compiled(spec, backward, x.device)
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        want = impls["torch-unfold"](x)
    errors = {name: rel_err(m(x).detach(), want) for name, m in impls.items() if name != "torch-unfold"}
    memory, rows = Memory(device), []
    for backward in (False, True):
        mb = {name: memory.growth_mb(lambda m=m: step(m, x, grad, backward)) for name, m in impls.items()}
        fns = {name: (lambda m=m: step(m, x, grad, backward)) for name, m in impls.items()}
        ms = alternating_median_ms(fns, sync, warmup, repeat)
        for name in impls:
            rows.append(dict(device=device, config=config, **cfg, layer=layer,
                             passes="forward+backward" if backward else "forward", impl=name, ms=ms[name],
                             mb=mb[name], rel_err=errors.get(name), compile_s=compile_s if name == "halstm" else None))
        x.grad = None
        for m in impls.values():
            m.zero_grad(set_to_none=True)
    return rows


def table(rows: list[dict]) -> str:
    """One line per (device, config, layer, passes): each implementation's ms and MB, and how many
    times faster halstm is."""
    lines = ["| device | config | layer | passes | implementation | ms | MB | rel. error | x halstm faster |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = next(o for o in rows if o["impl"] == "halstm" and all(
            o[k] == r[k] for k in ("device", "config", "layer", "passes")))
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        ratio = "" if r["impl"] == "halstm" else f"{r['ms'] / ours['ms']:.1f}"
        lines.append(f"| {r['device']} | {r['config']} | {r['layer']} | {r['passes']} | {r['impl']} | "
                     f"{r['ms']:.3g} | {r['mb']:.0f} | {err} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cpu,cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--configs", default="small,realistic")
    parser.add_argument("--layers", default="lightweight,dynamic")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="conv-results.json")
    parser.add_argument("--record", help="a JSON list this run is appended to (docs/conv-results.json)")
    args = parser.parse_args(argv)
    rows, load = [], os.getloadavg()[0]
    for device in args.devices.split(","):
        for config in args.configs.split(","):
            for layer in args.layers.split(","):
                rows += run(device, config, layer, args.warmup, args.repeat)
                print(table(rows[-6 if layer == "lightweight" else -4:]).split("\n", 2)[2], flush=True)
    machines = {d: torch.cuda.get_device_name() if d == "cuda" else machine() for d in args.devices.split(",")}
    record = dict(date=datetime.date.today().isoformat(), machines=machines,
                  torch=torch.__version__, tvm=tvm.__version__, env={k: os.environ[k] for k in WAIT},
                  warmup=args.warmup, repeat=args.repeat, load_average=[load, os.getloadavg()[0]], rows=rows)
    print(table(rows))
    save_run(record, args.out, args.record)


if __name__ == "__main__":
    main()
