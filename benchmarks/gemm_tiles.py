"""The tensor-core GEMM alone (schedules/cuda_tensorcore.py), C[M, N] = A[M, K] @ W[K, N] with fp16 or bf16
operands and an fp32 result, as the hoisted input GEMM runs it (or, with --result, C rounded to the operands'
type as it is written), at several tiles, side by side with cuBLAS (torch.matmul) in the same process:

    python3 benchmarks/gemm_tiles.py 25600,4096,1024 --tiles 2,2,4,4,32,4 2,2,4,4,64,2 4,2,4,4,32,3

A tile is warps_m,warps_n,fm,fn,bk,stages (TensorCoreTile: WMMA), or wgmma:<WgmmaTile.name> such as
wgmma:2x256x4f (Hopper: schedules/wgmma.py, given the weights (N, K); the recipes' wgmma_* knobs name
tiles so). Each is compiled for this GPU, checked against torch.matmul in float32 (relative norm error), and timed as kernel_breakdown.py
times kernels: GPU time from torch.profiler, summed over --reps calls after warm-up, divided by --reps (a small
GEMM's call costs more on the CPU than on the GPU, which CUDA events around the calls would time). Prints a
markdown table (us, TFLOP/s, cuBLAS/tile).
"""

from __future__ import annotations

import argparse

import torch
from tvm import te
from tvm.runtime import from_dlpack
from tvm.s_tir import Schedule

from halstm.schedules.cuda_tensorcore import BYTES, TensorCoreTile, gemm_tensorcore
from halstm.schedules.wgmma import WgmmaTile, gemm_wgmma, wgmma_available
from halstm.targets import CudaTarget

from kernel_breakdown import kernel_times  # noqa: E402 (beside this script)


def tile_of(text: str) -> TensorCoreTile | WgmmaTile:
    if text.startswith("wgmma:"):
        return WgmmaTile.parse(text[len("wgmma:"):])
    warps_m, warps_n, fm, fn, bk, stages = map(int, text.split(","))
    return TensorCoreTile(warps_m, warps_n, fm, fn, bk, stages=stages)


def fits(tile, n: int, k: int, dtype: str, target: CudaTarget) -> bool:
    if isinstance(tile, WgmmaTile):
        return wgmma_available(dtype, target) and tile.fits(n, k, dtype, target)
    return tile.fits(BYTES[dtype], target)


def build(tile, m: int, n: int, k: int, dtype: str, target: CudaTarget, result: str = "float32"):
    """The GEMM with ``tile``; a wgmma tile's W is given (N, K), as it reads it."""
    wgmma = isinstance(tile, WgmmaTile)
    a = te.placeholder((m, k), dtype, name="A")
    w = te.placeholder((n, k) if wgmma else (k, n), dtype, name="W")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(
        a[i, r].astype("float32") * (w[j, r] if wgmma else w[r, j]).astype("float32"), axis=r), name="C")
    rounded = result != "float32"
    out = te.compute((m, n), lambda i, j: c[i, j].astype(result), name="rounded") if rounded else c
    sch = Schedule(te.create_prim_func([a, w, out]))
    if wgmma:
        if rounded:
            raise ValueError("--result operands is for WMMA tiles")
        gemm_wgmma(sch, sch.get_sblock("C"), tile, dtype)
    else:
        gemm_tensorcore(sch, sch.get_sblock("C"), tile, dtype)
    if rounded:
        sch.reverse_compute_inline(sch.get_sblock("rounded"))  # into the write-back from the C tile
    return target.build(sch.mod)["main"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", help="M,N,K")
    ap.add_argument("--tiles", nargs="+", required=True)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    ap.add_argument("--result", default="float32", choices=("float32", "operands"),
                    help="the result's type: fp32, or the operands' (rounded as it is written)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    m, n, k = map(int, args.shape.split(","))
    result = args.dtype if args.result == "operands" else "float32"
    target = CudaTarget.detect()
    a = torch.randn(m, k, device="cuda").to(getattr(torch, args.dtype))
    w = (torch.randn(k, n, device="cuda") / k**0.5).to(a.dtype)
    w_nk = w.T.contiguous()  # what a wgmma tile is given
    want = a.float() @ w.float()
    flops = 2 * m * n * k

    def gpu_ms(fn):
        return sum(us for us, _ in kernel_times(fn, args.reps).values()) / 1e3

    cublas = gpu_ms(lambda: a @ w)
    print(f"| tile | us | TFLOP/s | cuBLAS/tile | rel. error |\n|---|---|---|---|---|\n"
          f"| cuBLAS (torch.matmul, {args.dtype} result) | {cublas * 1e3:.1f} | {flops / cublas / 1e9:.0f} | 1.00 | |")
    for text in args.tiles:
        tile = tile_of(text)
        if not fits(tile, n, k, args.dtype, target):
            print(f"| {text} | does not fit | | | |")
            continue
        c = torch.empty(m, n, device="cuda", dtype=getattr(torch, result))
        try:
            gemm = build(tile, m, n, k, args.dtype, target, result)
            operands = [from_dlpack(t) for t in (a, w_nk if isinstance(tile, WgmmaTile) else w, c)]
            ms = gpu_ms(lambda: gemm(*operands))
        except Exception as e:  # noqa: BLE001 (report and go on)
            print(f"| {text} | failed: {str(e).splitlines()[-1][:80]} | | | |")
            continue
        error = float(torch.linalg.norm(c.float() - want) / torch.linalg.norm(want))
        print(f"| {text} | {ms * 1e3:.1f} | {flops / ms / 1e9:.0f} | {cublas / ms:.2f} | {error:.1e} |")


if __name__ == "__main__":
    main()
