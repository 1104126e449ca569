"""Export a compiled cell to one module file and a JSON sidecar; load it with the TVM runtime alone.

    halstm.export(f, "lstm.so")            # writes lstm.so and lstm.so.json
    g = halstm.load("lstm.so")             # TVM_USE_RUNTIME_LIB=1 is enough: no compiler library
    y, states = g(x, params)

The sidecar records the cell (name and hash of its lowered expressions), the calling signature
(shapes, dtype), the target, the recipe and knobs, and the TVM version; ``load`` checks it against
the machine and against what the caller expects, and says what does not match.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import tvm
import tvm_ffi

from .runtime import SequenceFunction, Signature

FORMAT = 1


class LoadedCell(SequenceFunction):
    """An exported sequence function, loaded; ``meta`` is its sidecar."""

    def __init__(self, main, signature: Signature, device, meta: dict):
        super().__init__(main, signature, device)
        self.meta = meta

    def __repr__(self):
        s = self.signature
        return f"<loaded {s.cell} T={s.steps} B={s.batch} {s.dtype} for {self.meta['target']['key']}>"


def sidecar(path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def export(compiled, path) -> Path:
    """Write ``compiled``'s module to ``path`` (a shared library) and its metadata beside it."""
    from .lowering import cell_hash

    path = Path(path)
    compiled.module.export_library(str(path))
    target = compiled.target
    meta = {
        "format": FORMAT,
        "cell": compiled.cell.name,
        "cell_hash": cell_hash(compiled.cell),
        "signature": compiled.signature.to_json(),
        "target": {"kind": target.kind, "key": target.key, "arch": getattr(target, "arch", None),
                   "isa": getattr(target, "isa", None)},
        "recipe": compiled.recipe.name,
        "knobs": compiled.knobs,
        "allow_tf32": compiled.program.allow_tf32,
        "tvm": tvm.__version__,
    }
    sidecar(path).write_text(json.dumps(meta, indent=1) + "\n")
    return path


def read_meta(path) -> dict:
    meta_path = sidecar(path)
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} is missing: export writes it beside the module")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')}, this halstm reads format {FORMAT}")
    return meta


def load(path, *, steps: int | None = None, batch: int | None = None, dtype: str | None = None) -> LoadedCell:
    """Load an exported module. ``steps``, ``batch``, ``dtype``, when given, must match the export."""
    meta = read_meta(path)
    signature = Signature.from_json(meta["signature"])
    for name, want in (("steps", steps), ("batch", batch), ("dtype", dtype)):
        have = getattr(signature, name)
        if want is not None and want != have:
            raise ValueError(f"{path} was compiled for {name}={have}, not {want}")
    device = _device(meta["target"])
    if meta["target"]["kind"] == "cuda":
        _compile_kernels_for(meta["target"].get("isa") or meta["target"]["arch"])  # no isa before 2026-11-25
    module = tvm_ffi.load_module(str(path))
    return LoadedCell(module["main"], signature, device, meta)


def _device(target: dict):
    if target["kind"] == "cpu":
        return tvm.cpu(0)
    if target["kind"] != "cuda":
        raise ValueError(f"unknown target kind {target['kind']!r} in the sidecar")
    device = _cuda_device()
    arch = f"sm_{device.compute_version.replace('.', '')}"
    if target["arch"] != arch:
        raise ValueError(f"the module was compiled for {target['arch']} ({target['key']}), this GPU is {arch}")
    return device


def _compile_kernels_for(arch: str) -> None:
    """An exported CUDA module holds CUDA source (TVM 0.27 stores format 'cuda'), compiled with
    NVRTC when it loads. TVM's own hook asks the compiler library for the current target's
    architecture; this one takes the instruction set the module was built for from the sidecar
    (sm_90a where its kernels use wgmma, which sm_90 lacks), so the runtime alone suffices."""
    from tvm.support import nvcc

    def compile_cuda(code):
        return nvcc.compile_cuda(code, target_format="cubin", arch=arch, compiler="nvrtc")

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)


def _cuda_device():
    """The GPU, with TVM's CUDA runtime loaded: the runtime-only package does not load it itself."""
    device = tvm.cuda(0)
    if not device.exist:
        lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
        if lib.exists() and os.environ.get("TVM_USE_RUNTIME_LIB"):
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            device = tvm.cuda(0)
    if not device.exist:
        raise RuntimeError("the module is compiled for CUDA, but no CUDA device is visible")
    return device
