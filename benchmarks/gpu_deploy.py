"""On the GPU machine, with the TVM runtime alone: load the modules ``export_for_gpu.py`` wrote on a
CPU-only machine, run them, compare with the float64 results it stored.

    TVM_USE_RUNTIME_LIB=1 python benchmarks/gpu_deploy.py build-gpu
"""

import sys
from pathlib import Path

import numpy as np

import halstm.deploy as deploy


def main(folder: Path) -> int:
    failures = 0
    for module in sorted(folder.glob("*.so")):
        data = np.load(module.with_suffix(".npz"))
        params = {k[2:]: data[k] for k in data.files if k.startswith("p_")}
        f = deploy.load(module)
        y, _ = f(data["x"], params)
        error = float(np.linalg.norm(y - data["expected"]) / np.linalg.norm(data["expected"]))
        ok = error < 1e-5
        failures += not ok
        print(f"{module.name}: {f!r} relative error {error:.2e} {'ok' if ok else 'FAILED'}")
    maps = Path("/proc/self/maps").read_text()
    print("compiler library loaded:", "libtvm_compiler" in maps, "| runtime loaded:", "libtvm_runtime" in maps)
    return 1 if failures or "libtvm_compiler" in maps else 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "build-gpu")))
