"""On the GPU machine, with the TVM runtime alone: load the modules ``export_for_gpu.py`` wrote on a
CPU-only machine, run them on inputs made from a stored seed, compare with the float64 outputs it
stored.

    TVM_USE_RUNTIME_LIB=1 python benchmarks/gpu_deploy.py build-gpu
"""

import sys
import traceback
from pathlib import Path

import numpy as np

import halstm.deploy as deploy
from halstm.frames import numpy_dtype


# relative norm error against float64 (DEVELOPERS.md)
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}


def inputs(signature, seed: int):
    """x and parameters for a module's signature in its dtype, the same on both machines for the
    same seed."""
    rng = np.random.default_rng(seed)
    dtype = numpy_dtype(signature.dtype)
    x = rng.standard_normal((signature.steps, signature.batch, signature.input_size)).astype(dtype)
    bound = 1 / np.sqrt(signature.hidden_size)
    params = {a.name: rng.uniform(-bound, bound, a.shape).astype(dtype)
              for a in signature.args if a.role == "param"}
    return x, params


def main(folder: Path) -> int:
    failures = 0
    for module in sorted(folder.glob("*.so")):
        stored = np.load(module.with_suffix(".npz"))
        try:
            f = deploy.load(module)
        except Exception:
            traceback.print_exc()
            failures += 1
            continue
        y, _ = f(*inputs(f.signature, int(stored["seed"])))
        y = y.astype(np.float64)
        error = float(np.linalg.norm(y - stored["expected"]) / np.linalg.norm(stored["expected"]))
        ok = error < TOLERANCE[f.signature.dtype]
        failures += not ok
        print(f"{module.name}: {f!r}, {f.meta['recipe']}: relative error {error:.2e} {'ok' if ok else 'FAILED'}")
    maps = Path("/proc/self/maps").read_text()
    print("compiler library loaded:", "libtvm_compiler" in maps, "| runtime loaded:", "libtvm_runtime" in maps)
    return 1 if failures or "libtvm_compiler" in maps else 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "build-gpu")))
