"""Compile cells for an H100/H200 (sm_90, 132 SMs) on a machine without a GPU, export them with
a seed for their inputs and the float64 reference's outputs: ``benchmarks/gpu_deploy.py`` loads
and checks them on the GPU with the TVM runtime alone.

    python benchmarks/export_for_gpu.py build-gpu
"""

import sys
from pathlib import Path

import numpy as np

import halstm
from halstm.targets import CudaTarget

from gpu_deploy import inputs  # noqa: E402 (beside this script)

# (cell, T, B, I=H, dtype, recipe or None for the default): the persistent kernel (cooperative launch)
# at B=1 and 16; the step loop's GEMMs on wgmma (sm_90a)
CASES = [(halstm.LSTM, 100, 1, 256, "float32", None), (halstm.PeepholeLSTM, 50, 16, 256, "float32", None),
         (halstm.GRU, 5, 64, 256, "float16", "cuda-step-loop")]


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    target = CudaTarget("sm_90", sms=132)
    rng = np.random.default_rng()
    for cell_type, T, B, H, dtype, recipe in CASES:
        cell = cell_type(H, H)
        f = halstm.compile(cell, T, B, dtype, target=target, recipe=recipe, database=False)
        name = f"{cell.name}-T{T}-B{B}-H{H}-{dtype}"
        halstm.export(f, out / f"{name}.so")
        seed = int(rng.integers(1 << 31))
        y, _ = halstm.reference(cell, *inputs(f.signature, seed))
        np.savez(out / f"{name}.npz", seed=seed, expected=y.astype(np.float32))
        print(f"exported {name} with {f.recipe.name} {f.knobs}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "build-gpu"))
