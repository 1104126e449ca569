"""The tensor-core GEMM alone (schedules/cuda_tensorcore.py, wgmma.py), C[M, N] = A[M, K] @ W[K, N] with
fp16 or bf16 operands (fp32 ones as TF32, wgmma tiles only) and an fp32 result, as the hoisted input GEMM
runs it (or, with --result, C rounded to the operands' type as it is written), at several tiles, side by
side with cuBLAS (torch.matmul, TF32 allowed) in the same process:

    python3 benchmarks/gemm_tiles.py 25600,4096,1024 --tiles 2,2,4,4,32,4 2,2,4,4,64,2 4,2,4,4,32,3

A tile is warps_m,warps_n,fm,fn,bk,stages (TensorCoreTile: WMMA), or wgmma:<WgmmaTile.name> such as
wgmma:2x256x4f (Hopper: schedules/wgmma.py, given the weights (N, K); the recipes' wgmma_* knobs name
tiles so), with :kn given them (K, N) (wgmma's MN-major operand, fp16/bf16 only). Each is compiled for
this GPU, checked against the product in float64 (relative norm error), and timed as kernel_breakdown.py
times kernels: GPU time from torch.profiler, summed over --reps calls after warm-up, divided by --reps (a
small GEMM's call costs more on the CPU than on the GPU, which CUDA events around the calls would time).
Prints a markdown table (us, TFLOP/s, cuBLAS/tile).
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


def tile_of(text: str) -> tuple[TensorCoreTile | WgmmaTile, bool]:
    """The tile ``text`` names and whether it is given W (N, K)."""
    if text.startswith("wgmma:"):
        name, _, given = text[len("wgmma:"):].partition(":")
        return WgmmaTile.parse(name), given != "kn"
    warps_m, warps_n, fm, fn, bk, stages = map(int, text.split(","))
    return TensorCoreTile(warps_m, warps_n, fm, fn, bk, stages=stages), False


def fits(tile, n_by_k: bool, n: int, k: int, dtype: str, target: CudaTarget) -> bool:
    if isinstance(tile, WgmmaTile):
        return (wgmma_available(dtype, target, allow_tf32=True) and tile.fits(n, k, dtype, target)
                and (n_by_k or dtype != "float32"))
    return dtype != "float32" and tile.fits(BYTES[dtype], target)


def build(tile, n_by_k: bool, m: int, n: int, k: int, dtype: str, target: CudaTarget, result: str = "float32"):
    """The GEMM with ``tile``, given W (N, K) where ``n_by_k``, else (K, N)."""
    a = te.placeholder((m, k), dtype, name="A")
    w = te.placeholder((n, k) if n_by_k else (k, n), dtype, name="W")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(
        a[i, r].astype("float32") * (w[j, r] if n_by_k else w[r, j]).astype("float32"), axis=r), name="C")
    rounded = result != "float32"
    out = te.compute((m, n), lambda i, j: c[i, j].astype(result), name="rounded") if rounded else c
    sch = Schedule(te.create_prim_func([a, w, out]))
    if isinstance(tile, WgmmaTile):
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
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                    help="float32: TF32 (wgmma tiles; cuBLAS with TF32 allowed)")
    ap.add_argument("--result", default="float32", choices=("float32", "operands"),
                    help="the result's type: fp32, or the operands' (rounded as it is written)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    m, n, k = map(int, args.shape.split(","))
    result = args.dtype if args.result == "operands" else "float32"
    target = CudaTarget.detect()
    torch.backends.cuda.matmul.allow_tf32 = True
    a = torch.randn(m, k, device="cuda").to(getattr(torch, args.dtype))
    w = (torch.randn(k, n, device="cuda") / k**0.5).to(a.dtype)
    w_nk = w.T.contiguous()
    want = a.double() @ w.double()
    flops = 2 * m * n * k

    def gpu_ms(fn):
        return sum(us for us, _ in kernel_times(fn, args.reps).values()) / 1e3

    cublas = gpu_ms(lambda: a @ w)
    print(f"| tile | us | TFLOP/s | cuBLAS/tile | rel. error |\n|---|---|---|---|---|\n"
          f"| cuBLAS (torch.matmul, {args.dtype} result) | {cublas * 1e3:.1f} | {flops / cublas / 1e9:.0f} | 1.00 | |")
    for text in args.tiles:
        tile, n_by_k = tile_of(text)
        if not fits(tile, n_by_k, n, k, args.dtype, target):
            print(f"| {text} | does not fit | | | |")
            continue
        c = torch.empty(m, n, device="cuda", dtype=getattr(torch, result))
        try:
            gemm = build(tile, n_by_k, m, n, k, args.dtype, target, result)
            operands = [from_dlpack(t) for t in (a, w_nk if n_by_k else w, c)]
            ms = gpu_ms(lambda: gemm(*operands))
        except Exception as e:  # noqa: BLE001 (report and go on)
            print(f"| {text} | failed: {str(e).splitlines()[-1][:80]} | | | |")
            continue
        error = float(torch.linalg.norm(c.double() - want) / torch.linalg.norm(want))
        print(f"| {text} | {ms * 1e3:.1f} | {flops / ms / 1e9:.0f} | {cublas / ms:.2f} | {error:.1e} |")


if __name__ == "__main__":
    main()
